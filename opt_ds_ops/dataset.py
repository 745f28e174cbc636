"""Datasets: telemetry files read into one 2-D float32 array, rows = samples, columns = metrics.

Accepted: delimited text (``.csv .txt .tsv``, optionally ``.gz``; comma, semicolon, tab or
whitespace; optional header line; UTF-8 BOM, CRLF, trailing delimiter and blank lines tolerated),
``.npy`` (float32 memory-mapped), ``.npz`` (exactly one array) and ``.pt`` (a plain tensor, loaded
with ``torch.load(weights_only=True)``; nothing is ever unpickled). Everything else, and every
file that is not a clean numeric matrix, raises :class:`DatasetError` with the file, and the line
(text) or row (arrays) and column where that applies. Text is parsed by numpy's C reader
(``np.loadtxt``), not a Python loop.

**Budgets** (:class:`DatasetLimits`, from the conffile's ``job`` section) are checked before the
memory is spent, and a breach names the file, the config key and the numbers: text is counted
while it is read (``job.max_decompressed_bytes``, plain text too), its first line's fields before
anything is parsed (``job.max_columns``; a line may also not run past ``max_columns`` x 256
bytes), and rows are parsed only up to ``job.max_matrix_bytes`` // (4 x columns); an ``.npy`` header,
an ``.npz`` member's size and header and a ``.pt`` tensor's shape are checked before any data is
read, inflated or converted.

**Precision.** float32 keeps 24 bits: a column of 1e8 + N(0, 1) would lose its signal. Every source
that is not already float32 (text, float64 or integer arrays, ...) is read as float64, centred per
column by a float64 ``offset`` (the column means of its first block) and only then cast to
float32; :attr:`Dataset.offset` keeps that offset, so that ``data + offset`` (in float64) are the
file's values. A native float32 ``.npy`` is memory-mapped and ``.pt`` float32 used as is
(``offset`` None): their precision is already what the file holds.

**Memory** (text): the float32 matrix grows in place (``ndarray.resize``, a realloc: no second
copy) by 1.125x steps up to at most ``max_rows`` rows, and numpy parses into a float64 buffer of
at most ``_CHUNK_BYTES`` (16 MiB) at a time. The peak is the float32 matrix (up to 1.125x while it
grows, never past ``job.max_matrix_bytes``) plus about 16 MiB: measured with tracemalloc, 1.35x a
96 MB float32 matrix (750,000 x 32; the float32 parse before this was 1.10x). One ``np.loadtxt``
over the whole file with ``max_rows`` would allocate ``max_rows`` float64 rows up front: twice
``job.max_matrix_bytes``, whatever the file holds. Arrays that are converted (float64, integers,
...) need the float32 matrix plus one 16 MiB float64 block, besides the source where that is in
memory (a ``.pt`` tensor; a Fortran-ordered ``.npz`` member, read whole first).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import itertools
import os
import re
import warnings
import zipfile
import zlib
from dataclasses import dataclass

import numpy as np

from .config import JobConfig

TEXT_SUFFIXES = (".csv", ".txt", ".tsv")
ARRAY_SUFFIXES = (".npy", ".npz", ".pt")
ACCEPTED = ", ".join(TEXT_SUFFIXES + tuple(s + ".gz" for s in TEXT_SUFFIXES) + ARRAY_SUFFIXES)
_SNIFF_CHARS = 64 * 1024  # the first lines are read in pieces of this many characters
_FIELD_BYTES = 256  # average bytes a field may take: a line may hold max_columns x this (at least _SNIFF_CHARS)
_CHUNK_BYTES = 16 * 1024**2  # float64 rows parsed or converted at a time (bytes)
_READ_BYTES = 256 * 1024  # text read from the file at a time (bytes)
_GROWTH = 1.125  # the text matrix grows by this factor (a realloc, no copy): the most it overshoots
F32_MAX = float(np.finfo(np.float32).max)


class DatasetError(ValueError):
    """A dataset that cannot be used; the message says which file, where and why."""


@dataclass(frozen=True)
class DatasetLimits:
    """What reading one dataset may cost; each breach raises DatasetError naming its ``job.*`` key.

    ``max_decompressed_bytes``: bytes of text read (after gzip; plain text counts too) or of the
    ``.npz`` member. ``max_columns``: fields per row. ``max_matrix_bytes``: the float32 matrix,
    rows x columns x 4 bytes.
    """

    max_decompressed_bytes: int
    max_columns: int
    max_matrix_bytes: int

    @classmethod
    def from_config(cls, job_cfg: JobConfig) -> DatasetLimits:
        """Return the limits of the conffile's ``job`` section (the matrix: ``matrix_budget_bytes()``)."""
        return cls(
            max_decompressed_bytes=job_cfg.max_decompressed_bytes,
            max_columns=job_cfg.max_columns,
            max_matrix_bytes=job_cfg.matrix_budget_bytes(),
        )

    @property
    def max_line_bytes(self) -> int:
        """The longest line of text accepted (bytes): ``max_columns`` x 256, at least 64 KiB."""
        return max(_SNIFF_CHARS, self.max_columns * _FIELD_BYTES)

    def max_rows(self, columns: int) -> int:
        """Return the most rows of ``columns`` float32 values that fit ``max_matrix_bytes``."""
        return self.max_matrix_bytes // (4 * max(columns, 1))


