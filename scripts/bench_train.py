#!/usr/bin/env python3
"""Benchmark: ds-ops's trainer against the seed lab script's own loop, on the same data in one process.

The reference is the seed's loop exactly as ../shared/seeds/000-lab-script.txt writes it:
``TensorDataset(data, data)``, ``DataLoader(batch_size=2048, shuffle=True, pin_memory=<cuda>,
num_workers=4 if cuda else 0)``, AdamW(lr 1e-3, weight decay 1e-4) with PyTorch's default kernels,
fp32 (the seed's benchmark has no autocast), ``zero_grad(set_to_none=True)``, ``loss.item()``
every batch, on the seed's data (``torch.randn(rows, 32)``). ds-ops's trainer
(:func:`opt_ds_ops.training.fit.train`) trains the same TelemetryAutoencoder with the same
hyper-parameters on the same rows: on the CPU in fp32; on CUDA once per AMP dtype (bf16, fp16 with
GradScaler) with eager steps and with the step replayed from a CUDA graph (opt_ds_ops.training.step).
Before anything is timed, one small untimed run initialises the device (CUDA context, cuBLAS
handles, the DataLoader's code), so neither side pays for it.

It also trains the model that reads each metric's change beside its level
(``train.input_differences``: twice the input width, 2 x ``--features``) once, with the best
setting of the device (CPU: fp32; CUDA: bf16 with the CUDA graph step), as the row
``differences``: its ratio is to the same seed loop (which reads ``--features`` columns).

Prints one row per loop (samples/s, ratio to the seed loop, final epoch loss) and a final JSON line;
the machine's load moves both sides, so only the same-run ratio is a figure to quote.

Usage: scripts/bench_train.py [--rows 500000] [--features 32] [--epochs 5] [--device cpu|cuda|auto]
                              [--amp auto|bf16|fp16|off]  (CPU: the amp ds-ops uses; CUDA: both are run)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from opt_ds_ops.config.conffile import TrainConfig  # noqa: E402
from opt_ds_ops.health.device import plan_device  # noqa: E402
from opt_ds_ops.model.network import TelemetryAutoencoder  # noqa: E402
from opt_ds_ops.training.fit import train  # noqa: E402


def seed_loop(data: torch.Tensor, epochs: int, device: torch.device, num_workers: int | None = None) -> tuple[float, float]:
    """The seed lab script's loop, as the seed writes it; returns (samples/s, last epoch's mean loss).

    data: (rows, D) float32 CPU tensor. Only the prints are left out, and the epoch count is a parameter
    (the seed runs 5). ``num_workers`` None: the seed's (4 on CUDA, 0 elsewhere).
    """
    n_samples, n_features = data.shape
    dataset = TensorDataset(data, data)
    dataloader = DataLoader(
        dataset,
        batch_size=2048,
        shuffle=True,
        pin_memory=(device.type == "cuda"),
        num_workers=(4 if device.type == "cuda" else 0) if num_workers is None else num_workers
    )
    model = TelemetryAutoencoder(n_features).to(device)
    criterion = nn.MSELoss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4)
    t0 = time.perf_counter()
    model.train()
    avg_loss = float("nan")
    for _epoch in range(1, epochs + 1):
        epoch_loss = 0.0
        for batch_x, batch_target in dataloader:
            batch_x = batch_x.to(device, non_blocking=True)
            batch_target = batch_target.to(device, non_blocking=True)

            optimizer.zero_grad(set_to_none=True)
            outputs = model(batch_x)
            loss = criterion(outputs, batch_target)
            loss.backward()
            optimizer.step()

            epoch_loss += loss.item() * len(batch_x)
        avg_loss = epoch_loss / n_samples
    total_time = time.perf_counter() - t0
    return n_samples * epochs / total_time, avg_loss


def ds_ops_run(data: np.ndarray, cfg: TrainConfig, device: str, amp: str) -> dict:
    """Train with ds-ops's trainer; return its figures (samples/s over the training epochs)."""
    plan = plan_device(device, amp)
    result = train(data, cfg, plan)
    return {"amp_dtype": plan.amp_name, "cuda_graphs": cfg.cuda_graphs, "step_mode": result.step_mode,
            "samples_per_s": round(result.samples_per_s), "final_loss": result.history[-1].train_loss,
            "data_placement": result.data_placement, "epochs_run": len(result.history),
            "steps": result.stopping.get("steps")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=500_000)
    ap.add_argument("--features", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--amp", default="auto")
    ap.add_argument("--skip-parse", action="store_true", help="accepted for old callers; parsing is scripts/bench_parse.py")
    args = ap.parse_args()
    if args.rows % 2048 == 1:
        ap.error("--rows must not leave a last batch of 1 row (the seed loop's BatchNorm1d would raise)")

    torch.manual_seed(0)
    data = torch.randn(args.rows, args.features, dtype=torch.float32)  # the seed's data
    plan = plan_device(args.device, args.amp)
    device = plan.device
    # exactly --epochs epochs, as the seed's loop runs (the plateau rule is off here)
    # and with the seed's batch and learning rate, whatever the shipped defaults are
    cfg = TrainConfig(epochs=args.epochs, val_fraction=0.0, stopping="epochs", batch_size=2048, lr=1e-3)

    # untimed warm-up of both code paths on the device (CUDA context, cuBLAS, DataLoader workers)
    seed_loop(data[:8192], 1, device)
    train(data[:8192].numpy(), dataclasses.replace(cfg, epochs=1), plan)

    seed_note = "as the seed writes it"
    try:
        seed_sps, seed_loss = seed_loop(data, args.epochs, device)
    except RuntimeError as e:  # e.g. DataLoader workers without enough shared memory (/dev/shm) in a container
        seed_note = f"num_workers=0, the seed's 4 workers failed: {str(e).splitlines()[0][:160]}"
        print(f"bench_train: {seed_note}", file=sys.stderr)
        seed_sps, seed_loss = seed_loop(data, args.epochs, device, num_workers=0)
    if device.type == "cuda":
        runs = [ds_ops_run(data.numpy(), dataclasses.replace(cfg, cuda_graphs=graphs), str(device), amp)
                for amp in ("bf16", "fp16") for graphs in (False, True)]
    else:
        runs = [ds_ops_run(data.numpy(), cfg, str(device), args.amp)]
    for r in runs:
        r["ratio"] = round(r["samples_per_s"] / seed_sps, 2)
        r["loss_rel_diff"] = abs(r["final_loss"] - seed_loss) / seed_loss
    best = max(runs, key=lambda r: r["samples_per_s"])
    # the model of differences (2 x features wide), once, at the device's best setting
    diff_cfg = dataclasses.replace(cfg, input_differences=True, cuda_graphs=device.type == "cuda")
    differences = ds_ops_run(data.numpy(), diff_cfg, str(device), "bf16" if device.type == "cuda" else args.amp)
    differences["ratio"] = round(differences["samples_per_s"] / seed_sps, 2)
    differences["input_width"] = 2 * args.features
    report = {
        "device": str(device),
        "amp_dtype": best["amp_dtype"],
        "rows": args.rows,
        "features": args.features,
        "epochs": args.epochs,
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "seed_samples_per_s": round(seed_sps),
        "seed_final_loss": seed_loss,
        "seed_note": seed_note,
        "ds_ops_samples_per_s": best["samples_per_s"],
        "ds_ops_final_loss": best["final_loss"],
        "ratio": best["ratio"],
        "loss_rel_diff": best["loss_rel_diff"],
        "data_placement": best["data_placement"],
        "runs": runs,
        "differences": differences,
    }

    print(f"{'loop':<34}{'samples/s':>14}{'ratio':>8}{'final loss':>13}")
    print(f"{'seed (DataLoader, fp32)':<34}{seed_sps:>14,.0f}{'1.00x':>8}{seed_loss:>13.6f}")
    for r in runs:
        name = f"ds-ops {r['amp_dtype']} {r['step_mode']}"
        print(f"{name:<34}{r['samples_per_s']:>14,}{r['ratio']:>7.2f}x{r['final_loss']:>13.6f}")
    name = f"ds-ops {differences['amp_dtype']} differences ({2 * args.features} wide)"
    print(f"{name:<34}{differences['samples_per_s']:>14,}{differences['ratio']:>7.2f}x{differences['final_loss']:>13.6f}")
    print(f"ratio ds-ops / seed loop: {best['ratio']:.2f}x (best row) on {device}, {args.rows:,} x {args.features}, "
          f"{args.epochs} epochs, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(json.dumps(report, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
