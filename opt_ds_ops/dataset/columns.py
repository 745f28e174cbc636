"""Which columns of a table are features, which one is time, which are left out, and why.

Shared by the text and the Parquet/Arrow readers: each describes its columns as
:class:`ColumnInfo` (name, kind, a few leading values) and :func:`plan_columns` decides, under the
``dataset:`` options (:class:`opt_ds_ops.config.conffile.DatasetConfig`):

- **Time index** (never a feature). With ``time_column: auto``, the first column
  - named like a time column (:data:`TIME_NAMES`, case-insensitive, ignoring a leading ``@``/``_``
    and a trailing unit such as `` (UTC)``) holding timestamps, or numbers that are epoch-sized
    (>= 1e8) or non-decreasing; epoch units follow from the magnitude of the first value
    (< 1e11 s, < 1e14 ms, < 1e17 us, else ns: the ranges of a date after 1973 in each unit);
  - else holding ISO 8601 timestamps (``2024-05-18T00:00:00Z``, ``2024-05-18 00:00:00.123``,
    ``2024/05/18 12:00:00.123`` as nvidia-smi writes it, a date alone), under any name;
  - else, without a name, holding strictly increasing integers of epoch seconds or milliseconds
    between 2000 and 2100.
  A time-named column whose values are neither is refused: a silent wrong model is worse.
- **Row index**: a first column whose header name is empty (pandas' ``to_csv``), ``Unnamed: 0`` or
  ``index`` and that holds integers (in any order: pandas keeps the index of a filtered or sorted
  frame) is dropped; in a file without a header, a first column of 0, 1, 2, ... (or 1, 2, 3, ...).
  The readers check every row of it.
- **Text columns** are refused, naming them and the line that shows it, unless left out by
  ``exclude_columns`` or not listed in ``columns``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from ..config.conffile import DatasetConfig
from .core import DatasetError, dataset_stem, quoted

TIME_NAMES = frozenset({
    "time", "timestamp", "date", "datetime", "date_time", "ts", "epoch", "time_stamp", "timestamp_utc",
    "time_utc", "utc", "unix_time", "unixtime", "epoch_s", "epoch_ms", "timestamp_ms", "timestamp_s",
    "event_time", "sample_time", "period", "interval_start",
})
INDEX_NAMES = frozenset({"", "unnamed: 0", "index", "unnamed:0"})
ISO_TIME = re.compile(
    r"^\d{4}[-/]\d{2}[-/]\d{2}(?:[T ]\d{2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?)?\s*(?:Z|z|UTC|[+-]\d{2}:?\d{2})?$"
)
ZONED = re.compile(r"(?:Z|z|UTC|[+-]\d{2}:?\d{2})$")
EPOCH_SCALE = {"epoch_s": 1.0, "epoch_ms": 1e-3, "epoch_us": 1e-6, "epoch_ns": 1e-9}
TIME_KINDS = ("time", "timestamp")
_EPOCH_S_2000, _EPOCH_S_2100 = 946684800.0, 4102444800.0


def normalised_name(name: str | None) -> str:
    """Return a header name as matched against TIME_NAMES: ``"@Timestamp (UTC)"`` -> ``timestamp``."""
    n = (name or "").strip().casefold()
    n = re.sub(r"\s*[(\[].*$", "", n)
    return n.lstrip("@_").strip()


def is_iso_time(text: str) -> bool:
    """True if text is an ISO 8601-like timestamp or date (see the module docstring)."""
    return bool(ISO_TIME.match(text.strip()))


def epoch_kind(first: float) -> str:
    """Return the epoch unit of a timestamp column from its first value's magnitude (see module)."""
    v = abs(first)
    return "epoch_s" if v < 1e11 else "epoch_ms" if v < 1e14 else "epoch_us" if v < 1e17 else "epoch_ns"


@dataclass
class ColumnInfo:
    """One column as a reader saw it before reading the rows.

    ``name``: the header name, or None without a header. ``kind``: ``number`` (every value seen is
    a number), ``time`` (ISO 8601 text), ``timestamp`` (a typed Parquet/Arrow timestamp or date),
    ``text`` or ``empty``.
    ``values``: its first values as float64 (numbers only; for epoch and index detection).
    ``example``/``where``: a value that shows a text column's kind and where it is ("line 2").
    ``zoned``: the time text carries a zone (Z or an offset). ``mixed``: a text column whose other
    values are numbers (``example`` is then a bad cell, not a label).
    """

    name: str | None
    kind: str
    values: np.ndarray = field(default_factory=lambda: np.empty(0))
    example: str = ""
    where: str = ""
    zoned: bool = False
    mixed: bool = False