@dataclass
class Dataset:
    """A loaded dataset.

    ``data`` is a C-contiguous or memory-mapped float32 array of shape (rows, features).
    ``offset`` is None when ``data`` holds the file's values as they are (a float32 source), else
    a (features,) float64 array: the file's values are ``data + offset``, computed in float64
    (see :meth:`values`); pass it on to :func:`opt_ds_ops.train.train` and
    :func:`opt_ds_ops.score.score_rows`. ``header`` holds the column names when the text file had
    a header line, else None. ``size_bytes``: the file's size on disk.
    """

    path: str
    format: str
    data: np.ndarray
    header: list[str] | None
    size_bytes: int
    offset: np.ndarray | None = None

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
    return root if ext.lower() in TEXT_SUFFIXES + ARRAY_SUFFIXES else base


def file_sha256(path: str, chunk_bytes: int = 1 << 20) -> str:
    """Return the hex sha256 of a file, read in chunks of chunk_bytes (bytes)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            h.update(chunk)
    return h.hexdigest()


def _format_of(path: str) -> str:
    low = path.lower()
    for s in TEXT_SUFFIXES:
        if low.endswith(s) or low.endswith(s + ".gz"):
            return "text"
    for s in ARRAY_SUFFIXES:
        if low.endswith(s):
            return s[1:]
    raise DatasetError(f"{path}: unknown dataset format (accepted: {ACCEPTED})")


def load_dataset(path: str, limits: DatasetLimits | None = None) -> Dataset:
    """Given a dataset path, return a validated :class:`Dataset` (float32, 2-D, >= 2 rows, finite).

    ``limits`` default to those of a default ``JobConfig()``. Raises DatasetError for: unknown
    format, unreadable or empty file, fewer than 2 rows, a non-numeric cell, ragged rows, NaN or
    Inf, a value beyond float32's range, a wrong array rank or dtype, a pickled object, and each
    breach of ``limits``.
    """
    if limits is None:
        limits = DatasetLimits.from_config(JobConfig())
    fmt = _format_of(path)
    header = None
    try:
        size = os.stat(path).st_size
        if fmt == "text":
            data, offset, header = _load_text(path, limits)
        else:
            data, offset = _load_array(path, fmt, limits)
    except DatasetError:
        raise
    except (OSError, EOFError, gzip.BadGzipFile, zlib.error, UnicodeDecodeError) as e:
        raise DatasetError(f"{path}: cannot read: {getattr(e, 'strerror', None) or e}") from None
    if data.shape[0] < 2:
        raise DatasetError(f"{path}: {data.shape[0]} row(s); at least 2 are needed to train")
    if data.shape[1] < 1:
        raise DatasetError(f"{path}: no columns")
    return Dataset(path=path, format=fmt, data=data, header=header, size_bytes=size, offset=offset)


def _block_rows(columns: int, itemsize: int = 8) -> int:
    """Rows per block so that one block of ``columns`` values of ``itemsize`` bytes is about _CHUNK_BYTES."""
    return max(1, _CHUNK_BYTES // (itemsize * max(columns, 1)))


def _check_finite(path: str, data: np.ndarray, where) -> None:
    """Raise DatasetError at the first NaN/Inf cell of a float32 array, in blocks (memmaps stay on disk)."""
    block = _block_rows(data.shape[1], 4)
    for start in range(0, data.shape[0], block):
        chunk = np.asarray(data[start : start + block])
        bad = ~np.isfinite(chunk)
        if bad.any():
            r, c = np.argwhere(bad)[0]
            raise DatasetError(f"{path}: {where(start + int(r))}, column {int(c) + 1}: value {chunk[r, c]} is not finite")


class _Float32Builder:
    """Collects float64 blocks of rows into one float32 (rows, D) matrix, centred by a float64 offset.

    The offset is the column mean of the first block added. Given ``rows`` the matrix is allocated
    once; without, it grows in place by _GROWTH (a realloc: no second copy), never past
    ``max_rows``. ``where(row)`` names a 0-based row in messages ("line 7", "row 7").
    """

    def __init__(self, path: str, columns: int, where, rows: int | None = None, max_rows: int | None = None):
        self.path, self.where, self.max_rows = path, where, max_rows
        self.out = np.empty((rows or 0, columns), dtype=np.float32)
        self.n = 0
        self.offset: np.ndarray | None = None

    def add(self, block: np.ndarray) -> None:
        """Append block, (k, D) float64; raise DatasetError at a NaN/Inf or a value beyond float32."""
        if len(block) == 0:
            return
        # NaN propagates through max and min: two passes without a temporary find NaN, Inf and overflow
        magnitude = np.maximum(np.abs(block.max(axis=0)), np.abs(block.min(axis=0)))
        if not (magnitude <= F32_MAX).all():
            r, c = (int(i) for i in np.argwhere(~(np.abs(block) <= F32_MAX))[0])
            v = block[r, c]
            what = f"value {v} is not finite" if not np.isfinite(v) else f"value {v:g} is beyond float32's range (+-{F32_MAX:g})"
            raise DatasetError(f"{self.path}: {self.where(self.n + r)}, column {c + 1}: {what}")
        if self.offset is None:
            self.offset = block.mean(axis=0)
        need = self.n + len(block)
        if need > self.out.shape[0]:
            cap = max(need, int(self.out.shape[0] * _GROWTH))
            self.out.resize((min(cap, self.max_rows) if self.max_rows else cap, self.out.shape[1]), refcheck=False)
        dest = self.out[self.n : need]
        with np.errstate(over="ignore"):
            np.subtract(block, self.offset, out=dest, casting="same_kind")
        if (magnitude + np.abs(self.offset) > F32_MAX).any() and not np.isfinite(dest).all():
            r, c = (int(i) for i in np.argwhere(~np.isfinite(dest))[0])
            raise DatasetError(
                f"{self.path}: {self.where(self.n + r)}, column {c + 1}: value {block[r, c]:.17g} lies "
                f"{block[r, c] - self.offset[c]:.6g} from the column's offset {self.offset[c]:.6g}, beyond float32's range"
            )
        self.n = need

    def finish(self) -> tuple[np.ndarray, np.ndarray | None]:
        """Return (the float32 matrix, exactly the rows added; the (D,) float64 offset or None if empty)."""
        if self.out.shape[0] != self.n:
            self.out.resize((self.n, self.out.shape[1]), refcheck=False)
        return self.out, self.offset


# ---------------------------------------------------------------------------------------- text


class _BoundedReader(io.RawIOBase):
    """A binary stream over ``raw`` that raises DatasetError once more than
    ``limits.max_decompressed_bytes`` were read from it, or a line runs past ``limits.max_line_bytes``.

    Counted at every read, so a gzip bomb or an endless line stops within one read buffer
    (_READ_BYTES) of the limit; ``raw`` is a file or a GzipFile (bytes after decompression).
    """

    def __init__(self, raw, path: str, limits: DatasetLimits):
        super().__init__()
        self._raw, self._path, self._limits = raw, path, limits
        self.bytes_read = 0
        self._line_bytes = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = self._raw.readinto(b)
        if not n:
            return n
        self.bytes_read += n
        lim = self._limits
        if self.bytes_read > lim.max_decompressed_bytes:
            raise DatasetError(
                f"{self._path}: more than {lim.max_decompressed_bytes} bytes of text"
                f"{' after decompression' if isinstance(self._raw, gzip.GzipFile) else ''}; "
                f"job.max_decompressed_bytes is {lim.max_decompressed_bytes}"
            )
        data = bytes(memoryview(b)[:n])
        end = max(data.rfind(b"\n"), data.rfind(b"\r"))
        self._line_bytes = self._line_bytes + n if end < 0 else n - end - 1
        if self._line_bytes > lim.max_line_bytes:
            raise DatasetError(
                f"{self._path}: a line longer than {lim.max_line_bytes} bytes; job.max_columns is {lim.max_columns} "
                f"(a line may take {_FIELD_BYTES} bytes a field, {_SNIFF_CHARS} at least)"
            )
        return n

    def close(self) -> None:
        try:
            self._raw.close()
        finally:
            super().close()


def _open_text(path: str, limits: DatasetLimits):
    """Open a text dataset (gzip by suffix) for reading through a :class:`_BoundedReader`."""
    raw = gzip.open(path, "rb") if path.lower().endswith(".gz") else open(path, "rb", buffering=0)
    bounded = io.BufferedReader(_BoundedReader(raw, path, limits), buffer_size=_READ_BYTES)
    f = io.TextIOWrapper(bounded, encoding="utf-8-sig", newline=None)
    f._CHUNK_SIZE = _READ_BYTES  # TextIOWrapper reads 8 KiB at a time by default: a Python-level readinto each
    return f


def _is_number(token: str) -> bool:
    try:
        float(token)
        return True
    except ValueError:
        return False


def _delimiter(line: str) -> str | None:
    """The delimiter a line uses: tab, else semicolon, else comma, else None (whitespace)."""
    return "\t" if "\t" in line else ";" if ";" in line else "," if "," in line else None


def _split(line: str, delim: str | None) -> list[str]:
    """Return the stripped fields of a line; a trailing delimiter's empty last field is dropped."""
    fields = [t.strip() for t in (line.split(delim) if delim else line.split())]
    if delim and len(fields) > 1 and fields[-1] == "":
        fields.pop()
    return fields


