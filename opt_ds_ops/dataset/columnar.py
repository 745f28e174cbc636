"""Parquet (``.parquet``) and Arrow IPC (``.feather`` v2, ``.arrow`` file or stream) datasets.

What dataframe users and exporters write today, read with pyarrow. Numeric columns (integers,
floats, decimals, booleans as 0/1) become features; a timestamp or date column is the time index
(and a column named like one, see :mod:`opt_ds_ops.dataset.columns`); other columns (strings,
lists, ...) are refused naming them, unless the ``dataset:`` options leave them out. pandas'
index columns (``__index_level_0__``, from its metadata) are dropped, unless it is a time index.
Every record batch passes Arrow's full validation before any of its values is read.

**Budgets** before reading: rows x features x 4 bytes against ``job.max_matrix_bytes`` (Parquet
knows its rows; not for a training job, whose rows beyond the budget are converted into a ``.npy``
in its directory while the row groups are read, and streamed: :mod:`opt_ds_ops.dataset.core`) and
the columns read, decoded (8 bytes a value), against the decompressed-bytes limit; record batches
are counted against it again while they are read. Rows are converted to float64 in batches of
about 16 MiB.
"""

from __future__ import annotations

import numpy as np

from ..config.conffile import DatasetConfig
from .columns import ColumnInfo, ColumnPlan, is_iso_time, plan_columns
from .core import (
    LIMIT_KEYS, DatasetError, DatasetLimits, Float32Builder, TimeIndex, block_rows, clip, quoted, rows_where,
    too_many_rows,
)
from .timeindex import TimeCollector

SAMPLE_ROWS = 50


def _info(pa, name: str, typ, sample) -> ColumnInfo:
    """Describe one column from its Arrow type and its first values (a ChunkedArray or Array)."""
    t = pa.types
    if t.is_integer(typ) or t.is_floating(typ) or t.is_decimal(typ) or t.is_boolean(typ):
        values = np.asarray(sample.cast(pa.float64()).to_numpy(zero_copy_only=False), dtype=np.float64)
        return ColumnInfo(name, "number", values=values[np.isfinite(values)])
    if t.is_timestamp(typ) or t.is_date(typ):
        return ColumnInfo(name, "timestamp", example=str(typ))
    if t.is_string(typ) or t.is_large_string(typ):
        values = [v for v in sample.to_pylist() if v is not None]
        bad = next(((r, v) for r, v in enumerate(sample.to_pylist()) if v is not None and not is_iso_time(v)), None)
        if values and bad is None:
            return ColumnInfo(name, "time", example=values[0], zoned=values[0].rstrip().endswith(("Z", "UTC")))
        r, v = bad if bad else (0, "")
        return ColumnInfo(name, "text", example=v, where=f"row {r + 1}")
    return ColumnInfo(name, "text", example=f"values of type {typ}", where="")


def _validated(pa, path: str, batch):
    """Return ``batch`` once Arrow's full validation passed (``RecordBatch.validate(full=True)``:
    offsets within their buffers, UTF-8, dictionary indices, ...); raise DatasetError if not.

    An Arrow IPC file's buffers and offsets are the writer's word: a string offset past its buffer
    makes the first value read leave the file (SIGBUS or SIGSEGV on the memory map, or other bytes
    in a message). Nothing reads a value of a batch before this.
    """
    try:
        batch.validate(full=True)
    except pa.ArrowException as e:
        raise DatasetError(f"{path}: a record batch is not valid Arrow data ({clip(str(e))})") from None
    return batch


def _selected(batch, columns: list[str] | None):
    """Return ``batch`` with only ``columns`` (by name; None: all)."""
    return batch if columns is None else batch.select(columns)


def _open(pa, path: str, fmt: str):
    """Return (schema, rows or None, batches(columns) -> iterator of RecordBatch, uncompressed bytes(columns));
    ``batches(None, size)`` gives every column (names may repeat there: a select by name would fail)."""
    if fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(path)
        except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as e:
            raise DatasetError(f"{path}: not a readable Parquet file ({clip(str(e))})") from None
        md = pf.metadata

        def uncompressed(columns: list[str]) -> int:
            """Bytes the columns take decoded: 8 a value (float64/int64/timestamps; what they become here)."""
            return md.num_rows * 8 * len(columns)

        def batches(columns: list[str] | None, size: int):
            for b in pf.iter_batches(batch_size=size, columns=columns, use_threads=True):
                yield _validated(pa, path, b)

        return pf.schema_arrow, md.num_rows, batches, uncompressed
    source = pa.memory_map(path)
    try:
        reader = pa.ipc.open_file(source)
        count = reader.num_record_batches

        def batches(columns: list[str] | None, size: int):
            for i in range(count):
                yield _selected(_validated(pa, path, reader.get_batch(i)), columns)
    except pa.ArrowInvalid:
        try:
            source.seek(0)
            stream = pa.ipc.open_stream(source)
        except pa.ArrowInvalid as e:
            raise DatasetError(f"{path}: not an Arrow IPC file or stream (Feather v2); {clip(str(e))}") from None
        reader = stream
        seen: list = []  # a stream is read once: its first batch is kept for the second pass (the sample's)

        def batches(columns: list[str] | None, size: int):
            for b in seen:
                yield _selected(b, columns)
            for b in stream:
                b = _validated(pa, path, b)
                if not seen:
                    seen.append(b)
                yield _selected(b, columns)
    return reader.schema, None, batches, None


