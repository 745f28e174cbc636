"""The CUDA smoke test: one forward and backward of the model on the job's GPU before real work.

Why: NVML answering (nvidia-smi working) does not prove that CUDA works for torch: the CUDA
runtime torch was built with may not match what the driver expects, a GPU may raise an illegal
memory access (Xid 13/31) or hang on its first kernel. GPU training checklists run a small model on
one batch on CUDA first; this is that run, with the job's own autocast dtype and GradScaler.

Given a :class:`opt_ds_ops.health.device.DevicePlan`, :func:`smoke_test` creates the CUDA context on the
plan's device (``torch.cuda.set_device``), moves a TelemetryAutoencoder (38 features, the SMD
width; hidden 24, latent 8: the training defaults) and a batch of 512 rows of N(0, 1) float32 to
it, runs forward under the planned autocast dtype and backward through GradScaler (enabled for
fp16 only, as in training), synchronises (``torch.cuda.synchronize``, where CUDA's asynchronous
errors surface) and checks that the loss and every gradient are finite (the gradients only without
GradScaler: with it an overflowing scaled gradient is a skipped step, not a fault). It runs in a
thread joined with ``timeout_s``: a kernel or driver call that never returns cannot be
interrupted, so the thread is left behind (a daemon thread) and the result says it timed out. On the CPU
and MPS the same steps run without the CUDA calls (the dry run of scripts/gpu-check.sh).

Never raises: every failure is the result's ``error`` text (the CUDA error's first line).
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from dataclasses import asdict, dataclass

import torch
from torch import nn

from ..model.network import TelemetryAutoencoder
from .device import DevicePlan

SMOKE_ROWS = 512       # rows of the smoke batch
SMOKE_FEATURES = 38    # SMD's width
SMOKE_HIDDEN, SMOKE_LATENT = 24, 8  # TrainConfig's defaults


@dataclass
class SmokeResult:
    """One smoke test: ``ok``; ``seconds`` from the first CUDA call to the synchronised result
    (wall clock, the timeout when it timed out); ``error`` (empty when ok); ``timed_out``;
    ``device`` and ``amp_dtype`` it ran with; ``loss`` (MSE of the untrained model, about 1 on
    N(0, 1) data; None when it did not finish)."""

    ok: bool
    seconds: float
    error: str
    device: str
    amp_dtype: str
    timed_out: bool = False
    loss: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _one_step(plan: DevicePlan) -> tuple[float, bool]:
    """Run the smoke step on plan.device; return (loss, every gradient finite). Raises what torch raises."""
    device = plan.device
    if device.type == "cuda":
        torch.cuda.set_device(device)  # creates the CUDA context: a runtime/driver mismatch fails here
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(SMOKE_ROWS, SMOKE_FEATURES, generator=gen).to(device)
    model = TelemetryAutoencoder(SMOKE_FEATURES, SMOKE_HIDDEN, SMOKE_LATENT).to(device)
    scaler = torch.amp.GradScaler(device.type, enabled=plan.use_grad_scaler)
    autocast = torch.autocast(device.type, dtype=plan.amp_dtype) if plan.amp_dtype is not None else contextlib.nullcontext()
    with autocast:
        recon = model(x)
    loss = nn.functional.mse_loss(recon.float(), x)
    scaler.scale(loss).backward()
    grads_finite = torch.stack([p.grad.isfinite().all() for p in model.parameters() if p.grad is not None]).all()
    _synchronize(device)
    # With GradScaler (fp16) an overflowing scaled gradient is normal: the scaler skips that step.
    return float(loss.detach().cpu()), plan.use_grad_scaler or bool(grads_finite.cpu())


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def smoke_test(plan: DevicePlan, timeout_s: float) -> SmokeResult:
    """Given the job's plan and a time limit (seconds), run the smoke step (see the module) and
    return its :class:`SmokeResult`: a CUDA error, a timeout, a non-finite loss or gradient is
    ``ok=False`` with the reason in ``error``. Never raises."""
    box: dict = {}

    def work() -> None:
        try:
            box["value"] = _one_step(plan)
        except BaseException as e:  # noqa: BLE001 - every failure becomes the result's text
            box["error"] = e

    where = dict(device=str(plan.device), amp_dtype=plan.amp_name)
    t0 = time.perf_counter()
    thread = threading.Thread(target=work, name="ds-ops cuda smoke test", daemon=True)
    thread.start()
    thread.join(timeout_s)
    seconds = time.perf_counter() - t0
    if thread.is_alive():
        return SmokeResult(False, seconds, f"did not finish within {timeout_s:g} s (health.smoke_timeout_s): "
                                           "a hung kernel or driver call", timed_out=True, **where)
    if "error" in box:
        return SmokeResult(False, seconds, _first_line(box["error"]), **where)
    loss, grads_finite = box["value"]
    if not math.isfinite(loss):
        return SmokeResult(False, seconds, f"the forward pass gave a non-finite loss ({loss})", **where)
    if not grads_finite:
        return SmokeResult(False, seconds, "the backward pass gave non-finite gradients", loss=loss, **where)
    return SmokeResult(True, seconds, "", loss=loss, **where)


def main(argv: list[str] | None = None) -> int:
    """``python -m opt_ds_ops.health.smoke [--device cuda] [--amp bf16] [--timeout-s 5]``: run the smoke
    test once and print its result as one JSON line; exit 0 if it passed, 1 if not (a device this
    machine lacks is a failed result too). scripts/gpu-check.sh runs it."""
    import argparse
    import json

    from .device import DeviceError, plan_device

    ap = argparse.ArgumentParser(prog="python -m opt_ds_ops.health.smoke", description=main.__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="auto, cpu, mps, cuda or cuda:N (default: cuda)")
    ap.add_argument("--amp", default="auto", choices=["auto", "bf16", "fp16", "off"])
    ap.add_argument("--timeout-s", type=float, default=5.0, help="seconds (default 5: health.smoke_timeout_s)")
    args = ap.parse_args(argv)
    try:
        result = smoke_test(plan_device(args.device, args.amp), args.timeout_s)
    except DeviceError as e:
        result = SmokeResult(False, 0.0, str(e), args.device, args.amp)
    print(json.dumps(result.as_dict(), sort_keys=True), flush=True)
    return 0 if result.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
