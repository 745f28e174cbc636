#!/usr/bin/env python3
"""The record of how ds-ops's default score was picked (docs/detection.md, "How the default score was chosen").

On the selection half of the shared SMD machines only (default: machine-1-2 1-4 1-6 1-8 2-2; the
other five are the confirmation half and must not be given here), train one model per machine and
input-clip setting with the configured defaults, then score the test period with every
combination of error floor, smoothing and z-score weight of the two sweeps docs/detection.md lists, and
print the settings by the rule fixed beforehand: the highest mean ROC-AUC + mean PR-AUC
(``--sweep clip``, the first round).

``--sweep window`` (the second round, windowed inputs): one model per machine and input window
w (rows t-w+1..t concatenated, :func:`opt_ds_ops.model.network.window_rows`), trained as ``ds-ops
train`` does with the configured defaults otherwise (clip 20, floor 0.01, 5 epochs, seed 0);
each scored with the window's last row's error or the window's mean error
(:func:`opt_ds_ops.model.network.fold_window`) and an EMA of the spans in WINDOW_SWEEP; the z-score +
EMA baseline of ``ds-ops evaluate`` computed beside it. The rule, fixed before this round ran
(docs/detection-selection.md): the highest min(mean ROC-AUC - z-ema's, mean PR-AUC - z-ema's).

Usage: scripts/select_score_smd.py [--sweep clip|window] [--smd DIR] [--machines NAME ...] [--top N]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import sys

import numpy as np
import torch

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, REPO)

from opt_ds_ops.config.conffile import TrainConfig  # noqa: E402
from opt_ds_ops.dataset import load_dataset  # noqa: E402
from opt_ds_ops.health.device import plan_device  # noqa: E402
from opt_ds_ops.scoring.evaluate import smd_machines  # noqa: E402
from opt_ds_ops.model.network import feature_errors, fold_window, smooth, window_rows  # noqa: E402
from opt_ds_ops.model.detection import (  # noqa: E402
    EMA_BASELINE_WINDOW,
    average_precision,
    in_memory_model,
    load_labels,
    roc_auc,
    standardise_rows,
    zscore_cells,
)
from opt_ds_ops.training.fit import split_rows, train  # noqa: E402

SELECTION = ["machine-1-2", "machine-1-4", "machine-1-6", "machine-1-8", "machine-2-2"]
# (clips, floors, smoothings, z weights) of the two sweeps; "median" = the median validation error
SWEEPS = [
    ([0.0, 5.0, 10.0], [1e-6, 0.01, 0.1, 1.0, "median"], [("mean", 15), ("ema", 5), ("ema", 10), ("ema", 20), ("ema", 30)],
     [0.0, 0.5, 1.0, 2.0]),
    ([10.0, 20.0], [0.01], [("ema", 20), ("ema", 30), ("ema", 45), ("ema", 60), ("mean", 30), ("mean", 60)], [0.0, 0.5]),
]


def raw_errors(result, values: np.ndarray, clip: float) -> np.ndarray:
    """Squared reconstruction error per cell (rows, D) float64 of the file's values."""
    x = standardise_rows(in_memory_model(result), values)
    if clip > 0:
        x.clamp_(-clip, clip)
    return feature_errors(result.model, x).double().numpy()


# (input windows w, window errors, EMA spans) of the second round; clip 20 and floor 0.01 as configured
WINDOW_SWEEP = ([1, 2, 4, 8, 16], ["last", "window"], [10, 30, 60])


def window_cells(result, values: np.ndarray) -> np.ndarray:
    """Normalised squared errors (rows, D * w) float64 of the file's values, windowed and
    clipped as ``ds-ops score`` does, over the model's stored error scale."""
    x = standardise_rows(in_memory_model(result), values)
    if result.input_clip > 0:
        x.clamp_(-result.input_clip, result.input_clip)
    x = window_rows(x, result.input_window)
    return (feature_errors(result.model, x) / torch.from_numpy(result.error_scale)).double().numpy()


