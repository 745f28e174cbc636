#!/usr/bin/env python3
"""How many labelled segments could any threshold page, in hindsight? The ceiling of issue-style
goals (at most 1 false page a day, at least 80 % of labelled segments paged, at most 2 % of normal
rows in alarm) for the detector's scores, whatever policy sets the threshold.

Every series of both shared fleets is trained once with the shipped defaults and its test period
scored (``scripts/eval_incidents.py``'s :func:`series_scores`: the autoencoder and the PCA + EMA
baseline). For each series, every threshold of a fine grid (the test scores' own quantiles) turns
the scores into incidents with the shipped incident rule (:func:`opt_ds_ops.scoring.incidents.incidents_of`)
and is judged by :func:`opt_ds_ops.scoring.incidents.operator_figures`. Printed per series and per
fleet: the most segments paged by the best threshold for that series chosen knowing its labels
(an oracle no live policy can beat with these scores and this rule), within 1 false page a day,
and within that and 2 % of normal rows in alarm, for the autoencoder and the baseline.

``--quiet-s``: another quiet spell for the rule (0: every run of flagged rows is an incident).
``--open-window-s``: another opening window (0: one flagged row opens, the rule of rounds 4 to 14,
whose ceilings docs/detection-protocol.md records).
``--set train.KEY=VALUE``: the autoencoder trained and scored with another setting on top of the
shipped defaults (``train.input_differences=true``, ``train.score_window=10``: round 9's score).

Usage: scripts/page_ceiling.py [--smd DIR] [--asd DIR] [--seed N] [--quiet-s S] [--set train.K=V ...] [--json PATH]
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
import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from eval_incidents import FLEETS, SHARED, series_scores  # noqa: E402
from opt_ds_ops.config.conffile import Config, TrainConfig, with_overrides  # noqa: E402
from opt_ds_ops.config.yamlload import ConfigLoader  # noqa: E402
from opt_ds_ops.health.device import plan_device  # noqa: E402
from opt_ds_ops.scoring.evaluate import smd_machines  # noqa: E402
from opt_ds_ops.scoring.incidents import IncidentPolicy, incidents_of, operator_figures  # noqa: E402

GRID = 400  # thresholds per series: quantiles of its test scores, from the 0.5 to the top
FALSE_PER_DAY, IN_ALARM = 1.0, 0.02


def sweep(scores: np.ndarray, labels: np.ndarray, policy: IncidentPolicy, period: float) -> list[dict]:
    s = np.asarray(scores, dtype=np.float64)
    grid = np.unique(np.quantile(s, np.linspace(0.5, 1.0, GRID)))
    return [dict(operator_figures(incidents_of(s, float(t), policy, period), labels, period), threshold=float(t))
            for t in grid]


def ceiling(points: list[dict], max_alarm: float | None) -> dict | None:
    ok = [p for p in points if p["paged"] is not None and p["false_per_day"] <= FALSE_PER_DAY
          and (max_alarm is None or p["normal_in_alarm"] <= max_alarm)]
    if not ok:
        return None
    return max(ok, key=lambda p: (p["paged"], -p["false_per_day"], -p["normal_in_alarm"]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smd", default=os.path.join(SHARED, "smd"))
    ap.add_argument("--asd", default=os.path.join(SHARED, "asd"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quiet-s", type=float, help="the incident rule's quiet spell (default: the shipped one)")
    ap.add_argument("--open-window-s", type=float,
                    help="the incident rule's opening window (default: the shipped one; 0 before round 15)")
    ap.add_argument("--set", action="append", default=[], metavar="train.KEY=VALUE")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    plan = plan_device("cpu", "off")
    policy = IncidentPolicy.from_config(Config().scoring)  # the shipped incident rule
    if args.quiet_s is not None:
        policy = dataclasses.replace(policy, quiet_s=args.quiet_s)
    if args.open_window_s is not None:
        policy = dataclasses.replace(policy, open_window_s=args.open_window_s)
    print(f"incident rule: {policy}")
    roots = {"smd": args.smd, "asd": args.asd}
    out = {}
    for fleet, period in FLEETS.items():
        t0 = time.perf_counter()
        cfg = Config(device="cpu")
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(TrainConfig(), seed=args.seed, sample_period_s=period))
        cfg = with_overrides(cfg, {k: yaml.load(v, Loader=ConfigLoader) for k, _, v in (s.partition("=") for s in args.set)})
        with tempfile.TemporaryDirectory(prefix="page-ceiling-") as tmp:
            series = [series_scores(f, cfg, plan, tmp) for f in smd_machines(roots[fleet])]
        print(f"\n{fleet.upper()}: {len(series)} series trained and scored in {time.perf_counter() - t0:.0f} s; the best "
              f"threshold in hindsight: segments paged (false pages a day, normal rows in alarm)")
        print(f"{'series':<13}{'segments':>9}" + "".join(f"{h:>30}" for h in (
            "ae <=1/day", "ae <=1/day, <=2%", "pca <=1/day", "pca <=1/day, <=2%")))
        rows = []
        for s in series:
            labels = np.asarray(s["labels"]).astype(bool)
            cells = {}
            for det in ("scores", "pca"):
                pts = sweep(s[det], labels, policy, period)
                cells[det, "day"], cells[det, "alarm"] = ceiling(pts, None), ceiling(pts, IN_ALARM)
            segs = int(np.sum(np.diff(np.r_[0, labels.astype(np.int8)]) == 1))
            rows.append({"series": s["series"], "segments": segs,
                         **{f"{d}/{k}": v for (d, k), v in cells.items()}})
            print(f"{s['series']:<13}{segs:>9}" + "".join(_cell(cells[k]).rjust(30) for k in (
                ("scores", "day"), ("scores", "alarm"), ("pca", "day"), ("pca", "alarm"))))
        means = {}
        for k in ("scores/day", "scores/alarm", "pca/day", "pca/alarm"):
            got = [r[k] for r in rows]
            means[k] = {"paged": float(np.mean([g["paged"] if g else 0.0 for g in got])),
                        "segments_paged": int(sum(round(g["paged"] * r["segments"]) if g else 0
                                                  for g, r in zip(got, rows))),
                        "segments": int(sum(r["segments"] for r in rows))}
        print(f"{'mean':<13}{'':>9}" + "".join(
            f"{100 * means[k]['paged']:5.1f}% ({means[k]['segments_paged']} of {means[k]['segments']})".rjust(30)
            for k in ("scores/day", "scores/alarm", "pca/day", "pca/alarm")))
        auc = (float(np.mean([s["roc_auc"] for s in series])), float(np.mean([s["pr_auc"] for s in series])))
        print(f"point-wise ROC-AUC / PR-AUC of the autoencoder (as ds-ops evaluate): {auc[0]:.4f} / {auc[1]:.4f}")
        out[fleet] = {"series": rows, "means": means, "roc_auc": auc[0], "pr_auc": auc[1]}
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"seed": args.seed, "set": args.set, "policy": dataclasses.asdict(policy), "fleets": out}, f, indent=1)
    return 0


def _cell(p: dict | None) -> str:
    if p is None:
        return "none within"
    return f"{100 * p['paged']:5.1f}% ({p['false_per_day']:.2f}, {100 * p['normal_in_alarm']:.1f}%)"


if __name__ == "__main__":
    sys.exit(main())
