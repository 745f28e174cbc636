"""Array datasets: ``.npy`` (float32 memory-mapped), ``.npz`` (exactly one array) and ``.pt`` (the
one tensor ``torch.save`` writes, read by :mod:`.torchfile` without torch: no pickle runs).

An ``.npy`` header, an ``.npz`` member's size and header and a ``.pt`` tensor's shape are checked
against the limits before any data is read, inflated or converted. Arrays that are converted
(float64, integers, ...) need the float32 matrix plus one 16 MiB float64 block, besides the source
where that is in memory (a ``.pt`` tensor; a Fortran-ordered ``.npz`` member, read whole first).
"""

from __future__ import annotations

import os
import struct
import tokenize
import zipfile
import zlib

import numpy as np

from .core import (
    LIMIT_KEYS, OFFSET_ROWS, DatasetError, DatasetLimits, Float32Builder, all_constant, block_rows, check_finite,
    check_float32, check_shape, clip, offset_of, open_zip, read_exact, rows_where,
)
from .npyrows import NpyRows
from .torchfile import read_pt


# what numpy's .npy header parser raises for a malformed header (ast.literal_eval, and tokenize for
# the headers Python 2 wrote), besides the ValueError it raises itself
_HEADER_ERRORS = (ValueError, SyntaxError, TypeError, RecursionError, tokenize.TokenError)
# what zipfile raises for a malformed archive: unsupported versions, methods and flags, a name
# field cut short, a record that does not unpack, an encrypted member
_ZIP_ERRORS = (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, IndexError, KeyError, struct.error,
               RuntimeError)


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
        shape, fortran, dtype = read(f)
    except _HEADER_ERRORS as e:
        raise DatasetError(f"{path}: not a plain numeric {kind} ({clip(str(e))})") from None
    # numpy's header check takes any int; a negative one makes np.memmap raise OverflowError (fuzz)
    if any(int(n) < 0 for n in shape):
        raise DatasetError(f"{path}: not a plain numeric {kind} (negative dimension in shape {tuple(shape)})")
    return shape, fortran, dtype


def _centred(path: str, shape: tuple, block_of) -> tuple[np.ndarray, np.ndarray | None]:
    """Return (float32, offset) of an array read as float64 blocks: ``block_of(start, stop)``."""
    rows, cols = shape
    build = Float32Builder(path, cols, rows_where, rows=rows)
    step = block_rows(cols)
    for start in range(0, rows, step):
        build.add(block_of(start, min(start + step, rows)))
    return build.finish()


def load_array(path: str, fmt: str, limits: DatasetLimits) -> tuple[np.ndarray, np.ndarray | None]:
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
    if (limits.stream_large_npy and len(shape) == 2 and not fortran
            and int(shape[0]) * int(shape[1]) * 4 > limits.max_matrix_bytes and int(shape[1]) <= limits.max_columns):
        return _streamed_npy(path, shape, dtype)
    check_shape(path, "array", shape, limits)
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except _HEADER_ERRORS as e:
        raise DatasetError(f"{path}: not a plain numeric .npy array ({clip(str(e))})") from None
    if dtype == np.float32 and not fortran:
        check_finite(path, arr, rows_where)
        return arr, None
    return _centred(path, shape, lambda s, e: np.asarray(arr[s:e], dtype=np.float64))


