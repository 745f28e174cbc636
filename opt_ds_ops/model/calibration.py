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
  ``budget_per_day`` alarms a day, and never under ``floor`` times the model's own threshold (1
  as shipped: never under it; a lower floor lets the budget undo a model threshold that one event
  in its validation split set high). Less than
  ``min_days`` of history: the model's threshold. A change is an event ``threshold-calibrated``.
* **What teaches it** (``learns``): with ``normal``, a run that starts inside an incident
  (:mod:`opt_ds_ops.scoring.incidents`), its first row included, is not counted, so an incident, a burst of them or the same
  failure again never raises the threshold that must page it (with one flagged row opening an
  incident, the budget then learns only the runs under the threshold in force); with ``warnings``,
  only the runs of incidents that were or became critical are left out, so the budget still
  learns the model's noise, the warnings it pages for nothing, while loud bursts and real
  failures (twice the threshold or more) never raise it and a repeat within ``days`` is paged as
  the first was; ``all`` counts every run (before round 9). A run over the threshold in force
  waits until its day closes (``pending``): an incident that opens, or becomes critical, later
  that day takes back the runs from its first row to that row (:func:`forget_from`), so a warning that
  escalates, or an incident that opens after its window fills, teaches nothing either (runs on
  an earlier day, or starting under the threshold, stay counted).
* **Enough history first**: the threshold stays the model's until ``min_days`` days are kept (by
  the rows' times a partial day counts as a day; without times, rows at the sample period); the
  budget allows ``floor(budget_per_day x days)`` alarms, so with 0.5 a day (as shipped) it
  allows none until 2 days are kept (with 0.25, rounds 14-16, none until 4).
* **Bounded**: one day moves the threshold by at most :data:`MAX_DAY_FACTOR` either way (never
  under the floor); a move of that factor or more is said at warning level by the daemon. A seed
  (below) rolls its days at once: its one move can reach that factor per day of history.
* **Invariant**: the threshold moves only at day boundaries of the rows, so a file scored in one
  chunk or in many gives the same flags; the state is a few hundred numbers a day, ``days`` days
  at most, and the current day's held runs (:data:`MAX_PENDING` at most: three numbers each),
  carried in the series state.

