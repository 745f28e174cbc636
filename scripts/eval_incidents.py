#!/usr/bin/env python3
"""Round 4 of docs/detection-protocol.md: which incident rule (and threshold) pages an operator
least for nothing and most for real, chosen leave-one-fleet-out on the shared SMD and ASD fleets.

Every series of both fleets is trained once with the shipped defaults (seed ``--seed``, CPU, one
thread) and its test period scored as ``ds-ops score`` does (:func:`opt_ds_ops.scoring.evaluate.evaluate_machine`,
which also gives the PCA + EMA baseline's scores and threshold). Each candidate then turns the
scores into incidents with :func:`opt_ds_ops.scoring.incidents.incidents_of`, the function the daemon
runs, and is judged by :func:`opt_ds_ops.scoring.incidents.operator_figures`: false pages a day,
the share of labelled segments paged (an incident opened inside the segment or at most an hour
before it), the share of normal rows inside an incident. Prints per series and per fleet, the two
folds and the choice by the rule fixed in the protocol; ``--json PATH`` writes everything.

Usage: scripts/eval_incidents.py [--smd DIR] [--asd DIR] [--seed N] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, REPO)

from opt_ds_ops.config.conffile import Config, TrainConfig  # noqa: E402
from opt_ds_ops.dataset import DatasetLimits, load_dataset  # noqa: E402
from opt_ds_ops.health.device import plan_device  # noqa: E402
from opt_ds_ops.model.detection import score_rows  # noqa: E402
from opt_ds_ops.model.threshold import quantile_threshold  # noqa: E402
from opt_ds_ops.scoring.evaluate import evaluate_machine, smd_machines  # noqa: E402
from opt_ds_ops.scoring.incidents import IncidentPolicy, incidents_of, operator_figures  # noqa: E402
from opt_ds_ops.store.versions import load_model  # noqa: E402
from opt_ds_ops.training.common import split_rows  # noqa: E402

SHARED = os.path.join(REPO, "..", "shared", "data")
FLEETS = {"smd": 60.0, "asd": 300.0}  # sample period (s)
# the pre-registered candidates (docs/detection-protocol.md, "Round 4"), in the order used for ties:
# (incident policy, threshold: "stored" = the model's own (the validation split's 0.99 quantile),
# "q999" = the 0.999 quantile of the same validation scores, "agree-pca" = the stored threshold and
# a row counts only when the PCA + EMA baseline flags it too)
CANDIDATES = {
    "rows": (IncidentPolicy(open_window_s=0, open_share=0.5, quiet_s=0), "stored"),
    "merge-30m": (IncidentPolicy(open_window_s=0, open_share=0.5, quiet_s=1800), "stored"),
    "persist-10m": (IncidentPolicy(open_window_s=600, open_share=0.5, quiet_s=1800), "stored"),
    "persist-30m": (IncidentPolicy(open_window_s=1800, open_share=0.5, quiet_s=3600), "stored"),
    "persist-10m-q999": (IncidentPolicy(open_window_s=600, open_share=0.5, quiet_s=1800), "q999"),
    "persist-30m-q999": (IncidentPolicy(open_window_s=1800, open_share=0.5, quiet_s=3600), "q999"),
    "persist-10m-agree-pca": (IncidentPolicy(open_window_s=600, open_share=0.5, quiet_s=1800), "agree-pca"),
}
BUDGET = 1.0  # false pages a day per machine (mean over the fleet) a candidate may cost
TIE = 0.01


def objective(fig: dict) -> float:
    """The rule's figure for one fleet: within the budget, the mean share of segments paged; over it,
    minus the false pages a day (so that any candidate within budget beats every one over it)."""
    return fig["paged"] if fig["false_per_day"] <= BUDGET else -fig["false_per_day"]


def series_scores(files, cfg, plan, tmp: str) -> dict:
    """Train and score one series; its scores, labels, thresholds and validation scores."""
    r = evaluate_machine(files, cfg, plan, models_dir=tmp, keep_scores=True)
    stored = load_model(r["model_dir"])
    train = load_dataset(files.train, DatasetLimits.from_config(cfg.job))
    _, val_idx = split_rows(train.rows, cfg.train.val_fraction)
    val = score_rows(stored, train.values()[val_idx])
    return {"series": files.name, "scores": r["_scores"]["ds-ops"], "pca": r["_scores"]["pca-ema"],
            "labels": r["_labels"], "threshold": float(stored.threshold), "pca_threshold": float(r["_thresholds"]["pca-ema"]),
            "q999": quantile_threshold(val, 0.999), "roc_auc": r["ds-ops"]["roc_auc"], "pr_auc": r["ds-ops"]["pr_auc"]}


def judge(s: dict, policy: IncidentPolicy, threshold: str, period: float) -> dict:
    scores = np.asarray(s["scores"], dtype=np.float64)
    t = s["q999"] if threshold == "q999" else s["threshold"]
    if threshold == "agree-pca":  # rows the PCA baseline does not flag cannot count
        scores = np.where(np.asarray(s["pca"]) > s["pca_threshold"], scores, np.minimum(scores, t))
    return operator_figures(incidents_of(scores, t, policy, period), s["labels"], period)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smd", default=os.path.join(SHARED, "smd"))
    ap.add_argument("--asd", default=os.path.join(SHARED, "asd"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    plan = plan_device("cpu", "off")
    roots = {"smd": args.smd, "asd": args.asd}
    series, figs, means = {}, {}, {}
    for fleet, period in FLEETS.items():
        t0 = time.perf_counter()
        cfg = Config(device="cpu")
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(TrainConfig(), seed=args.seed, sample_period_s=period))
        with tempfile.TemporaryDirectory(prefix="eval-incidents-") as tmp:
            series[fleet] = [series_scores(f, cfg, plan, tmp) for f in smd_machines(roots[fleet])]
        print(f"# {fleet}: {len(series[fleet])} series trained and scored in {time.perf_counter() - t0:.0f} s", flush=True)
        for name, (policy, threshold) in CANDIDATES.items():
            figs[name, fleet] = [judge(s, policy, threshold, period) for s in series[fleet]]
            rows = figs[name, fleet]
            paged = [r["paged"] for r in rows if r["paged"] is not None]
            means[name, fleet] = {"false_per_day": float(np.mean([r["false_per_day"] for r in rows])),
                                  "paged": float(np.mean(paged)) if paged else 0.0,
                                  "normal_in_alarm": float(np.mean([r["normal_in_alarm"] for r in rows])),
                                  "pages": float(np.mean([r["pages"] for r in rows]))}
    for fleet in FLEETS:
        print(f"\n{fleet.upper()} (seed {args.seed}): per series false pages a day / segments paged / normal rows in alarm")
        print(f"{'series':<13}" + "".join(f"{n:>24}" for n in CANDIDATES))
        for i, s in enumerate(series[fleet]):
            print(f"{s['series']:<13}" + "".join(
                f"{figs[n, fleet][i]['false_per_day']:5.2f} {_pct(figs[n, fleet][i]['paged'])} "
                f"{_pct(figs[n, fleet][i]['normal_in_alarm'])}".rjust(24) for n in CANDIDATES))
        print(f"{'mean':<13}" + "".join(
            f"{means[n, fleet]['false_per_day']:5.2f} {_pct(means[n, fleet]['paged'])} "
            f"{_pct(means[n, fleet]['normal_in_alarm'])}".rjust(24) for n in CANDIDATES))
        print(f"{'objective':<13}" + "".join(f"{objective(means[n, fleet]):.4f}".rjust(24) for n in CANDIDATES))
        print(f"ROC-AUC / PR-AUC (the same for every candidate): "
              f"{np.mean([s['roc_auc'] for s in series[fleet]]):.4f} / {np.mean([s['pr_auc'] for s in series[fleet]]):.4f}")

    print(f"\nfolds (leave one fleet out; objective: segments paged within {BUDGET:g} false page a day):")
    names = list(CANDIDATES)
    folds = {}
    for pick, held in (("smd", "asd"), ("asd", "smd")):
        best = max(objective(means[n, pick]) for n in names)
        chosen = next(n for n in names if objective(means[n, pick]) >= best - TIE)
        folds[pick] = chosen
        m = means[chosen, held]
        print(f"  chosen on {pick.upper()}: {chosen}; held out {held.upper()}: {m['false_per_day']:.2f} false a day, "
              f"{_pct(m['paged'])} paged, {_pct(m['normal_in_alarm'])} normal rows in alarm")
    both = {n: (objective(means[n, "smd"]) + objective(means[n, "asd"])) / 2 for n in names}
    best = max(both.values())
    tied = [n for n in names if both[n] >= best - TIE]
    print("  mean objective over the two fleets: " + ", ".join(f"{n} {both[n]:.4f}" for n in names))
    print(f"  choice: {tied[0]}" + (f" (tied within {TIE} with {', '.join(tied[1:])}; the first in the table)"
                                   if len(tied) > 1 else ""))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"seed": args.seed, "candidates": {n: [dataclasses.asdict(p), t] for n, (p, t) in CANDIDATES.items()},
                       "figures": {f"{n}/{fl}": v for (n, fl), v in figs.items()},
                       "means": {f"{n}/{fl}": v for (n, fl), v in means.items()}, "folds": folds,
                       "choice": tied[0]}, f, indent=1)
    return 0


def _pct(v) -> str:
    return "  n/a" if v is None else f"{100 * v:5.1f}%"


if __name__ == "__main__":
    sys.exit(main())
