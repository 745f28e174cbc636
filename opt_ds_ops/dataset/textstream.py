"""The byte streams under the text reader (:mod:`opt_ds_ops.dataset.text`): a dataset file opened
with its budgets counted as it is read (``job.max_decompressed_bytes``, the line limit), lone CRs
read as line ends, cut into chunks of whole lines for Arrow, and the stream Arrow parses (a
sniffed prefix, then the rest; runs of spaces and tabs as commas).
"""

from __future__ import annotations

import gzip
import io
import re

import numpy as np

from .core import FIELD_BYTES, LIMIT_KEYS, SNIFF_BYTES, DatasetError, DatasetLimits

READ_BYTES = 256 * 1024  # text read from the file at a time (bytes)


class _Over(io.RawIOBase):
    """A readable raw stream over another one, ``self._raw``, which it closes with itself."""

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        try:
            self._raw.close()
        finally:
            super().close()


class _BoundedReader(_Over):
    """A binary stream over ``raw`` that raises DatasetError once more than
    ``limits.max_decompressed_bytes`` were read from it, or a line runs past ``limits.max_line_bytes``.

    Counted at every read, so a gzip bomb or an endless line stops within one read buffer
    (256 KiB) of the limit; ``raw`` is a file or a GzipFile (bytes after decompression).
    ``stop_at``: bytes after which the stream ends (a tail of blank lines cut off).
    """

    def __init__(self, raw, path: str, limits: DatasetLimits, stop_at: int | None = None):
        super().__init__()
        self._raw, self._path, self._limits, self._stop_at = raw, path, limits, stop_at
        self.bytes_read = 0
        self._line_bytes = 0

    def readinto(self, b) -> int:
        if self._stop_at is not None:
            room = self._stop_at - self.bytes_read
            if room <= 0:
                return 0
            b = memoryview(b)[:room]
        n = self._raw.readinto(b)
        if not n:
            return n
        self.bytes_read += n
        lim = self._limits
        if self.bytes_read > lim.max_decompressed_bytes:
            raise DatasetError(
                f"{self._path}: more than {lim.max_decompressed_bytes} bytes of text"
                f"{' after decompression' if isinstance(self._raw, gzip.GzipFile) else ''}; "
                f"{LIMIT_KEYS} is {lim.max_decompressed_bytes}"
            )
        data = bytes(memoryview(b)[:n])
        end = max(data.rfind(b"\n"), data.rfind(b"\r"))
        self._line_bytes = self._line_bytes + n if end < 0 else n - end - 1
        if self._line_bytes > lim.max_line_bytes:
            raise DatasetError(
                f"{self._path}: a line longer than {lim.max_line_bytes} bytes; job.max_columns is {lim.max_columns} "
                f"(a line may take {FIELD_BYTES} bytes a field, {SNIFF_BYTES} at least)"
            )
        return n


_LONE_CR = re.compile(rb"\r(?!\n)")


