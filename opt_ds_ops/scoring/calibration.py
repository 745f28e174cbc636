"""The threshold kept to an alarm budget: ``scoring.alarm_budget_per_day`` alarms a day at most.

A model's threshold is set once, at training, from the newest tenth of its training file (a week,
say). Months later the scores have drifted a little and that threshold pages several times a day
for nothing. With a budget, each series re-derives its threshold from what it has scored itself:

* **What is counted**: alarms, the runs of rows over a threshold (an incident is one run or
  several merged, so incidents are at most as many). For every candidate threshold at once, a
  day's runs are kept as one small histogram: a run starts at row i for every threshold ``t`` in
  ``[s[i-1], s[i])`` (``s``: the smoothed score), so ``+1`` at the bin of ``s[i-1]`` and ``-1`` at
  the bin of ``s[i]`` count, summed up to a bin, the runs over that bin's threshold (as
  :func:`opt_ds_ops.model.threshold.alarms_at` counts them from the scores).
  Bins are log-spaced in score / the model's threshold: 16 to an octave (4.4 % apart), from 1/16 to
  1024 times it.
* **When**: at the first row of each day of the data's clock (UTC days of the rows' times, or days
  of rows at the model's sample period without times), from the last ``days`` days scored by the
  same version: the lowest bin edge at which that history and every higher edge give at most
  ``budget_per_day`` alarms a day, and never under the model's own threshold. Less than
  ``min_days`` of history: the model's threshold. A change is an event ``threshold-calibrated``.
* **Invariant**: the threshold moves only at day boundaries of the rows, so a file scored in one
  chunk or in many gives the same flags; the state is a few hundred numbers a day, ``days`` days
  at most, carried in the series state.

A new version starts again from its own threshold (its scores are not the old one's). The
functions here are pure on the plain dict kept in :class:`opt_ds_ops.scoring.series.SeriesState`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

PER_OCTAVE = 16
EDGES = 2.0 ** (np.arange(-4 * PER_OCTAVE, 10 * PER_OCTAVE + 1) / PER_OCTAVE)  # score / the model's threshold
SECONDS_PER_DAY = 86400.0


@dataclass(frozen=True)
class CalibrationPolicy:
    """The conffile's ``scoring.alarm_budget_*`` keys. ``budget_per_day`` 0: off (the model's threshold)."""

    budget_per_day: float = 0.0
    days: float = 14.0
    min_days: float = 1.0

    @classmethod
    def from_config(cls, scoring) -> CalibrationPolicy:
        return cls(budget_per_day=scoring.alarm_budget_per_day, days=scoring.alarm_budget_days)

    @property
    def on(self) -> bool:
        return self.budget_per_day > 0


def fresh(base: float) -> dict:
    """The calibration state of a series that starts now, against the model's threshold ``base``."""
    return {"base": float(base), "threshold": float(base), "day": None, "prev": None, "rows": 0, "runs": {},
            "days": []}


def valid(cal, base: float) -> bool:
    """Whether cal is a calibration state of this shape, made against the threshold ``base``."""
    if not isinstance(cal, dict) or cal.get("base") != float(base):
        return False
    try:
        ok = (isinstance(cal["threshold"], (int, float)) and math.isfinite(cal["threshold"])
              and (cal["day"] is None or isinstance(cal["day"], int))
              and (cal["prev"] is None or isinstance(cal["prev"], (int, float)))
              and isinstance(cal["rows"], int) and isinstance(cal["runs"], dict) and isinstance(cal["days"], list)
              and all(isinstance(d, list) and len(d) == 3 and isinstance(d[0], int) and isinstance(d[1], int)
                      and isinstance(d[2], dict) for d in cal["days"]))
    except (KeyError, TypeError):
        return False
    return ok and len(cal["days"]) <= 10000


