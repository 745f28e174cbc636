"""What every dataset reader shares: the error, the limits, the result and the float32 matrix builder.

**Precision.** float32 keeps 24 bits: a column of 1e8 + N(0, 1) would lose its signal. Every source
that is not already float32 (text, Parquet, float64 or integer arrays, ...) is read as float64,
centred per column by a float64 ``offset`` (the column means of its first :data:`OFFSET_ROWS` rows,
all of a shorter file: the same rows give the same offset, whatever the text's line lengths or
the reader's block and batch boundaries, so the same model) and only then
cast to float32 (:class:`Float32Builder`); :attr:`Dataset.offset` keeps that offset, so that
``data + offset`` (in float64) are the file's values. A finite float64 beyond float32's range is
refused naming its row and column, before any training.

**Memory.** The float32 matrix grows in place (``ndarray.resize``, a realloc: no second copy) by
1.125x steps, never past ``job.max_matrix_bytes``, and readers hand it float64 blocks of about
``CHUNK_BYTES`` (16 MiB). Measured with tracemalloc for text: 1.35x the float32 matrix at the peak.

**Larger than the budget**. Given ``DatasetLimits.spill_dir`` (a training job's own
directory), a text, Parquet or Arrow dataset whose matrix outgrows ``job.max_matrix_bytes`` is not
refused: the rows read so far and every later block go, centred as above, into one float32
``.npy`` there (:data:`SPILL_FILE`, written once while the file is read), and the dataset's
``data`` is an :class:`opt_ds_ops.dataset.npyrows.NpyRows` over it, which the trainer streams. The memory
it costs stays at the budget; the disk, rows x columns x 4 bytes.
"""

from __future__ import annotations

import hashlib
import os
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Callable, Iterator

import numpy as np

from ..config.conffile import JobConfig
from .npyrows import NpyRows

TEXT_SUFFIXES = (".csv", ".txt", ".tsv")
ARRAY_SUFFIXES = (".npy", ".npz", ".pt")
COLUMNAR_SUFFIXES = (".parquet", ".feather", ".arrow")
ALL_SUFFIXES = TEXT_SUFFIXES + ARRAY_SUFFIXES + COLUMNAR_SUFFIXES
ACCEPTED = ", ".join(TEXT_SUFFIXES + tuple(s + ".gz" for s in TEXT_SUFFIXES) + COLUMNAR_SUFFIXES + ARRAY_SUFFIXES)
SNIFF_BYTES = 64 * 1024  # the shortest line limit, whatever job.max_columns says (bytes)
FIELD_BYTES = 256  # average bytes a field may take: a line may hold max_columns x this (at least SNIFF_BYTES)
CHUNK_BYTES = 16 * 1024**2  # float64 rows converted at a time (bytes)
_GROWTH = 1.125  # the matrix grows by this factor (a realloc, no copy): the most it overshoots
F32_MAX = float(np.finfo(np.float32).max)
SPILL_FILE = "converted.npy"  # the float32 .npy a dataset over the matrix budget is written to, in spill_dir
_SPILL_HEADER_BYTES = 128  # a fixed .npy header (format 1.0, 64-byte aligned) holds any final shape
QUOTE_CHARS = 200  # the most characters of a file's content (a cell, a name, a library's message) one error quotes
LIMIT_KEYS = "job.max_decompressed_bytes (or spool.max_dataset_bytes, if smaller)"  # the decompressed-bytes limit, in messages


class DatasetError(ValueError):
    """A dataset that cannot be used; the message says which file, where (line or row, column) and why."""


