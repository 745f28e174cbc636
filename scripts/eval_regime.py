#!/usr/bin/env python3
"""Round 5 of docs/detection-protocol.md: does recognising a change of regime (and re-baselining the
series at once) page an operator less for nothing and spend less time in alarm, without losing real
pages? Chosen leave-one-fleet-out on the shared SMD and ASD fleets.

Every series of both fleets is trained once with the shipped defaults (seed ``--seed``, CPU, one
thread), as round 4 does (:func:`eval_incidents.series_scores`). Each candidate then scores the test
period as the daemon does, through :func:`opt_ds_ops.scoring.series.score_chunk` with the shipped
incident rule and the candidate's change-of-regime rule (in one chunk: chunks change nothing,
tests/scoring/test_regime.py), and is judged by :func:`opt_ds_ops.scoring.incidents.operator_figures`.
Offline: no retraining (the daemon's learning of a regime is measured by the month replays).

Usage: scripts/eval_regime.py [--smd DIR] [--asd DIR] [--seed N] [--json PATH]
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from eval_incidents import FLEETS, REPO, SHARED, _pct  # noqa: E402

sys.path.insert(0, REPO)
from opt_ds_ops.config.conffile import Config, TrainConfig  # noqa: E402
from opt_ds_ops.dataset import DatasetLimits, load_dataset  # noqa: E402
from opt_ds_ops.health.device import plan_device  # noqa: E402
from opt_ds_ops.scoring.evaluate import evaluate_machine, smd_machines  # noqa: E402
from opt_ds_ops.scoring.incidents import IncidentPolicy, operator_figures  # noqa: E402
from opt_ds_ops.scoring.regime import RegimePolicy  # noqa: E402
from opt_ds_ops.scoring.series import fresh_state, score_chunk  # noqa: E402
from opt_ds_ops.store.versions import load_model  # noqa: E402

# the pre-registered candidates (docs/detection-protocol.md, "Round 5"), in the order used for ties;
# None: no change-of-regime rule (round 4's choice as shipped)
CANDIDATES = {
    "none": None,
    "regime-6h-3sd": RegimePolicy(after_s=6 * 3600, shift_sd=3.0),
    "regime-2h-3sd": RegimePolicy(after_s=2 * 3600, shift_sd=3.0),
    "regime-12h-3sd": RegimePolicy(after_s=12 * 3600, shift_sd=3.0),
    "regime-6h-5sd": RegimePolicy(after_s=6 * 3600, shift_sd=5.0),
}
BUDGET = 1.0  # false pages a day per machine (mean over the fleet) a candidate may cost
TIE = 0.01


def objective(fig: dict) -> float:
    """The rule's figure for one fleet: within the budget of false pages, the share of segments
    paged less the share of normal rows in alarm; over it, minus the false pages a day."""
    return fig["paged"] - fig["normal_in_alarm"] if fig["false_per_day"] <= BUDGET else -fig["false_per_day"]


def incidents_of_events(events: list[dict], state) -> list[dict]:
    """The incidents of a scored series as :func:`opt_ds_ops.scoring.incidents.operator_figures` takes them."""
    opened = {e["incident"]: e for e in events if e["event"] == "incident-opened"}
    out = [{"start": e["started_row"], "opened": e["opened_row"], "end": e["row"]}
           for e in events if e["event"] == "incident-closed" and e["incident"] in opened]
    inc = state.open_incident
    if inc is not None:
        out.append({"start": inc["start_row"], "opened": inc["opened_row"], "end": inc["last_row"]})
    return out


def series_runs(files, cfg, plan, tmp: str, period: float) -> dict:
    r = evaluate_machine(files, cfg, plan, models_dir=tmp, keep_scores=True)
    stored = load_model(r["model_dir"])
    test = load_dataset(files.test, DatasetLimits.from_config(cfg.job))
    names = [str(j) for j in range(stored.n_features)]
    out = {"series": files.name, "labels": r["_labels"], "figs": {}, "regimes": {}}
    for name, regime in CANDIDATES.items():
        res = score_chunk(stored, np.asarray(test.data), test.offset, None, fresh_state(files.name, stored),
                          names=names, max_gap_periods=0, policy=IncidentPolicy(), regime=regime)
        out["figs"][name] = operator_figures(incidents_of_events(res.events, res.state), r["_labels"], period)
        out["regimes"][name] = [{"row": e["row"], "metrics": [m["metric"] for m in e["metrics"]][:5]}
                                for e in res.events if e["event"] == "regime-changed"]
    return out


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
    series, means = {}, {}
    for fleet, period in FLEETS.items():
        t0 = time.perf_counter()
        cfg = Config(device="cpu")
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(TrainConfig(), seed=args.seed, sample_period_s=period))
        with tempfile.TemporaryDirectory(prefix="eval-regime-") as tmp:
            series[fleet] = [series_runs(f, cfg, plan, tmp, period) for f in smd_machines(roots[fleet])]
        print(f"# {fleet}: {len(series[fleet])} series in {time.perf_counter() - t0:.0f} s", flush=True)
        for name in CANDIDATES:
            rows = [s["figs"][name] for s in series[fleet]]
            paged = [r["paged"] for r in rows if r["paged"] is not None]
            means[name, fleet] = {"false_per_day": float(np.mean([r["false_per_day"] for r in rows])),
                                  "paged": float(np.mean(paged)) if paged else 0.0,
                                  "normal_in_alarm": float(np.mean([r["normal_in_alarm"] for r in rows])),
                                  "pages": float(np.mean([r["pages"] for r in rows])),
                                  "regimes": float(np.mean([len(s["regimes"][name]) for s in series[fleet]]))}
    for fleet in FLEETS:
        print(f"\n{fleet.upper()} (seed {args.seed}): per series false pages a day / segments paged / normal rows "
              "in alarm / changes of regime")
        print(f"{'series':<13}" + "".join(f"{n:>28}" for n in CANDIDATES))
        for s in series[fleet]:
            print(f"{s['series']:<13}" + "".join(
                f"{s['figs'][n]['false_per_day']:5.2f} {_pct(s['figs'][n]['paged'])} "
                f"{_pct(s['figs'][n]['normal_in_alarm'])} {len(s['regimes'][n]):3d}".rjust(28) for n in CANDIDATES))
        print(f"{'mean':<13}" + "".join(
            f"{means[n, fleet]['false_per_day']:5.2f} {_pct(means[n, fleet]['paged'])} "
            f"{_pct(means[n, fleet]['normal_in_alarm'])} {means[n, fleet]['regimes']:3.1f}".rjust(28) for n in CANDIDATES))
        print(f"{'objective':<13}" + "".join(f"{objective(means[n, fleet]):.4f}".rjust(28) for n in CANDIDATES))
    print(f"\nfolds (leave one fleet out; objective: segments paged less normal rows in alarm, within {BUDGET:g} "
          "false page a day):")
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
            json.dump({"seed": args.seed,
                       "candidates": {n: dataclasses.asdict(p) if p else None for n, p in CANDIDATES.items()},
                       "series": {fl: [{k: v for k, v in s.items() if k != "labels"} for s in series[fl]] for fl in FLEETS},
                       "means": {f"{n}/{fl}": v for (n, fl), v in means.items()}, "folds": folds,
                       "choice": tied[0]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
