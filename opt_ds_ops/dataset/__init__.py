"""Datasets: telemetry files read into one 2-D float32 array, rows = samples, columns = metrics.

| format | read by | module |
|---|---|---|
| ``.csv .txt .tsv`` (``.gz``) | Arrow's CSV reader, dialect from the first lines | :mod:`.text` |
| ``.parquet .feather .arrow`` | pyarrow | :mod:`.columnar` |
| ``.npy .npz .pt`` | numpy; a ``torch.save`` archive's tensor without torch (:mod:`.torchfile`) | :mod:`.arrays` |

Tables (text, Parquet, Arrow) may carry a time column, a row index and text columns; which
columns are features is decided by :mod:`.columns` under the conffile's ``dataset:`` options
(:class:`opt_ds_ops.config.conffile.DatasetConfig`), overridable per dataset by a sidecar. The time
index is kept out of the features and its rows put in time order (:mod:`.timeindex`). Every
file that is not a usable numeric table raises :class:`DatasetError` naming the file, the line
(text) or row (arrays) and the column; the budgets of :class:`DatasetLimits` are checked before
the memory is spent. Precision and memory, and what a training job does with a dataset larger
than its budget (streamed from a ``.npy``, :mod:`.npyrows`): :mod:`.core`. The byte streams under
the text reader (budgets, line ends, chunks of whole lines): :mod:`.textstream`.
"""

from __future__ import annotations

import os
import zlib

from ..config.conffile import DatasetConfig, JobConfig
from .core import (
    ACCEPTED, ARRAY_SUFFIXES, COLUMNAR_SUFFIXES, TEXT_SUFFIXES, Dataset, DatasetError, DatasetLimits, SpillError,
    TimeIndex, all_constant, clip, constant_columns, dataset_stem, file_sha256,
)

__all__ = ["ACCEPTED", "Dataset", "DatasetError", "DatasetLimits", "SpillError", "TimeIndex", "dataset_stem",
           "file_sha256", "format_of", "load_dataset"]


def format_of(path: str) -> str:
    """Return ``text``, ``parquet``, ``feather``, ``arrow``, ``npy``, ``npz`` or ``pt`` from the
    file name; raise DatasetError for any other suffix."""
    low = path.lower()
    for s in TEXT_SUFFIXES:
        if low.endswith(s) or low.endswith(s + ".gz"):
            return "text"
    for s in COLUMNAR_SUFFIXES + ARRAY_SUFFIXES:
        if low.endswith(s):
            return s[1:]
    raise DatasetError(f"{path}: unknown dataset format (accepted: {ACCEPTED})")


def _select_array_columns(path: str, data, offset, opts: DatasetConfig):
    """Apply ``columns``/``exclude_columns`` (1-based numbers) to an array dataset's columns."""
    if opts.time_column.strip().casefold() not in ("auto", "none"):
        raise DatasetError(f"{path}: dataset.time_column is {opts.time_column!r}, but an array has no time column "
                           "(write a CSV, Parquet or Arrow file with a time column instead)")
    if not opts.columns and not opts.exclude_columns:
        return data, offset, [], None
    n = data.shape[1]

    def number(key: str, ref) -> int:
        text = str(ref).strip()
        if not text.isdigit() or not 1 <= int(text) <= n:
            raise DatasetError(f"{path}: dataset.{key} names {text!r}; an array's columns are numbers 1 to {n}")
        return int(text) - 1

    keep = [number("columns", r) for r in opts.columns] if opts.columns else list(range(n))
    drop = {number("exclude_columns", r) for r in opts.exclude_columns}
    keep = sorted(set(keep) - drop)
    if not keep:
        raise DatasetError(f"{path}: no feature column left after dataset.columns/exclude_columns")
    left_out = [{"column": f"column {i + 1}", "why": "dataset.exclude_columns" if i in drop else "not in dataset.columns"}
                for i in range(n) if i not in keep]
    import numpy as np

    if hasattr(data, "select"):  # opt_ds_ops.dataset.npyrows.NpyRows: the columns are picked as rows are read
        return data.select(keep), (offset[keep] if offset is not None else None), left_out, keep
    data = np.ascontiguousarray(np.asarray(data)[:, keep])
    return data, (offset[keep] if offset is not None else None), left_out, keep


