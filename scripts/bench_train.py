#!/usr/bin/env python3
"""Benchmark: ds-ops's trainer against the seed lab script's loop, on the same data in one process.

The seed loop is TensorDataset + DataLoader(shuffle=True, batch_size=2048), AdamW with default
(for-loop) kernels, ``loss.item()`` every batch. ds-ops's loop (opt_ds_ops.train.train) keeps the
data in one tensor, shuffles it with one permutation per epoch, uses fused AdamW and reads the
loss once per epoch. Both train the same TelemetryAutoencoder on the same standardised rows with
the same hyper-parameters; the final losses must agree. Also times dataset parsing of the same
rows written as CSV against Python's csv module, and the parse's peak memory (tracemalloc: Python
and numpy allocations) as a multiple of the float32 matrix. Prints a table and a final JSON line.

Usage: scripts/bench_train.py [--rows 500000] [--features 32] [--epochs 5] [--device cpu|cuda|auto]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import tempfile
import time
import tracemalloc

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from opt_ds_ops.config import TrainConfig  # noqa: E402
from opt_ds_ops.dataset import load_dataset  # noqa: E402
from opt_ds_ops.device import plan_device  # noqa: E402
from opt_ds_ops.model import TelemetryAutoencoder  # noqa: E402
from opt_ds_ops.train import fit_scaler, standardise, train  # noqa: E402


def seed_loop(x: torch.Tensor, cfg: TrainConfig, device: torch.device, amp_dtype) -> tuple[float, float]:
    """The seed lab script's training loop; returns (samples/s, final epoch mean loss)."""
    torch.manual_seed(cfg.seed)
    model = TelemetryAutoencoder(x.shape[1], cfg.hidden, cfg.latent).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    loader = DataLoader(TensorDataset(x), batch_size=cfg.batch_size, shuffle=True)
    loss_fn = nn.MSELoss()
    t0 = time.perf_counter()
    for _epoch in range(cfg.epochs):
        model.train()
        total, n = 0.0, 0
        for (xb,) in loader:
            xb = xb.to(device)
            if xb.shape[0] < 2:
                continue
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                loss = loss_fn(model(xb).float(), xb)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            total += loss.item() * xb.shape[0]
            n += xb.shape[0]
    if device.type == "cuda":
        torch.cuda.synchronize()
    return x.shape[0] * cfg.epochs / (time.perf_counter() - t0), total / n


def parse_speeds(rows: np.ndarray) -> tuple[float, float, float]:
    """Return (MB/s of load_dataset, MB/s of a csv-module loop, load_dataset's peak memory / the float32
    matrix) on rows written as a CSV file. The peak is measured in a second, untimed load."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.csv")
        np.savetxt(path, rows, delimiter=",", fmt="%.6f")
        mb = os.path.getsize(path) / 1e6
        t0 = time.perf_counter()
        ds = load_dataset(path)
        ours = mb / (time.perf_counter() - t0)
        matrix_bytes = ds.data.nbytes
        del ds
        tracemalloc.start()
        load_dataset(path)
        peak = tracemalloc.get_traced_memory()[1] / matrix_bytes
        tracemalloc.stop()
        t0 = time.perf_counter()
        with open(path, newline="") as f:
            np.array([[float(v) for v in r] for r in csv.reader(f)], dtype=np.float32)
        loop = mb / (time.perf_counter() - t0)
    return ours, loop, peak


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=500_000)
    ap.add_argument("--features", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--amp", default="auto")
    ap.add_argument("--skip-parse", action="store_true")
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    data = rng.random((args.rows, args.features), dtype=np.float32)
    cfg = TrainConfig(epochs=args.epochs, val_fraction=0.0)
    plan = plan_device(args.device, args.amp)
    mean, std = fit_scaler(data)
    x = standardise(data, mean, std)

    seed_sps, seed_loss = seed_loop(x, cfg, plan.device, plan.amp_dtype)
    result = train(data, cfg, plan)
    ours_sps, ours_loss = result.samples_per_s, result.history[-1].train_loss
    ratio = ours_sps / seed_sps
    report = {
        "device": str(plan.device),
        "amp_dtype": plan.amp_name,
        "rows": args.rows,
        "features": args.features,
        "epochs": args.epochs,
        "torch_threads": torch.get_num_threads(),
        "seed_samples_per_s": round(seed_sps),
        "ds_ops_samples_per_s": round(ours_sps),
        "ratio": round(ratio, 2),
        "seed_final_loss": seed_loss,
        "ds_ops_final_loss": ours_loss,
        "loss_rel_diff": abs(ours_loss - seed_loss) / seed_loss,
        "data_placement": result.data_placement,
    }
    if not args.skip_parse:
        ours_mbs, loop_mbs, peak = parse_speeds(data)
        report.update(parse_mb_per_s=round(ours_mbs, 1), csv_loop_mb_per_s=round(loop_mbs, 1),
                      parse_ratio=round(ours_mbs / loop_mbs, 2), parse_peak_x_matrix=round(peak, 2))

    print(f"{'loop':<10}{'samples/s':>14}{'final loss':>14}")
    print(f"{'seed':<10}{seed_sps:>14,.0f}{seed_loss:>14.6f}")
    print(f"{'ds-ops':<10}{ours_sps:>14,.0f}{ours_loss:>14.6f}")
    print(f"ratio ds-ops / seed: {ratio:.2f}x on {plan.describe()}, {args.rows:,} x {args.features}, {args.epochs} epochs")
    if "parse_mb_per_s" in report:
        print(f"CSV parsing: {report['parse_mb_per_s']} MB/s (csv-module loop {report['csv_loop_mb_per_s']} MB/s, "
              f"{report['parse_ratio']}x); peak memory {report['parse_peak_x_matrix']}x the float32 matrix")
    print(json.dumps(report, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
