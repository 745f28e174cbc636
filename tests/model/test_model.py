"""The TelemetryAutoencoder's architecture and the reconstruction-error helpers."""

from __future__ import annotations

import torch
from torch import nn

from opt_ds_ops.model.network import TelemetryAutoencoder, anomaly_scores, feature_errors, row_errors, smooth_scores


def test_architecture_is_the_seed_one():
    m = TelemetryAutoencoder(32, 24, 8)
    kinds = [type(layer) for layer in list(m.encoder) + list(m.decoder)]
    assert kinds == [nn.Linear, nn.BatchNorm1d, nn.LeakyReLU, nn.Linear, nn.LeakyReLU,
                     nn.Linear, nn.BatchNorm1d, nn.LeakyReLU, nn.Linear]
    shapes = [(layer.in_features, layer.out_features) for layer in list(m.encoder) + list(m.decoder) if isinstance(layer, nn.Linear)]
    assert shapes == [(32, 24), (24, 8), (8, 24), (24, 32)]
    assert all(layer.negative_slope == 0.2 for layer in m.modules() if isinstance(layer, nn.LeakyReLU))
    assert m(torch.randn(4, 32)).shape == (4, 32)
    assert m.model_args() == {"n_features": 32, "hidden": 24, "latent": 8}


def test_errors_are_per_cell_and_per_row_squared_differences():
    torch.manual_seed(0)
    m = TelemetryAutoencoder(5, 4, 2).eval()
    x = torch.randn(10, 5)
    with torch.no_grad():
        expected = (m(x) - x) ** 2
    torch.testing.assert_close(feature_errors(m, x), expected)
    torch.testing.assert_close(row_errors(m, x), expected.mean(1))
    scale = torch.rand(5) + 0.5
    torch.testing.assert_close(anomaly_scores(expected, scale), (expected / scale).mean(1))


def test_smooth_scores_is_a_trailing_mean():
    s = torch.tensor([1.0, 2.0, 3.0, 4.0, 10.0])
    torch.testing.assert_close(smooth_scores(s, 1), s)
    torch.testing.assert_close(smooth_scores(s, 2), torch.tensor([1.0, 1.5, 2.5, 3.5, 7.0]))
    torch.testing.assert_close(smooth_scores(s, 3), torch.tensor([1.0, 1.5, 2.0, 3.0, 17 / 3]))
    torch.testing.assert_close(smooth_scores(s, 100), torch.cumsum(s, 0) / torch.arange(1, 6))