def _read_line(f, path: str, lineno: int, limits: DatasetLimits) -> str | None:
    """Return line ``lineno`` (1-based) of f with its newline, or None at the end of the file.

    Read in pieces of _SNIFF_CHARS characters; raise DatasetError as soon as the fields seen so far
    (under the delimiter they select) exceed ``limits.max_columns``, before the rest is read.
    """
    parts: list[str] = []
    tabs = semis = commas = words = 0
    while True:
        piece = f.readline(_SNIFF_CHARS)
        if not piece:
            break
        if parts and not parts[-1][-1:].isspace() and not piece[:1].isspace():
            words -= 1  # a word cut in two by the piece boundary
        parts.append(piece)
        if piece.endswith("\n"):
            break
        tabs, semis, commas = tabs + piece.count("\t"), semis + piece.count(";"), commas + piece.count(",")
        words += len(piece.split())
        seen = tabs + 1 if tabs else semis + 1 if semis else commas + 1 if commas else words
        if seen > limits.max_columns + 1:  # + 1: a trailing delimiter
            raise DatasetError(
                f"{path}: line {lineno} has more than {limits.max_columns} fields; job.max_columns is {limits.max_columns}"
            )
    return "".join(parts) if parts else None


def _check_columns(path: str, lineno: int, fields: list[str], limits: DatasetLimits) -> None:
    if len(fields) > limits.max_columns:
        raise DatasetError(
            f"{path}: line {lineno} has {len(fields)} fields; job.max_columns is {limits.max_columns}"
        )


