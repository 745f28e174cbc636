"""One series per model across chunks: telemetry that arrives in files is scored as one stream.

A model's score is causal (row t depends on rows <= t: :func:`opt_ds_ops.model.detection.score_rows`), so a
stream scored chunk by chunk equals the whole stream scored at once when each chunk starts from
what the previous one left: :class:`SeriesState` carries the window context (the last
``input_window - 1`` standardised and clipped rows), the smoothing's memory (the EMA's numerator
and denominator in pandas' ``adjust=True`` form, or the last ``score_window - 1`` raw scores of a
trailing mean), the anomaly segment still open at the chunk's end (first row, peak, and each
metric's sum of its unsmoothed terms, so its ranking is :func:`opt_ds_ops.model.detection.flagged_segments`'),
and counters. :func:`score_chunk` is pure: it returns a new state and never changes the one given,
so a chunk that is refused never advances the series.

The carried state is reset (a note says why; an open segment is ended first, ``reason: reset``)
when the model's version changes, when a chunk's first time is before the previous chunk's last,
or when the gap between them exceeds ``max_gap_periods`` sample periods (:func:`sample_period_s`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from ..dataset.core import iso_utc
from ..model.detection import ScoreError, standardise_rows
from ..model.network import feature_errors, fold_window, window_rows
from ..store.versions import StoredModel

STATE_FORMAT = 1
TOP_METRICS = 3  # metrics named per segment and per flagged row
BATCH_ROWS = 65536  # rows through the model at a time


@dataclass
class SeriesState:
    """What one model's series carries from a chunk to the next (JSON-safe by :meth:`to_dict`).

    ``next_row``: the series row of the next chunk's first row; ``last_time``: the last row's epoch
    seconds (None without a time column); ``ema_num``/``ema_den``: the EMA of the raw score as
    ``num / den`` (``score_smoothing: ema``); ``recent``: the last ``score_window - 1`` raw scores
    (``mean``); ``context``: the last ``input_window - 1`` standardised, clipped rows (float32
    values); ``segment``: the open anomaly segment or None (``start_row``, ``start_time``,
    ``peak_score``, ``peak_row``, ``peak_time``, ``sums``: each metric's sum of unsmoothed terms,
    ``rows``); counters over the series; ``last_job``, ``last_result``, ``scored_at``,
    ``top_metrics``: the scoring job that wrote this state, its result directory, when, and the
    open segment's top metrics by name (:func:`opt_ds_ops.scoring.job.score_job` sets them).
    """

    model: str
    version: str | None = None
    next_row: int = 0
    last_time: float | None = None
    ema_num: float = 0.0
    ema_den: float = 0.0
    recent: list = field(default_factory=list)
    context: list = field(default_factory=list)
    segment: dict | None = None
    rows_scored: int = 0
    rows_flagged: int = 0
    segments: int = 0
    last_score: float | None = None
    threshold: float | None = None
    last_job: str | None = None
    last_result: str | None = None
    scored_at: str | None = None  # when last_job wrote it (ISO 8601 UTC)
    top_metrics: list = field(default_factory=list)  # the open segment's, named (for status and metrics)
    lineage: str | None = None  # the model's (opt_ds_ops.store.model_dir.model_lineage) when last_job wrote it

    def to_dict(self) -> dict:
        """Return the state as plain JSON types, with ``format``."""
        return dict(dataclasses.asdict(self), format=STATE_FORMAT)

    @classmethod
    def from_dict(cls, obj: dict) -> SeriesState:
        """Return the state saved by :meth:`to_dict`. Raises ValueError for another format or shape."""
        if not isinstance(obj, dict) or obj.get("format") != STATE_FORMAT:
            raise ValueError(f"series state of unknown format (want format {STATE_FORMAT})")
        known = {f.name for f in dataclasses.fields(cls)}
        try:
            state = cls(**{k: v for k, v in obj.items() if k in known})
        except TypeError as e:
            raise ValueError(f"series state: {e}") from None
        numbers = (state.next_row, state.ema_num, state.ema_den, state.rows_scored, state.rows_flagged, state.segments)
        if (not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers)
                or not isinstance(state.context, list) or not isinstance(state.recent, list)
                or not (state.segment is None
                        or isinstance(state.segment, dict) and isinstance(state.segment.get("sums"), list))
                or not (state.last_time is None or isinstance(state.last_time, (int, float)))):
            raise ValueError("series state: a field of the wrong type")
        return state


@dataclass
class ChunkResult:
    """One chunk scored: ``scores`` (n,) float32, ``flags`` (n,) bool (``scores > threshold``),
    ``top`` (n,) the flagged rows' metrics (the open segment's ranking through that row, names
    joined by ``;``; "" elsewhere), ``first_row`` (the series row of row 0), ``events``,
    ``notes`` (why the state was reset), the new ``state`` and ``active`` (a segment is open)."""

    scores: np.ndarray
    flags: np.ndarray
    top: list
    first_row: int
    events: list
    notes: list
    state: SeriesState
    active: bool


def model_version(stored: StoredModel) -> str:
    """Return the stored model's version name (metadata.json ``version``, else its directory)."""
    import os

    return str(stored.metadata.get("version") or os.path.basename(stored.path.rstrip("/")) or "")


