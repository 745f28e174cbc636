"""A trained model as scoring needs it: the network with its scaling, error scale and threshold.

:func:`opt_ds_ops.store.versions.load_model` builds one from a stored version,
:func:`opt_ds_ops.model.detection.in_memory_model` from a training's result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .network import TelemetryAutoencoder


@dataclass
class StoredModel:
    """A model loaded back from the store, ready to score.

    ``mean``: (D,) float64 tensor (float32 in models saved before ds-ops kept the exact mean of
    columns far from zero); ``std``, ``error_scale``: (D,) float32 tensors; ``threshold``: anomaly-score threshold
    for scores smoothed over ``score_window`` rows by ``score_smoothing`` (``ema`` or ``mean``) of
    inputs clipped to +-``input_clip`` standard deviations (0: none). Models saved before ds-ops
    stored the smoothing and the clip lack the last two and load with their score then: a trailing
    mean, no clipping.
    ``input_window``: rows per model input (the model's n_features is D * input_window and
    ``error_scale`` is (D * input_window,)); ``window_error``: ``last``, ``window`` or ``max``, which
    of the window's rows make the score (:func:`opt_ds_ops.model.network.fold_window`). Models saved
    before windowed inputs load as 1 and ``last``: one row per input, as they were trained.
    ``diff``: for a model that reads each metric's change beside its level
    (:func:`opt_ds_ops.model.network.with_differences`; then ``input_window`` is 2 and
    ``window_error`` ``window``, the mean of a metric's change and level terms, or ``max``, the larger), the (D,) float32 ``(diff_mean, diff_std)`` of its training rows'
    standardised first differences; None for a model of levels alone (every model saved before).
    """

    path: str
    model: TelemetryAutoencoder
    mean: torch.Tensor
    std: torch.Tensor
    error_scale: torch.Tensor
    threshold: float
    score_window: int
    metadata: dict
    score_smoothing: str = "mean"
    input_clip: float = 0.0
    input_window: int = 1
    window_error: str = "last"
    diff: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def n_features(self) -> int:
        """D: the columns of one data row (the model's input width over ``input_window``)."""
        return self.model.n_features // self.input_window


def sample_period_s(stored: StoredModel) -> float | None:
    """Return the model's seconds between rows: the median step of its training file's time
    column (metadata.json ``dataset.time.median_step_s``), else the training configuration's
    ``train.sample_period_s``; None if neither is known."""
    md = stored.metadata
    step = ((md.get("dataset") or {}).get("time") or {}).get("median_step_s")
    if isinstance(step, (int, float)) and step > 0:
        return float(step)
    period = ((md.get("config") or {}).get("train") or {}).get("sample_period_s")
    return float(period) if isinstance(period, (int, float)) and period > 0 else None