_LOADTXT_ERR = re.compile(r"at row (\d+)(?:, column (\d+))?")
_COLS_CHANGED = re.compile(r"changed from (\d+) to (\d+)")
_COLS_MISSING = re.compile(r"invalid column index \d+ at row \d+ with (\d+) columns")  # with usecols


def _load_text(path: str, limits: DatasetLimits, row_cap: int | None = None):
    """Return (float32 matrix, float64 offset, header or None) of a text dataset.

    Lines before the data (blank lines, the header) and the first data line are read and checked
    here; the rest is parsed by ``np.loadtxt`` into float64 chunks of at most _CHUNK_BYTES, each
    checked and appended to a :class:`_Float32Builder`. ``row_cap``: stop after this many rows
    (set when the file ends in lines of spaces, which numpy reports as ragged rows).
    """
    with _open_text(path, limits) as f:
        lineno = 0
        while True:
            line = _read_line(f, path, lineno + 1, limits)
            if line is None:
                raise DatasetError(f"{path}: empty file (no data rows)")
            lineno += 1
            if line.strip():
                break
        sample = line.rstrip("\n")
        delim = _delimiter(sample)
        tokens = _split(sample, delim)
        _check_columns(path, lineno, tokens, limits)
        header, pending, skip = None, [line], lineno - 1
        if not all(_is_number(t) for t in tokens if t):
            header, pending, skip = tokens, [], lineno
            while (line := _read_line(f, path, lineno + 1, limits)) is not None:
                lineno += 1
                pending.append(line)
                if line.strip():
                    break
            else:
                raise DatasetError(f"{path}: empty file (no data rows)")
        first = _split(pending[-1].rstrip("\n"), delim)
        _check_columns(path, lineno, first, limits)
        ncols = len(first)
        raw_fields = len(pending[-1].rstrip("\n").split(delim)) if delim else ncols
        usecols = range(ncols) if raw_fields > ncols else None  # a trailing delimiter: drop the empty column
        if header is not None and len(header) != ncols:
            raise DatasetError(f"{path}: line {skip}: header has {len(header)} names but rows have {ncols} columns")

        def line_of(row: int) -> int:
            return _line_of_data_row(path, limits, skip, row, blank_if_spaces=delim is None)

        max_rows = limits.max_rows(ncols) + 1
        stop = min(max_rows, row_cap) if row_cap is not None else max_rows
        chunk_rows = _block_rows(ncols)
        build = _Float32Builder(path, ncols, lambda row: f"line {line_of(row)}", max_rows=max_rows)
        lines = itertools.chain(pending, f)
        while build.n < stop:
            want = min(chunk_rows, stop - build.n)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)  # "input contained no data": reported below
                    chunk = np.loadtxt(lines, delimiter=delim, dtype=np.float64, ndmin=2, usecols=usecols,
                                       comments=None, max_rows=want)
            except (DatasetError, UnicodeDecodeError):
                raise
            except ValueError as e:
                cap = _text_error(path, limits, e, build.n, ncols, line_of, tail_ok=row_cap is None)
                return _load_text(path, limits, row_cap=cap)
            if chunk.shape[0] == 0:
                break
            if chunk.shape[1] != ncols:  # this chunk's first row had another column count
                raise DatasetError(f"{path}: line {line_of(build.n)}: ragged rows: the number of columns "
                                   f"changes from {ncols} to {chunk.shape[1]}")
            build.add(chunk)
            if chunk.shape[0] < want:
                break
        if build.n >= max_rows:
            raise DatasetError(
                f"{path}: more than {max_rows - 1} rows of {ncols} columns; the float32 matrix would pass "
                f"job.max_matrix_bytes ({limits.max_matrix_bytes} bytes, {4 * ncols} bytes a row)"
            )
    data, offset = build.finish()
    if data.shape[0] == 0:
        raise DatasetError(f"{path}: empty file (no data rows)")
    return data, offset, header