def sample_period_s(stored: StoredModel) -> float | None:
    """Return the model's seconds between rows: the median step of its training file's time
    column (metadata.json ``dataset.time.median_step_s``), else the training configuration's
    ``train.sample_period_s``; None if neither is known."""
    md = stored.metadata
    step = ((md.get("dataset") or {}).get("time") or {}).get("median_step_s")
    if isinstance(step, (int, float)) and step > 0:
        return float(step)
    period = ((md.get("config") or {}).get("train") or {}).get("sample_period_s")
    return float(period) if isinstance(period, (int, float)) and period > 0 else None


def model_metric_names(stored: StoredModel, fallback: list[str] | None = None) -> list[str]:
    """Return the model's D metric names: metadata.json ``metric_names`` (the training file's
    header, or ``dataset.metric_names``), else its ``dataset.header``, else ``fallback`` (the
    scored file's header, say) when it has D names, else the 1-based file columns of the
    model's features as text."""
    md, d = stored.metadata, stored.n_features
    for names in (md.get("metric_names"), (md.get("dataset") or {}).get("header"), fallback):
        if isinstance(names, list) and len(names) == d:
            return [str(n) for n in names]
    cols = (md.get("dataset") or {}).get("feature_columns")
    if isinstance(cols, list) and len(cols) == d:
        return [str(c) for c in cols]
    return [str(j + 1) for j in range(d)]


def _time(t: float | None) -> str | None:
    return iso_utc(t) if t is not None else None


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


def _ended(seg: dict, last_row: int, last_time: float | None, names: list[str], reason: str, top: int,
           version: str | None) -> dict:
    duration = (last_time - seg["start_time"]) if last_time is not None and seg["start_time"] is not None else None
    return {"event": "anomaly-ended", "version": version, "row": last_row, "time": _time(last_time),
            "started_row": seg["start_row"],
            "started_time": _time(seg["start_time"]), "rows": seg["rows"], "duration_s": duration,
            "peak_score": seg["peak_score"], "peak_row": seg["peak_row"], "peak_time": _time(seg["peak_time"]),
            "top_metrics": _ranked(np.asarray(seg["sums"], dtype=np.float64), names, top), "reason": reason}


