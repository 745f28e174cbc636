#!/usr/bin/env python3
"""The pre-registered evaluation of the stopping rule (docs/detection-protocol.md): the stopping candidates on
two fleets, leave-one-fleet-out, with the z-score + EMA and PCA + EMA baselines of ``ds-ops
evaluate`` computed in the same run from the same files.

Per fleet and candidate, every series is trained as ``ds-ops train`` does (the candidate's
``train:`` keys over the defaults, seed ``--seed``, CPU, one thread) and its test period scored as
``ds-ops score`` does (:func:`opt_ds_ops.scoring.evaluate.evaluate_machine`). Prints per series and per
fleet the ROC-AUC / PR-AUC of each candidate and baseline, training seconds and why training
stopped, then the two folds and the choice by the rule fixed beforehand; ``--json PATH`` writes
everything.

Usage: scripts/eval_fleets.py [--smd DIR] [--asd DIR] [--seed N] [--only NAME ...] [--json PATH]
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
from opt_ds_ops.health.device import plan_device  # noqa: E402
from opt_ds_ops.scoring.evaluate import evaluate_machine, smd_machines  # noqa: E402

SHARED = os.path.join(REPO, "..", "shared", "data")
# the pre-registered candidates (docs/detection-protocol.md), in order of cost
CANDIDATES = {
    "epochs5": dict(stopping="epochs", epochs=5),
    "plateau-short": dict(stopping="plateau", eval_every_steps=25, patience=4, min_delta=0.01, min_steps=100,
                          max_steps=1000, epochs=1000),
    "plateau-mid": dict(stopping="plateau", eval_every_steps=50, patience=5, min_delta=0.005, min_steps=250,
                        max_steps=3000, epochs=1000),
    "plateau-long": dict(stopping="plateau", eval_every_steps=50, patience=10, min_delta=0.001, min_steps=500,
                         max_steps=10000, epochs=1000),
}
# round 2 (docs/detection-protocol.md, "Round 2"): the same question under a 2 s drop-to-model cost,
# in the order used for ties (cheapest first); plateau-long is the reference and must pass the cost gate too
FAST = dict(stopping="plateau", eval_every_steps=25, patience=6, min_delta=0.002, min_steps=100, epochs=1000)
ROUND2 = {
    "epochs5": CANDIDATES["epochs5"],
    "fast-b1024": dict(FAST, batch_size=1024, lr=1e-2, max_steps=600),
    "fast-lr3e-3": dict(FAST, batch_size=2048, lr=3e-3, max_steps=500),
    "fast-lr1e-2": dict(FAST, batch_size=2048, lr=1e-2, max_steps=500),
    "fast-lr3e-2": dict(FAST, batch_size=2048, lr=3e-2, max_steps=500),
    "plateau-long": CANDIDATES["plateau-long"],
}
# round 3 (docs/detection-protocol.md, "Round 3"): the per-metric error scale's floor and the input clip, on
# round 2's default; in the order used for ties (the default first: a change must win by more than TIE)
ROUND3 = {
    "base": {},
    "floor-0.1": dict(error_floor=0.1),
    "floor-1": dict(error_floor=1.0),
    "clip-5": dict(input_clip=5.0),
    "floor-0.1-clip-5": dict(error_floor=0.1, input_clip=5.0),
}
COST_GATE_S = 1.2  # round 2: the median training seconds over the SMD series a default may take
FLEETS = {"smd": 60.0, "asd": 300.0}  # sample period (s), for alarms per day
BASELINES = ("z-ema", "pca-ema")
TIE = 0.005


def merit(roc: float, pr: float) -> float:
    """The fleet's figure of merit S: PR-AUC weighs as much as ROC-AUC."""
    return (roc + pr) / 2