def _text_error(path: str, limits: DatasetLimits, e: ValueError, rows_before: int, ncols: int, line_of,
                tail_ok: bool) -> int:
    """Turn np.loadtxt's ValueError for a chunk into a DatasetError naming the line (and column).

    numpy counts data rows of the chunk (empty lines skipped): 1-based for a column-count change,
    0-based for a bad cell. Lines holding only spaces at the end of an export count as rows with
    one empty field (ragged, or a bad cell when one starts a chunk): then, if ``tail_ok``, return
    the number of rows before them (the row cap to parse again with) instead of raising.
    """
    msg = str(e)
    m = _LOADTXT_ERR.search(msg)
    what = msg.split(" at row")[0]
    if m is None:
        raise DatasetError(f"{path}: {msg}") from None
    column = f", column {m.group(2)}" if m.group(2) else ""
    missing = _COLS_MISSING.search(msg)
    if missing:  # a trailing delimiter made numpy select columns: a short row is reported this way, 1-based
        row, column = rows_before + int(m.group(1)) - 1, ""
        what = f"ragged rows: the number of columns changes from {ncols} to {missing.group(1)}"
    elif "number of columns changed" in msg:
        row = rows_before + int(m.group(1)) - 1
        changed = _COLS_CHANGED.search(msg)
        if changed and int(changed.group(1)) != ncols:  # the chunk's first row is the odd one
            row, what = rows_before, f"the number of columns changed from {ncols} to {changed.group(1)}"
        what = "ragged rows: " + what.replace("the number of columns changed", "the number of columns changes")
        column = ""
    else:
        row = rows_before + int(m.group(1))
    lineno = line_of(row)
    if tail_ok and _only_blank_from(path, limits, lineno):
        return row
    raise DatasetError(f"{path}: line {lineno}{column}: {what}") from None