def _cells(stored: StoredModel, data: np.ndarray, offset, context: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    """Return (the chunk's normalised errors (n, D) float32, the new window context (<= w-1, D))."""
    w = stored.input_window
    out = np.empty(data.shape, dtype=np.float32)
    for start in range(0, data.shape[0], BATCH_ROWS):
        x = standardise_rows(stored, data[start : start + BATCH_ROWS], offset)
        if stored.input_clip > 0:
            x.clamp_(-stored.input_clip, stored.input_clip)
        xw = window_rows(x, w, context=context)
        cells = feature_errors(stored.model, xw) / stored.error_scale
        out[start : start + x.shape[0]] = fold_window(cells, w, stored.window_error).numpy()
        if w > 1:
            context = torch.cat([context, x])[-(w - 1):]
    return out, context


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
                state: SeriesState, *, names: list[str], max_gap_periods: float, top: int = TOP_METRICS) -> ChunkResult:
    """Given the next chunk of a model's series, data (n, D) float32 (the file's values are data +
    offset, see :class:`opt_ds_ops.dataset.Dataset`) with epoch seconds ``times`` (n,) or None,
    score it as the continuation of ``state`` and return a :class:`ChunkResult`.

    The scores equal :func:`opt_ds_ops.model.detection.score_rows` of the whole series to float rounding
    (the window context and smoothing carry over). ``events``: ``{"event": "anomaly-started",
    "row", "time", "threshold", "score", "top_metrics"}`` for each segment of ``scores >
    threshold`` that starts here and ``{"event": "anomaly-ended", "row" (its last row), "time",
    "started_row", "started_time", "rows", "duration_s" (None without times), "peak_score",
    "peak_row", "peak_time", "top_metrics", "reason" ("recovered" or "reset"), "version" (the one
    that flagged it)}`` for each that ends
    (known at the first row below the threshold, which may be this chunk's first); a segment
    spanning chunks is one of each. Rows are series rows, times ISO 8601 UTC (None without
    times); ``top_metrics`` ``[{"metric", "share"}]`` rank the segment's unsmoothed terms as
    :func:`opt_ds_ops.model.detection.flagged_segments` does (a started event: its first row's). ``names``:
    the D metric names. ``state`` is not changed. Raises ScoreError if D differs from the model's
    or ``times`` is not (n,).
    """
    want = stored.n_features
    if data.ndim != 2 or data.shape[1] != want:
        raise ScoreError(f"data has {data.shape[1] if data.ndim == 2 else '?'} features, model expects {want}")
    if times is not None and np.shape(times) != (data.shape[0],):
        raise ScoreError(f"times has shape {np.shape(times)}, data has {data.shape[0]} rows")
    if len(names) != want:
        raise ScoreError(f"{len(names)} metric names for {want} features")
    st = SeriesState.from_dict(state.to_dict())  # a copy: the caller's state never moves
    events, notes = [], []
    reason = _reset_reason(stored, st, times, max_gap_periods)
    if reason is not None:
        notes.append(reason)
        if st.segment is not None:
            events.append(_ended(st.segment, st.next_row - 1, st.last_time, names, "reset", top, st.version))
        counters = (st.rows_scored, st.rows_flagged, st.segments)
        st = fresh_state(st.model, stored)
        st.rows_scored, st.rows_flagged, st.segments = counters
    st.version, st.threshold = model_version(stored), float(stored.threshold)
    n, w = data.shape[0], stored.input_window
    context = torch.tensor(st.context, dtype=torch.float32).reshape(-1, want) if st.context else torch.empty(0, want)
    cells, context = _cells(stored, data, offset, context)
    raw = cells.mean(axis=1) if n else np.empty(0, dtype=np.float32)
    scores = _smoothed(stored, raw, st).astype(np.float32)
    flags = scores > stored.threshold
    row0 = st.next_row
    t = np.asarray(times, dtype=np.float64) if times is not None else None
    at = (lambda i: float(t[i])) if t is not None else (lambda i: None)
    top_rows = [""] * n
    seg = st.segment
    if seg is not None and n and not flags[0]:
        events.append(_ended(seg, row0 - 1, st.last_time, names, "recovered", top, st.version))
        seg = None
    d = np.diff(np.r_[0, flags.astype(np.int8), 0])
    for a, b in zip(np.flatnonzero(d == 1).tolist(), np.flatnonzero(d == -1).tolist()):
        if seg is None:
            seg = {"start_row": row0 + a, "start_time": at(a), "peak_score": float(scores[a]), "peak_row": row0 + a,
                   "peak_time": at(a), "sums": [0.0] * want, "rows": 0}
            st.segments += 1
            events.append({"event": "anomaly-started", "row": row0 + a, "time": _time(at(a)),
                           "threshold": float(stored.threshold), "score": float(scores[a]),
                           "top_metrics": _ranked(cells[a].astype(np.float64), names, top)})
        # summed row after row from the carried sums: the same additions whatever the chunks
        running = np.cumsum(np.vstack([np.asarray(seg["sums"], dtype=np.float64)[None], cells[a:b]]), axis=0,
                            dtype=np.float64)[1:]
        order = np.argsort(-running, axis=1, kind="stable")[:, :top]
        for k, i in enumerate(range(a, b)):
            top_rows[i] = ";".join(names[j] for j in order[k])
        peak = a + int(np.argmax(scores[a:b]))
        if float(scores[peak]) > seg["peak_score"]:
            seg.update(peak_score=float(scores[peak]), peak_row=row0 + peak, peak_time=at(peak))
        seg["sums"], seg["rows"] = running[-1].tolist(), seg["rows"] + (b - a)
        if b < n:
            events.append(_ended(seg, row0 + b - 1, at(b - 1), names, "recovered", top, st.version))
            seg = None
    st.segment = seg
    st.next_row = row0 + n
    if n:
        st.last_time = at(n - 1)
        st.last_score = float(scores[-1])
    st.context = context.tolist() if w > 1 else []
    st.rows_scored += n
    st.rows_flagged += int(flags.sum())
    return ChunkResult(scores=scores, flags=flags, top=top_rows, first_row=row0, events=events, notes=notes,
                       state=st, active=seg is not None)


def active_top_metrics(state: SeriesState, names: list[str], top: int = TOP_METRICS) -> list[dict]:
    """Return the open segment's top metrics ``[{"metric", "share"}]``, or [] without one."""
    if state.segment is None or len(state.segment["sums"]) != len(names):
        return []
    return _ranked(np.asarray(state.segment["sums"], dtype=np.float64), names, top)


def finite_or_none(v: float | None) -> float | None:
    """Return v, or None for NaN/Inf (strict JSON)."""
    return v if v is None or math.isfinite(v) else None