@dataclass(frozen=True)
class DatasetLimits:
    """What reading one dataset may cost; each breach raises DatasetError naming its ``job.*`` key.

    ``max_decompressed_bytes``: bytes of text read (after gzip; plain text counts too), of an
    ``.npz`` member, or of Parquet/Arrow column data once decompressed. ``max_columns``: fields per
    row. ``max_matrix_bytes``: the float32 matrix, rows x columns x 4 bytes.
    """

    max_decompressed_bytes: int
    max_columns: int
    max_matrix_bytes: int
    # A C-ordered .npy whose matrix exceeds max_matrix_bytes is opened for streaming
    # (opt_ds_ops.dataset.npyrows.NpyRows) instead of refused; jobs set it, scoring does not
    stream_large_npy: bool = False
    # Where a text/Parquet/Arrow dataset over max_matrix_bytes is converted to a float32
    # .npy (SPILL_FILE) and streamed instead of refused; None: refused (scoring, and where unset)
    spill_dir: str | None = None
    # A dataset whose feature columns are all constant is refused (nothing to learn) and
    # constant columns among others are noted; training jobs set it, scoring (flat new data) does not
    refuse_constant: bool = False
    # The fewest rows accepted: 2 to train (BatchNorm), 1 for a chunk of a scored series
    min_rows: int = 2

    @classmethod
    def from_config(cls, job_cfg: JobConfig, max_dataset_bytes: int | None = None, *,
                    stream_large_npy: bool = False, spill_dir: str | None = None,
                    base_bytes: int = 0, refuse_constant: bool = False) -> DatasetLimits:
        """Return the limits of the conffile's ``job`` section (the matrix: ``matrix_budget_bytes(base_bytes)``,
        ``base_bytes`` being what the job's process holds already, see
        :func:`opt_ds_ops.config.sizes.data_segment_bytes`).

        ``max_dataset_bytes`` (``spool.max_dataset_bytes``) also bounds the decompressed bytes: a
        9.6 KB ``.csv.gz`` that inflates to 3.8 MB passes a 1 MB limit on the file's size only.
        """
        inflated = job_cfg.max_decompressed_bytes
        return cls(
            max_decompressed_bytes=min(inflated, max_dataset_bytes) if max_dataset_bytes else inflated,
            max_columns=job_cfg.max_columns,
            max_matrix_bytes=job_cfg.matrix_budget_bytes(base_bytes),
            stream_large_npy=stream_large_npy,
            spill_dir=spill_dir,
            refuse_constant=refuse_constant,
        )

    @property
    def max_line_bytes(self) -> int:
        """The longest line of text accepted (bytes): ``max_columns`` x 256, at least 64 KiB."""
        return max(SNIFF_BYTES, self.max_columns * FIELD_BYTES)

    def max_rows(self, columns: int) -> int:
        """Return the most rows of ``columns`` float32 values that fit ``max_matrix_bytes``."""
        return self.max_matrix_bytes // (4 * max(columns, 1))


def clip(text: str, limit: int = QUOTE_CHARS) -> str:
    """Return ``text`` cut to ``limit`` characters, saying how long it was when cut."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def quoted(value) -> str:
    """Return ``repr(value)`` of a file's cell or name cut to :data:`QUOTE_CHARS` characters, for messages."""
    text = str(value)
    return repr(text) if len(text) <= QUOTE_CHARS else f"{text[:QUOTE_CHARS]!r}... ({len(text)} characters)"


