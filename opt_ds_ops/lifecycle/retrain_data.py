"""Train only on normal rows (docs/retraining.md): leave out what a model flagged, with a margin.

A retraining dataset (made from a model's scoring history, :mod:`opt_ds_ops.lifecycle.history`), or a
training file whose sidecar says ``exclude_flagged: true``, is cut before training: every
flagged segment (a run of consecutive flagged rows) and ``retrain.exclude_margin`` rows before
and after it are left out. A segment longer than ``retrain.exclude_max_rows`` is kept: a model
that flags everything after a level shift (a new workload, a kernel upgrade) would otherwise
leave nothing of the new normal to learn from; that is a change of regime for the promotion
gate to judge, not an incident. The version's metadata.json says what was left out and why
(``excluded``: :func:`exclusion_info`).

Runs in the job process (it parses data and scores it), never in the daemon.
"""

from __future__ import annotations

import os

import numpy as np

from ..model.detection import ScoreError, score_rows
from ..model.threshold import segments
from ..store.versions import CURRENT, StoreError, load_model, safe_model_name


def exclusion_mask(flags: np.ndarray, margin: int, max_rows: int = 0) -> tuple[np.ndarray, dict]:
    """Given flags (n,) bool, return (keep (n,) bool, counts): False for each row of a flagged
    segment and the ``margin`` rows on each side, except segments longer than ``max_rows``
    (0: no limit). ``counts``: ``segments``, ``segments_kept_as_regime``, ``flagged_rows``."""
    flags = np.asarray(flags, dtype=bool)
    keep = np.ones(flags.shape[0], dtype=bool)
    starts, ends = segments(flags)
    long = 0
    for s, e in zip(starts.tolist(), ends.tolist()):
        if max_rows and e - s > max_rows:
            long += 1
            continue
        keep[max(0, s - margin) : min(flags.shape[0], e + margin)] = False
    return keep, {"segments": int(starts.size), "segments_kept_as_regime": long, "flagged_rows": int(flags.sum())}


def exclusion_info(keep: np.ndarray, counts: dict, margin: int, max_rows: int, source: str) -> dict:
    """Return metadata.json's ``excluded``: rows in and left out, the segments, the margin, why."""
    n, out = int(keep.shape[0]), int((~keep).sum())
    why = (f"{counts['segments']} flagged segment(s) ({counts['flagged_rows']} rows flagged by {source}) and "
           f"{margin} row(s) before and after each left out")
    if counts["segments_kept_as_regime"]:
        why += (f"; {counts['segments_kept_as_regime']} segment(s) longer than {max_rows} rows kept "
                "(retrain.exclude_max_rows: a change of regime, not an incident)")
    return dict(counts, rows_in=n, rows_left_out=out, rows_kept=n - out, margin=margin, max_rows=max_rows,
                flags_from=source, reason=why)


def exclude_flagged(ds, models_dir: str, name: str, margin: int, max_rows: int,
                    hold_back: bool = True) -> tuple[dict, np.ndarray | None]:
    """Given a loaded training Dataset of model ``name`` whose sidecar opted in, score it with the
    model's ``current`` version, hold back the file's newest tenth for the promotion gate (as a
    retraining holds back its history's: before the cut, flagged rows included; metadata's
    ``excluded.held_back``), and cut the older rows of ``ds`` (its data and time index) to those
    kept by :func:`exclusion_mask`; return (the ``excluded`` record, the held-back rows (k, D) as
    ``ds.data`` held them, centred by ``ds.offset``, or None). Nothing is left out or held back
    (``rows_left_out`` 0 and the reason) when nothing could be excluded: no current version, other
    columns, a dataset streamed from disk. ``hold_back`` False (``ds-ops train``: no gate runs):
    nothing is held back, every row not cut is trained on, and the rows returned are None.
    Raises ValueError if nothing would be left to train on."""
    try:
        stored = load_model(os.path.join(models_dir, safe_model_name(name), CURRENT))
        if not isinstance(ds.data, np.ndarray) or isinstance(ds.data, np.memmap):
            raise ScoreError("the dataset streams from disk (over the job's matrix budget)")
        flags = score_rows(stored, ds.data, offset=ds.offset) > stored.threshold
    except (StoreError, ScoreError) as e:
        return {"rows_in": ds.rows, "rows_left_out": 0, "reason": f"nothing excluded: {str(e).splitlines()[0][:300]}"}, None
    n = flags.shape[0]
    held_range = held_back_range(flags, ds.time.seconds if ds.time is not None else None) if hold_back else None
    k = held_range["rows"] if held_range else 0
    keep, counts = exclusion_mask(flags[: n - k], margin, max_rows)
    info = exclusion_info(keep, counts, margin, max_rows, f"current version {stored.metadata.get('version')}")
    if info["rows_kept"] < 2:
        raise ValueError(f"exclude_flagged would leave {info['rows_kept']} rows to train on: {info['reason']}")
    held = np.array(ds.data[n - k:])
    keep = np.r_[keep, np.zeros(k, dtype=bool)]
    ds.data = np.ascontiguousarray(ds.data[keep])
    if ds.time is not None:
        ds.time.seconds = ds.time.seconds[keep]
    note = f"exclude_flagged: {info['rows_left_out']} of {info['rows_in']} rows left out: {info['reason']}"
    if not hold_back:
        ds.notes.append(note)
        return info, None
    ds.notes.append(f"{note}; the newest {k} held back for the promotion gate")
    return dict(info, held_back=held_range), held


