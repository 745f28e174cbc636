"""The training step (opt_ds_ops.training.step): eager on the CPU; on CUDA, replayed from a CUDA graph with the
eager step's numerics. The CUDA tests run on a machine with a GPU (scripts/gpu-check.sh runs this file)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from opt_ds_ops.config.conffile import TrainConfig
from opt_ds_ops.health.device import plan_device
from opt_ds_ops.model.network import TelemetryAutoencoder
from opt_ds_ops.training.step import WARMUP_STEPS, TrainStep
from opt_ds_ops.training.fit import make_optimizer, train

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu-check.sh runs it there)")


def _rows(n: int, d: int = 32, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((n, 6), dtype=np.float32) @ rng.standard_normal((6, d), dtype=np.float32)
    return (base + 0.1 * rng.standard_normal((n, d), dtype=np.float32)).astype(np.float32)


def test_the_step_is_the_seed_step_on_the_cpu_and_never_captures_there():
    """Three steps of TrainStep (capture asked for) equal three steps of the seed's loop body."""
    x = torch.from_numpy(_rows(3 * 256))
    cfg = TrainConfig(batch_size=256)
    torch.manual_seed(1)
    a = TelemetryAutoencoder(32)
    b = TelemetryAutoencoder(32)
    b.load_state_dict(a.state_dict())
    opt_a, opt_b = make_optimizer(a, cfg, torch.device("cpu")), make_optimizer(b, cfg, torch.device("cpu"))
    step = TrainStep(a, opt_a, torch.amp.GradScaler("cpu", enabled=False), None, torch.device("cpu"), 256, capture=True)
    for i in range(3):
        xb = x[i * 256 : (i + 1) * 256]
        loss, skipped = step(xb)
        opt_b.zero_grad(set_to_none=True)
        ref = torch.nn.functional.mse_loss(b(xb), xb)
        ref.backward()
        opt_b.step()
        assert skipped is None
        assert float(loss) == float(ref)
    assert step.mode == "eager"
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def test_cuda_graphs_setting_changes_nothing_on_the_cpu():
    data = _rows(6000)
    plan = plan_device("cpu", "off")
    on = train(data, TrainConfig(epochs=2, batch_size=512, cuda_graphs=True), plan)
    off = train(data, TrainConfig(epochs=2, batch_size=512, cuda_graphs=False), plan)
    assert on.step_mode == off.step_mode == "eager"
    assert on.threshold == off.threshold
    assert [h.train_loss for h in on.history] == [h.train_loss for h in off.history]


@cuda
@pytest.mark.parametrize("amp", ["off", "bf16", "fp16"])
def test_a_captured_run_equals_an_eager_run_on_cuda(amp):
    """The same job with and without CUDA graphs: the same per-epoch losses and weights (float tolerance)."""
    data = _rows(40_000)
    plan = plan_device("cuda", amp)
    cfg = TrainConfig(epochs=3, batch_size=2048)
    captured = train(data, cfg, plan)
    eager = train(data, dataclasses.replace(cfg, cuda_graphs=False), plan)
    assert captured.step_mode == ("cuda-graph-fwd-bwd" if amp == "fp16" else "cuda-graph"), captured.step_mode
    assert eager.step_mode == "eager"
    for c, e in zip(captured.history, eager.history):
        assert c.train_loss == pytest.approx(e.train_loss, rel=1e-3)
    assert captured.threshold == pytest.approx(eager.threshold, rel=1e-2)
    assert captured.skipped_steps == eager.skipped_steps
    for (name, pc), pe in zip(captured.model.state_dict().items(), eager.model.state_dict().values()):
        if pc.is_floating_point():
            assert torch.allclose(pc, pe, rtol=1e-2, atol=1e-3), name


@cuda
def test_capture_starts_after_the_warm_up_and_a_short_last_batch_runs_eagerly():
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = TelemetryAutoencoder(32).to(device)
    cfg = TrainConfig(batch_size=1024)
    opt = make_optimizer(model, cfg, device)
    step = TrainStep(model, opt, torch.amp.GradScaler("cuda", enabled=False), torch.bfloat16, device, 1024, capture=True)
    x = torch.from_numpy(_rows(1024 * (WARMUP_STEPS + 3) + 100)).to(device)
    losses = []
    for i in range(WARMUP_STEPS + 3):
        losses.append(step(x[i * 1024 : (i + 1) * 1024])[0])
        assert step.mode == ("cuda-graph" if i >= WARMUP_STEPS else "eager")
    losses.append(step(x[-100:])[0])  # a short batch: eager, on the graph's gradient tensors
    losses.append(step(x[:1024])[0])  # and the graph replays again after it
    assert all(torch.isfinite(v) for v in losses)
    assert float(losses[-1]) < float(losses[0])