def load_columnar(path: str, fmt: str, limits: DatasetLimits, opts: DatasetConfig):
    """Return (float32 matrix, float64 offset, plan, TimeIndex or None, rows_where) of a Parquet or Arrow file.

    Raises DatasetError for: a file pyarrow cannot read, more than ``job.max_columns`` columns,
    duplicate names among the columns read, a column plan that fails (see
    :func:`opt_ds_ops.dataset.columns.plan_columns`), a missing value, a value beyond float32 and
    each breach of ``limits``.
    """
    import pyarrow as pa

    try:
        schema, rows, batches, uncompressed = _open(pa, path, fmt)
        if len(schema) > limits.max_columns:
            raise DatasetError(f"{path}: {len(schema)} columns; job.max_columns is {limits.max_columns}")
        names = list(schema.names)
        pandas_index = set((schema.pandas_metadata or {}).get("index_columns", []) if schema.metadata else [])
        pandas_index = {n for n in pandas_index if isinstance(n, str)}
        sample = next(iter(batches(None, SAMPLE_ROWS)), None)
        if sample is None:
            raise DatasetError(f"{path}: no rows")
        sample = sample.slice(0, SAMPLE_ROWS)
        infos = [_info(pa, n, schema.field(i).type, sample.column(i)) for i, n in enumerate(names)]
        dropped = []
        for i, n in enumerate(names):
            if n in pandas_index and infos[i].kind != "timestamp":
                infos[i] = ColumnInfo(n, "text", example="pandas index")
                dropped.append(n)
        keep = DatasetConfig(time_column=opts.time_column, columns=opts.columns,
                             exclude_columns=tuple(opts.exclude_columns) + tuple(dropped), time_order=opts.time_order)
        plan = plan_columns(path, infos, keep)
        for d in plan.left_out:
            if any(d["column"] == plan.labels[names.index(n)] for n in dropped):
                d["why"] = "pandas index"
        read = [names[i] for i in plan.features] + ([names[plan.time]] if plan.time is not None else [])
        dup = sorted({n for n in read if names.count(n) > 1})
        if dup:
            raise DatasetError(f"{path}: column name {quoted(dup[0])} appears {names.count(dup[0])} times; rename the columns")
        if rows is not None and limits.spill_dir is None:  # with a spill_dir the rows go to a .npy
            need = rows * len(plan.features) * 4
            if need > limits.max_matrix_bytes:
                raise DatasetError(f"{path}: {rows} rows of {len(plan.features)} features need {need} bytes as float32; "
                                   f"job.max_matrix_bytes is {limits.max_matrix_bytes}")
        if uncompressed is not None and uncompressed(read) > limits.max_decompressed_bytes:
            raise DatasetError(f"{path}: the columns read hold {uncompressed(read)} bytes decoded (8 a value); "
                               f"{LIMIT_KEYS} is {limits.max_decompressed_bytes}")
        return _read(pa, path, limits, plan, names, rows, batches, read)
    except DatasetError:
        raise
    except (pa.ArrowException, OSError, ValueError) as e:
        raise DatasetError(f"{path}: cannot read {fmt}: {clip(str(e))}") from None
    except KeyError as e:  # pyarrow has no array class for a crafted type id (fuzz: KeyError 21)
        raise DatasetError(f"{path}: cannot read {fmt}: a column of an unknown Arrow type (type id {clip(str(e))})") from None


def _read(pa, path, limits, plan: ColumnPlan, names, rows, batches, read):
    max_rows = limits.max_rows(len(plan.features))
    build = Float32Builder(path, len(plan.features), rows_where, rows=rows,
                           max_rows=max_rows if limits.spill_dir else max_rows + 1, column=plan.feature_label,
                           nan_is_missing=True, spill_dir=limits.spill_dir)
    times = TimeCollector(path, plan, rows_where) if plan.time is not None else None
    seen = 0
    for batch in batches(read, block_rows(len(plan.features))):
        seen += batch.nbytes
        if seen > limits.max_decompressed_bytes:
            raise DatasetError(f"{path}: more than {limits.max_decompressed_bytes} bytes of column data once "
                               f"decompressed; {LIMIT_KEYS} is {limits.max_decompressed_bytes}")
        if times is not None:
            times.add(batch.column(len(plan.features)), build.n)
        block = np.empty((batch.num_rows, len(plan.features)), dtype=np.float64)
        for j in range(len(plan.features)):
            block[:, j] = batch.column(j).cast(pa.float64()).to_numpy(zero_copy_only=False)
        build.add(block)
        if build.n > max_rows and not build.spilled:
            raise too_many_rows(path, max_rows, len(plan.features), limits)
    data, offset = build.finish()
    time: TimeIndex | None = times.finish(data.shape[0]) if times is not None else None
    return data, offset, plan, time, rows_where
