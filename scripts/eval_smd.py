#!/usr/bin/env python3
"""Evaluate ds-ops's anomaly scores on the labelled SMD machines against the seed score and a z-score.

For each machine: train with the configured hyper-parameters on train/, score test/, compare with
test_label/. Columns (point-wise ROC-AUC, PR-AUC = average precision):
  ds-ops    the stored score: per-feature error / validation error of that feature, trailing mean
            over ``score_window`` rows, as ``ds-ops score`` computes it
  seed      the seed script's raw per-row reconstruction MSE
  z-score   model-free: mean squared z-score of the row against train's column statistics
  z-win     the z-score with the same trailing window (is it the model or the window that helps?)
F1 is ds-ops's at its stored threshold. Prints a table, the means and a final JSON line.

Usage: scripts/eval_smd.py [--smd DIR] [--epochs N] [--window ROWS] [--machines machine-1-2 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, REPO)

from opt_ds_ops.config import TrainConfig  # noqa: E402
from opt_ds_ops.dataset import load_dataset  # noqa: E402
from opt_ds_ops.device import plan_device  # noqa: E402
from opt_ds_ops.model import feature_errors, smooth_scores  # noqa: E402
from opt_ds_ops.score import (  # noqa: E402
    average_precision, evaluate, load_labels, roc_auc, score_rows, standardise_rows, zscore_baseline,
)
from opt_ds_ops.store import StoredModel  # noqa: E402
from opt_ds_ops.train import train  # noqa: E402


def default_smd_dir() -> str:
    shared = os.path.join(REPO, "..", "shared", "data", "smd")
    return shared if os.path.isdir(os.path.join(shared, "train")) else os.path.join(REPO, "data", "smd")


def label_path(smd: str, name: str) -> str:
    for suffix in (".txt", ".txt.gz"):
        path = os.path.join(smd, "test_label", name + suffix)
        if os.path.exists(path):
            return path
    raise FileNotFoundError(f"no labels for {name} under {smd}/test_label")


def evaluate_machine(smd: str, name: str, cfg: TrainConfig, device: str) -> dict:
    tr = load_dataset(os.path.join(smd, "train", name + ".txt.gz"))
    te = load_dataset(os.path.join(smd, "test", name + ".txt.gz"))
    labels = load_labels(label_path(smd, name), te.rows)
    result = train(tr.data, cfg, plan_device(device, "auto"), offset=tr.offset)
    stored = StoredModel(
        path="", model=result.model, mean=torch.from_numpy(result.mean), std=torch.from_numpy(result.std),
        error_scale=torch.from_numpy(result.error_scale), threshold=result.threshold,
        score_window=result.score_window, metadata={},
    )
    ours = score_rows(stored, te.data, offset=te.offset)
    seed = feature_errors(result.model, standardise_rows(stored, te.data, te.offset)).mean(dim=1).numpy()
    z = zscore_baseline(tr.values(), te.values())
    z_win = smooth_scores(torch.from_numpy(z), cfg.score_window).numpy()
    ev = evaluate(ours, labels, result.threshold)
    return {
        "machine": name,
        "anomaly_pct": 100 * labels.mean(),
        "roc_auc": {"ds-ops": ev.roc_auc, "seed": roc_auc(seed, labels), "z-score": roc_auc(z, labels),
                    "z-win": roc_auc(z_win, labels)},
        "pr_auc": {"ds-ops": ev.pr_auc, "seed": average_precision(seed, labels),
                   "z-score": average_precision(z, labels), "z-win": average_precision(z_win, labels)},
        "f1": ev.f1,
        "precision": ev.precision,
        "recall": ev.recall,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smd", default=default_smd_dir(), help="SMD folder with train/ test/ test_label/")
    ap.add_argument("--epochs", type=int, default=TrainConfig.epochs)
    ap.add_argument("--window", type=int, default=TrainConfig.score_window, help="score_window (rows)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--machines", nargs="*")
    args = ap.parse_args()
    names = args.machines or sorted(f.removesuffix(".txt.gz") for f in os.listdir(os.path.join(args.smd, "train")))
    cfg = TrainConfig(epochs=args.epochs, score_window=args.window)
    methods = ["ds-ops", "seed", "z-score", "z-win"]
    print(f"SMD {args.smd}: {len(names)} machines, epochs {cfg.epochs}, score_window {cfg.score_window}")
    print(f"{'machine':<13}{'anom%':>6}  " + "".join(f"{'AUC ' + m:>12}" for m in methods) + f"{'AP ds-ops':>11}{'AP z':>8}{'F1':>7}")
    rows = []
    for name in names:
        r = evaluate_machine(args.smd, name, cfg, args.device)
        rows.append(r)
        print(f"{name:<13}{r['anomaly_pct']:>6.2f}  " + "".join(f"{r['roc_auc'][m]:>12.4f}" for m in methods)
              + f"{r['pr_auc']['ds-ops']:>11.4f}{r['pr_auc']['z-score']:>8.4f}{r['f1']:>7.3f}", flush=True)
    mean_auc = {m: float(np.mean([r["roc_auc"][m] for r in rows])) for m in methods}
    mean_ap = {m: float(np.mean([r["pr_auc"][m] for r in rows])) for m in methods}
    wins = sum(r["roc_auc"]["ds-ops"] > r["roc_auc"]["z-score"] for r in rows)
    wins_win = sum(r["roc_auc"]["ds-ops"] > r["roc_auc"]["z-win"] for r in rows)
    print(f"{'mean':<13}{'':>6}  " + "".join(f"{mean_auc[m]:>12.4f}" for m in methods)
          + f"{mean_ap['ds-ops']:>11.4f}{mean_ap['z-score']:>8.4f}{np.mean([r['f1'] for r in rows]):>7.3f}")
    print(f"ds-ops beats the z-score on {wins} of {len(rows)} machines (ROC-AUC), "
          f"mean {mean_auc['ds-ops']:.4f} vs {mean_auc['z-score']:.4f}; the windowed z-score on {wins_win} of "
          f"{len(rows)}, mean {mean_auc['ds-ops']:.4f} vs {mean_auc['z-win']:.4f}")
    print(json.dumps({"machines": rows, "mean_roc_auc": mean_auc, "mean_pr_auc": mean_ap,
                      "wins_vs_zscore": wins, "wins_vs_zscore_windowed": wins_win, "epochs": cfg.epochs, "score_window": cfg.score_window}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