class _CRLines(_Over):
    """The bytes of ``raw`` with every CR that is not followed by LF turned into LF.

    Classic Mac and some Excel exports end their lines with CR only; a line is then ``\n``,
    ``\r\n`` or ``\r``, as for Arrow's parser and Python's universal newlines. One byte for one
    byte: offsets in the file (``stop_at``) stay the same. A CR at the end of a read is held back
    until the next byte shows whether an LF follows.
    """

    def __init__(self, raw):
        super().__init__()
        self._raw, self._pending, self._cr = raw, b"", False

    def readinto(self, b) -> int:
        while not self._pending:
            data = self._raw.read(READ_BYTES)
            if not data:
                if not self._cr:
                    return 0
                self._pending, self._cr = b"\n", False  # the file ends with a lone CR
                break
            if self._cr:
                data, self._cr = b"\r" + data, False
            if data.endswith(b"\r"):
                data, self._cr = data[:-1], True
            self._pending = _LONE_CR.sub(b"\n", data) if b"\r" in data else data
        n = min(len(b), len(self._pending))
        b[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n


def open_text(path: str, limits: DatasetLimits, stop_at: int | None = None) -> io.BufferedReader:
    """Open a text dataset (gzip by suffix) as bytes through a :class:`_BoundedReader`, lone CRs
    read as line ends (:class:`_CRLines`)."""
    raw = gzip.open(path, "rb") if path.lower().endswith(".gz") else open(path, "rb", buffering=0)
    return io.BufferedReader(_CRLines(_BoundedReader(raw, path, limits, stop_at)), buffer_size=READ_BYTES)


CHUNK_BYTES = 16 * 1024**2  # text parsed by Arrow at a time (bytes of whole lines)


def line_chunks(stream, size: int):
    """Yield the bytes of stream in chunks of about ``size`` that end at a line break (``\\n``, else
    ``\\r``), the last one with whatever follows the last break; chunks of blank lines only are skipped."""
    carry = b""
    while True:
        data = stream.read(size)
        if not data:
            if carry.strip():
                yield carry
            return
        data = carry + data
        cut = data.rfind(b"\n") + 1 or data.rfind(b"\r") + 1
        if not cut and len(data) < 4 * size:  # a line longer than a chunk: read on (the line limit is checked by the sniffer)
            carry = data
            continue
        cut = cut or len(data)
        chunk, carry = data[:cut], data[cut:]
        if chunk.strip():
            yield chunk


def arrow_owned(pa, data: bytes):
    """``data`` copied into a buffer Arrow allocated (one memcpy, 16 MiB at most).

    A ``bytes`` object handed to Arrow is released by whichever Arrow thread drops it last, and
    releasing a Python object takes the GIL. A CPU-pool thread doing that while the interpreter
    finalises is ended by CPython with ``pthread_exit``, which unwinds through Arrow's ``noexcept``
    worker loop: ``std::terminate`` and SIGABRT, "terminate called without an active exception"
    (apache/arrow#34314, python/cpython#87135). It aborted 28 of 100 short ``ds-ops score`` runs
    on a loaded 2-core machine. A buffer Arrow owns is freed without Python, so no Arrow thread
    ever waits for the GIL.
    """
    buf = pa.allocate_buffer(len(data))
    np.frombuffer(buf, dtype=np.uint8)[:] = np.frombuffer(data, dtype=np.uint8)
    return buf


class Prefixed(io.RawIOBase):
    """``prefix`` bytes, then the rest of ``stream``; with ``whitespace``, runs of spaces and tabs
    become one comma and are dropped at the ends of lines (line breaks are kept, so line numbers
    hold). Arrow reads from this."""

    def __init__(self, prefix: bytes, stream, whitespace: bool):
        super().__init__()
        self._pending, self._stream, self._ws = _commas(prefix) if whitespace else prefix, stream, whitespace
        self._carry = b""  # an incomplete last line, held back until its end is read (whitespace only)
        self._eof = False

    def readable(self) -> bool:
        return True

    def _fill(self) -> None:
        while not self._pending and not self._eof:
            chunk = self._stream.read(READ_BYTES)
            if not chunk:
                self._eof = True
                self._pending, self._carry = _commas(self._carry) if self._ws else b"", b""
                return
            if not self._ws:
                self._pending = chunk
                return
            data = self._carry + chunk
            cut = data.rfind(b"\n") + 1
            self._pending, self._carry = _commas(data[:cut]), data[cut:]

    def readinto(self, b) -> int:
        if not self._pending:
            self._fill()
        n = min(len(b), len(self._pending))
        b[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n


_EDGE_SPACE = re.compile(rb"(?m)^[ \t]+|[ \t]+(?=\r?$)")
_RUN_SPACE = re.compile(rb"[ \t]+")


def _commas(data: bytes) -> bytes:
    """Return whitespace-separated lines as comma-separated ones (see :class:`Prefixed`)."""
    return _RUN_SPACE.sub(b",", _EDGE_SPACE.sub(b"", data))
