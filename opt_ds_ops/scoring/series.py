"""One series per model across chunks: telemetry that arrives in files is scored as one stream.

A model's score is causal (row t depends on rows <= t: :func:`opt_ds_ops.model.detection.score_rows`), so a
stream scored chunk by chunk equals the whole stream scored at once when each chunk starts from
what the previous one left: :class:`SeriesState` carries the window context (the last
``input_window - 1`` standardised and clipped rows), the smoothing's memory (the EMA's numerator
and denominator in pandas' ``adjust=True`` form, or the last ``score_window - 1`` raw scores of a
trailing mean), the incident rule's memory (:mod:`opt_ds_ops.scoring.incidents`: the last flags and
the incident still open at the chunk's end, with each metric's sum of its flagged rows'
unsmoothed terms), and counters. What pages is an incident, not a flagged row. :func:`score_chunk` is pure: it returns a new state and never changes the one given,
so a chunk that is refused never advances the series.

The carried state is reset (a note says why; an open incident is closed first, ``reason: reset``)
when the model's version changes, when a chunk's first time is before the previous chunk's last,
or when the gap between them exceeds ``max_gap_periods`` sample periods
(:func:`opt_ds_ops.model.trained.sample_period_s`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from ..dataset.core import iso_utc
from ..model import calibration as calib
from ..model.calibration import CalibrationPolicy
from ..model.detection import ScoreError, standardise_rows
from ..model.network import feature_errors, fold_window, model_inputs
from ..model.trained import sample_period_s
from ..store.versions import StoredModel
from .incidents import IncidentPolicy, Tracker, track
from .regime import MIN_TAIL, SUSTAINED, RegimePolicy, described, refined

STATE_FORMAT = 2  # 1: before incidents (an open anomaly segment, ``segment``/``segments``); read and carried over
TOP_METRICS = 3  # metrics named per incident and per flagged row
BATCH_ROWS = 65536  # rows through the model at a time


@dataclass
class SeriesState:
    """What one model's series carries from a chunk to the next (JSON-safe by :meth:`to_dict`).

    ``next_row``: the series row of the next chunk's first row; ``last_time``: the last row's epoch
    seconds (None without a time column); ``ema_num``/``ema_den``: the EMA of the raw score as
    ``num / den`` (``score_smoothing: ema``); ``recent``: the last ``score_window - 1`` raw scores
    (``mean``); ``context``: the last ``input_window - 1`` standardised, clipped rows (float32
    values); ``incident``: the incident rule's memory (:meth:`opt_ds_ops.scoring.incidents.Tracker.to_dict`:
    the last flags and the open incident or None, with ``sums``: each metric's sum of unsmoothed terms);
    ``incidents``: incidents opened so far; ``critical_incidents``: those that were or became
    critical (counted when they opened critical or were escalated); counters over the series;
    ``version_rows``: the rows its current version scored (the drift trigger's own rows: kept
    through a gap's or time going back's restart, 0 for a new version); ``last_job``, ``last_result``,
    ``scored_at``, ``top_metrics``: the scoring job that wrote this state, its result directory,
    when, and the open incident's top metrics by name (:func:`opt_ds_ops.scoring.job.score_job` sets them).
    """

    model: str
    version: str | None = None
    next_row: int = 0
    last_time: float | None = None
    ema_num: float = 0.0
    ema_den: float = 0.0
    recent: list = field(default_factory=list)
    context: list = field(default_factory=list)
    incident: dict | None = None
    rows_scored: int = 0
    rows_flagged: int = 0
    version_rows: int = 0  # rows scored by the current version (a gap's restart keeps them; a new version: 0)
    incidents: int = 0
    critical_incidents: int = 0
    last_score: float | None = None
    threshold: float | None = None
    last_job: str | None = None
    last_result: str | None = None
    scored_at: str | None = None  # when last_job wrote it (ISO 8601 UTC)
    top_metrics: list = field(default_factory=list)  # the open incident's, named (for status and metrics)
    lineage: str | None = None  # the model's (opt_ds_ops.store.model_dir.model_lineage) when last_job wrote it
    rebase: list = field(default_factory=list)  # a change of regime's shift per metric (standardised units), or []
    regime: dict | None = None  # the last change of regime of this version (opt_ds_ops.scoring.regime), not yet learned
    regime_changes: int = 0
    calibration: dict | None = None  # the alarm budget's (opt_ds_ops.model.calibration), or None: off

    def to_dict(self) -> dict:
        """Return the state as plain JSON types, with ``format``."""
        return dict(dataclasses.asdict(self), format=STATE_FORMAT)

    @classmethod
    def from_dict(cls, obj: dict) -> SeriesState:
        """Return the state saved by :meth:`to_dict`. Raises ValueError for another format or shape."""
        if isinstance(obj, dict) and obj.get("format") == 1:  # before incidents: its counters and memory go on
            n = obj.get("segments", 0)  # the ids of its incidents go on from its segments' count
            n = int(n) if isinstance(n, (int, float)) and not isinstance(n, bool) and 0 <= n < 2 ** 53 else 0
            obj = dict(obj, format=STATE_FORMAT, incidents=n, incident={"recent": [], "open": None, "opened": n})
        if not isinstance(obj, dict) or obj.get("format") != STATE_FORMAT:
            raise ValueError(f"series state of unknown format (want format {STATE_FORMAT})")
        known = {f.name for f in dataclasses.fields(cls)}
        try:
            state = cls(**{k: v for k, v in obj.items() if k in known})
        except TypeError as e:
            raise ValueError(f"series state: {e}") from None
        if "version_rows" not in obj:  # saved before it was kept: the series' rows are its version's
            state.version_rows = state.next_row
        if not isinstance(state.version_rows, int) or isinstance(state.version_rows, bool) or state.version_rows < 0:
            raise ValueError("series state: version_rows is not a count")
        numbers = (state.next_row, state.ema_num, state.ema_den, state.rows_scored, state.rows_flagged, state.incidents,
                   state.critical_incidents, state.version_rows)
        if (not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers)
                or not isinstance(state.context, list) or not isinstance(state.recent, list)
                or not (state.last_time is None or isinstance(state.last_time, (int, float)))):
            raise ValueError("series state: a field of the wrong type")
        Tracker.from_dict(state.incident)  # ValueError for one of the wrong shape
        if (not isinstance(state.rebase, list)
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                           for v in state.rebase)
                or not (state.regime is None or isinstance(state.regime, dict))
                or not isinstance(state.regime_changes, int) or isinstance(state.regime_changes, bool)):
            raise ValueError("series state: a change of regime's field of the wrong type")
        if not (state.calibration is None or isinstance(state.calibration, dict)):
            raise ValueError("series state: the alarm budget's field of the wrong type")
        return state

    @property
    def open_incident(self) -> dict | None:
        """The open incident (:class:`opt_ds_ops.scoring.incidents.Tracker`'s ``open``) or None."""
        return (self.incident or {}).get("open")


@dataclass
class ChunkResult:
    """One chunk scored: ``scores`` (n,) float32, ``flags`` (n,) bool (``scores > threshold``),
    ``top`` (n,) each flagged row's own top metrics (its unsmoothed terms' ranking, names joined by
    ``;``; "" elsewhere), ``incident`` (n,) int64 the id of the incident each row belongs to as
    known when the chunk was scored (0: none; rows of an earlier chunk that opened it are not
    relabelled), ``first_row`` (the series row of row 0), ``events``, ``notes`` (why the state was
    reset), the new ``state``, ``active`` (an incident is open) and ``cells`` (n, D) float32, the
    rows' unsmoothed terms (:func:`opt_ds_ops.model.detection.flagged_segments` ranks by them)."""

    scores: np.ndarray
    flags: np.ndarray
    top: list
    incident: np.ndarray
    first_row: int
    events: list
    notes: list
    state: SeriesState
    active: bool
    cells: np.ndarray | None = None
    stopped: int | None = None  # (internal) the row of a change of regime in a piece
    live: np.ndarray | None = None  # (n,) int8: an incident open at each row as known then (0, 1 warning, 2 critical)


def model_version(stored: StoredModel) -> str:
    """Return the stored model's version name (metadata.json ``version``, else its directory)."""
    import os

    return str(stored.metadata.get("version") or os.path.basename(stored.path.rstrip("/")) or "")


def model_metric_names(stored: StoredModel, fallback: list[str] | None = None) -> list[str]:
    """Return the model's D metric names: metadata.json ``metric_names`` (the training file's
    header, or ``dataset.metric_names``), else its ``dataset.header``, else ``fallback`` (the
    scored file's header, say) when it has D names, else the 1-based file columns of the
    model's features as text."""
    d = stored.n_features
    return stored_metric_names(stored.metadata, d, fallback) or [str(j + 1) for j in range(d)]


def stored_metric_names(md: dict, d: int, fallback: list[str] | None = None) -> list[str] | None:
    """:func:`model_metric_names` from a version's metadata.json ``md`` and its ``d`` features,
    None where they would be column numbers 1..d."""
    ds = md.get("dataset") if isinstance(md.get("dataset"), dict) else {}
    for names in (md.get("metric_names"), ds.get("header"), fallback):
        if isinstance(names, list) and len(names) == d:
            return [str(n) for n in names]
    cols = ds.get("feature_columns")
    if isinstance(cols, list) and len(cols) == d:
        return [str(c) for c in cols]
    return None


def _time(t: float | None) -> str | None:
    return iso_utc(t) if t is not None else None


def _calibrated(move: dict, st: SeriesState, stored: StoredModel, calibration: CalibrationPolicy,
                t0: float | None) -> dict:
    """The ``threshold-calibrated`` event of a move of the threshold in force (a roll, a seed, a floor) at time t0."""
    return dict(move, event="threshold-calibrated", row=st.next_row, time=_time(t0), version=st.version,
                model_threshold=float(stored.threshold), budget_per_day=calibration.budget_per_day)


def _ranked(sums: np.ndarray, names: list[str], top: int) -> list[dict]:
    """The ``top`` metrics by share of sums (D,): ``[{"metric", "share"}]``, as rank_metrics does."""
    order = np.argsort(-sums, kind="stable")[:top]
    denom = float(sums.sum())
    return [{"metric": names[j], "share": float(sums[j] / denom) if denom > 0 else 0.0} for j in order]


def _reset_reason(stored: StoredModel, state: SeriesState, times: np.ndarray | None,
                  max_gap_periods: float) -> str | None:
    """Return why the carried state does not continue into this chunk, or None."""
    version = model_version(stored)
    if state.version is not None and state.version != version:
        return f"the model's current version changed from {state.version} to {version}: the series starts again"
    if times is None or not len(times) or state.last_time is None:
        return None
    first = float(times[0])
    if first < state.last_time:
        return (f"time went backwards: this chunk starts at {_time(first)}, before the previous chunk's last row "
                f"({_time(state.last_time)}): the series starts again")
    period = sample_period_s(stored)
    if max_gap_periods > 0 and period and first - state.last_time > max_gap_periods * period:
        return (f"a gap of {first - state.last_time:g} s since the previous chunk ({_time(state.last_time)}) is more "
                f"than scoring.max_gap_periods = {max_gap_periods:g} sample periods of {period:g} s: the series "
                "starts again")
    return None


def _closed(inc: dict, names: list[str], reason: str, top: int, version: str | None) -> dict:
    """The ``incident-closed`` event of an incident (a :class:`opt_ds_ops.scoring.incidents.Tracker` ``open`` dict)."""
    start, last = inc.get("start_time"), inc.get("last_time")
    duration = (last - start) if last is not None and start is not None else None
    return {"event": "incident-closed", "incident": inc["id"], "version": version, "row": inc["last_row"],
            "time": _time(last), "started_row": inc["start_row"], "started_time": _time(start),
            "opened_row": inc["opened_row"], "opened_time": _time(inc.get("opened_time")),
            "rows": inc["last_row"] - inc["start_row"] + 1, "rows_flagged": inc["rows_flagged"],
            "duration_s": duration, "peak_score": inc["peak_score"], "peak_row": inc["peak_row"],
            "peak_time": _time(inc.get("peak_time")), "severity": inc["severity"],
            "top_metrics": _ranked(np.asarray(inc["sums"], dtype=np.float64), names, top) if inc["sums"] else [],
            "reason": reason}


def _opened(inc: dict, names: list[str], top: int, threshold: float, score: float) -> dict:
    """The ``incident-opened`` event of an incident at the row that opened it."""
    return {"event": "incident-opened", "incident": inc["id"], "row": inc["opened_row"],
            "time": _time(inc.get("opened_time")), "started_row": inc["start_row"],
            "started_time": _time(inc.get("start_time")), "threshold": threshold, "score": score,
            "peak_score": inc["peak_score"], "severity": inc["severity"], "rows_flagged": inc["rows_flagged"],
            "top_metrics": _ranked(np.asarray(inc["sums"], dtype=np.float64), names, top) if inc["sums"] else []}


def _cells(stored: StoredModel, data: np.ndarray, offset, context: torch.Tensor,
           rebase: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
    """Return (the chunk's normalised errors (n, D) float32, its standardised levels (n, D) float32,
    before clipping and after the series' ``rebase`` (D,) (a change of regime's shift) is taken
    off, the new window context (<= w-1, D))."""
    w = stored.input_window
    out = np.empty(data.shape, dtype=np.float32)
    levels = np.empty(data.shape, dtype=np.float32)
    for start in range(0, data.shape[0], BATCH_ROWS):
        x = standardise_rows(stored, data[start : start + BATCH_ROWS], offset)
        if rebase is not None:
            x -= torch.from_numpy(rebase.astype(np.float32))
        levels[start : start + x.shape[0]] = x.numpy()
        if stored.input_clip > 0:
            x.clamp_(-stored.input_clip, stored.input_clip)
        xw = model_inputs(x, w, context=context, diff=stored.diff, clip=stored.input_clip)
        cells = feature_errors(stored.model, xw) / stored.error_scale
        out[start : start + x.shape[0]] = fold_window(cells, w, stored.window_error).numpy()
        if w > 1:
            context = torch.cat([context, x])[-(w - 1):]
    return out, levels, context


def _smoothed(stored: StoredModel, raw: np.ndarray, state: SeriesState) -> np.ndarray:
    """Smooth raw scores (n,) float32 as :func:`opt_ds_ops.model.network.smooth` does over the whole
    series, from the state's memory (updated in place: the caller's copy); (n,) float64."""
    window = stored.score_window
    x = raw.astype(np.float64)
    if window <= 1 or not x.size:
        return x
    if stored.score_smoothing == "ema":
        keep = 1.0 - 2.0 / (window + 1)
        num, den = state.ema_num, state.ema_den
        out = np.empty_like(x)
        for i, v in enumerate(x.tolist()):
            num = v + keep * num
            den = 1.0 + keep * den
            out[i] = num / den
        state.ema_num, state.ema_den = num, den
        return out
    if stored.score_smoothing != "mean":
        raise ScoreError(f"unknown score smoothing {stored.score_smoothing!r}")
    prev = np.asarray(state.recent, dtype=np.float64)
    full = np.r_[prev, x]
    c = np.r_[0.0, np.cumsum(full)]
    i = np.arange(prev.size, full.size)
    lo = np.maximum(i - window + 1, 0)
    state.recent = full[-(window - 1):].tolist()
    return (c[i + 1] - c[lo]) / (i + 1 - lo)


def fresh_state(name: str, stored: StoredModel) -> SeriesState:
    """Return the state of a series that starts now, for the stored model."""
    return SeriesState(model=name, version=model_version(stored), threshold=float(stored.threshold))


def score_chunk(stored: StoredModel, data: np.ndarray, offset: np.ndarray | None, times: np.ndarray | None,
                state: SeriesState, *, names: list[str], max_gap_periods: float, top: int = TOP_METRICS,
                policy: IncidentPolicy | None = None, regime: RegimePolicy | None = None,
                calibration: CalibrationPolicy | None = None,
                calibration_seed: tuple[np.ndarray, np.ndarray | None, np.ndarray | None] | None = None) -> ChunkResult:
    """Given the next chunk of a model's series, data (n, D) float32 (the file's values are data +
    offset, see :class:`opt_ds_ops.dataset.Dataset`) with epoch seconds ``times`` (n,) or None,
    score it as the continuation of ``state`` and return a :class:`ChunkResult`.

    The scores equal :func:`opt_ds_ops.model.detection.score_rows` of the whole series to float rounding
    (the window context and smoothing carry over). Rows over the threshold are flagged; the
    incident rule ``policy`` (:mod:`opt_ds_ops.scoring.incidents`; None: the defaults, rows
    :func:`sample_period_s` apart) turns them into incidents, the same whatever the chunks.
    ``events``: ``{"event": "incident-opened", "incident" (its id in the series), "row" (the row
    that opened it), "time", "started_row", "started_time" (its first flagged row), "threshold",
    "score", "peak_score", "severity", "rows_flagged", "top_metrics"}`` for each incident opened
    here, the same keys with ``"event": "incident-escalated"`` and the row that made a warning
    critical, and ``{"event": "incident-closed", "incident", "row" (its last flagged row), "time",
    "started_row", "started_time", "opened_row", "opened_time", "rows", "rows_flagged",
    "duration_s" (None without times), "peak_score", "peak_row", "peak_time", "severity",
    "top_metrics", "reason" ("recovered", "reset" or "regime"), "version" (the one that flagged
    it)}`` for each that closes (known once its quiet spell is complete, or at a reset); an incident
    spanning chunks is one of each. With ``regime`` (:class:`opt_ds_ops.scoring.regime.RegimePolicy`;
    None: off), an incident that is a change of regime closes (``reason: regime``) and is followed by
    ``{"event": "regime-changed", "regime" (its number in the series), "row", "time",
    "started_row", "started_time", "incident", "version", "metrics": [{"metric", "before", "after",
    "shift_sd"}] (the 10 largest shifts), "metrics_shifted"}``; the rows after it are scored
    re-baselined (the state's ``rebase``), and the state's ``regime`` keeps it until a new version.
    With ``calibration`` (:class:`opt_ds_ops.model.calibration.CalibrationPolicy`; None or a
    budget of 0: the model's threshold) the threshold is set again at the first row of each day,
    ``{"event": "threshold-calibrated", "row", "time", "version", "threshold", "previous",
    "model_threshold", "days", "alarms", "budget_per_day"}`` when it changes. ``calibration_seed``
    (scores, times or None, normal or None): the rows scored before this version, scored again by it (the newest
    last, :func:`opt_ds_ops.model.calibration.seed`), counted into its calibration where it starts
    afresh here (a new version, or none carried), so that the threshold at the first row is the one
    those days give; the event that says it has ``seeded_rows`` and ``seeded_left_out``. Rows are series rows, times ISO 8601 UTC (None without times);
    ``top_metrics`` ``[{"metric", "share"}]`` rank the incident's flagged rows' unsmoothed terms as
    :func:`opt_ds_ops.model.detection.flagged_segments` ranks a segment's. ``names``: the D metric
    names. ``state`` is not changed. Raises ScoreError if D differs from the model's or ``times``
    is not (n,).
    """
    want = stored.n_features
    if data.ndim != 2 or data.shape[1] != want:
        raise ScoreError(f"data has {data.shape[1] if data.ndim == 2 else '?'} features, model expects {want}")
    if times is not None and np.shape(times) != (data.shape[0],):
        raise ScoreError(f"times has shape {np.shape(times)}, data has {data.shape[0]} rows")
    if len(names) != want:
        raise ScoreError(f"{len(names)} metric names for {want} features")
    policy = policy or IncidentPolicy()
    st = SeriesState.from_dict(state.to_dict())  # a copy: the caller's state never moves
    events, notes = [], []
    reason = _reset_reason(stored, st, times, max_gap_periods)
    if reason is not None:
        notes.append(reason)
        if st.open_incident is not None:
            events.append(_closed(st.open_incident, names, "reset", top, st.version))
        counters = (st.rows_scored, st.rows_flagged, st.incidents, st.critical_incidents,
                    Tracker.from_dict(st.incident).opened)
        same = st.version == model_version(stored)  # a gap or time backwards: the re-baseline stays with its version
        version_rows = st.version_rows if same else 0
        kept = (st.rebase, st.regime) if same else ([], None)
        changes, cal = st.regime_changes, (st.calibration if same else None)
        if cal is not None:
            calib.gap(cal)
        st = fresh_state(st.model, stored)
        st.calibration = cal
        st.rows_scored, st.rows_flagged, st.incidents, st.critical_incidents = counters[:4]
        st.version_rows = version_rows
        st.incident = Tracker(opened=counters[4]).to_dict()  # incident ids go on counting in the series
        st.rebase, st.regime, st.regime_changes = kept[0], kept[1], changes
    st.version, st.threshold = model_version(stored), float(stored.threshold)
    on = calibration is not None and calibration.on and calib.usable(st.threshold)  # a threshold of 0: nothing to scale
    t = np.asarray(times, dtype=np.float64) if times is not None else None
    t0 = float(t[0]) if t is not None and t.size else None  # the chunk's first row's time
    period = sample_period_s(stored) or 60.0
    if not on:
        st.calibration = None
    elif not calib.valid(st.calibration, st.threshold):
        st.calibration = calib.fresh(st.threshold)
        if calibration_seed is not None and data.shape[0]:
            seeded = calib.seed(st.calibration, *calibration_seed, period, calibration,
                                calib.day_of(t0, st.next_row, period), "rows" if t is None else "time")
            if seeded is not None:
                st.threshold = float(st.calibration["threshold"])
                events.append(_calibrated(seeded, st, stored, calibration, t0))
    else:
        lifted = calib.floored(st.calibration, calibration)
        st.threshold = float(st.calibration["threshold"])
        if lifted is not None:
            events.append(_calibrated(lifted, st, stored, calibration, t0))
    if st.rebase and len(st.rebase) != want:
        notes.append(f"the carried re-baseline has {len(st.rebase)} metrics, the model {want}: dropped")
        st.rebase, st.regime = [], None
    cuts = calib.day_cuts(t, st.next_row, data.shape[0], period) if on else []  # the threshold moves only at a new day
    pieces, start, n = [], 0, data.shape[0]
    while True:  # a change of regime re-baselines the rows after it: they are scored from there again
        stop = next((c for c in cuts if c > start), n)
        part = _piece(stored, data[start:stop], offset, None if t is None else t[start:stop], st, names, top, policy,
                      regime, calibration if on else None)
        if part.stopped is not None and part.stopped < stop - start - 1:  # only rows up to it are valid: again
            end = start + part.stopped + 1
            part = _piece(stored, data[start:end], offset, None if t is None else t[start:end], st, names, top,
                          policy, regime, calibration if on else None)
        events.extend(part.events)
        pieces.append(part)
        st, start = part.state, start + part.scores.shape[0]
        if part.stopped is not None:
            events.extend(_regime_changed(stored, part, names, top))
        if start >= n:
            break
    cat = lambda k: np.concatenate([getattr(p, k) for p in pieces])  # noqa: E731
    return ChunkResult(scores=cat("scores"), flags=cat("flags"), top=[x for p in pieces for x in p.top],
                       incident=cat("incident"), first_row=pieces[0].first_row, events=events, notes=notes, state=st,
                       active=st.open_incident is not None, cells=cat("cells"), live=cat("live"))


def _piece(stored: StoredModel, data: np.ndarray, offset, t: np.ndarray | None, state: SeriesState, names: list[str],
           top: int, policy: IncidentPolicy, regime: RegimePolicy | None,
           calibration: CalibrationPolicy | None = None) -> ChunkResult:
    """Score rows as the continuation of ``state`` (a copy is returned, the state given is not
    changed); ``stopped`` (set on the result) is the row at which a change of regime was found, and
    then only the rows up to it are valid for the caller (:func:`score_chunk` scores them again).
    With ``calibration`` the rows are of one day, and its threshold is set at the first."""
    st = SeriesState.from_dict(state.to_dict())
    want = stored.n_features
    n, w = data.shape[0], stored.input_window
    period = sample_period_s(stored) or 60.0
    events = []
    if calibration is not None and n:
        t0 = None if t is None else float(t[0])
        day = calib.day_of(t0, st.next_row, period)
        moved = calib.roll(st.calibration, day, calibration, period, "rows" if t is None else "time")
        st.threshold = float(st.calibration["threshold"])
        if moved is not None:
            events.append(_calibrated(moved, st, stored, calibration, t0))
    threshold = float(st.threshold)
    context = torch.tensor(st.context, dtype=torch.float32).reshape(-1, want) if st.context else torch.empty(0, want)
    rebase = np.asarray(st.rebase, dtype=np.float64) if st.rebase else None
    cells, levels, context = _cells(stored, data, offset, context, rebase)
    raw = cells.mean(axis=1) if n else np.empty(0, dtype=np.float32)
    scores = _smoothed(stored, raw, st).astype(np.float32)
    flags = scores > threshold
    row0 = st.next_row
    explained = _explained(stored, threshold) if regime is not None and regime.explains == "model" else None
    done = track(flags, scores, threshold, Tracker.from_dict(st.incident), policy,
                 period, row0=row0, times=t, cells=cells, levels=levels, regime=regime, explained=explained)
    if done.stopped is not None and done.stopped < n - 1:
        part = ChunkResult(scores=scores, flags=flags, top=[], incident=done.incident, live=done.live, first_row=row0,
                           events=events,
                           notes=[], state=st, active=False, cells=cells)
        part.stopped = done.stopped
        return part
    for kind, i, inc in done.changes:
        if kind == "opened":
            events.append(_opened(inc, names, top, threshold, float(scores[i])))
        elif kind == "escalated":
            events.append(dict(_opened(inc, names, top, threshold, float(scores[i])),
                               event="incident-escalated", row=row0 + i, time=_time(inc.get("last_time"))))
        elif kind == "regime":
            events.append(_closed(inc, names, "regime", top, st.version))
            st.regime = {"shift": [list(p) for p in inc["shift"]], "tail": inc.get("ltail") or [], "row": row0 + i, "time": _time(inc.get("last_time")),
                         "start_row": inc["start_row"], "start_time": _time(inc.get("start_time")),
                         "incident": inc["id"]}
        else:
            events.append(_closed(inc, names, "recovered", top, st.version))  # a new version resets first
    top_rows = [""] * n
    for i in np.flatnonzero(flags).tolist():
        order = np.argsort(-cells[i].astype(np.float64), kind="stable")[:top]
        top_rows[i] = ";".join(names[j] for j in order)
    st.incident = done.tracker.to_dict()
    st.incidents += sum(1 for kind, _, _ in done.changes if kind == "opened")
    st.critical_incidents += sum(1 for kind, _, inc in done.changes
                                 if kind == "escalated" or kind == "opened" and inc["severity"] == "critical")
    st.next_row = row0 + n
    if n:
        st.last_time = float(t[-1]) if t is not None else None
        st.last_score = float(scores[-1])
    st.context = context.tolist() if w > 1 else []
    st.rows_scored += n
    st.version_rows += n
    st.rows_flagged += int(flags.sum())
    if calibration is not None:  # the budget learns from the rows its policy lets it (calibration.learns)
        learns = calibration.learns
        calib.add(st.calibration, scores, in_incident=_not_learned(done, learns),
                  row0=None if learns == "all" else row0, forget=_taken_back(done, learns, row0))
    part = ChunkResult(scores=scores, flags=flags, top=top_rows, incident=done.incident, live=done.live, first_row=row0,
                       events=events, notes=[], state=st, active=done.tracker.open is not None, cells=cells)
    part.stopped = done.stopped
    return part


def _not_learned(done, learns: str) -> np.ndarray | None:
    """The rows of a tracked chunk whose runs the alarm budget does not count, as known at each row
    (so one chunk or many count the same): an incident open there (``normal``), a critical one open
    there (``warnings``: critical when it opened or since it escalated), or None (``all``). The runs
    of an incident's rows before it opened or became critical are taken back when it does, on the
    same day (:func:`opt_ds_ops.model.calibration.forget_from`)."""
    if learns == "all":
        return None
    return done.live > 0 if learns == "normal" else done.live == 2


def _taken_back(done, learns: str, row0: int) -> list[tuple[int, int]]:
    """(first row, row) of each incident of a tracked chunk that became one the alarm budget does not
    learn at that row (opened, for ``normal``; opened critical or escalated, for ``warnings``): its
    runs held from the one to the other are not counted."""
    if learns == "all":
        return []
    return [(int(inc["start_row"]), row0 + i) for kind, i, inc in done.changes
            if kind == "escalated" or kind == "opened" and (learns == "normal" or inc["severity"] == "critical")]


def _moved_raw(stored: StoredModel, rows: np.ndarray, moved: np.ndarray) -> np.ndarray:
    """Unsmoothed scores (k,) of standardised rows (k, D) with ``moved`` (D,) taken off."""
    x = torch.from_numpy((rows - moved).astype(np.float32))
    if stored.input_clip > 0:
        x = x.clamp(-stored.input_clip, stored.input_clip)
    w = stored.input_window
    cells = feature_errors(stored.model, model_inputs(x, w, diff=stored.diff, clip=stored.input_clip)) / stored.error_scale
    return fold_window(cells, w, stored.window_error).numpy().mean(axis=1)


def _explained(stored: StoredModel, threshold: float):
    """``scoring.regime_explains: model``'s question (:func:`opt_ds_ops.scoring.regime.shifted`): would
    the incident's last rows ``tail`` (k, D), moved back by the shift fit to the model, be flagged at
    most ``1 - SUSTAINED`` of the time at ``threshold``? At least ``MIN_TAIL`` rows of the model's width."""
    def explained(shift: list[tuple[int, float]], tail) -> bool:
        rows = np.asarray(tail or [], dtype=np.float64)
        if rows.ndim != 2 or rows.shape[0] < MIN_TAIL or rows.shape[1] != stored.n_features:
            return False
        moved = np.zeros(stored.n_features)
        for j, m in refined(stored, shift, tail):
            moved[j] = m
        return float((_moved_raw(stored, rows, moved) > threshold).mean()) <= 1.0 - SUSTAINED
    return explained


def _warm_smoothing(stored: StoredModel, tail, moved: np.ndarray, st: SeriesState) -> None:
    """After a re-baseline: the smoothing's memory as if the incident's last rows (``tail``: their
    standardised levels before the re-baseline, (k, D); :func:`opt_ds_ops.scoring.regime.tail_rows`)
    had been scored against the new levels (``moved``: the shift just added, standardised), so the
    rows after it are smoothed as any others; a memory started from nothing would score the next
    rows unsmoothed. The tail is carried in the series state, so chunks change nothing."""
    st.ema_num, st.ema_den, st.recent = 0.0, 0.0, []
    rows = np.asarray(tail or [], dtype=np.float64)
    if stored.score_window <= 1 or rows.ndim != 2 or not rows.shape[0] or rows.shape[1] != stored.n_features:
        return
    _smoothed(stored, _moved_raw(stored, rows, moved).astype(np.float32), st)


def _regime_changed(stored: StoredModel, part: ChunkResult, names: list[str], top: int) -> list[dict]:
    """After a piece that ended on a change of regime: move the series' baseline by the shift (in
    place, on ``part.state``) and return the ``regime-changed`` event."""
    st = part.state
    reg = st.regime
    want = stored.n_features
    before = np.asarray(st.rebase, dtype=np.float64) if st.rebase else np.zeros(want)
    after = before.copy()
    shift = refined(stored, [(int(j), float(m)) for j, m in reg["shift"]], reg.get("tail"))
    for j, m in shift:
        after[j] += m
    metrics = described(shift, names, stored.mean.double().numpy(), stored.std.double().numpy(), before)
    st.rebase = after.tolist()
    _warm_smoothing(stored, reg.get("tail"), after - before, st)
    # the window's context rows are moved as the rows after them will be (the smoothing's memory is
    # warmed on the new levels above: _warm_smoothing)
    if st.context:
        ctx = np.asarray(st.context, dtype=np.float32).reshape(-1, want)
        ctx -= (after - before).astype(np.float32)
        st.context = ctx.tolist()
    st.regime_changes += 1
    st.regime = {"id": st.regime_changes, "row": reg["row"], "time": reg["time"], "start_row": reg["start_row"],
                 "start_time": reg["start_time"], "metrics": metrics, "incident": reg["incident"]}
    return [{"event": "regime-changed", "regime": st.regime_changes, "row": reg["row"], "time": reg["time"],
             "started_row": reg["start_row"], "started_time": reg["start_time"], "incident": reg["incident"],
             "version": st.version, "metrics": metrics[:max(top, 10)], "metrics_shifted": len(metrics)}]


def active_top_metrics(state: SeriesState, names: list[str], top: int = TOP_METRICS) -> list[dict]:
    """Return the open incident's top metrics ``[{"metric", "share"}]``, or [] without one."""
    inc = state.open_incident
    if inc is None or len(inc.get("sums") or []) != len(names):
        return []
    return _ranked(np.asarray(inc["sums"], dtype=np.float64), names, top)


def finite_or_none(v: float | None) -> float | None:
    """Return v, or None for NaN/Inf (strict JSON)."""
    return v if v is None or math.isfinite(v) else None
