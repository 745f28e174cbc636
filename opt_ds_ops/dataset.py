"""Datasets: telemetry files read into one 2-D float32 array, rows = samples, columns = metrics.

Accepted: delimited text (``.csv .txt .tsv``, optionally ``.gz``; comma, semicolon, tab or
whitespace; optional header line; UTF-8 BOM, CRLF, trailing delimiter and blank lines tolerated),
``.npy`` (memory-mapped), ``.npz`` (exactly one array) and ``.pt`` (a plain tensor, loaded with
``torch.load(weights_only=True)``; nothing is ever unpickled). Everything else, and every file that
is not a clean numeric matrix, raises :class:`DatasetError` with the file, and the line and column
where that applies. Text is parsed by numpy's C reader (``np.loadtxt``), not a Python loop.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import re
import warnings
import zlib
from dataclasses import dataclass

import numpy as np

TEXT_SUFFIXES = (".csv", ".txt", ".tsv")
ARRAY_SUFFIXES = (".npy", ".npz", ".pt")
ACCEPTED = ", ".join(TEXT_SUFFIXES + tuple(s + ".gz" for s in TEXT_SUFFIXES) + ARRAY_SUFFIXES)
_SNIFF_BYTES = 64 * 1024


class DatasetError(ValueError):
    """A dataset that cannot be used; the message says which file, where and why."""


@dataclass
class Dataset:
    """A loaded dataset.

    ``data`` is a C-contiguous or memory-mapped float32 array of shape (rows, features).
    ``header`` holds the column names when the text file had a header line, else None.
    """

    path: str
    format: str
    data: np.ndarray
    header: list[str] | None
    size_bytes: int

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


def load_dataset(path: str) -> Dataset:
    """Given a dataset path, return a validated :class:`Dataset` (float32, 2-D, >= 2 rows, finite).

    Raises DatasetError for: unknown format, unreadable or empty file, fewer than 2 rows,
    a non-numeric cell, ragged rows, NaN or Inf, a wrong array rank or dtype, a pickled object.
    """
    fmt = _format_of(path)
    try:
        size = os.stat(path).st_size
        if fmt == "text":
            data, header, line_of = _load_text(path)
        else:
            data, header, line_of = _load_array(path, fmt), None, None
    except DatasetError:
        raise
    except (OSError, EOFError, gzip.BadGzipFile, zlib.error, UnicodeDecodeError) as e:
        raise DatasetError(f"{path}: cannot read: {getattr(e, 'strerror', None) or e}") from None
    if data.shape[0] < 2:
        raise DatasetError(f"{path}: {data.shape[0]} row(s); at least 2 are needed to train")
    if data.shape[1] < 1:
        raise DatasetError(f"{path}: no columns")
    _check_finite(path, data, line_of)
    return Dataset(path=path, format=fmt, data=data, header=header, size_bytes=size)


def _check_finite(path: str, data: np.ndarray, line_of) -> None:
    """Raise DatasetError at the first NaN/Inf cell, scanning in blocks (memmaps stay on disk)."""
    block = 1 << 16
    for start in range(0, data.shape[0], block):
        chunk = np.asarray(data[start : start + block])
        bad = ~np.isfinite(chunk)
        if bad.any():
            r, c = np.argwhere(bad)[0]
            row = start + int(r)
            where = f"line {line_of(row)}" if line_of else f"row {row + 1}"
            raise DatasetError(f"{path}: {where}, column {int(c) + 1}: value {chunk[r, c]} is not finite")


def _open_text(path: str):
    if path.lower().endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8-sig", newline=None)
    return open(path, encoding="utf-8-sig", newline=None)


def _is_number(token: str) -> bool:
    try:
        float(token)
        return True
    except ValueError:
        return False


_LOADTXT_ERR = re.compile(r"at row (\d+)(?:, column (\d+))?")


def _load_text(path: str):
    """Return (float32 array, header or None, data-row -> 1-based line function)."""
    with _open_text(path) as f:
        head = f.read(_SNIFF_BYTES)
    lines = head.splitlines()
    first = next((i for i, line in enumerate(lines) if line.strip()), None)
    if first is None:
        raise DatasetError(f"{path}: empty file (no data rows)")
    sample = lines[first]
    delim = "\t" if "\t" in sample else ";" if ";" in sample else "," if "," in sample else None

    def split(line: str) -> list[str]:
        return [t.strip() for t in (line.split(delim) if delim else line.split())]

    tokens = split(sample)
    header = None
    skip = first
    if not all(_is_number(t) for t in tokens if t):
        header = [t for t in tokens]
        skip = first + 1
    # A trailing delimiter ("1,2,3,") makes an empty last field on every line: drop that column.
    data_line = next((line for line in lines[skip:] if line.strip()), sample if header is None else None)
    ncols = None
    if data_line is not None and delim is not None:
        fields = split(data_line)
        if len(fields) > 1 and fields[-1] == "":
            ncols = len(fields) - 1
    if header is not None and header and header[-1] == "":
        header = header[:-1]

    def line_of(row: int) -> int:
        return _line_of_data_row(path, skip, row, blank_if_spaces=delim is None)

    def parse(max_rows=None):
        with _open_text(path) as f, warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "input contained no data": reported below
            return np.loadtxt(
                f,
                delimiter=delim,
                skiprows=skip,
                dtype=np.float32,
                ndmin=2,
                usecols=range(ncols) if ncols else None,
                comments=None,
                max_rows=max_rows,
            )

    try:
        try:
            data = parse()
        except ValueError as e:
            # Lines holding only spaces at the end of an export count as rows with one empty field;
            # numpy reports them as ragged (1-based data row). Tolerate them when nothing follows.
            m = _LOADTXT_ERR.search(str(e))
            if not (m and "number of columns changed" in str(e) and _only_blank_from(path, line_of(int(m.group(1)) - 1))):
                raise
            data = parse(max_rows=int(m.group(1)) - 1)
    except ValueError as e:
        msg = str(e)
        m = _LOADTXT_ERR.search(msg)
        what = msg.split(" at row")[0]
        if "number of columns changed" in msg:
            # numpy counts data rows (empty lines skipped): 1-based for this error, 0-based for a bad cell
            what = "ragged rows: " + what.replace("the number of columns changed", "the number of columns changes")
            row = int(m.group(1)) - 1 if m else None
        else:
            row = int(m.group(1)) if m else None
        if row is not None:
            where = f"line {line_of(row)}" + (f", column {m.group(2)}" if m.group(2) else "")
            raise DatasetError(f"{path}: {where}: {what}") from None
        raise DatasetError(f"{path}: {msg}") from None
    if data.size == 0:
        raise DatasetError(f"{path}: empty file (no data rows)")
    if header is not None and len(header) != data.shape[1]:
        raise DatasetError(
            f"{path}: line {skip}: header has {len(header)} names but rows have {data.shape[1]} columns"
        )
    return data, header, line_of


def _line_of_data_row(path: str, skip: int, row: int, blank_if_spaces: bool) -> int:
    """Return the 1-based file line of 0-based data row ``row`` (error path only: a Python scan).

    numpy's reader skips empty lines without counting them; with the whitespace delimiter a line
    of spaces is empty too.
    """
    seen = -1
    with _open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            if lineno <= skip:
                continue
            text = line.rstrip("\r\n")
            if text and (text.strip() or not blank_if_spaces):
                seen += 1
                if seen == row:
                    return lineno
    return skip + row + 1


def _only_blank_from(path: str, lineno: int) -> bool:
    """Return True if line lineno (1-based) and every later line hold only whitespace."""
    with _open_text(path) as f:
        return all(not line.strip() for i, line in enumerate(f, 1) if i >= lineno)


def _check_array(path: str, arr, what: str = "array") -> np.ndarray:
    if arr.ndim != 2:
        raise DatasetError(f"{path}: {what} has rank {arr.ndim} (shape {tuple(arr.shape)}); need rows x metrics (rank 2)")
    if arr.dtype.kind not in "fiu" or arr.dtype.itemsize > 8:
        raise DatasetError(f"{path}: {what} has dtype {arr.dtype}; need a real number dtype (float or int)")
    return arr


def _load_array(path: str, fmt: str) -> np.ndarray:
    """Return a 2-D numeric array from .npy (memory-mapped), .npz (one array) or .pt (plain tensor)."""
    if fmt == "npy":
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError as e:
            raise DatasetError(f"{path}: not a plain numeric .npy array ({e})") from None
        return _check_array(path, arr)
    if fmt == "npz":
        try:
            with np.load(path, allow_pickle=False) as z:
                names = list(z.files)
                if len(names) != 1:
                    raise DatasetError(f"{path}: .npz holds {len(names)} arrays ({', '.join(names) or 'none'}); need exactly one")
                arr = z[names[0]]
        except DatasetError:
            raise
        except (ValueError, OSError) as e:
            raise DatasetError(f"{path}: not a plain numeric .npz archive ({e})") from None
        return _check_array(path, arr, f"array '{names[0]}'")
    import torch  # only here: reading text or .npy does not need torch

    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises UnpicklingError, RuntimeError, ... for non-tensor content
        raise DatasetError(f"{path}: not a plain tensor file (loaded with weights_only=True: {type(e).__name__})") from None
    if not isinstance(obj, torch.Tensor):
        raise DatasetError(f"{path}: .pt holds a {type(obj).__name__}, need a plain 2-D tensor")
    if obj.is_complex() or obj.dtype == torch.bool:
        raise DatasetError(f"{path}: tensor has dtype {obj.dtype}; need a real number dtype")
    return _check_array(path, obj.float().numpy())