A new version starts again from its own threshold (its scores are not the old one's); with
``from_history`` it starts from the series' scored history scored again by it (:func:`seed`): the
rows of the last ``days`` days the versions before it scored (most of them its own training rows,
whose scores are lower than unseen rows' would be: the threshold they give errs towards the model's
own, never under it); unless ``learns`` is ``all``, a run that starts in what those versions flagged,
or within ``retrain.exclude_margin`` rows of it, is not counted (the rows a retraining leaves out,
long segments too: the new version never saw most of them, and its scores of them would teach it
the incidents; stricter than ``warnings`` live, which learns a warning's runs). The
functions here are pure on the plain dict kept in :class:`opt_ds_ops.scoring.series.SeriesState`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

PER_OCTAVE = 16
EDGES = 2.0 ** (np.arange(-4 * PER_OCTAVE, 10 * PER_OCTAVE + 1) / PER_OCTAVE)  # score / the model's threshold
SECONDS_PER_DAY = 86400.0
MAX_DAY_FACTOR = 2.0  # one day's calibration moves the threshold by at most this factor, up or down
MAX_PENDING = 10_000  # runs over the threshold held until their day closes; more in a day are counted


@dataclass(frozen=True)
class CalibrationPolicy:
    """The conffile's ``scoring.alarm_budget_*`` keys. ``budget_per_day`` 0: off (the model's threshold)."""

    budget_per_day: float = 0.0
    days: float = 14.0
    min_days: float = 1.0
    from_history: bool = False  # a new version's days start from the scored history, scored again by it
    learns: str = "all"  # whose runs count: "all", "warnings" (not a critical incident's), "normal" (no incident's)
    floor: float = 1.0  # the lowest threshold the budget sets, times the model's (EDGES[0] .. 1; 1: never under it)

    @classmethod
    def from_config(cls, scoring) -> CalibrationPolicy:
        return cls(budget_per_day=scoring.alarm_budget_per_day, days=scoring.alarm_budget_days,
                   min_days=scoring.alarm_budget_min_days, from_history=scoring.alarm_budget_history,
                   learns=scoring.alarm_budget_learns, floor=scoring.alarm_budget_floor)

    @property
    def on(self) -> bool:
        return self.budget_per_day > 0


def floor_bin(floor: float) -> int:
    """The index of the first of EDGES at or over ``floor`` (1: the model's threshold, EDGES[64])."""
    return int(np.searchsorted(EDGES, floor * (1 - 1e-12)))


def fresh(base: float) -> dict:
    """The calibration state of a series that starts now, against the model's threshold ``base``."""
    return {"base": float(base), "threshold": float(base), "day": None, "prev": None, "rows": 0, "runs": {},
            "days": [], "clock": None, "pending": []}


def usable(base: float) -> bool:
    """Whether a model's threshold can be calibrated from (a positive, finite number)."""
    return isinstance(base, (int, float)) and math.isfinite(base) and base > 0


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _runs_ok(runs) -> bool:
    return isinstance(runs, dict) and all(isinstance(b, str) and b.isdigit() and int(b) <= EDGES.size and _count(v)
                                          for b, v in runs.items())


def _pending_ok(pending) -> bool:
    return isinstance(pending, list) and len(pending) <= MAX_PENDING and all(
        isinstance(p, list) and len(p) == 3 and all(_count(v) for v in p) and 0 <= p[1] <= EDGES.size
        and 0 <= p[2] <= EDGES.size for p in pending)


def valid(cal, base: float) -> bool:
    """Whether cal is a calibration state of this shape, made against the threshold ``base``: its
    threshold finite and within the edges' range of ``base`` (a floor under 1 lets it go under
    ``base``: :func:`floored` applies the floor in force), its days and bins in range, its counts integers."""
    if not isinstance(cal, dict) or cal.get("base") != float(base):
        return False
    try:
        ok = (isinstance(cal["threshold"], (int, float)) and math.isfinite(cal["threshold"])
              and EDGES[0] * float(base) <= cal["threshold"] <= EDGES[-1] * float(base)
              and (cal["day"] is None or _count(cal["day"]))
              and (cal["prev"] is None or isinstance(cal["prev"], (int, float)) and not isinstance(cal["prev"], bool)
                   and math.isfinite(cal["prev"]))
              and _count(cal["rows"]) and cal["rows"] >= 0 and _runs_ok(cal["runs"]) and isinstance(cal["days"], list)
              and cal.get("clock") in (None, "time", "rows")
              and all(isinstance(d, list) and len(d) == 3 and _count(d[0]) and _count(d[1]) and d[1] >= 0
                      and _runs_ok(d[2]) for d in cal["days"])
              and _pending_ok(cal.get("pending", [])))
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


def add(cal: dict, scores: np.ndarray, in_incident: np.ndarray | None = None, row0: int | None = None,
        forget: list[tuple[int, int]] = ()) -> None:
    """Count the run starts of scores (n,) (the current day's, the next rows of the series) into cal;
    ``in_incident`` (n,) bool: rows inside an incident, whose run starts are not counted. With
    ``row0`` (the series row of scores[0]) a run starting over the threshold in force is held in
    ``pending`` until the day closes; ``forget``: ``(first row, row)`` of each incident these rows
    opened or made critical, whose held runs from the one to the other are taken back
    (:func:`forget_from`), in row order with the holding, so that any chunking holds the same."""
    s = np.asarray(scores, dtype=np.float64) / cal["base"]
    if not s.size:
        return
    lo = np.r_[-np.inf if cal["prev"] is None else cal["prev"], s[:-1]]
    up = lo < s
    if in_incident is not None:
        up &= ~np.asarray(in_incident, dtype=bool)
    if row0 is not None:
        held = up & (s > cal["threshold"] / cal["base"])
        idx = np.flatnonzero(held)
        todo = sorted(forget, key=lambda f: f[1])
        for i, lo_bin, hi_bin in zip(idx.tolist(), _bins(lo[idx]).tolist(), _bins(s[idx]).tolist()):
            while todo and todo[0][1] < row0 + i:
                forget_from(cal, *todo.pop(0))
            if len(cal.setdefault("pending", [])) >= MAX_PENDING:
                _fold_pending(cal)  # too many held in a day: those are counted (the same in any chunking)
            cal["pending"].append([int(row0) + i, lo_bin, hi_bin])
        for f in todo:
            forget_from(cal, *f)
        up &= ~held
    _tally(cal, _bins(lo[up]), _bins(s[up]))
    cal["prev"] = float(s[-1])
    cal["rows"] += int(s.size)


def _tally(cal: dict, lo_bins, hi_bins) -> None:
    """Count runs into the current day's histogram: each starts at the bin of the score before it
    (``+1``) and covers thresholds up to the bin of its own (``-1``)."""
    runs = cal["runs"]
    for bins, sign in ((lo_bins, 1), (hi_bins, -1)):
        for b, k in zip(*np.unique(np.asarray(bins, dtype=np.int64), return_counts=True)):
            runs[str(int(b))] = runs.get(str(int(b)), 0) + sign * int(k)
    cal["runs"] = {b: v for b, v in runs.items() if v}


def forget_from(cal: dict, row: int, until: int) -> None:
    """An incident whose first row is series row ``row`` opened (or became critical) at row
    ``until``: the runs held from the one to the other are not counted."""
    cal["pending"] = [p for p in cal.get("pending", []) if not row <= p[0] <= until]


def _fold_pending(cal: dict) -> None:
    """Count the held runs into the current day's (its day closes, or the series starts again); a
    state whose held runs or counts are not of their shape drops what it holds (:func:`valid`
    then starts it again)."""
    pending, cal["pending"] = cal.get("pending", []), []
    if _pending_ok(pending) and _runs_ok(cal.get("runs")):
        _tally(cal, [p[1] for p in pending], [p[2] for p in pending])


def gap(cal: dict) -> None:
    """The series starts again after a gap: the next row starts a run of its own (the held runs
    are counted: no incident spans the gap)."""
    _fold_pending(cal)
    cal["prev"] = None


def budget_threshold(days: list, policy: CalibrationPolicy, base: float, period_s: float,
                     clock: str | None = None) -> tuple[float, dict]:
    """Return (the threshold, what it rests on: ``days`` covered, ``alarms`` at it and, where even
    the top edge, 1024 times the model's threshold, gives more than the budget, ``capped``) from the
    kept days ``[[day, rows, runs], ...]``; the model's threshold ``base`` with too little history.
    Days covered: by the rows' clock (``clock`` "time"), the days kept; by rows, their rows at
    ``period_s`` seconds a row."""
    rows = sum(d[1] for d in days)
    covered = float(len([d for d in days if d[1]])) if clock == "time" else rows * period_s / SECONDS_PER_DAY
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
    k = max(k, floor_bin(policy.floor))  # never under the floor (1: the model's own threshold)
    basis = {"days": round(covered, 3), "alarms": int(runs[k]), "allowed": int(allowed)}
    if runs[k] > allowed:  # even the top edge: the budget cannot be kept, and the event says so
        basis["capped"] = True
    return float(EDGES[k] * base), basis


def roll(cal: dict, day: int, policy: CalibrationPolicy, period_s: float, clock: str = "rows") -> dict | None:
    """At the first row of ``day`` (of ``clock``: "time", UTC days of the rows' times, or "rows"):
    close the current day (merged into a kept day of the same number: time went back), keep the
    days within ``policy.days`` of the newest and set the threshold from those before ``day``.
    Days of another clock are dropped (a series whose files gained or lost their time column
    starts its history again). Return ``{"previous", "threshold", "days", "alarms"}`` if the
    threshold changed, else None."""
    if cal.get("clock") not in (None, clock):
        cal["days"], cal["day"], cal["rows"], cal["runs"], cal["pending"] = [], None, 0, {}, []
    cal["clock"] = clock
    if cal["day"] == day:
        return None
    _fold_pending(cal)
    if cal["day"] is not None and cal["rows"]:
        same = next((d for d in cal["days"] if d[0] == cal["day"]), None)
        if same is None:
            cal["days"].append([cal["day"], cal["rows"], cal["runs"]])
        else:
            same[1] += cal["rows"]
            for b, v in cal["runs"].items():
                same[2][b] = same[2].get(b, 0) + v
            same[2] = {b: v for b, v in same[2].items() if v}
    newest = max([day] + [d[0] for d in cal["days"]])
    cal["days"] = sorted((d for d in cal["days"] if d[0] >= newest - policy.days), key=lambda d: d[0])
    cal["day"], cal["rows"], cal["runs"] = day, 0, {}
    threshold, basis = budget_threshold(_days_before(cal, day, policy), policy, cal["base"], period_s, clock)
    previous = cal["threshold"]
    threshold, basis = bounded(threshold, basis, previous, cal["base"], policy.floor)
    cal["threshold"] = threshold
    if threshold == previous:
        return None
    return _said(dict(basis, previous=previous, threshold=threshold))


def _said(event: dict) -> dict:
    """A threshold-calibrated event with ``bound`` (:data:`MAX_DAY_FACTOR`) and ``far`` (:func:`far`):
    the journal says a far move at warning level."""
    return dict(event, bound=MAX_DAY_FACTOR, far=far(event))


def floored(cal: dict, policy: CalibrationPolicy) -> dict | None:
    """Raise a valid state's threshold in force to the policy's floor at once (a floor raised since
    the state was kept, by a conffile reload), keeping its history. Return ``{"previous",
    "threshold", "floor"}`` when it moved, else None."""
    previous = float(cal["threshold"])
    cal["threshold"] = max(previous, float(EDGES[floor_bin(policy.floor)] * cal["base"]))
    if cal["threshold"] == previous:
        return None
    return _said({"previous": previous, "threshold": cal["threshold"], "floor": policy.floor})


def bounded(threshold: float, basis: dict, previous: float, base: float, floor: float = 1.0) -> tuple[float, dict]:
    """The budget's threshold kept within :data:`MAX_DAY_FACTOR` of the one in force (and never under
    ``floor`` times the model's own ``base``); ``basis`` gains ``wanted`` (the budget's) where it was held back."""
    lo = max(float(EDGES[floor_bin(floor)]) * base, previous / MAX_DAY_FACTOR)
    hi = previous * MAX_DAY_FACTOR
    if lo <= threshold <= hi:
        return threshold, basis
    return min(max(threshold, lo), hi), dict(basis, wanted=threshold)


def far(event: dict) -> bool:
    """Whether a ``threshold-calibrated`` event moved the threshold far: by :data:`MAX_DAY_FACTOR` or
    more either way, or was held back by that bound (the daemon says it at warning level)."""
    prev, new = event.get("previous"), event.get("threshold")
    if "wanted" in event:
        return True
    if not (isinstance(prev, (int, float)) and isinstance(new, (int, float)) and prev > 0 and new > 0):
        return False
    return max(new / prev, prev / new) >= MAX_DAY_FACTOR * (1 - 1e-9)


def _days_before(cal: dict, day: int, policy: CalibrationPolicy) -> list:
    """The kept days a threshold set at the first row of ``day`` rests on: the last ``policy.days`` before it."""
    return [d for d in cal["days"] if d[0] < day][-int(policy.days):] if policy.days else []


def seed_rows(times: np.ndarray | None, n: int, policy: CalibrationPolicy, period_s: float) -> int:
    """How many of a history's newest n rows a seed scores: those of its last ``policy.days`` days,
    by their times (``times`` (n,) epoch seconds, all finite: the rows from the first one within
    that many days of the newest time, in their order, rows of older days sent again after it
    included), else (``times`` None) by rows at ``period_s`` seconds a row."""
    if n <= 0:
        return 0
    if times is not None:
        t = np.asarray(times, dtype=np.float64)
        recent = np.flatnonzero(t > float(t.max()) - policy.days * SECONDS_PER_DAY)
        return int(n - recent[0]) if recent.size else n
    return min(n, int(math.ceil(policy.days * SECONDS_PER_DAY / (period_s or 60.0))))


def seed(cal: dict, scores: np.ndarray, times: np.ndarray | None, normal: np.ndarray | None, period_s: float,
         policy: CalibrationPolicy, first_day: int, clock: str) -> dict | None:
    """Count a new version's scores of the rows scored before it (the series' history, the newest
    last) into its fresh state ``cal``, day by day as if it had scored them, then :func:`roll` to
    ``first_day``, the day of its first row, on ``clock`` (that row's: "time", ``times`` (n,) epoch
    seconds of the history's rows; "rows", the history's rows at ``period_s`` seconds a row, the
    last one just before the series' row 0). ``cal``'s threshold is then the one in force at that
    row; the next row starts a run of its own (the series starts again). Return ``{"previous",
    "threshold", "days", "alarms", "seeded_rows", "seeded_left_out"}`` (the last: the rows whose runs
    were not counted) when that threshold is not the model's, else None; None, and ``cal``
    untouched, when the history's clock is not the row's (no times where the row has them) or a
    score is not finite. ``normal`` (n,) bool or None (every row):
    the rows whose runs are counted; a run starting on any other row is not (unless ``policy.learns``
    is "all"): the job gives the rows outside what the versions before flagged and their retraining
    margin, so the incidents the new version was not trained on never raise the threshold that must
    page them again. Raises ValueError if ``normal`` is not (n,)."""
    s = np.asarray(scores, dtype=np.float64)
    n = int(s.size)
    if normal is not None and np.shape(normal) != (n,):
        raise ValueError(f"normal has shape {np.shape(normal)}, the history {n} rows")
    if not n or not np.isfinite(s).all() or (clock == "time" and (times is None or not np.isfinite(times).all())):
        return None
    t = np.asarray(times, dtype=np.float64) if clock == "time" else None
    previous = cal["threshold"]
    skip = None if normal is None or policy.learns == "all" else ~np.asarray(normal, dtype=bool)  # not counted
    cuts = [0] + day_cuts(t, -n, n, period_s) + [n]  # the history's rows are the series rows -n .. -1
    for a, b in zip(cuts[:-1], cuts[1:]):
        roll(cal, day_of(None if t is None else float(t[a]), a - n, period_s), policy, period_s, clock)
        add(cal, s[a:b], None if skip is None else skip[a:b])
    roll(cal, int(first_day), policy, period_s, clock)
    gap(cal)
    if cal["threshold"] == previous:
        return None
    _, basis = budget_threshold(_days_before(cal, cal["day"], policy), policy, cal["base"], period_s, clock)
    left_out = 0 if skip is None else int(skip.sum())
    return _said(dict(basis, previous=previous, threshold=cal["threshold"], seeded_rows=n, seeded_left_out=left_out))