def _streamed_npy(path: str, shape: tuple, dtype: np.dtype) -> tuple:
    """Return (:class:`opt_ds_ops.dataset.npyrows.NpyRows`, float64 offset or None) for a .npy too large for
    the job's memory, after one pass that checks the file's length and every cell.

    A float64 or integer file is centred as in memory (:func:`_centred`): by the column means of
    its first OFFSET_ROWS rows, the same offset, so that the same file gives the same float32 rows
    whether it is loaded or streamed.
    """
    with open(path, "rb") as f:
        _npy_header(f, path, ".npy array")
        offset = f.tell()
        size = os.fstat(f.fileno()).st_size
    need = offset + int(shape[0]) * int(shape[1]) * dtype.itemsize
    if size < need:
        raise DatasetError(f"{path}: array data is truncated ({size} bytes for shape {tuple(shape)}, {dtype})")
    rows = NpyRows(path, shape, dtype, offset)
    if dtype == np.float32:
        check_finite(path, rows, rows_where)  # reads the file in blocks, as for a memmap
        return rows, None
    step = block_rows(int(shape[1]))
    centre = None
    if int(shape[0]):  # Float32Builder's offset: the column means of the first OFFSET_ROWS rows
        centre = offset_of(rows.raw(0, min(OFFSET_ROWS, int(shape[0]))).astype(np.float64))
    for start in range(0, int(shape[0]), step):
        block = rows.raw(start, min(start + step, int(shape[0]))).astype(np.float64)
        check_float32(path, block, centre, start, rows_where)
    return NpyRows(path, shape, dtype, offset, centre=centre), centre


def _load_npz(path: str, limits: DatasetLimits) -> tuple[np.ndarray, np.ndarray | None]:
    try:
        with open_zip(path) as z:
            infos = [i for i in z.infolist() if not i.is_dir()]
            names = [i.filename.removesuffix(".npy") for i in infos]
            if len(infos) != 1:
                raise DatasetError(f"{path}: .npz holds {len(names)} arrays ({', '.join(names) or 'none'}); need exactly one")
            info, what = infos[0], f"array '{names[0]}'"
            if info.file_size > limits.max_decompressed_bytes:
                raise DatasetError(f"{path}: {what} inflates to {info.file_size} bytes; "
                                   f"{LIMIT_KEYS} is {limits.max_decompressed_bytes}")
            with z.open(info) as m:
                shape, fortran, dtype = _npy_header(m, path, ".npz archive")
                _check_dtype(path, what, dtype, ".npz archive")
                check_shape(path, what, shape, limits)
                rows, cols = shape
                if info.file_size < m.tell() + rows * cols * dtype.itemsize:
                    raise DatasetError(f"{path}: {what} is truncated ({info.file_size} bytes for shape {shape}, {dtype})")
                if dtype == np.float32 and not fortran:
                    out = np.empty(shape, dtype=np.float32)
                    read_exact(m, out, path)
                    check_finite(path, out, rows_where)
                    return out, None
                if fortran:  # columns are contiguous: read the whole source (itemsize/4 x the matrix) first
                    src = np.empty(shape[::-1], dtype=dtype)
                    read_exact(m, src, path)
                    return _centred(path, shape, lambda s, e: src.T[s:e].astype(np.float64))

                def block_of(start: int, stop: int) -> np.ndarray:
                    buf = np.empty((stop - start, cols), dtype=dtype)
                    read_exact(m, buf, path)  # rows arrive in order: read each block once, as it streams
                    return buf.astype(np.float64)

                return _centred(path, shape, block_of)
    except DatasetError:
        raise
    except _ZIP_ERRORS + _HEADER_ERRORS as e:
        raise DatasetError(f"{path}: not a plain numeric .npz archive ({clip(str(e))})") from None


def _load_pt(path: str, limits: DatasetLimits) -> tuple[np.ndarray, np.ndarray | None]:
    view, code = read_pt(path, limits)  # checked: a 2-D real tensor within the limits, inside its storage
    if limits.refuse_constant and view.shape[0] > 1 and view.strides[0] == 0:
        raise all_constant(path, int(view.shape[1]))  # every row is the first (expanded): known without a copy
    if view.dtype == np.float32 and view.flags.c_contiguous:  # native float32 (a big-endian one is converted)
        check_finite(path, view, rows_where)
        return view, None
    if code == "bf16":  # bfloat16 is a float32's upper 16 bits
        return _centred(path, view.shape, lambda s, e: (view[s:e].astype(np.uint32) << 16).view(np.float32)
                        .astype(np.float64))
    return _centred(path, view.shape, lambda s, e: view[s:e].astype(np.float64))