def _line_of_data_row(path: str, limits: DatasetLimits, skip: int, row: int, blank_if_spaces: bool) -> int:
    """Return the 1-based file line of 0-based data row ``row`` (error path only: a Python scan).

    numpy's reader skips empty lines without counting them; with the whitespace delimiter a line
    of spaces is empty too.
    """
    seen = -1
    with _open_text(path, limits) as f:
        for lineno, line in enumerate(f, 1):
            if lineno <= skip:
                continue
            text = line.rstrip("\r\n")
            if text and (text.strip() or not blank_if_spaces):
                seen += 1
                if seen == row:
                    return lineno
    return skip + row + 1


def _only_blank_from(path: str, limits: DatasetLimits, lineno: int) -> bool:
    """Return True if line lineno (1-based) exists and it and every later line hold only whitespace."""
    seen = 0
    with _open_text(path, limits) as f:
        for i, line in enumerate(f, 1):
            if i >= lineno:
                if line.strip():
                    return False
                seen += 1
    return seen > 0


# -------------------------------------------------------------------------------------- arrays


def _check_shape(path: str, what: str, shape: tuple, limits: DatasetLimits) -> None:
    """Raise DatasetError unless shape is (rows, columns) within job.max_columns and job.max_matrix_bytes."""
    if len(shape) != 2:
        raise DatasetError(f"{path}: {what} has rank {len(shape)} (shape {tuple(shape)}); need rows x metrics (rank 2)")
    rows, cols = (int(s) for s in shape)
    if cols > limits.max_columns:
        raise DatasetError(f"{path}: {what} of shape ({rows}, {cols}) has {cols} columns; "
                           f"job.max_columns is {limits.max_columns}")
    if rows * cols * 4 > limits.max_matrix_bytes:
        raise DatasetError(f"{path}: {what} of shape ({rows}, {cols}) needs {rows * cols * 4} bytes as float32; "
                           f"job.max_matrix_bytes is {limits.max_matrix_bytes}")


def _check_dtype(path: str, what: str, dtype: np.dtype, kind: str) -> None:
    if dtype.hasobject:
        raise DatasetError(f"{path}: not a plain numeric {kind} ({what} has dtype {dtype}, which needs pickle)")
    if dtype.kind not in "fiu" or dtype.itemsize > 8:
        raise DatasetError(f"{path}: {what} has dtype {dtype}; need a real number dtype (float or int)")


def _npy_header(f, path: str, kind: str) -> tuple[tuple, bool, np.dtype]:
    """Return (shape, fortran_order, dtype) from the .npy header at f's position (nothing else is read)."""
    try:
        version = np.lib.format.read_magic(f)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        return read(f)
    except ValueError as e:
        raise DatasetError(f"{path}: not a plain numeric {kind} ({e})") from None


def _rows_where(row: int) -> str:
    return f"row {row + 1}"


def _centred(path: str, shape: tuple, block_of) -> tuple[np.ndarray, np.ndarray | None]:
    """Return (float32, offset) of an array read as float64 blocks: ``block_of(start, stop)``."""
    rows, cols = shape
    build = _Float32Builder(path, cols, _rows_where, rows=rows)
    step = _block_rows(cols)
    for start in range(0, rows, step):
        build.add(block_of(start, min(start + step, rows)))
    return build.finish()


def _load_array(path: str, fmt: str, limits: DatasetLimits) -> tuple[np.ndarray, np.ndarray | None]:
    """Return (2-D float32 array, float64 offset or None) from .npy (memory-mapped), .npz or .pt."""
    if fmt == "npy":
        return _load_npy(path, limits)
    if fmt == "npz":
        return _load_npz(path, limits)
    return _load_pt(path, limits)