def iso_utc(seconds: float) -> str:
    """Return epoch seconds as ISO 8601 UTC with microseconds: ``2024-05-18T00:00:00.000000Z``."""
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class TimeIndex:
    """A dataset's time column, kept out of the features.

    ``seconds``: (rows,) float64 epoch seconds (UTC) in the rows' final order. ``column``: its
    header name (or ``column N``); ``kind``: how it was read (``iso8601``, ``epoch_s``,
    ``epoch_ms``, ``epoch_us``, ``epoch_ns``, ``timestamp`` for a typed Parquet/Arrow column);
    ``detected``: why it was taken as the time index. ``sorted_rows``: how many rows changed
    place when the rows were sorted by time (0: the file was in order); ``order``: then the
    (rows,) int64 permutation applied (row i of the dataset is row ``order[i]`` of the file),
    else None. ``shared_times``: rows whose time equals the row before's (several series
    interleaved, such as one nvidia-smi line per GPU).
    """

    column: str
    kind: str
    detected: str
    seconds: np.ndarray
    sorted_rows: int = 0
    order: np.ndarray | None = None
    shared_times: int = 0

    def summary(self) -> dict:
        """Return metadata.json's ``dataset.time``: first/last (ISO UTC), median step (seconds),
        gaps (steps longer than 3 median steps), duplicate times and the rows sorted."""
        t = self.seconds
        steps = np.diff(t)
        median = float(np.median(steps)) if len(steps) else None
        return {
            "column": self.column,
            "kind": self.kind,
            "detected": self.detected,
            "first": iso_utc(float(t[0])) if len(t) else None,
            "last": iso_utc(float(t[-1])) if len(t) else None,
            "median_step_s": round(median, 6) if median is not None else None,
            "gaps": int((steps > 3 * median).sum()) if median else 0,
            "duplicate_times": int((steps == 0).sum()),  # several series interleaved, when many
            "rows_sorted": self.sorted_rows,
        }


@dataclass
class Dataset:
    """A loaded dataset.

    ``data`` is a C-contiguous or memory-mapped float32 array of shape (rows, features).
    ``offset`` is None when ``data`` holds the file's values as they are (a float32 source), else
    a (features,) float64 array: the file's values are ``data + offset``, computed in float64
    (see :meth:`values`); pass it on to :func:`opt_ds_ops.training.fit.train` and
    :func:`opt_ds_ops.model.detection.score_rows`. ``header`` holds the feature columns' names when the
    file names its columns (a header line, Parquet, Arrow), else None. ``time`` is the time
    index (None without one). ``left_out`` lists the file's columns that are not features, each
    ``{"column": name, "why": ...}``; ``notes`` are what a person should know (rows sorted, ...).
    ``feature_columns``: the 0-based file columns the features come from (None: all, in order).
    ``size_bytes``: the file's size on disk.
    """

    path: str
    format: str
    data: np.ndarray
    header: list[str] | None
    size_bytes: int
    offset: np.ndarray | None = None
    time: TimeIndex | None = None
    left_out: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    feature_columns: list[int] | None = None

    @property
    def rows(self) -> int:
        return int(self.data.shape[0])

    @property
    def features(self) -> int:
        return int(self.data.shape[1])

    @property
    def name(self) -> str:
        """The dataset's stem: ``machine-1-2.txt.gz`` -> ``machine-1-2``."""
        return dataset_stem(self.path)

    def metric_labels(self) -> list[str]:
        """Return each feature's name: its header name, else its 1-based column number in the file
        (as errors and ``dataset.exclude_columns`` count them)."""
        if self.header is not None and len(self.header) == self.features:
            return [str(h) for h in self.header]
        cols = self.feature_columns if self.feature_columns is not None else range(self.features)
        return [str(c + 1) for c in cols]

    def values(self) -> np.ndarray:
        """Return the file's values, (rows, features) float64: ``data + offset`` (a new array, 2x data)."""
        out = np.asarray(self.data, dtype=np.float64).copy()
        if self.offset is not None:
            out += self.offset
        return out


def dataset_stem(path: str) -> str:
    """Return the file name without its dataset suffixes (``.gz`` and then one format suffix)."""
    base = os.path.basename(path)
    if base.lower().endswith(".gz"):
        base = base[:-3]
    root, ext = os.path.splitext(base)
    return root if ext.lower() in ALL_SUFFIXES else base


