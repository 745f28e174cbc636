"""The rows a model scored, kept to retrain from (docs/retraining.md): ``RESULTS/NAME/history.npz``.

Written by the scoring job (a job process, never the daemon) after its results and before the
series state (:mod:`opt_ds_ops.scoring.job`), one file per model, in a bounded rolling window
(``retrain.window`` rows, or a duration by the rows' times; ``retrain.max_history_bytes``)::

    values   (n, D) float32   the rows minus ``offset`` (so a column far from zero keeps its digits);
                    float64 once a chunk would not keep them in float32 (:func:`fits_float32`)
    offset   (D,)   float64   added back by :func:`History.rows`
    flags    (n,)   bool      what the model's version of the time flagged
    times    (n,)   float64   UTC seconds, NaN where the chunk had no time column
    last_job ()     str       the scoring job that appended last: a replay never appends twice

The file is replaced atomically (a temporary file in the same directory, fsync'ed, renamed, the
directory fsync'ed), so a SIGKILL at any instant leaves the previous history or the new one.
It is read with ``allow_pickle=False``: only arrays, never objects.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from ..config.conffile import parse_window
from ..fsutil import fsync_dir

HISTORY_FILE = "history.npz"
FILE_MODE = 0o640


@dataclass
class History:
    values: np.ndarray
    offset: np.ndarray
    flags: np.ndarray
    times: np.ndarray
    last_job: str = ""

    @property
    def n_features(self) -> int:
        return int(self.values.shape[1])

    def rows(self) -> np.ndarray:
        """The rows as scored: (n, D) float64."""
        return self.values.astype(np.float64) + self.offset


def history_path(results_dir: str, name: str) -> str:
    return os.path.join(results_dir, name, HISTORY_FILE)


def read_history(path: str) -> History | None:
    """Return the history at path, or None if there is none. Raises ValueError for a file that is
    not a history (a wrong key, shape or dtype) and OSError if it cannot be read."""
    try:
        with np.load(path, allow_pickle=False) as z:
            h = History(values=z["values"], offset=z["offset"], flags=z["flags"], times=z["times"],
                        last_job=str(z["last_job"]))
    except FileNotFoundError:
        return None
    except KeyError as e:
        raise ValueError(f"{path}: not a scoring history (no {e})") from None
    n = h.values.shape[0] if h.values.ndim == 2 else -1
    if h.values.dtype not in (np.float32, np.float64):
        raise ValueError(f"{path}: not a scoring history (values of dtype {h.values.dtype})")
    if n < 0 or h.offset.shape != (h.values.shape[1],) or h.flags.shape != (n,) or h.times.shape != (n,):
        raise ValueError(f"{path}: not a scoring history (shapes {h.values.shape}, {h.offset.shape}, "
                         f"{h.flags.shape}, {h.times.shape})")
    return h


def write_history(path: str, h: History) -> None:
    """Replace the history at path atomically (a killed writer's hidden temporary file is
    overwritten by the next one). Raises OSError."""
    tmp = os.path.join(os.path.dirname(path), ".history.tmp")  # one scoring job per model at a time
    try:
        with open(tmp, "wb") as f:
            values = h.values if h.values.dtype == np.float64 else h.values.astype(np.float32)
            np.savez(f, values=values, offset=h.offset.astype(np.float64),
                     flags=h.flags.astype(bool), times=h.times.astype(np.float64), last_job=np.array(h.last_job))
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, FILE_MODE)
        os.rename(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(os.path.dirname(path))


def bounded(h: History, window: str, max_bytes: int) -> History:
    """Return h cut to its newest rows: ``window`` rows, or the rows within a duration of the
    newest time (rows without a time are kept by count only), and at most ``max_bytes`` on disk."""
    rows, seconds = parse_window(window)
    n = h.values.shape[0]
    keep = n
    if rows:
        keep = min(keep, rows)
    if seconds and n and np.isfinite(h.times[-1]):
        keep = min(keep, int(np.sum(~(h.times < h.times[-1] - seconds))))
    per_row = h.values.shape[1] * h.values.dtype.itemsize + 1 + 8
    keep = min(keep, max(1, max_bytes // per_row), n)
    s = n - keep
    return History(h.values[s:], h.offset, h.flags[s:], h.times[s:], h.last_job)


def record_chunk(results_model_dir: str, job_id: str, data: np.ndarray, offset: np.ndarray | None,
                 flags: np.ndarray, times: np.ndarray | None, window: str, max_bytes: int) -> str | None:
    """Append a scored chunk (data (n, D) + offset, its flags (n,), times (n,) or None) to the
    model's history under ``results_model_dir`` and bound it; return a note when the history
    was started afresh (other columns, an unreadable file), else None. A replay of the job that
    appended last appends nothing. Raises OSError if it cannot be written."""
    path = os.path.join(results_model_dir, HISTORY_FILE)
    note = None
    try:
        h = read_history(path)
    except (ValueError, OSError) as e:
        h, note = None, f"scoring history started afresh: {e}"
    if h is not None and h.last_job == job_id:
        return None
    d = data.shape[1]
    off = np.asarray(offset, dtype=np.float64) if offset is not None else np.zeros(d)
    if h is not None and h.n_features != d:
        h, note = None, f"scoring history started afresh: the model now has {d} metrics, the history {h.n_features}"
    if h is None:
        h = History(np.empty((0, d), np.float32), off, np.empty(0, bool), np.empty(0, np.float64))
    centred = np.asarray(data, dtype=np.float64) + (off - h.offset)
    if h.values.dtype == np.float32 and fits_float32(centred, np.asarray(data, np.float64) + off, h.values):
        values = centred.astype(np.float32)
    else:  # float32 would round this chunk away or overflow: the history keeps float64 from now on
        values, h = centred, History(h.values.astype(np.float64), h.offset, h.flags, h.times, h.last_job)
    t = np.asarray(times, dtype=np.float64) if times is not None else np.full(data.shape[0], np.nan)
    merged = History(np.concatenate([h.values, values]), h.offset, np.concatenate([h.flags, np.asarray(flags, bool)]),
                     np.concatenate([h.times, t]), job_id)
    write_history(path, bounded(merged, window, max_bytes))
    return note


PRECISION = 1e-4  # the largest rounding error kept, as a share of a column's spread in the chunk


def fits_float32(centred: np.ndarray, rows: np.ndarray, kept: np.ndarray | None = None) -> bool:
    """Whether the chunk's values centred on the history's offset (n, D) float64 keep, in float32,
    every row within :data:`PRECISION` of its column's spread (``rows``: the values as scored; a
    column constant in the chunk at a value within the history's range: its spread in the history
    ``kept`` (k, D), else a thousandth of its magnitude), and none overflows. A column that moved far from the history's offset (a
    counter at 1e12, then reset to 0.1-0.9) would otherwise be stored as multiples of 65,536; one
    that crossed from -3e38 to +3e38, as inf. A column constant in the chunk and in the history,
    whose value float32 does not hold exactly on the offset (all 0 after a mean of 1/60 as the
    offset), moves the history to float64 too: it is rare, and costs only the history's size."""
    if not centred.size:
        return True
    with np.errstate(over="ignore", invalid="ignore"):
        err = np.abs(centred.astype(np.float32).astype(np.float64) - centred)
        spread = np.ptp(rows, axis=0)
        if kept is not None and kept.size:  # a column constant in the chunk, at a value within the history's range
            k = kept.astype(np.float64)
            lo, hi = k.min(axis=0), k.max(axis=0)
            inside = (centred.min(axis=0) >= lo) & (centred.max(axis=0) <= hi)
            spread = np.where((spread > 0) | ~inside, spread, hi - lo)
        scale = np.where(spread > 0, spread, 1e-3 * np.abs(rows).max(axis=0))
        return bool(np.all(np.isfinite(err)) and np.all(err.max(axis=0) <= PRECISION * scale))