def day_of(time_s: float | None, row: int, period_s: float) -> int:
    """The day of a row: of its UTC time, else of its series row at ``period_s`` seconds a row."""
    if time_s is not None and math.isfinite(time_s):
        return int(time_s // SECONDS_PER_DAY)
    return int(row * period_s // SECONDS_PER_DAY)


def day_cuts(times: np.ndarray | None, row0: int, n: int, period_s: float) -> list[int]:
    """Return the indices 0 < i < n of the rows that start a new day (:func:`day_of`)."""
    if n < 2:
        return []
    if times is not None:
        days = np.floor(np.asarray(times, dtype=np.float64) / SECONDS_PER_DAY)
    else:
        days = np.floor((row0 + np.arange(n)) * period_s / SECONDS_PER_DAY)
    return (np.flatnonzero(np.diff(days) != 0) + 1).tolist()


def _bins(x: np.ndarray) -> np.ndarray:
    """The bin of each ratio x: how many edges are strictly below it (0 .. len(EDGES))."""
    return np.searchsorted(EDGES, x, side="left")


def add(cal: dict, scores: np.ndarray) -> None:
    """Count the run starts of scores (n,) (the current day's, the next rows of the series) into cal."""
    s = np.asarray(scores, dtype=np.float64) / cal["base"]
    if not s.size:
        return
    lo = np.r_[-np.inf if cal["prev"] is None else cal["prev"], s[:-1]]
    up = lo < s
    runs = cal["runs"]
    for b, k in zip(*np.unique(_bins(lo[up]), return_counts=True)):
        runs[str(int(b))] = runs.get(str(int(b)), 0) + int(k)
    for b, k in zip(*np.unique(_bins(s[up]), return_counts=True)):
        runs[str(int(b))] = runs.get(str(int(b)), 0) - int(k)
    cal["runs"] = {b: v for b, v in runs.items() if v}
    cal["prev"] = float(s[-1])
    cal["rows"] += int(s.size)


def gap(cal: dict) -> None:
    """The series starts again after a gap: the next row starts a run of its own."""
    cal["prev"] = None


def budget_threshold(days: list, policy: CalibrationPolicy, base: float, period_s: float) -> tuple[float, dict]:
    """Return (the threshold, what it rests on: ``days`` covered and ``alarms`` at it) from the
    kept days ``[[day, rows, runs], ...]``; the model's threshold ``base`` with too little history."""
    rows = sum(d[1] for d in days)
    covered = rows * period_s / SECONDS_PER_DAY
    if covered < policy.min_days or not rows:
        return base, {"days": round(covered, 3), "alarms": None}
    delta = np.zeros(EDGES.size + 1, dtype=np.int64)
    for d in days:
        for b, v in d[2].items():
            delta[int(b)] += v
    runs = np.cumsum(delta)[: EDGES.size]  # runs[k]: runs of the history over EDGES[k] * base
    allowed = math.floor(policy.budget_per_day * covered + 1e-9)
    over = np.flatnonzero(runs > allowed)
    k = min(int(over[-1]) + 1, EDGES.size - 1) if over.size else 0
    k = max(k, int(np.searchsorted(EDGES, 1.0)))  # never under the model's own threshold
    return float(EDGES[k] * base), {"days": round(covered, 3), "alarms": int(runs[k])}


def roll(cal: dict, day: int, policy: CalibrationPolicy, period_s: float) -> dict | None:
    """At the first row of ``day``: close the current day, keep the last ``policy.days`` days and
    set the threshold from them. Return ``{"previous", "threshold", "days", "alarms"}`` if the
    threshold changed, else None."""
    if cal["day"] == day:
        return None
    if cal["day"] is not None and cal["rows"]:
        cal["days"].append([cal["day"], cal["rows"], cal["runs"]])
    cal["days"] = [d for d in cal["days"] if day - policy.days <= d[0] < day]
    cal["day"], cal["rows"], cal["runs"] = day, 0, {}
    threshold, basis = budget_threshold(cal["days"], policy, cal["base"], period_s)
    previous = cal["threshold"]
    cal["threshold"] = threshold
    if threshold == previous:
        return None
    return dict(basis, previous=previous, threshold=threshold)