def file_sha256(path: str, chunk_bytes: int = 1 << 20) -> str:
    """Return the hex sha256 of a file, read in chunks of chunk_bytes (bytes)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            h.update(chunk)
    return h.hexdigest()


def block_rows(columns: int, itemsize: int = 8) -> int:
    """Rows per block so that one block of ``columns`` values of ``itemsize`` bytes is about CHUNK_BYTES."""
    return max(1, CHUNK_BYTES // (itemsize * max(columns, 1)))


def rows_where(row: int) -> str:
    """Name a 0-based array row in messages: ``row 7`` is the 7th row."""
    return f"row {row + 1}"


def number_column(c: int) -> str:
    """Name a 0-based column in messages: ``column 3`` is the 3rd."""
    return f"column {c + 1}"


def check_finite(path: str, data: np.ndarray, where: Callable[[int], str]) -> None:
    """Raise DatasetError at the first NaN/Inf cell of a float32 array, in blocks (memmaps stay on disk)."""
    step = block_rows(data.shape[1], 4)
    for start in range(0, data.shape[0], step):
        chunk = np.asarray(data[start : start + step])
        bad = ~np.isfinite(chunk)
        if bad.any():
            r, c = np.argwhere(bad)[0]
            raise DatasetError(f"{path}: {where(start + int(r))}, column {int(c) + 1}: value {chunk[r, c]} is not finite")


def constant_columns(data) -> list[int]:
    """Return the 0-based columns of ``data`` (rows, D) float32 (an array, a memmap or an
    :class:`opt_ds_ops.dataset.npyrows.NpyRows`) whose every value equals the first row's; read in blocks
    of about CHUNK_BYTES, stopping as soon as every column has varied."""
    rows, cols = data.shape
    first = np.asarray(data[0:1])[0]
    varies = np.zeros(cols, dtype=bool)
    step = block_rows(cols, 4)
    for start in range(0, rows, step):
        varies |= (np.asarray(data[start : start + step]) != first).any(axis=0)
        if varies.all():
            break
    return [int(c) for c in np.flatnonzero(~varies)]


def all_constant(path: str, columns: int) -> DatasetError:
    """Return the error for a dataset whose ``columns`` feature columns hold one value each."""
    return DatasetError(f"{path}: every feature column is constant ({columns} column{'s' if columns != 1 else ''}, "
                        "each one value in every row): there is nothing to learn from; a model of it would flag "
                        "any change. Check the export (a stuck collector, a filled placeholder)")


def read_exact(f, out: np.ndarray, path: str) -> None:
    """Fill out's bytes from stream f; raise DatasetError if f ends first. A zip member's readinto
    reads its whole request into bytes first, so each request is at most 1 MiB (a 64 MiB .npz
    member took 129 MiB when asked for at once)."""
    view = memoryview(out.reshape(-1).view(np.uint8))
    got = 0
    while got < len(view):
        n = f.readinto(view[got:got + (1 << 20)])
        if not n:
            raise DatasetError(f"{path}: array data ends after {got} of {len(view)} bytes")
        got += n


MAX_ZIP_DIRECTORY = 1 << 20  # bytes: a .npz of one array or a .pt of one tensor lists a handful of members


class _BoundedReads:
    """A file whose reads are refused over ``limit`` bytes while the limit is set (zipfile reads an
    archive's whole central directory in one read, then builds an object per entry)."""

    def __init__(self, f, path: str, limit: int | None):
        self._f, self._path, self.limit = f, path, limit

    def read(self, n: int = -1) -> bytes:
        if self.limit is not None:
            want = n if n is not None and n >= 0 else os.fstat(self._f.fileno()).st_size - self._f.tell()
            if want > self.limit:
                raise DatasetError(f"{self._path}: its zip directory reads {want} bytes at once; a dataset's lists "
                                   f"a few members (at most {self.limit} bytes)")
        return self._f.read(n)

    def __getattr__(self, name: str):
        return getattr(self._f, name)


@contextmanager
def open_zip(path: str) -> Iterator[zipfile.ZipFile]:
    """``zipfile.ZipFile`` of ``path``, its central directory at most :data:`MAX_ZIP_DIRECTORY`
    bytes: zipfile builds an object per entry before a member can be checked (1M entries of one
    byte, a 47 MB file, took 480 MB)."""
    with open(path, "rb") as f:
        bounded = _BoundedReads(f, path, MAX_ZIP_DIRECTORY)
        with zipfile.ZipFile(bounded) as z:
            bounded.limit = None  # the members' own sizes are checked by their readers
            yield z


def check_shape(path: str, what: str, shape: tuple, limits: DatasetLimits) -> None:
    """Raise DatasetError unless shape is (rows, columns) within job.max_columns and job.max_matrix_bytes."""
    if len(shape) != 2:
        raise DatasetError(f"{path}: {what} has rank {len(shape)} (shape {clip(str(tuple(shape)))}); "
                           "need rows x metrics (rank 2)")
    rows, cols = (int(s) for s in shape)
    if rows < 0 or cols < 0:
        raise DatasetError(f"{path}: {what} has a negative dimension (shape {tuple(shape)})")
    if cols == 0:  # before any loop over its rows: (2**58, 0) passes every byte budget
        raise DatasetError(f"{path}: {what} of shape ({rows}, 0) has no columns")
    if cols > limits.max_columns:
        raise DatasetError(f"{path}: {what} of shape ({rows}, {cols}) has {cols} columns; "
                           f"job.max_columns is {limits.max_columns}")
    if rows * cols * 4 > limits.max_matrix_bytes:
        raise DatasetError(f"{path}: {what} of shape ({rows}, {cols}) needs {rows * cols * 4} bytes as float32; "
                           f"job.max_matrix_bytes is {limits.max_matrix_bytes}")


def too_many_rows(path: str, max_rows: int, columns: int, limits: DatasetLimits) -> DatasetError:
    """Return the error for a dataset with more than ``max_rows`` rows of ``columns`` features."""
    return DatasetError(
        f"{path}: more than {max_rows} rows of {columns} columns; the float32 matrix would pass "
        f"job.max_matrix_bytes ({limits.max_matrix_bytes} bytes, {4 * columns} bytes a row)"
    )


def _magnitude(path: str, block: np.ndarray, row0: int, where: Callable[[int], str], column: Callable[[int], str],
               nan_is_missing: bool) -> np.ndarray:
    """Return the (D,) largest |value| of each column of ``block`` (k, D) float64, whose first row
    is row ``row0``; raise DatasetError at its first NaN, Inf or value beyond float32's range."""
    # NaN propagates through max and min: two passes without a temporary find NaN, Inf and overflow
    magnitude = np.maximum(np.abs(block.max(axis=0)), np.abs(block.min(axis=0)))
    if not (magnitude <= F32_MAX).all():
        r, c = (int(i) for i in np.argwhere(~(np.abs(block) <= F32_MAX))[0])
        v = block[r, c]
        what = ("a missing value (empty, NA or NaN)" if np.isnan(v) and nan_is_missing
                else f"value {v} is not finite" if not np.isfinite(v)
                else f"value {v:g} is beyond float32's range (+-{F32_MAX:g})")
        raise DatasetError(f"{path}: {where(row0 + r)}, {column(c)}: {what}")
    return magnitude


def _refuse_far_from_offset(path: str, block: np.ndarray, magnitude: np.ndarray, offset: np.ndarray, dest: np.ndarray,
                            row0: int, where: Callable[[int], str], column: Callable[[int], str]) -> None:
    """Raise DatasetError if a value of ``block`` centred by ``offset`` (``dest``, float32) left float32's range."""
    if (magnitude + np.abs(offset) > F32_MAX).any() and not np.isfinite(dest).all():
        r, c = (int(i) for i in np.argwhere(~np.isfinite(dest))[0])
        raise DatasetError(
            f"{path}: {where(row0 + r)}, {column(c)}: value {block[r, c]:.17g} lies "
            f"{block[r, c] - offset[c]:.6g} from the column's offset {offset[c]:.6g}, beyond float32's range"
        )


def check_float32(path: str, block: np.ndarray, offset: np.ndarray, row0: int, where: Callable[[int], str]) -> None:
    """Raise DatasetError where :class:`Float32Builder` would refuse ``block`` (k, D) float64 of rows
    ``row0``..., centred by ``offset``: a NaN/Inf, a value beyond float32 or beyond it from the offset."""
    magnitude = _magnitude(path, block, row0, where, number_column, False)
    if (magnitude + np.abs(offset) > F32_MAX).any():
        with np.errstate(over="ignore"):
            dest = (block - offset).astype(np.float32)
        _refuse_far_from_offset(path, block, magnitude, offset, dest, row0, where, number_column)


OFFSET_ROWS = 1024  # a dataset's offset: the column means of its first this many rows


def offset_of(first_rows: np.ndarray) -> np.ndarray:
    """The float64 offset of a dataset whose first rows (float64, at least :data:`OFFSET_ROWS` of them
    or all there are) are ``first_rows``: their column means, the same whatever blocks they came in."""
    return first_rows[:OFFSET_ROWS].mean(axis=0)


class Float32Builder:
    """Collects float64 blocks of rows into one float32 (rows, D) matrix, centred by a float64 offset.

    The offset is :func:`offset_of` the first :data:`OFFSET_ROWS` rows added (blocks are held
    until that many have come, or :meth:`finish`). Given ``rows`` the matrix is allocated
    once; without, it grows in place by 1.125x (a realloc: no second copy), never past
    ``max_rows``. ``where(row)`` names a 0-based row in messages ("line 7", "row 7");
    ``column(c)`` names a 0-based feature column (default "column 3"). ``nan_is_missing``: a
    NaN is reported as a missing value (tabular readers turn empty and NA cells into NaN).

    ``spill_dir``: when the rows would pass ``max_rows``, they go on into ``spill_dir/SPILL_FILE``
    instead (see the module docstring): :attr:`spilled` turns true, memory is freed, and
    :meth:`finish` returns an :class:`opt_ds_ops.dataset.npyrows.NpyRows`. Writing it raises
    :class:`SpillError` (an OSError keeping its errno: ENOSPC, EDQUOT, ...).
    """

    def __init__(self, path: str, columns: int, where: Callable[[int], str], rows: int | None = None,
                 max_rows: int | None = None, column: Callable[[int], str] = number_column,
                 nan_is_missing: bool = False, spill_dir: str | None = None):
        self.path, self.where, self.max_rows, self.column = path, where, max_rows, column
        self.nan_is_missing = nan_is_missing
        if rows is not None and max_rows is not None:
            rows = min(rows, max_rows)  # a spilling builder never holds more than max_rows in memory
        self.out = np.empty((rows or 0, columns), dtype=np.float32)
        self._n = 0  # rows in the matrix (or the spill file)
        self.offset: np.ndarray | None = None
        self.spill_dir = spill_dir if max_rows else None
        self._spill = None  # the open SPILL_FILE once spilling
        self._held: list[np.ndarray] = []  # the first blocks, until OFFSET_ROWS rows fix the offset
        self._held_rows = 0
        self._offset_rows = min(OFFSET_ROWS, max_rows) if max_rows else OFFSET_ROWS

    @property
    def spilled(self) -> bool:
        """True once the rows go to ``spill_dir`` (the matrix outgrew ``max_rows``)."""
        return self._spill is not None

    @property
    def n(self) -> int:
        """Rows added so far (those held for the offset among them)."""
        return self._n + self._held_rows

    def add(self, block: np.ndarray) -> None:
        """Append block, (k, D) float64; raise DatasetError at a NaN/Inf or a value beyond float32,
        SpillError if the spill file cannot be written."""
        if len(block) == 0:
            return
        if self.offset is None:
            _magnitude(self.path, block, self.n, self.where, self.column, self.nan_is_missing)
            self._held.append(block)
            self._held_rows += len(block)
            if self._held_rows >= self._offset_rows:
                self._settle()
            return
        self._append(block)

    def _settle(self) -> None:
        """Fix the offset from the held blocks' first rows (:func:`offset_of`) and add them."""
        held, self._held, self._held_rows = self._held, [], 0
        first = np.concatenate(held)[: self._offset_rows] if len(held) > 1 else held[0][: self._offset_rows]
        self.offset = offset_of(first)
        for block in held:
            self._append(block)

    def _append(self, block: np.ndarray) -> None:
        if self.max_rows and self._n + len(block) > self.max_rows and not self.spilled:
            if self.spill_dir is not None:
                self._start_spill()
            else:
                block = block[: self.max_rows - self._n]  # the rows past max_rows are never kept: the caller refuses
        if len(block) == 0:
            return
        magnitude = _magnitude(self.path, block, self._n, self.where, self.column, self.nan_is_missing)
        need = self._n + len(block)
        if self.spilled:
            dest = np.empty((len(block), self.out.shape[1]), dtype=np.float32)
        else:
            if need > self.out.shape[0]:
                cap = max(need, int(self.out.shape[0] * _GROWTH))
                self.out.resize((min(cap, self.max_rows) if self.max_rows else cap, self.out.shape[1]), refcheck=False)
            dest = self.out[self._n : need]
        with np.errstate(over="ignore"):
            np.subtract(block, self.offset, out=dest, casting="same_kind")
        _refuse_far_from_offset(self.path, block, magnitude, self.offset, dest, self._n, self.where, self.column)
        if self.spilled:
            self._write(dest)
        self._n = need

    def _start_spill(self) -> None:
        """Open SPILL_FILE (a header with room for any shape, then the rows held so far); free them."""
        target = os.path.join(self.spill_dir, SPILL_FILE)
        try:
            os.makedirs(self.spill_dir, mode=0o700, exist_ok=True)
            self._spill = open(target, "wb")
            self._spill.write(_npy_header(0, self.out.shape[1]))
        except OSError as e:
            raise SpillError(e.errno, f"cannot write {target}: {e.strerror or e}") from None
        self._write(self.out[: self._n])
        self.out = np.empty((0, self.out.shape[1]), dtype=np.float32)

    def _write(self, rows: np.ndarray) -> None:
        if not len(rows):
            return
        try:
            self._spill.write(memoryview(np.ascontiguousarray(rows)).cast("B"))
        except OSError as e:
            raise SpillError(e.errno, f"cannot write {self._spill.name}: {e.strerror or e}") from None

    def finish(self):
        """Return (the float32 matrix, exactly the rows added; the (D,) float64 offset or None if
        empty). Spilled: the matrix is an :class:`opt_ds_ops.dataset.npyrows.NpyRows` over the completed,
        fsynced SPILL_FILE."""
        if self._held:
            self._settle()
        if self.spilled:

            f, self._spill = self._spill, None
            try:
                with f:
                    f.seek(0)
                    f.write(_npy_header(self._n, self.out.shape[1]))
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as e:
                raise SpillError(e.errno, f"cannot write {f.name}: {e.strerror or e}") from None
            return NpyRows(f.name, (self._n, self.out.shape[1]), np.dtype(np.float32), _SPILL_HEADER_BYTES), self.offset
        if self.out.shape[0] != self._n:
            self.out.resize((self._n, self.out.shape[1]), refcheck=False)
        return self.out, self.offset


class SpillError(OSError):
    """The ``.npy`` that a dataset over the matrix budget is converted to could not be written
    (errno kept: ENOSPC, EDQUOT, EROFS, EIO): a storage problem, not the dataset's."""


def _npy_header(rows: int, columns: int) -> bytes:
    """A .npy format 1.0 header of exactly _SPILL_HEADER_BYTES for a C-ordered little-endian
    float32 (rows, columns) array (numpy's layout: magic, version, header length, a dict padded
    with spaces to a 64-byte boundary, newline; numpy.lib.format)."""
    text = "{'descr': '<f4', 'fortran_order': False, 'shape': (%d, %d), }" % (rows, columns)
    body = text.encode("latin1").ljust(_SPILL_HEADER_BYTES - 10 - 1) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(body).to_bytes(2, "little") + body