def history_dataset(history, margin: int, max_rows: int) -> tuple[np.ndarray, dict]:
    """Given a model's scoring History, return (its normal rows (k, D) float64, oldest first; the
    ``excluded`` record). Raises ValueError if fewer than 2 rows are left."""
    keep, counts = exclusion_mask(history.flags, margin, max_rows)
    info = exclusion_info(keep, counts, margin, max_rows, "the model's scoring history")
    if info["rows_kept"] < 2:
        raise ValueError(f"the history leaves {info['rows_kept']} normal rows to train on: {info['reason']}")
    return history.rows()[keep], info


HOLD_BACK_FRACTION = 0.1  # the newest tenth of a history is held back for the promotion gate


def held_back_range(flags: np.ndarray, times: np.ndarray | None, fraction: float = HOLD_BACK_FRACTION) -> dict:
    """Given the rows' flags (n,) bool and their times (n,) epoch seconds (NaN or None: unknown),
    return metadata's ``held_back``: the newest ``fraction`` of the rows (``from_row`` inclusive,
    ``to_row`` exclusive, at least 1 row, at most all but 2), taken BEFORE the flagged segments are
    cut, so they keep the rows the model flagged; their UTC times where known; how many the model
    of the time flagged. A retraining's history and a file with ``exclude_flagged`` alike."""
    n = int(flags.shape[0])
    k = min(max(1, int(round(n * fraction))), max(0, n - 2))
    times = times[n - k:] if times is not None and k else np.empty(0)
    known = times[np.isfinite(times)]
    return {"from_row": n - k, "to_row": n, "rows": k, "history_rows": n,
            "flagged_by_current": int(flags[n - k:].sum()),
            "from_time_s": float(known[0]) if known.size else None,
            "to_time_s": float(known[-1]) if known.size else None}


def write_history_dataset(history_path: str, out_path: str, margin: int, max_rows: int,
                          held_path: str | None = None, regime: dict | None = None) -> dict:
    """Write the normal rows of the scoring history at history_path as a float64 ``.npy`` at
    out_path (the dataset of a retraining job, trained through :func:`opt_ds_ops.training.job.run_job`);
    return the ``excluded`` record. With ``held_path``, the newest rows of the history
    (:func:`held_back_range`, flagged rows included) are written there instead, and what the series
    flagged among them when it scored them beside it (:func:`held_flags_path`), for the promotion
    gate: neither the cut, the training nor the challenger's threshold sees them; ``excluded``
    then counts the older rows only and says the held-back range (``held_back``). Raises
    ValueError for a missing, unreadable or too small history, OSError if a file cannot be written.
    ``regime``: a change of regime to learn (:func:`rebased_history`): ``rows`` (the history's
    newest rows are the new regime's) and ``shift`` ``[[column, delta]]`` in the data's units; the
    older rows are moved by it, so that the whole history, held-back rows included, is in the new
    regime's levels (``excluded.regime`` says so)."""
    from .history import History, read_history

    h = read_history(history_path)
    if h is None:
        raise ValueError(f"{history_path}: no scoring history to retrain from")
    if regime:
        h, moved = rebased_history(h, regime)
    held = None
    if held_path is not None:
        held = held_back_range(h.flags, h.times)
        if held["rows"]:
            _save(held_path, h.rows()[held["from_row"]:])
            _save(held_flags_path(held_path), h.flags[held["from_row"]:].astype(bool))
        cut = held["from_row"]
        h = History(values=h.values[:cut], offset=h.offset, flags=h.flags[:cut], times=h.times[:cut])
    rows, info = history_dataset(h, margin, max_rows)
    _save(out_path, rows)
    if regime:
        info = dict(info, regime=moved)
    return dict(info, held_back=held) if held is not None else info


def rebased_history(h, regime: dict):
    """Return (the history with its rows before a change of regime moved to the new levels, what
    was moved: ``{"rows": the new regime's rows, "rows_moved", "shift": [[column, delta]]}``).
    ``regime``: ``rows`` (the newest rows of the history that are the new regime's: not moved) and
    ``shift`` ``[[column, delta]]`` (data units). A bad shift (a column out of range, a delta not
    finite) raises ValueError."""
    from .history import History

    n, d = h.values.shape
    rows = int(regime.get("rows") or 0)
    shift = regime.get("shift") or []
    old = max(0, n - max(rows, 0))
    values = h.rows()
    for item in shift:
        if not (isinstance(item, (list, tuple)) and len(item) == 2):
            raise ValueError(f"a change of regime's shift {item!r} is not [column, delta]")
        j, delta = item
        if not isinstance(j, int) or isinstance(j, bool) or not 0 <= j < d or not isinstance(delta, (int, float)) \
                or not np.isfinite(delta):
            raise ValueError(f"a change of regime's shift {item!r} is not a column of {d} and a finite delta")
        values[:old, j] += float(delta)
    moved = History(values=values - h.offset, offset=h.offset, flags=h.flags, times=h.times, last_job=h.last_job)
    return moved, {"rows": rows, "rows_moved": old, "shift": [[int(j), float(v)] for j, v in shift]}


def held_flags_path(held_path: str) -> str:
    """Where the held-back rows' live flags (what the series flagged when it scored them) lie:
    ``held_back.npy`` -> ``held_back.flags.npy``."""
    return held_path[: -len(".npy")] + ".flags.npy" if held_path.endswith(".npy") else held_path + ".flags"


def _save(path: str, rows: np.ndarray) -> None:
    with open(path, "wb") as f:
        np.save(f, rows, allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())