def load_dataset(path: str, limits: DatasetLimits | None = None, options: DatasetConfig | None = None) -> Dataset:
    """Given a dataset path, return a validated :class:`Dataset` (float32, 2-D, >= 2 rows, finite).

    ``limits`` default to those of a default ``JobConfig()``, ``options`` (which columns; see
    :class:`opt_ds_ops.config.conffile.DatasetConfig`) to ``DatasetConfig()``. Raises DatasetError for:
    unknown format, unreadable or empty file, fewer than 2 rows, a non-numeric feature cell,
    ragged rows, a missing value, NaN or Inf, a value beyond float32's range, a time column that
    cannot be read or (``time_order: refuse``) is out of order, a wrong array rank or dtype, a
    pickled object, a record batch that fails Arrow's full validation, each breach of ``limits``
    and, with ``limits.refuse_constant`` (training), feature columns that are all constant (some
    constant among others are noted in ``notes``); SpillError (an OSError) when the ``.npy`` that a
    dataset over the matrix budget is converted to (``limits.spill_dir``) cannot be written.
    """
    from . import arrays, columnar, text
    from .timeindex import apply_time_order

    limits = limits or DatasetLimits.from_config(JobConfig())
    options = options or DatasetConfig()
    fmt = format_of(path)
    header, time, left_out, notes, feature_columns = None, None, [], [], None
    try:
        size = os.stat(path).st_size
        if fmt == "text":
            data, offset, plan, time, where = text.load_text(path, limits, options)
        elif fmt in ("parquet", "feather", "arrow"):
            data, offset, plan, time, where = columnar.load_columnar(path, fmt, limits, options)
        else:
            data, offset = arrays.load_array(path, fmt, limits)
            data, offset, left_out, feature_columns = _select_array_columns(path, data, offset, options)
            plan = None
    except (DatasetError, SpillError):
        raise
    except (OSError, EOFError, UnicodeDecodeError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
        raise DatasetError(f"{path}: cannot read: {clip(str(getattr(e, 'strerror', None) or e))}") from None
    if plan is not None:
        header, left_out, feature_columns = plan.feature_names(), plan.left_out, list(plan.features)
    if data.shape[0] < limits.min_rows:
        raise DatasetError(f"{path}: {data.shape[0]} row(s); at least {limits.min_rows} "
                           f"{'are needed to train' if limits.min_rows > 1 else 'is needed'}")
    if data.shape[1] < 1:
        raise DatasetError(f"{path}: no columns")
    if time is not None:
        data, notes = apply_time_order(path, data, time, options, where)
    if fmt != "npy" and hasattr(data, "select"):  # an opt_ds_ops.dataset.npyrows.NpyRows: spilled (see .core); say where
        notes = notes + [f"{data.shape[0]:,} rows x {data.shape[1]} features ({data.nbytes:,} bytes as float32) are "
                         f"over job.max_matrix_bytes ({limits.max_matrix_bytes:,}): converted while read into "
                         f"{data.path} and streamed from there (removed after training)"]
    ds = Dataset(path=path, format=fmt, data=data, header=header, size_bytes=size, offset=offset, time=time,
                 left_out=left_out, notes=notes, feature_columns=feature_columns)
    if limits.refuse_constant:
        _note_constant_columns(ds, options)
    return ds


def _note_constant_columns(ds: Dataset, options: DatasetConfig) -> None:
    """Raise DatasetError if every feature column of ``ds`` is constant; note those that are, if
    some, by name: the header's, else ``dataset.metric_names`` (a retrained version's history has
    no header: its names are the model's), else column numbers."""
    constant = constant_columns(ds.data)
    if len(constant) == ds.features:
        raise all_constant(ds.path, ds.features)
    if constant:
        labels = ds.metric_labels()
        if ds.header is None and options.metric_names and len(options.metric_names) == ds.features:
            labels = [str(n).strip() for n in options.metric_names]
        named = ", ".join(clip(labels[c], 40) for c in constant[:20]) + (", ..." if len(constant) > 20 else "")
        ds.notes.append(f"{len(constant)} of {ds.features} feature columns are constant ({named}): they carry no "
                        "signal here, and a change in them will stand out when scored")
