"""The rows of a ``.npy`` too large for a job's memory budget, read from disk on demand.

A dataset over ``job.max_matrix_bytes`` is not loaded: :mod:`.arrays` (a C-ordered 2-D ``.npy``)
and :mod:`.core` (a text or columnar file spilled to a ``.npy`` while it is parsed) return an
:class:`NpyRows` over the file instead, which :mod:`opt_ds_ops.training.stream` trains on chunk
by chunk. Rows are read with ``pread`` into buffers of their own, never memory mapped, so the
file's pages never count towards the job's RSS or its ``RLIMIT_DATA``.
"""

from __future__ import annotations

import os

import numpy as np

CHUNK_BYTES = 16 * 1024**2  # float32 bytes of one chunk read from disk


class NpyRows:
    """The rows of a C-ordered 2-D ``.npy`` file of a real dtype, read on demand, never mapped.

    ``shape``: (rows, columns) of the file; ``columns``: the 0-based columns that are features
    (None: all); ``dtype``: the file's. ``centre``: None (float32 rows are read as they are), or
    the (file columns,) float64 offset each value is centred by, in float64, before it becomes
    float32, as :class:`opt_ds_ops.dataset.core.Float32Builder` does in memory: the dataset's
    ``offset``. :meth:`read` returns float32 rows. ``nbytes``: the float32 matrix's size (bytes),
    what loading it would cost.
    """

    def __init__(self, path: str, shape: tuple[int, int], dtype: np.dtype, data_offset: int,
                 columns: list[int] | None = None, centre: np.ndarray | None = None):
        self.path, self.file_shape, self.dtype, self.data_offset = path, (int(shape[0]), int(shape[1])), np.dtype(dtype), data_offset
        self.columns, self.centre = columns, centre

    @property
    def shape(self) -> tuple[int, int]:
        return (self.file_shape[0], len(self.columns) if self.columns is not None else self.file_shape[1])

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.shape[1] * 4

    def select(self, columns: list[int]) -> NpyRows:
        """Return the same rows with only ``columns`` (0-based file columns) as features."""
        return NpyRows(self.path, self.file_shape, self.dtype, self.data_offset, list(columns), self.centre)

    def raw(self, start: int, stop: int) -> np.ndarray:
        """Return rows [start, stop) of every file column as the file holds them (its dtype).
        Raises OSError when the file is shorter than its header says."""
        cols = self.file_shape[1]
        raw = np.empty((stop - start, cols), dtype=self.dtype)
        view = memoryview(raw.reshape(-1).view(np.uint8))
        pos, got = self.data_offset + start * cols * self.dtype.itemsize, 0
        with open(self.path, "rb", buffering=0) as f:
            while got < len(view):
                n = os.preadv(f.fileno(), [view[got:]], pos + got)
                if not n:
                    raise OSError(f"{self.path}: the file ends {len(view) - got} bytes early (rows {start}-{stop})")
                got += n
        return raw

    def read(self, start: int, stop: int) -> np.ndarray:
        """Return rows [start, stop) as a new (stop - start, D) float32 array (values converted
        from the file's dtype, centred by ``centre``). Raises OSError when the file is shorter
        than its header says."""
        raw = self.raw(start, stop)
        if self.columns is not None:
            raw = raw[:, self.columns]
        if self.centre is not None:
            centre = self.centre if self.columns is None else self.centre[self.columns]
            out = np.empty(raw.shape, dtype=np.float32)
            with np.errstate(over="ignore"):
                np.subtract(raw.astype(np.float64, copy=False), centre, out=out, casting="same_kind")
            return out
        return raw if raw.dtype == np.float32 and raw.flags.c_contiguous else np.ascontiguousarray(raw, dtype=np.float32)

    def __getitem__(self, rows: slice) -> np.ndarray:
        """``source[start:stop]``: :meth:`read` of those rows (a step is not supported), so block
        loops written for arrays (:func:`opt_ds_ops.dataset.core.check_finite`) read the file."""
        start, stop, step = rows.indices(self.shape[0])
        if step != 1:
            raise ValueError("NpyRows reads contiguous rows only")
        return self.read(start, max(start, stop))

    def chunk_rows(self) -> int:
        """Rows in one chunk of :data:`CHUNK_BYTES` (float32), at least 2."""
        return max(2, CHUNK_BYTES // (4 * max(self.shape[1], 1)))