@dataclass
class ColumnPlan:
    """What :func:`plan_columns` decided, as 0-based column numbers of the file.

    ``features``: the feature columns in file order. ``time``: the time column or None, read as
    ``time_kind`` (iso8601, timestamp, epoch_s/ms/us/ns) because ``time_detected``. ``index``:
    a row-index column to drop: its values must be integers, and ``index_start``,
    ``index_start`` + 1, ... unless ``index_start`` is None (a named index: any integers).
    ``left_out``: ``{"column": label, "why": ...}`` for every column not a feature.
    """

    labels: list[str]
    names: list[str | None]
    features: list[int]
    time: int | None = None
    time_kind: str | None = None
    time_detected: str | None = None
    time_zoned: bool = False
    index: int | None = None
    index_start: int | None = 0
    left_out: list[dict] = field(default_factory=list)

    def feature_names(self) -> list[str] | None:
        """Return the features' header names, or None if the file names no columns."""
        if all(n is None for n in self.names):
            return None
        return [self.names[i] if self.names[i] else f"column {i + 1}" for i in self.features]

    def feature_label(self, c: int) -> str:
        """Name feature c (0-based among the features) in messages: ``column 3 ('cpu')``."""
        return self.labels[self.features[c]]


def column_label(i: int, name: str | None) -> str:
    """``column 3 ('cpu')`` or ``column 3``: how messages name the file's column i (0-based)."""
    return f"column {i + 1} ({quoted(name)})" if name else f"column {i + 1}"


def _resolve(path: str, key: str, ref, infos: list[ColumnInfo]) -> int:
    """Return the 0-based column that ``ref`` (a header name, else a 1-based number) names."""
    names = [c.name for c in infos]
    text = str(ref).strip()
    hits = [i for i, n in enumerate(names) if n is not None and n.strip() == text]
    if len(hits) > 1:
        raise DatasetError(f"{path}: dataset.{key} names {text!r}, which {len(hits)} columns are called; "
                           f"use their numbers ({', '.join(str(h + 1) for h in hits)})")
    if hits:
        return hits[0]
    if text.isdigit() and 1 <= int(text) <= len(infos):
        return int(text) - 1
    shown = ", ".join(repr(n) for n in names[:20] if n is not None) or f"numbers 1 to {len(infos)}"
    raise DatasetError(f"{path}: dataset.{key} names {text!r}, which is not a column of this file "
                       f"(its columns: {shown}{', ...' if len(names) > 20 else ''})")


def _time_candidate(info: ColumnInfo, unnamed_ok: bool) -> str | None:
    """Return why info is a time column under ``time_column: auto``, or None."""
    named = normalised_name(info.name) in TIME_NAMES
    if named and info.kind in TIME_KINDS:
        return f"named {quoted(info.name)}, holding timestamps"
    if named and info.kind == "number" and len(info.values):
        v = info.values
        if abs(v[0]) >= 1e8 or bool(np.all(np.diff(v) >= 0)):
            return f"named {quoted(info.name)}, holding {epoch_kind(v[0]).replace('epoch_', 'epoch ')}"
    if info.kind in TIME_KINDS:
        return "holding ISO 8601 timestamps" if info.kind == "time" else "typed as timestamps"
    if unnamed_ok and info.kind == "number" and len(info.values) >= 3:
        v = info.values
        scaled = v if v[0] < 1e11 else v / 1000.0
        if (np.all(np.diff(v) > 0) and np.all(v == np.round(v)) and np.median(np.diff(scaled)) >= 1.0
                and _EPOCH_S_2000 <= scaled[0] and scaled[-1] <= _EPOCH_S_2100):
            return f"unnamed, holding increasing {epoch_kind(v[0]).replace('epoch_', 'epoch ')}"
    return None


def _is_index(info: ColumnInfo) -> tuple[bool, int | None]:
    """Return (is a row-index column, its first value 0 or 1 when it must count up; None: any integers)."""
    v = info.values
    if info.kind != "number" or len(v) < 2 or not np.all(v == np.round(v)):
        return False, None
    if info.name is not None:
        return info.name.strip().casefold() in INDEX_NAMES, None
    if v[0] in (0.0, 1.0) and np.array_equal(v, v[0] + np.arange(len(v))):
        return True, int(v[0])
    return False, None


_GROUPED_NUMBER = re.compile(r"^[+-]?\d{1,3}([.,' \u00a0\u202f]\d{3})+([.,]\d+)?$")
_OTHER_TIME = re.compile(r"^\d{1,4}[./-]\d{1,2}[./-]\d{1,4}([ T]\d{1,2}:\d{2}(:\d{2}([.,]\d+)?)?)?$")


def _what_text(info: ColumnInfo) -> str:
    """How a refused column's values read to a person: timestamps, numbers ds-ops cannot read, text."""
    if info.kind in TIME_KINDS:
        return "timestamps (only one column is the time index)"
    v = info.example.strip()
    if _GROUPED_NUMBER.match(v):
        return "numbers with thousands separators, which ds-ops does not read (export them without)"
    if _OTHER_TIME.match(v):
        return ("dates that are not ISO 8601 (ds-ops reads 2024-05-18T00:00:00 and epoch numbers; export "
                "them so, or leave the column out)")
    return "text"