def chunk_drift(results_model_dir: str, job_id: str, flags: np.ndarray, times: np.ndarray | None, window: str,
                design_rate: float, own_rows: int | None = None, period_s: float | None = None) -> dict:
    """:func:`drift` of the model's history under results_model_dir with a chunk's flags (n,) and
    times appended, as :func:`record_chunk` will append them (nothing if job_id appended last).
    ``own_rows``: the rows the current version scored, the chunk's included; the history's older
    rows were flagged by another version, so they do not count (a version just promoted is not
    judged by its predecessor's flags). ``period_s``: the model's seconds between rows, for a
    duration window over rows without times."""
    try:
        h = read_history(os.path.join(results_model_dir, HISTORY_FILE))
    except (ValueError, OSError):
        h = None
    n = np.asarray(flags).shape[0]
    t = np.asarray(times, dtype=np.float64) if times is not None else np.full(n, np.nan)
    if h is not None and h.last_job == job_id:
        return drift(h, window, design_rate, own_rows, period_s)
    old_f = h.flags if h is not None else np.empty(0, bool)
    old_t = h.times if h is not None else np.empty(0)
    both = History(np.empty((old_f.shape[0] + n, 0), np.float32), np.empty(0), np.concatenate([old_f, flags]),
                   np.concatenate([old_t, t]))
    return drift(both, window, design_rate, own_rows, period_s)


