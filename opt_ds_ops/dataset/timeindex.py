"""A dataset's time index: read batch by batch, then checked for order (sorted or refused).

Timestamps become float64 epoch seconds (UTC). ISO 8601 text is parsed by Arrow's cast to
``timestamp[ns]`` (``2024/05/18`` dates as nvidia-smi writes them are read as ``2024-05-18``, a
``,`` before the fraction of a second as ``.``); text with a zone (``Z``, ``+02:00``, ``UTC``)
is converted to UTC, text without one is taken as UTC. Epoch numbers are scaled by their unit
(:data:`opt_ds_ops.dataset.columns.EPOCH_SCALE`).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..config.conffile import DatasetConfig
from .columns import EPOCH_SCALE, ColumnPlan
from .core import DatasetError, TimeIndex, iso_utc, quoted


def _normalise(col):
    """Arrow string array -> the ISO 8601 form Arrow's cast reads (see the module docstring)."""
    import pyarrow.compute as pc

    col = pc.utf8_trim_whitespace(col)
    col = pc.replace_substring_regex(col, r"^(\d{4})/(\d{2})/(\d{2})", r"\1-\2-\3")
    col = pc.replace_substring_regex(col, r"(:\d{2}),(\d)", r"\1.\2")
    return pc.replace_substring_regex(col, r"\s*UTC$", "Z")


class TimeCollector:
    """Collects the time column of each batch as float64 epoch seconds.

    ``where(row)`` names a 0-based data row in messages (``line 7``).
    """

    def __init__(self, path: str, plan: ColumnPlan, where: Callable[[int], str]):
        self.path, self.plan, self.where = path, plan, where
        self.label = plan.labels[plan.time]
        self.parts: list[np.ndarray] = []

    def add(self, col, rows_before: int) -> None:
        """Append one batch's time column (an Arrow array); raise DatasetError at a value that is
        not a timestamp of the column's form, or a missing one."""
        import pyarrow as pa

        kind = self.plan.time_kind
        if kind == "iso8601":
            typ = pa.timestamp("ns", tz="UTC") if self.plan.time_zoned else pa.timestamp("ns")
            try:
                ns = col.cast(typ)  # plain ISO 8601: no rewriting (the rewrite costs 15 % of a CSV's parse)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                norm = _normalise(col)
                try:
                    ns = norm.cast(typ)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                    self._bad_text(col, norm, typ, rows_before)
            values = ns.cast(pa.int64()).to_numpy(zero_copy_only=False).astype(np.float64) * 1e-9
        elif kind == "timestamp":
            if pa.types.is_date(col.type):
                col = col.cast(pa.timestamp("s"))
            if col.null_count:
                self._missing(col, rows_before)
            values = col.cast(pa.timestamp("ns", tz=col.type.tz)).cast(pa.int64()).to_numpy(
                zero_copy_only=False).astype(np.float64) * 1e-9
        else:
            values = np.asarray(col.to_numpy(zero_copy_only=False), dtype=np.float64) * EPOCH_SCALE[kind]
            bad = np.flatnonzero(~np.isfinite(values))
            if len(bad):
                raise DatasetError(f"{self.path}: {self.where(rows_before + int(bad[0]))}, {self.label}: "
                                   "a missing time (empty, NA or NaN)")
        self.parts.append(values)

    def _missing(self, col, rows_before: int) -> None:
        r = next(i for i, v in enumerate(col.is_null().to_pylist()) if v)
        raise DatasetError(f"{self.path}: {self.where(rows_before + r)}, {self.label}: a missing time")

    def _bad_text(self, col, norm, typ, rows_before: int) -> None:
        import pyarrow as pa

        for r, (raw, value) in enumerate(zip(col.to_pylist(), norm.to_pylist())):
            try:
                pa.array([value]).cast(typ)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                form = "with a zone (Z or +HH:MM)" if self.plan.time_zoned else "without a zone"
                raise DatasetError(
                    f"{self.path}: {self.where(rows_before + r)}, {self.label}: {quoted(raw)} is not an ISO 8601 timestamp "
                    f"{form}, as the first rows are"
                ) from None
        raise DatasetError(f"{self.path}: {self.label}: timestamps that cannot be read")

    def finish(self, rows: int) -> TimeIndex:
        """Return the :class:`TimeIndex` of the ``rows`` rows read."""
        plan = self.plan
        seconds = np.concatenate(self.parts) if self.parts else np.empty(0)
        return TimeIndex(column=plan.names[plan.time] or f"column {plan.time + 1}", kind=plan.time_kind,
                         detected=plan.time_detected, seconds=seconds[:rows])


def apply_time_order(path: str, data: np.ndarray, time: TimeIndex, opts: DatasetConfig,
                     where: Callable[[int], str]) -> tuple[np.ndarray, list[str]]:
    """Return (data, notes) with rows in time order: sorted (stable; a copy of data) when
    ``opts.time_order`` is ``sort``, else DatasetError naming the first row out of order. Rows
    streamed from disk (an :class:`opt_ds_ops.dataset.npyrows.NpyRows`) out of order are always refused."""
    t = time.seconds
    notes = []
    time.shared_times = int((np.diff(t) == 0).sum())
    if time.shared_times > 0.1 * max(len(t) - 1, 1):
        notes.append(
            f"{time.shared_times} of {len(t)} rows have the time of the row before: several series (GPUs, hosts, "
            "cores) interleaved? They train as one pooled model; split the file per series for one model each "
            "(e.g. by nvidia-smi's index column)"
        )
    back = np.flatnonzero(np.diff(t) < 0)
    if not len(back):
        return data, notes
    r = int(back[0]) + 1
    if not isinstance(data, np.ndarray):  # rows streamed from a .npy (over the matrix budget): not sorted here
        raise DatasetError(
            f"{path}: {where(r)}: time {iso_utc(t[r])} is earlier than the row before ({iso_utc(t[r - 1])}); "
            f"the {data.shape[0]:,} rows are over job.max_matrix_bytes and stream from disk, where they are "
            "not sorted: sort the file by time, or raise job.memory_max / job.max_matrix_bytes"
        )
    if opts.time_order == "refuse":
        raise DatasetError(
            f"{path}: {where(r)}: time {iso_utc(t[r])} is earlier than the row before ({iso_utc(t[r - 1])}); "
            "rows out of time order are refused (dataset.time_order: refuse; sort would sort them)"
        )
    order = np.argsort(t, kind="stable")
    moved = int((order != np.arange(len(order))).sum())
    time.seconds, time.sorted_rows, time.order = t[order], moved, order
    note = (f"rows out of time order (the first at {where(r)}) were sorted by {time.column}: {moved} of {len(t)} "
            "rows moved (dataset.time_order: sort)")
    return np.ascontiguousarray(np.asarray(data)[order]), [note] + notes