def plan_columns(path: str, infos: list[ColumnInfo], opts: DatasetConfig) -> ColumnPlan:
    """Given the file's columns, return the :class:`ColumnPlan` (see the module docstring).

    Raises DatasetError naming the file and columns for: an option that names no column, a time
    column that holds neither timestamps nor epoch numbers, text columns that would be features,
    and no feature column left.
    """
    labels = [column_label(i, c.name) for i, c in enumerate(infos)]
    plan = ColumnPlan(labels=labels, names=[c.name for c in infos], features=[])
    chosen = {_resolve(path, "columns", r, infos) for r in opts.columns}
    excluded = {_resolve(path, "exclude_columns", r, infos) for r in opts.exclude_columns}
    tc = opts.time_column.strip()
    if tc.casefold() not in ("auto", "none"):
        i = _resolve(path, "time_column", tc, infos)
        info = infos[i]
        if info.kind not in TIME_KINDS + ("number",):
            raise DatasetError(f"{path}: dataset.time_column is {labels[i]}, which holds {quoted(info.example)} "
                               f"({info.where}): neither an ISO 8601 timestamp nor epoch seconds/milliseconds")
        plan.time, plan.time_detected = i, "set by dataset.time_column"
    elif tc.casefold() == "auto":
        for i, info in enumerate(infos):
            if i in excluded or (chosen and i not in chosen and info.kind not in TIME_KINDS
                                 and normalised_name(info.name) not in TIME_NAMES):
                continue
            why = _time_candidate(info, unnamed_ok=i == 0 and not (info.name or "").strip())
            if why:
                plan.time, plan.time_detected = i, why
                break
            if normalised_name(info.name) in TIME_NAMES and i not in chosen:
                raise DatasetError(
                    f"{path}: {labels[i]} is named like a time column but holds "
                    f"{quoted(info.example or ', '.join(f'{x:g}' for x in info.values[:3]))} ({info.where or 'first rows'}): "
                    "neither ISO 8601 timestamps nor epoch seconds/milliseconds. Set dataset.time_column "
                    "to the time column, or to none to train on it as a feature"
                )
    if plan.time is not None:
        info = infos[plan.time]
        plan.time_zoned = info.zoned
        plan.time_kind = ("iso8601" if info.kind == "time" else "timestamp" if info.kind == "timestamp"
                          else epoch_kind(info.values[0] if len(info.values) else 0.0))
        plan.left_out.append({"column": labels[plan.time], "why": f"time index ({plan.time_detected})"})
    if infos and plan.time != 0 and 0 not in chosen and 0 not in excluded:
        is_index, start = _is_index(infos[0])
        if is_index:
            plan.index, plan.index_start = 0, start
            why = f"row index ({start}, {start + 1}, {start + 2}, ...)" if start is not None else "row index (integers)"
            plan.left_out.append({"column": labels[0], "why": why})
    text = []
    for i, info in enumerate(infos):
        if i in (plan.time, plan.index):
            continue
        if i in excluded:
            plan.left_out.append({"column": labels[i], "why": "dataset.exclude_columns"})
        elif chosen and i not in chosen:
            plan.left_out.append({"column": labels[i], "why": "not in dataset.columns"})
        elif info.kind in ("text",) + TIME_KINDS:
            text.append(i)
        else:
            plan.features.append(i)
    mixed = [i for i in text if infos[i].mixed]
    if mixed:
        i = mixed[0]
        raise DatasetError(f"{path}: {infos[i].where}, {labels[i]}: {quoted(infos[i].example)} is not a number "
                           "(the column's other values are)")
    if text:
        shown = "; ".join(
            f"{labels[i]} holds {_what_text(infos[i])} "
            f"({quoted(infos[i].example)}{', ' + infos[i].where if infos[i].where else ''})" for i in text[:5]
        )
        # a name as the file spells it, if short, else the column's number; 20 at most (messages stay bounded)
        refs = ", ".join(infos[i].name.strip() if 0 < len((infos[i].name or "").strip()) <= 40 else str(i + 1)
                         for i in text[:20]) + (f", ... ({len(text)} columns)" if len(text) > 20 else "")
        raise DatasetError(
            f"{path}: {shown}{'; ...' if len(text) > 5 else ''}. Only numbers can be features: leave "
            f"{'it' if len(text) == 1 else 'them'} out with dataset.exclude_columns: [{refs}] "
            f"(in the conffile, or in a sidecar {dataset_stem(path)}.yaml beside the dataset)"
        )
    if not plan.features:
        raise DatasetError(f"{path}: no feature column left ({'; '.join(d['column'] + ': ' + d['why'] for d in plan.left_out)})")
    return plan