def sweep_window(args, plan) -> int:
    """The second round: windowed inputs (module docstring); prints every candidate, best first."""
    windows, hows, spans = WINDOW_SWEEP
    data, base_auc, base_ap = {}, [], []
    for files in smd_machines(args.smd, args.machines):
        tr, te = load_dataset(files.train), load_dataset(files.test)
        labels = load_labels(files.labels, te.rows)
        z = smooth(zscore_cells(tr.values(), te.values()).mean(axis=1), EMA_BASELINE_WINDOW, "ema")
        base_auc.append(roc_auc(z, labels))
        base_ap.append(average_precision(z, labels))
        per_w = {}
        for w in windows:
            result = train(tr.data, dataclasses.replace(TrainConfig(), input_window=w), plan, offset=tr.offset)
            per_w[w] = window_cells(result, te.values())
        data[files.name] = (labels, per_w)
        print(f"{files.name}: trained w={windows}; z-ema {base_auc[-1]:.4f} / {base_ap[-1]:.4f}", flush=True)
    z_auc, z_ap = float(np.mean(base_auc)), float(np.mean(base_ap))
    rows = []
    for w, how, span in itertools.product(windows, hows, spans):
        if w == 1 and how == "window":
            continue  # the same score as "last"
        aucs, aps = [], []
        for labels, per_w in data.values():
            raw = fold_window(torch.from_numpy(per_w[w]), w, how).mean(dim=1).float().numpy()
            s = smooth(raw, span, "ema")
            aucs.append(roc_auc(s, labels))
            aps.append(average_precision(s, labels))
        auc, ap_ = float(np.mean(aucs)), float(np.mean(aps))
        rows.append((min(auc - z_auc, ap_ - z_ap), auc, ap_, w, how, span, aucs, aps))
    rows.sort(key=lambda r: -r[0])
    names = list(data)
    print(f"z-ema (baseline): ROC-AUC {z_auc:.4f}  PR-AUC {z_ap:.4f}  (mean over {len(names)} machines: {' '.join(names)})")
    print(f"{'min gain':>9}{'ROC-AUC':>8}{'PR-AUC':>8}  w   error   EMA   per-machine ROC-AUC / PR-AUC")
    for gain, auc, ap_, w, how, span, aucs, aps in rows[: args.top]:
        per = " ".join(f"{a:.3f}/{p:.3f}" for a, p in zip(aucs, aps))
        print(f"{gain:>+9.4f}{auc:>8.4f}{ap_:>8.4f}  {w:<3d} {how:<7} {span:<4d}  {per}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", choices=("clip", "window"), default="window")
    ap.add_argument("--smd", default=os.path.join(REPO, "..", "shared", "data", "smd"))
    ap.add_argument("--machines", nargs="+", default=SELECTION)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(1)
    plan = plan_device("cpu", "off")
    if args.sweep == "window":
        return sweep_window(args, plan)
    clips = sorted({c for sweep in SWEEPS for c in sweep[0]})
    data = {}
    for files in smd_machines(args.smd, args.machines):
        tr, te = load_dataset(files.train), load_dataset(files.test)
        labels = load_labels(files.labels, te.rows)
        values = tr.values()
        _, val_idx = split_rows(tr.rows, TrainConfig.val_fraction)
        mean, std = values[: val_idx[0]].mean(0), values[: val_idx[0]].std(0)
        std[std == 0] = 1
        z = lambda v: (((v - mean) / std) ** 2).mean(1)  # noqa: E731
        per_clip = {}
        for clip in clips:
            result = train(tr.data, dataclasses.replace(TrainConfig(), input_clip=clip), plan, offset=tr.offset)
            per_clip[clip] = (raw_errors(result, values[val_idx], clip), raw_errors(result, te.values(), clip))
        data[files.name] = (labels, per_clip, z(values[val_idx]), z(te.values()))
        print(f"{files.name}: trained", flush=True)
    rows = []
    for clips_, floors, smoothings, weights in SWEEPS:
        for clip, floor, (how, window), weight in itertools.product(clips_, floors, smoothings, weights):
            aucs, aps = [], []
            for labels, per_clip, z_val, z_test in data.values():
                e_val, e_test = per_clip[clip]
                scale = e_val.mean(0)
                scale = np.maximum(scale, max(np.median(scale), 1e-6) if floor == "median" else floor)
                s_test, s_val = (e_test / scale).mean(1), (e_val / scale).mean(1)
                if weight:
                    s_test = s_test / s_val.mean() + weight * z_test / z_val.mean()
                s = smooth(s_test, window, how)
                aucs.append(roc_auc(s, labels))
                aps.append(average_precision(s, labels))
            rows.append((float(np.mean(aucs)), float(np.mean(aps)), clip, floor, f"{how} {window}", weight))
    rows = sorted(set(rows), key=lambda r: -(r[0] + r[1]))
    print(f"{'ROC-AUC':>8}{'PR-AUC':>8}  clip  floor   smoothing  z-weight   (mean over {len(data)} machines)")
    for auc, ap_, clip, floor, how, weight in rows[: args.top]:
        print(f"{auc:>8.4f}{ap_:>8.4f}  {clip:<5g} {floor!s:<7} {how:<10} {weight:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