def run_fleet(root: str, period: float, train_keys: dict, seed: int, plan) -> list[dict]:
    """Evaluate every series of an SMD-layout folder with train_keys; per series the figures."""
    cfg = Config(device="cpu")
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(TrainConfig(), seed=seed, sample_period_s=period,
                                                             **train_keys))
    out = []
    with tempfile.TemporaryDirectory(prefix="eval-fleets-") as tmp:
        for files in smd_machines(root):
            t0 = time.perf_counter()
            r = evaluate_machine(files, cfg, plan, models_dir=tmp)
            with open(os.path.join(r["model_dir"], "metadata.json"), encoding="utf-8") as f:
                md = json.load(f)
            out.append({"series": files.name, "seconds": time.perf_counter() - t0, "train_s": md["duration_s"],
                        "stopping": md.get("stopping"), "warnings": md.get("warnings"),
                        **{k: {m: r[k][m] for m in ("roc_auc", "pr_auc", "alarms_per_day", "segments_flagged")}
                           for k in ("ds-ops",) + BASELINES}})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smd", default=os.path.join(SHARED, "smd"))
    ap.add_argument("--asd", default=os.path.join(SHARED, "asd"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--round", type=int, choices=(1, 2, 3), default=1, help="the protocol's round (default 1)")
    ap.add_argument("--only", nargs="*", help="candidates to run (default: all)")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    plan = plan_device("cpu", "off")
    roots = {"smd": args.smd, "asd": args.asd}
    table = {1: CANDIDATES, 2: ROUND2, 3: ROUND3}[args.round]
    names = args.only or list(table)
    runs = {}  # (candidate, fleet) -> per series
    for name in names:
        for fleet, period in FLEETS.items():
            t0 = time.perf_counter()
            runs[name, fleet] = run_fleet(roots[fleet], period, table[name], args.seed, plan)
            print(f"# {name} on {fleet}: {time.perf_counter() - t0:.0f} s", flush=True)

    means = {}
    for fleet in FLEETS:
        print(f"\n{fleet.upper()} (seed {args.seed}): ROC-AUC / PR-AUC per series; train s; why stopped (steps)")
        first = runs[names[0], fleet]
        head = f"{'series':<13}" + "".join(f"{n:>27}" for n in names) + "".join(f"{b:>16}" for b in BASELINES)
        print(head)
        for i, row in enumerate(first):
            cells = []
            for n in names:
                r = runs[n, fleet][i]
                st = r["stopping"] or {}
                cells.append(f"{r['ds-ops']['roc_auc']:.3f}/{r['ds-ops']['pr_auc']:.3f} "
                             f"{r['train_s']:4.1f}s {str(st.get('reason', '?'))[:3]} {st.get('steps', 0):>5}")
            base = [f"{row[b]['roc_auc']:.3f}/{row[b]['pr_auc']:.3f}" for b in BASELINES]
            print(f"{row['series']:<13}" + "".join(f"{c:>27}" for c in cells) + "".join(f"{c:>16}" for c in base))
        for key in names + list(BASELINES):
            rows = runs[key, fleet] if key in names else first
            score = "ds-ops" if key in names else key
            roc = float(np.mean([r[score]["roc_auc"] for r in rows]))
            pr = float(np.mean([r[score]["pr_auc"] for r in rows]))
            alarms = float(np.mean([r[score]["alarms_per_day"] for r in rows]))
            segs = [r[score]["segments_flagged"] for r in rows if r[score]["segments_flagged"] is not None]
            train_s = float(np.median([r["train_s"] for r in rows])) if key in names else None
            means[key, fleet] = {"roc_auc": roc, "pr_auc": pr, "S": merit(roc, pr), "alarms_per_day": alarms,
                                 "segments_flagged": float(np.mean(segs)) if segs else None, "median_train_s": train_s}
        print(f"{'mean':<13}" + "".join(f"{means[n, fleet]['roc_auc']:.4f}/{means[n, fleet]['pr_auc']:.4f} "
                                        f"S={means[n, fleet]['S']:.4f}".rjust(27) for n in names)
              + "".join(f"{means[b, fleet]['roc_auc']:.4f}/{means[b, fleet]['pr_auc']:.4f}".rjust(16) for b in BASELINES))
        print(f"{'median train':<13}" + "".join(f"{means[n, fleet]['median_train_s']:.2f} s".rjust(27) for n in names))
        print(f"{'alarms/day':<13}" + "".join(f"{means[k, fleet]['alarms_per_day']:.2f}".rjust(27 if k in names else 16)
                                              for k in names + list(BASELINES)))
        print(f"{'segs flagged':<13}" + "".join(_share(means[k, fleet]["segments_flagged"]).rjust(27 if k in names else 16)
                                                for k in names + list(BASELINES)))

    print("\nfolds (leave one fleet out; S = (mean ROC-AUC + mean PR-AUC) / 2):")
    eligible = names
    if args.round == 2:
        eligible = [n for n in names if means[n, "smd"]["median_train_s"] <= COST_GATE_S]
        print(f"  cost gate (median SMD training <= {COST_GATE_S} s): "
              + ", ".join(f"{n} {means[n, 'smd']['median_train_s']:.2f} s {'pass' if n in eligible else 'FAIL'}"
                          for n in names))
        if not eligible:
            print("  choice: none (no candidate passes the cost gate)")
            return 1
    folds = {}
    for pick, held in (("smd", "asd"), ("asd", "smd")):
        chosen = max(eligible, key=lambda n: means[n, pick]["S"])
        folds[pick] = chosen
        m = means[chosen, held]
        print(f"  chosen on {pick.upper()}: {chosen} (S {means[chosen, pick]['S']:.4f}); held out {held.upper()}: "
              f"ROC-AUC {m['roc_auc']:.4f} PR-AUC {m['pr_auc']:.4f} S {m['S']:.4f}  "
              f"(z-ema {means['z-ema', held]['S']:.4f}, pca-ema {means['pca-ema', held]['S']:.4f})")
    both = {n: (means[n, "smd"]["S"] + means[n, "asd"]["S"]) / 2 for n in names}
    best = max(both[n] for n in eligible)
    tied = [n for n in eligible if both[n] >= best - TIE]  # names are in order of cost: the first tied is the cheapest
    print("  mean of held-out S per candidate: " + ", ".join(f"{n} {both[n]:.4f}" for n in names))
    print(f"  choice: {tied[0]}" + (f" (tied within {TIE} with {', '.join(tied[1:])}; the cheapest)" if len(tied) > 1 else ""))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"seed": args.seed, "round": args.round, "candidates": {n: table[n] for n in names},
                       "runs": {f"{n}/{fl}": v for (n, fl), v in runs.items()},
                       "means": {f"{k}/{fl}": v for (k, fl), v in means.items()}, "folds": folds,
                       "choice": tied[0]}, f, indent=1)
    return 0


def _share(v) -> str:
    return "n/a" if v is None else f"{100 * v:.1f} %"


if __name__ == "__main__":
    sys.exit(main())
