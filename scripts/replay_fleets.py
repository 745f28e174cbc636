#!/usr/bin/env python3
"""Rounds 6 to 22 of docs/detection-protocol.md: a month of every shared machine of both fleets
replayed through the real daemon (scripts/replay_month.py, the shipped defaults), for each
configuration of the round, in the order used for ties: round 6, ``before`` (the defaults before
it: no retraining, no change of regime; reported, not a candidate) and its candidates; round 7,
the alarm budget's candidates; round 8, a new version's budget from the scored history; round 9,
the score (each metric's change beside its level, shorter smoothing) and what the alarm budget
learns from; round 10, round 9's best on SMD with half the alarm budget, and the levels score with
the budget's ``warnings`` rule; round 11, a metric's term the larger of its change's and its
level's error, with EMA 10 or 5; round 12, after the budget's take-back of an incident's first
runs, a budget that waits two days, and round 11's max-5 again; round 13, a change of regime
judged by the model (the incident's last rows moved back by the shift), alone and with a budget
that waits two days; round 14, fewer false pages: half the alarm budget, with the model's change
of regime, and with incidents merged over an hour; round 15, on round 14's choice, an incident
that opens only when half of its last 5 minutes are flagged, and a new version's budget seeded
from the scored history, alone and together; round 16, a floor under the model's threshold for
the alarm budget (a half, a quarter); round 17, a new version's budget seeded from the history's
normal rows only (not what the versions before flagged, nor their retraining margin), alone, with
one flagged row opening an incident, and with 0.5 alarms a day; round 18, on round 17's choice, a
budget that learns no incident's runs, and one whose incidents are critical (never learned) from
1.5 times the threshold; rounds 19 to 21, the error floor, the gate's seeded threshold, the
incident's quiet spell and a metric's term; round 22, a measurement: a host upgraded across round
21's change of term. Prints each
machine's figures (false pages a day, labelled segments
paged, normal rows in alarm, retrains promoted, changes of regime) and each fleet's means, then
the folds and the choice by the rule fixed in the protocol.

Usage: scripts/replay_fleets.py [--round 6] [--jobs 2] [--out build/roundN] [--only CONFIG ...] [--machines M ...]
Each replay writes OUT/CONFIG-MACHINE.json and .log; one already there is not run again.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SHARED = os.path.join(REPO, "..", "shared", "data")
FLEETS = {"smd": 60.0, "asd": 300.0}
ROUNDS = {  # round -> (configuration -> replay_month.py --set items on top of --shipped, the candidates)
    6: ({"before": ["retrain.every=\"\"", "retrain.drift_rate=0", "scoring.regime_after_s=0"],
         "unattended": ["scoring.regime_after_s=0"],
         "unattended-regime": ["scoring.regime_after_s=21600", "scoring.regime_shift_sd=3"]},
        ("unattended", "unattended-regime")),
    7: ({"model-threshold": ["scoring.alarm_budget_per_day=0"],
         "budget-1": ["scoring.alarm_budget_per_day=1", "scoring.alarm_budget_days=14"],
         "budget-0.5": ["scoring.alarm_budget_per_day=0.5", "scoring.alarm_budget_days=14"]},
        ("model-threshold", "budget-1", "budget-0.5")),
    8: ({"budget-1": ["scoring.alarm_budget_history=false"],
         "history-seed": ["scoring.alarm_budget_history=true"],
         "history-seed-regime": ["scoring.alarm_budget_history=true", "scoring.regime_after_s=21600",
                                 "scoring.regime_shift_sd=3"]},
        ("budget-1", "history-seed", "history-seed-regime")),
    9: ({"shipped": ["scoring.alarm_budget_learns=all"],
         "diff-10": ["train.input_differences=true", "train.score_window=10", "scoring.alarm_budget_learns=warnings"],
         "diff-10-normal": ["train.input_differences=true", "train.score_window=10",
                            "scoring.alarm_budget_learns=normal"],
         "diff-10-regime": ["train.input_differences=true", "train.score_window=10",
                            "scoring.alarm_budget_learns=warnings", "scoring.regime_after_s=21600",
                            "scoring.regime_shift_sd=3"]},
        ("shipped", "diff-10", "diff-10-normal", "diff-10-regime")),
    10: ({"shipped": ["scoring.alarm_budget_learns=all"],
          "diff-10-regime-b0.5": ["train.input_differences=true", "train.score_window=10",
                                  "scoring.alarm_budget_learns=warnings", "scoring.regime_after_s=21600",
                                  "scoring.regime_shift_sd=3", "scoring.alarm_budget_per_day=0.5"],
          "levels-warnings-regime": ["scoring.alarm_budget_learns=warnings", "scoring.regime_after_s=21600",
                                     "scoring.regime_shift_sd=3"]},
         ("shipped", "diff-10-regime-b0.5", "levels-warnings-regime")),
    11: ({"shipped": [],
          "max-10": ["train.difference_term=max"],
          "max-5": ["train.difference_term=max", "train.score_window=5"]},
         ("shipped", "max-10", "max-5")),
    12: ({"shipped": [],
          "min-days-2": ["scoring.alarm_budget_min_days=2"],
          "max-5": ["train.difference_term=max", "train.score_window=5"]},
         ("shipped", "min-days-2", "max-5")),
    13: ({"shipped": [],
          "regime-model": ["scoring.regime_explains=model"],
          "regime-model-days-2": ["scoring.regime_explains=model", "scoring.alarm_budget_min_days=2"]},
         ("shipped", "regime-model", "regime-model-days-2")),
    14: ({"shipped": [],
          "budget-0.25": ["scoring.alarm_budget_per_day=0.25"],
          "model-budget-0.25": ["scoring.alarm_budget_per_day=0.25", "scoring.regime_explains=model"],
          "model-budget-0.25-quiet-1h": ["scoring.alarm_budget_per_day=0.25", "scoring.regime_explains=model",
                                         "scoring.incident_quiet_s=3600"]},
         ("shipped", "budget-0.25", "model-budget-0.25", "model-budget-0.25-quiet-1h")),
    15: ({"shipped": [],
          "open-5m": ["scoring.incident_open_window_s=300"],
          "history-seed": ["scoring.alarm_budget_history=true"],
          "history-seed-open-5m": ["scoring.alarm_budget_history=true", "scoring.incident_open_window_s=300"]},
         ("shipped", "open-5m", "history-seed", "history-seed-open-5m")),
    16: ({"shipped": [],
          "floor-0.5": ["scoring.alarm_budget_floor=0.5"],
          "floor-0.25": ["scoring.alarm_budget_floor=0.25"]},
         ("shipped", "floor-0.5", "floor-0.25")),
    17: ({"shipped": [],
          "history-normal": ["scoring.alarm_budget_history=true"],
          "history-normal-open-0": ["scoring.alarm_budget_history=true", "scoring.incident_open_window_s=0"],
          "history-normal-budget-0.5": ["scoring.alarm_budget_history=true", "scoring.alarm_budget_per_day=0.5"]},
         ("shipped", "history-normal", "history-normal-open-0", "history-normal-budget-0.5")),
    18: ({"shipped": [],
          "learns-normal": ["scoring.alarm_budget_learns=normal"],
          "critical-1.5": ["scoring.incident_critical_ratio=1.5"]},
         ("shipped", "learns-normal", "critical-1.5")),
    19: ({"shipped": [],
          "floor-0.1": ["train.error_floor=0.1"],
          "floor-1": ["train.error_floor=1"],
          "floor-0.1-clip-5": ["train.error_floor=0.1", "train.input_clip=5"]},
         ("shipped", "floor-0.1", "floor-1", "floor-0.1-clip-5")),
    20: ({"shipped": [],
          "seeded-32": ["store.promote_max_seeded_factor=32"],
          "seeded-8": ["store.promote_max_seeded_factor=8"]},
         ("shipped", "seeded-32", "seeded-8")),
    21: ({"shipped": [],
          "quiet-15m": ["scoring.incident_quiet_s=900"],
          "term-mean": ["train.difference_term=mean"]},
         ("shipped", "quiet-15m", "term-mean")),
    # a measurement, no candidates: a host upgraded from the package before round 21 (its first
    # version trained with the term max, every later one with mean) beside one installed fresh
    22: ({"shipped": [],
          "upgraded": ["before:train.difference_term=max"]},
         ()),
}


def _pin(rounds, before: list[str]) -> None:
    """Put ``before`` (the shipped conffile of those rounds' time) under every configuration's items
    of ``rounds``: each round's own items come after, so they win (replay_month.py's --set: the last wins)."""
    for r in rounds:
        ROUNDS[r] = ({name: before + items for name, items in ROUNDS[r][0].items()}, ROUNDS[r][1])


# Rounds 9 and 10 on the shipped conffile of their time (round 10's choice became the shipped one):
# each configuration's items go on top of these, so their records reproduce (those whose budget
# learns warnings or normal only on the code before the budget held a day's runs, 8e4b380). Rounds 6 to 8 run on
# today's score, with the incident rule and budget of rounds 15 and 17 below: beside today's score, not their records.
BEFORE_ROUND_10 = ["train.input_differences=false", "train.score_window=30", "scoring.alarm_budget_learns=all",
                   "scoring.regime_after_s=0", "scoring.alarm_budget_per_day=1", "train.difference_term=mean"]
_pin((9, 10), BEFORE_ROUND_10)
# Rounds 11 and 12 likewise on round 10's score (round 12's choice, max-5, became the shipped one).
BEFORE_ROUND_12 = ["train.difference_term=mean", "train.score_window=10"]
_pin((11, 12), BEFORE_ROUND_12)
# Rounds 9 to 14 on the budget and change-of-regime rule of their time (round 14's choice,
# 0.25 a day and the model's rule, became the shipped one): first, so each round's own items win.
BEFORE_ROUND_14 = ["scoring.alarm_budget_per_day=0.5", "scoring.regime_explains=share"]
_pin(range(9, 15), BEFORE_ROUND_14)
# Rounds 6 to 15 on the incident rule of their time (round 15's choice, a 5-minute window, became
# the shipped one): first, so each round's own items win.
BEFORE_ROUND_15 = ["scoring.incident_open_window_s=0"]
_pin(range(6, 16), BEFORE_ROUND_15)
# Rounds 6 to 17 on the budget of their time (round 17's choice, a new version seeded from the
# history's normal rows at 0.5 alarms a day, became the shipped one): first, so each round's own
# items win (rounds 9 to 14's 0.5 a day above, and round 7's own; round 8's history-seed its own).
BEFORE_ROUND_17 = ["scoring.alarm_budget_history=false", "scoring.alarm_budget_per_day=0.25"]
_pin(range(6, 18), BEFORE_ROUND_17)
# (Round 15's history-seed configurations replay today with round 17's seed, the runs in what the
# versions before flagged not counted: their records were made with the seed that counted every
# run, which only scoring.alarm_budget_learns=all restores, with what live scoring learns.)

# Rounds 6 to 20 without the gate's seeded-threshold (round 20's choice, 32, became the shipped one):
# first, so round 20's own items win.
BEFORE_ROUND_20 = ["store.promote_max_seeded_factor=0"]
_pin(range(6, 21), BEFORE_ROUND_20)
# Rounds 13 to 21 on the term of their time (round 21's choice, mean, became the shipped one):
# first, so round 21's own term-mean wins; rounds 9 to 12 have their own mean above.
BEFORE_ROUND_21 = ["train.difference_term=max"]
_pin(range(13, 22), BEFORE_ROUND_21)
TIES = {8: 0.03}  # round 8: a candidate must beat the first (as shipped) by more than the replays' own spread
CONFIGS, CANDIDATES = ROUNDS[6]
BUDGET, TIE = 1.0, 0.01


def machines(fleet: str) -> list[str]:
    names = os.listdir(os.path.join(SHARED, fleet, "test"))
    return sorted({f.split(".txt")[0] for f in names if ".txt" in f})


def run(config: str, fleet: str, machine: str, out: str) -> str:
    """Replay one machine with one configuration of the round (CONFIGS) into out; return its JSON."""
    path = os.path.join(out, f"{config}-{machine}.json")
    if os.path.exists(path):
        return path
    cmd = [sys.executable, os.path.join(REPO, "scripts", "replay_month.py"), "--corpus", os.path.join(SHARED, fleet),
           "--period-s", str(FLEETS[fleet]), "--machine", machine, "--shipped", "--day-s", "2", "--json", path + ".part"]
    for item in CONFIGS[config]:  # "before:SECTION.KEY=VALUE": the package's before an upgrade (--before-set)
        cmd += ["--before-set", item[len("before:"):]] if item.startswith("before:") else ["--set", item]
    with open(os.path.join(out, f"{config}-{machine}.log"), "w") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    os.rename(path + ".part", path)
    return path


def figures(path: str) -> dict | None:
    doc = json.load(open(path))
    f = doc.get("figures") or {}
    o = (f.get("test_period") or {}).get("operator")
    if not o:
        return None
    r = f.get("retrains") or []
    return {"false_per_day": o["false_pages_per_day"], "paged": o["paged_share"], "normal_in_alarm": o["normal_in_alarm"],
            "pages": o["pages"], "retrains": len(r), "promoted": sum(1 for x in r if x.get("promoted")),
            "regimes": f.get("regime_changes", 0), "failures": len(doc.get("failures") or [])}


def objective(m: dict) -> float:
    return m["paged"] - m["normal_in_alarm"] if m["false_per_day"] <= BUDGET else -m["false_per_day"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    global CONFIGS, CANDIDATES, TIE
    ap.add_argument("--round", type=int, default=6, choices=sorted(ROUNDS))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out")
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--machines", nargs="*")
    args = ap.parse_args()
    CONFIGS, CANDIDATES = ROUNDS[args.round]
    TIE = TIES.get(args.round, TIE)
    args.out = args.out or os.path.join(REPO, "build", f"round{args.round}")
    args.only = args.only or list(CONFIGS)
    os.makedirs(args.out, exist_ok=True)
    todo = [(c, fl, m) for fl in FLEETS for m in machines(fl) if not args.machines or m in args.machines
            for c in args.only]
    with ThreadPoolExecutor(args.jobs) as pool:
        paths = dict(zip(todo, pool.map(lambda t: run(*t, args.out), todo)))
    means = {}
    for fl in FLEETS:
        print(f"\n{fl.upper()}: false pages a day / labelled segments paged / normal rows in alarm / retrains promoted "
              "/ changes of regime")
        print(f"{'machine':<13}" + "".join(f"{c:>40}" for c in args.only))
        rows = {c: [] for c in args.only}
        for m in machines(fl):
            if args.machines and m not in args.machines:
                continue
            cells = []
            for c in args.only:
                f = figures(paths[c, fl, m])
                rows[c].append(f)
                cells.append("failed" if f is None else
                             f"{f['false_per_day']:5.2f} {100 * (f['paged'] or 0):5.1f}% {100 * f['normal_in_alarm']:5.1f}% "
                             f"{f['promoted']:2d}/{f['retrains']:<2d} {f['regimes']:2d}" + (" !" if f["failures"] else ""))
            print(f"{m:<13}" + "".join(x.rjust(40) for x in cells))
        for c in args.only:
            ok = [f for f in rows[c] if f is not None]
            paged = [f["paged"] for f in ok if f["paged"] is not None]
            means[c, fl] = {"false_per_day": float(np.mean([f["false_per_day"] for f in ok])),
                            "paged": float(np.mean(paged)) if paged else 0.0,
                            "normal_in_alarm": float(np.mean([f["normal_in_alarm"] for f in ok])),
                            "promoted": int(sum(f["promoted"] for f in ok)), "retrains": int(sum(f["retrains"] for f in ok)),
                            "regimes": int(sum(f["regimes"] for f in ok)), "machines": len(ok)}
        print(f"{'mean':<13}" + "".join(
            (f"{means[c, fl]['false_per_day']:5.2f} {100 * means[c, fl]['paged']:5.1f}% "
             f"{100 * means[c, fl]['normal_in_alarm']:5.1f}% {means[c, fl]['promoted']:2d}/{means[c, fl]['retrains']:<2d} "
             f"{means[c, fl]['regimes']:2d}").rjust(40) for c in args.only))
        print(f"{'objective':<13}" + "".join(f"{objective(means[c, fl]):.4f}".rjust(40) for c in args.only))
    cands = [c for c in CANDIDATES if c in args.only]
    if cands and len(cands) == len(CANDIDATES):
        print(f"\nfolds (leave one fleet out; objective: paged less normal rows in alarm within {BUDGET:g} false page a day):")
        for pick, held in (("smd", "asd"), ("asd", "smd")):
            best = max(objective(means[c, pick]) for c in cands)
            chosen = next(c for c in cands if objective(means[c, pick]) >= best - TIE)
            m = means[chosen, held]
            print(f"  chosen on {pick.upper()}: {chosen}; held out {held.upper()}: {m['false_per_day']:.2f} false a day, "
                  f"{100 * m['paged']:.1f}% paged, {100 * m['normal_in_alarm']:.1f}% normal rows in alarm")
        both = {c: (objective(means[c, "smd"]) + objective(means[c, "asd"])) / 2 for c in cands}
        best = max(both.values())
        tied = [c for c in cands if both[c] >= best - TIE]
        print("  mean objective over the two fleets: " + ", ".join(f"{c} {both[c]:.4f}" for c in cands))
        print(f"  choice: {tied[0]}" + (f" (tied within {TIE} with {', '.join(tied[1:])}; the first)" if len(tied) > 1 else ""))
    with open(os.path.join(args.out, "means.json"), "w") as f:
        json.dump({f"{c}/{fl}": v for (c, fl), v in means.items()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