def _load_npy(path: str, limits: DatasetLimits) -> tuple[np.ndarray, np.ndarray | None]:
    with open(path, "rb") as f:
        shape, fortran, dtype = _npy_header(f, path, ".npy array")
    _check_dtype(path, "array", dtype, ".npy array")
    _check_shape(path, "array", shape, limits)
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError as e:
        raise DatasetError(f"{path}: not a plain numeric .npy array ({e})") from None
    if dtype == np.float32 and not fortran:
        _check_finite(path, arr, _rows_where)
        return arr, None
    return _centred(path, shape, lambda s, e: np.asarray(arr[s:e], dtype=np.float64))


def _read_exact(f, out: np.ndarray, path: str) -> None:
    """Fill out's bytes from stream f; raise DatasetError if f ends first."""
    view = memoryview(out.reshape(-1).view(np.uint8))
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise DatasetError(f"{path}: array data ends after {got} of {len(view)} bytes")
        got += n


def _load_npz(path: str, limits: DatasetLimits) -> tuple[np.ndarray, np.ndarray | None]:
    try:
        with zipfile.ZipFile(path) as z:
            infos = [i for i in z.infolist() if not i.is_dir()]
            names = [i.filename.removesuffix(".npy") for i in infos]
            if len(infos) != 1:
                raise DatasetError(f"{path}: .npz holds {len(names)} arrays ({', '.join(names) or 'none'}); need exactly one")
            info, what = infos[0], f"array '{names[0]}'"
            if info.file_size > limits.max_decompressed_bytes:
                raise DatasetError(f"{path}: {what} inflates to {info.file_size} bytes; "
                                   f"job.max_decompressed_bytes is {limits.max_decompressed_bytes}")
            with z.open(info) as m:
                shape, fortran, dtype = _npy_header(m, path, ".npz archive")
                _check_dtype(path, what, dtype, ".npz archive")
                _check_shape(path, what, shape, limits)
                rows, cols = shape
                if info.file_size < m.tell() + rows * cols * dtype.itemsize:
                    raise DatasetError(f"{path}: {what} is truncated ({info.file_size} bytes for shape {shape}, {dtype})")
                if dtype == np.float32 and not fortran:
                    out = np.empty(shape, dtype=np.float32)
                    _read_exact(m, out, path)
                    _check_finite(path, out, _rows_where)
                    return out, None
                if fortran:  # columns are contiguous: read the whole source (itemsize/4 x the matrix) first
                    src = np.empty(shape[::-1], dtype=dtype)
                    _read_exact(m, src, path)
                    return _centred(path, shape, lambda s, e: src.T[s:e].astype(np.float64))

                def block_of(start: int, stop: int) -> np.ndarray:
                    buf = np.empty((stop - start, cols), dtype=dtype)
                    _read_exact(m, buf, path)  # rows arrive in order: read each block once, as it streams
                    return buf.astype(np.float64)

                return _centred(path, shape, block_of)
    except DatasetError:
        raise
    except (zipfile.BadZipFile, zlib.error, EOFError, ValueError) as e:
        raise DatasetError(f"{path}: not a plain numeric .npz archive ({e})") from None


def _load_pt(path: str, limits: DatasetLimits) -> tuple[np.ndarray, np.ndarray | None]:
    import torch  # only here: reading text or .npy does not need torch

    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises UnpicklingError, RuntimeError, ... for non-tensor content
        raise DatasetError(f"{path}: not a plain tensor file (loaded with weights_only=True: {type(e).__name__})") from None
    if not isinstance(obj, torch.Tensor):
        raise DatasetError(f"{path}: .pt holds a {type(obj).__name__}, need a plain 2-D tensor")
    if obj.layout != torch.strided or obj.is_quantized:
        raise DatasetError(f"{path}: tensor has layout {obj.layout}{' (quantized)' if obj.is_quantized else ''}; need a dense tensor")
    if obj.is_complex() or obj.dtype == torch.bool:
        raise DatasetError(f"{path}: tensor has dtype {obj.dtype}; need a real number dtype")
    # before any copy: an expanded (stride 0) tensor of a few bytes on disk may claim any shape
    _check_shape(path, "tensor", tuple(obj.shape), limits)
    t = obj.detach()
    if t.dtype == torch.float32 and t.is_contiguous():
        arr = t.numpy()
        _check_finite(path, arr, _rows_where)
        return arr, None
    return _centred(path, tuple(t.shape), lambda s, e: t[s:e].to(torch.float64).numpy())