def drift(h: History, window: str, design_rate: float, own_rows: int | None = None,
          period_s: float | None = None) -> dict:
    """Return the share of rows flagged over the history's last ``window`` (rows or a duration),
    at most its last ``own_rows`` rows, its ratio to the design rate, and whether those rows fill
    the window (``full``: as many rows as a row window; for a duration, as many rows as it holds
    at their median step, or at ``period_s`` where they have no times; neither: not full):
    ``{rows, flagged_share, design_rate, drift_ratio, full}``."""
    tail = bounded(h, window, 1 << 62)
    total = int(h.flags.shape[0])
    own = total if own_rows is None else min(total, max(0, int(own_rows)))
    n = min(int(tail.flags.shape[0]), own)
    flags = tail.flags[tail.flags.shape[0] - n:]
    rows, seconds = parse_window(window)
    if rows:
        full = n >= rows
    else:  # rows counted, not a span: a gap inside the window is not its rows
        t = tail.times[tail.times.shape[0] - n:]
        steps = np.diff(t[np.isfinite(t)])
        steps = steps[steps > 0]
        step = float(np.median(steps)) if steps.size else (period_s or 0.0)
        full = step > 0 and n * step >= seconds
    share = float(flags.mean()) if n else 0.0
    return {"rows": n, "flagged_share": share, "design_rate": design_rate,
            "drift_ratio": share / design_rate if design_rate > 0 else None, "full": bool(full)}


def sent_again(h: History | None, data: np.ndarray, offset: np.ndarray | None, times: np.ndarray | None,
               last_time: float | None) -> int:
    """How many leading rows of a chunk (``data`` (n, D) float32 + ``offset``, ``times`` (n,) epoch
    seconds in order) the series scored already: rows at or before its ``last_time`` that the history
    ``h`` holds at the same times with the same values (to float32's rounding of two centrings). A
    chunk sent again (a puller killed after its drop, before it saved its state) starts with them;
    other rows at those times (a host clock set back) are new: 0, and the series starts again."""
    if h is None or times is None or last_time is None or not len(times):
        return 0
    k = int(np.searchsorted(times, last_time, side="right"))
    if k == 0 or not h.times.size:
        return 0
    idx = np.searchsorted(h.times, times[:k])
    if np.any(idx >= h.times.size) or not np.array_equal(h.times[np.minimum(idx, h.times.size - 1)], times[:k]):
        return 0
    old = h.values[idx].astype(np.float64) + h.offset
    new = np.asarray(data[:k], dtype=np.float64) + (0.0 if offset is None else np.asarray(offset, dtype=np.float64))
    scale = np.abs(h.offset) + np.abs(old).max(axis=0) + 1.0
    return k if np.all(np.abs(new - old) <= 1e-6 * scale) else 0
