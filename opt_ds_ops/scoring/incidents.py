"""Incidents: what pages. Flagged rows (a score above the threshold) are evidence; an incident is
what an operator is told about.

An incident **opens** at a flagged row when at least ``open_share`` of the rows of the last
``open_window_s`` seconds (that row included) are flagged: a persistence rule, so that one noisy
row, or a few scattered ones, page nobody. It **starts** at the first flagged row of that window.
It stays open across short gaps and **closes** once ``quiet_s`` seconds of rows in a row are
unflagged (a quiet spell); it then ends at its last flagged row. Flagged runs closer together than
the quiet spell are therefore one incident, not several. Its **severity** is ``critical`` once
its peak score reached ``critical_ratio`` times the threshold, else ``warning``: an incident that
opens as a warning and then reaches it is **escalated** (said once, at that row).

The rule counts rows, not seconds: the seconds are turned into rows with the model's sample period
(:meth:`IncidentPolicy.rows`). With ``open_window_s: 0`` and ``quiet_s: 0`` every run of
flagged rows is an incident of its own (each flagged run paged, as ds-ops did before incidents).

:func:`track` is pure and streams: it takes the state a previous chunk left (:class:`Tracker`, JSON-able
through :meth:`Tracker.to_dict`) and returns the new one, so a series scored chunk by chunk
opens and closes the same incidents as the whole series scored at once. The offline evaluation
(``scripts/eval_incidents.py``) and the daemon run this same function.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .regime import RegimePolicy, add_levels, shifted, tail_rows, weight

SEVERITIES = ("warning", "critical")


@dataclass(frozen=True)
class IncidentPolicy:
    """When flagged rows make an incident (the conffile's ``scoring.incident_*`` keys)."""

    open_window_s: float = 0.0  # round 4's choice; the conffile's default is 300 since round 15 (docs/detection-protocol.md)
    open_share: float = 0.5
    quiet_s: float = 1800.0
    critical_ratio: float = 2.0

    @classmethod
    def from_config(cls, scoring) -> IncidentPolicy:
        """The rule of the conffile's ``scoring:`` section (:class:`opt_ds_ops.config.conffile.ScoringConfig`)."""
        return cls(open_window_s=scoring.incident_open_window_s, open_share=scoring.incident_open_share,
                   quiet_s=scoring.incident_quiet_s, critical_ratio=scoring.incident_critical_ratio)

    def rows(self, period_s: float) -> tuple[int, int, int]:
        """Return (window, need, quiet) in rows for rows ``period_s`` seconds apart: an incident opens
        when ``need`` of the last ``window`` rows are flagged and closes after ``quiet`` unflagged rows."""
        period = period_s if period_s and period_s > 0 and math.isfinite(period_s) else 60.0
        window = max(1, math.ceil(self.open_window_s / period - 1e-9))
        need = min(window, max(1, math.ceil(self.open_share * window - 1e-9)))
        quiet = max(1, math.ceil(self.quiet_s / period - 1e-9))
        return window, need, quiet


@dataclass
class Tracker:
    """What a series carries between chunks: ``recent`` the flags (0/1) of the rows before the next
    one, at most ``window - 1`` of them; ``open`` the open incident or None (``id``, ``start_row``,
    ``start_time``, ``opened_row``, ``opened_time``, ``last_row``, ``last_time`` (its last flagged
    row), ``quiet`` (unflagged rows since), ``rows_flagged``, ``peak_score``, ``peak_row``,
    ``peak_time``, ``severity``, ``sums``: each metric's sum of its flagged rows' unsmoothed terms;
    with a change-of-regime rule ``lmean``, ``lvar``, ``lrows``, ``ltail`` and, under
    ``regime_explains: model``, ``regime_checked``: :mod:`opt_ds_ops.scoring.regime`);
    ``opened``: incidents opened so far (the next one's id is ``opened + 1``)."""

    recent: list = field(default_factory=list)
    recent_times: list = field(default_factory=list)
    recent_scores: list = field(default_factory=list)
    recent_cells: list = field(default_factory=list)
    open: dict | None = None
    opened: int = 0

    def to_dict(self) -> dict:
        return {"recent": list(self.recent), "recent_times": list(self.recent_times),
                "recent_scores": list(self.recent_scores), "recent_cells": [list(c) for c in self.recent_cells],
                "open": dict(self.open) if self.open else None, "opened": self.opened}

    @classmethod
    def from_dict(cls, obj) -> Tracker:
        """Return the tracker saved by :meth:`to_dict`; ValueError for anything else (a field of the
        wrong type or shape, an open incident without its keys)."""
        if obj is None:
            return cls()
        if not isinstance(obj, dict):
            raise ValueError("incident tracker: not a mapping")
        try:
            recent = [1 if v else 0 for v in _list(obj, "recent")]
            n = len(recent)
            times = [_number_or_none(t) for t in _list(obj, "recent_times")][-n:] if n else []
            scores = [float(_number(v)) for v in _list(obj, "recent_scores")][-n:] if n else []
            cells = [[float(_number(x)) for x in _list({"c": c}, "c")] for c in _list(obj, "recent_cells")][-n:] if n else []
            opened = obj.get("opened", 0)
            if not isinstance(opened, int) or isinstance(opened, bool) or opened < 0:
                raise ValueError("opened is not an integer >= 0")
            inc = obj.get("open")
            if inc is not None:
                inc = _checked_open(inc)
        except (TypeError, OverflowError, KeyError) as e:
            raise ValueError(f"incident tracker: {e}") from None
        except ValueError as e:
            raise ValueError(f"incident tracker: {e}") from None
        pad = lambda xs, fill: [fill] * (n - len(xs)) + xs  # noqa: E731 (older states carry fewer)
        return cls(recent=recent, recent_times=pad(times, None) if n else [],
                   recent_scores=pad(scores, 0.0) if n else [], recent_cells=cells if len(cells) == n else [],
                   open=inc, opened=opened)


_OPEN_INTS = ("id", "start_row", "opened_row", "last_row", "quiet", "rows_flagged", "peak_row")
_OPEN_TIMES = ("start_time", "opened_time", "last_time", "peak_time")


def _list(obj: dict, key: str) -> list:
    v = obj.get(key, [])
    if not isinstance(v, list):
        raise ValueError(f"{key} is not a list")
    return v


def _number(v) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(float(v)):
        raise ValueError(f"{v!r} is not a finite number")
    return v


def _number_or_none(v) -> float | None:
    return None if v is None else float(_number(v))


def _checked_open(inc) -> dict:
    """The open incident of a saved tracker, its keys and types checked."""
    if not isinstance(inc, dict):
        raise ValueError("open is not a mapping")
    out = dict(inc)
    for k in _OPEN_INTS:
        if not isinstance(out.get(k), int) or isinstance(out.get(k), bool):
            raise ValueError(f"open.{k} is not an integer")
    for k in _OPEN_TIMES:
        out[k] = _number_or_none(out.get(k))
    out["peak_score"] = float(_number(out.get("peak_score")))
    if out.get("severity") not in SEVERITIES:
        raise ValueError("open.severity is not warning or critical")
    out["sums"] = [float(_number(x)) for x in _list(out, "sums")]
    if any(k in out for k in ("lmean", "lvar", "lrows")):  # a change of regime's levels (opt_ds_ops.scoring.regime)
        out["lmean"] = [float(_number(x)) for x in _list(out, "lmean")]
        out["lvar"] = [float(_number(x)) for x in _list(out, "lvar")]
        lrows = out.get("lrows", 0)
        if not isinstance(lrows, int) or isinstance(lrows, bool) or lrows < 0 or len(out["lmean"]) != len(out["lvar"]):
            raise ValueError("open.lrows, lmean or lvar is of the wrong shape")
        out["ltail"] = [[float(_number(x)) for x in _list({"r": r}, "r")] for r in _list(out, "ltail")]
        if any(len(r) != len(out["lmean"]) for r in out["ltail"]):
            raise ValueError("open.ltail is of the wrong shape")
    rc = out.get("regime_checked", 0)
    if not isinstance(rc, int) or isinstance(rc, bool) or rc > out["last_row"]:
        raise ValueError("open.regime_checked is not an integer at most open.last_row")
    return out


@dataclass
class Tracked:
    """One chunk through :func:`track`: ``changes`` ``[("opened" | "escalated" | "closed", row index
    in the chunk, incident dict)]`` in row order (``"regime"``: the open incident is a change of regime,
    its dict with ``shift`` ``[(column, mean level)]``; it is closed and tracking stops at that row,
    ``stopped``, for the caller to re-baseline the rows after it; escalated: a warning whose peak reached the
    critical ratio at that row; a closed one is known at the row that completes its quiet spell); ``incident`` (n,) int64, the id of the incident each row belongs to as known after this
    chunk (0: none); ``tracker`` the state for the next chunk."""

    changes: list
    incident: np.ndarray
    tracker: Tracker
    stopped: int | None = None  # the chunk's row at which a change of regime closed the incident: rows after it are not tracked
    live: np.ndarray | None = None  # (n,) int8, as known at each row (never relabelled): 0 none open, 1 warning, 2 critical


def severity(peak: float, threshold: float, critical_ratio: float, was: str = "warning") -> str:
    """``critical`` once the peak reached critical_ratio x threshold, or if it already was (a severity
    never falls back while the incident is open, even if the ratio is raised)."""
    return "critical" if was == "critical" or (threshold > 0 and peak >= critical_ratio * threshold) else "warning"


def track(flags: np.ndarray, scores: np.ndarray, threshold: float, tracker: Tracker, policy: IncidentPolicy,
          period_s: float, *, row0: int = 0, times: np.ndarray | None = None,
          cells: np.ndarray | None = None, levels: np.ndarray | None = None,
          regime: RegimePolicy | None = None, explained=None) -> Tracked:
    """Run the incident rule over one chunk: flags (n,) bool, scores (n,), its first series row
    ``row0``, epoch seconds ``times`` (n,) or None, unsmoothed terms ``cells`` (n, D) or None (then
    ``sums`` stay empty), standardised levels ``levels`` (n, D) or None and the change-of-regime
    rule ``regime`` (None: off; :mod:`opt_ds_ops.scoring.regime`; ``explained``: its model check,
    :func:`opt_ds_ops.scoring.regime.shifted`). ``tracker`` is not changed. See
    the module docstring."""
    window, need, quiet = policy.rows(period_s)
    regime_rows = regime.rows(period_s) if regime is not None and levels is not None else 0
    alpha, tail = weight(regime_rows), tail_rows(regime_rows)
    stopped = None
    flags = np.asarray(flags, dtype=bool)
    n = flags.shape[0]
    keep_n = window - 1  # the rows a later opening window may reach back to
    recent = list(tracker.recent[-keep_n:]) if keep_n else []
    base = len(recent)
    # the rows before this chunk, as carried: times, scores and terms (for an opening window that reaches them)
    prev_t = list(tracker.recent_times[-base:]) if base else []
    prev_s = list(tracker.recent_scores[-base:]) if base else []
    prev_c = list(tracker.recent_cells[-base:]) if base and len(tracker.recent_cells) >= base else []
    inc = dict(tracker.open) if tracker.open else None
    if inc is not None:
        inc["sums"] = list(inc.get("sums", []))
    opened = tracker.opened
    out = np.zeros(n, dtype=np.int64)
    live = np.zeros(n, dtype=np.int8)  # as known at each row: 0 no incident open, 1 a warning, 2 a critical one
    changes = []

    def at(i: int) -> float | None:  # row i of the chunk's time; i < 0: a row of the previous chunk's
        if i < 0:
            return prev_t[base + i] if len(prev_t) == base else None
        return float(times[i]) if times is not None else None

    def score(i: int) -> float:
        return float(prev_s[base + i]) if i < 0 else float(scores[i])

    def terms(i: int):
        if cells is None:
            return None
        if i >= 0:
            return cells[i]
        return prev_c[base + i] if prev_c else None

    hist = recent + [0] * n  # the flags of the rows before this chunk's, then this chunk's
    count = sum(recent)
    for i in range(n):
        f = bool(flags[i])
        hist[base + i] = int(f)
        count += int(f)
        if base + i - window >= 0:
            count -= hist[base + i - window]
        if inc is not None:
            if f:
                out[max(inc["last_row"] - row0 + 1, 0):i + 1] = inc["id"]  # the gap since its last flagged row, and i
                inc["quiet"] = 0
                _extend(inc, row0 + i, score(i), terms(i), at(i))
                if regime_rows:
                    add_levels(inc, levels[i], alpha, tail)
                    shift = shifted(inc, regime, regime_rows, row0 + i, explained)
                    if shift is not None:  # said once; the caller re-baselines the rows after i
                        changes.append(("regime", i, dict(inc, shift=shift)))
                        inc, stopped = None, i
                        hist[: base + i + 1] = [0] * (base + i + 1)
                        break
                was = inc["severity"]
                inc["severity"] = severity(inc["peak_score"], threshold, policy.critical_ratio, was)
                if was != inc["severity"]:  # a warning that became critical: said once, at this row
                    changes.append(("escalated", i, dict(inc, sums=list(inc["sums"]))))
            else:
                inc["quiet"] += 1
                if inc["quiet"] >= quiet:
                    changes.append(("closed", i, inc))
                    inc = None
                    # its rows are spent: a later incident's opening window counts only rows after it
                    hist[: base + i + 1] = [0] * (base + i + 1)
                    count = 0
            live[i] = 0 if inc is None else 2 if inc["severity"] == "critical" else 1
            continue
        if f and count >= need:
            opened += 1
            lo = max(i - window + 1, -base)  # the window's first row, maybe in the previous chunk
            first = next(j for j in range(lo, i + 1) if hist[base + j])
            inc = {"id": opened, "start_row": row0 + first, "start_time": at(first),
                   "opened_row": row0 + i, "opened_time": at(i), "last_row": row0 + first, "last_time": at(first),
                   "quiet": 0, "rows_flagged": 0, "peak_score": score(first), "peak_row": row0 + first,
                   "peak_time": at(first), "severity": "warning", "sums": []}
            for j in range(first, i + 1):
                if hist[base + j]:
                    _extend(inc, row0 + j, score(j), terms(j), at(j))
                    if regime_rows and j >= 0:
                        add_levels(inc, levels[j], alpha, tail)
            inc["severity"] = severity(inc["peak_score"], threshold, policy.critical_ratio)
            out[max(first, 0):i + 1] = inc["id"]
            changes.append(("opened", i, dict(inc, sums=list(inc["sums"]))))
            live[i] = 2 if inc["severity"] == "critical" else 1
    end = n if stopped is None else stopped + 1  # the rows tracked
    hist = hist[: base + end]
    keep = hist[-keep_n:] if keep_n else []
    k = len(keep)
    all_t = [*(prev_t if len(prev_t) == base else [None] * base), *(at(i) for i in range(end))]
    all_s = [*(float(v) for v in prev_s), *(float(v) for v in np.asarray(scores, dtype=np.float64)[:end][-k:])] if k else []
    all_c = []
    if k and cells is not None and (prev_c or base == 0):
        all_c = [*(list(map(float, c)) for c in prev_c), *(np.asarray(cells[:end][-k:], dtype=np.float64).tolist())]
    return Tracked(changes=changes, incident=out[:end], stopped=stopped, live=live[:end],
                   tracker=Tracker(recent=keep, recent_times=all_t[-k:] if k else [], recent_scores=all_s[-k:],
                                   recent_cells=all_c[-k:] if len(all_c) >= k else [], open=inc, opened=opened))


def incidents_of(scores: np.ndarray, threshold: float, policy: IncidentPolicy, period_s: float) -> list[dict]:
    """Return the incidents of a whole series of scores (n,), each ``{"start", "opened", "end"
    (its last flagged row), "severity", "open" (still open at the series' end)}`` (rows)."""
    scores = np.asarray(scores)
    done = track(scores > threshold, scores, threshold, Tracker(), policy, period_s)
    out = [{"start": inc["start_row"], "opened": inc["opened_row"], "end": inc["last_row"],
            "severity": inc["severity"], "open": False} for kind, _, inc in done.changes if kind == "closed"]
    if done.tracker.open is not None:
        inc = done.tracker.open
        out.append({"start": inc["start_row"], "opened": inc["opened_row"], "end": inc["last_row"],
                    "severity": inc["severity"], "open": True})
    return out


def operator_figures(incidents: list[dict], labels: np.ndarray, period_s: float, page_lead_s: float = 3600.0) -> dict:
    """What an operator lives with, from incidents (:func:`incidents_of`) and labels (n,) 0/1:

    ``pages`` (incidents), ``false_pages`` (incidents whose rows touch no labelled row),
    ``false_per_day`` (over the labels' span), ``segments`` (labelled runs), ``paged`` (the share of
    labelled runs in which an incident *opened*, or at most ``page_lead_s`` before the run's first
    row; None without a labelled run) and ``normal_in_alarm`` (the share of unlabelled rows inside
    an incident, start to end)."""
    labels = np.asarray(labels).astype(bool)
    n = labels.shape[0]
    days = n * period_s / 86400.0
    alarm = np.zeros(n, dtype=bool)
    false = 0
    for inc in incidents:
        a, b = inc["start"], inc["end"] + 1
        alarm[a:b] = True
        false += not labels[a:b].any()
    d = np.diff(np.r_[0, labels.astype(np.int8), 0])
    starts, ends = np.flatnonzero(d == 1), np.flatnonzero(d == -1)
    lead = math.ceil(page_lead_s / period_s)
    opened = np.array(sorted(inc["opened"] for inc in incidents), dtype=np.int64)
    paged = sum(bool(((opened >= s - lead) & (opened < e)).any()) for s, e in zip(starts, ends))
    normal = int((~labels).sum())
    return {"pages": len(incidents), "false_pages": false, "false_per_day": false / days if days > 0 else 0.0,
            "segments": len(starts), "paged": paged / len(starts) if len(starts) else None,
            "normal_in_alarm": float((alarm & ~labels).sum() / normal) if normal else 0.0}


def _extend(inc: dict, row: int, score: float, terms, time: float | None) -> None:
    """Add a flagged series row (its score, unsmoothed terms (D,) or None, time) to the open incident."""
    inc["rows_flagged"] += 1
    inc["last_row"], inc["last_time"] = row, time
    if score > inc["peak_score"]:
        inc.update(peak_score=score, peak_row=row, peak_time=time)
    if terms is not None:
        c = np.asarray(terms, dtype=np.float64)
        sums = inc["sums"] or [0.0] * c.shape[0]
        inc["sums"] = (np.asarray(sums, dtype=np.float64) + c).tolist()
