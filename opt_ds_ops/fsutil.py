"""Primitives shared by the spool and the model store: fsync'ed atomic writes, writer liveness.

The pattern is the one POSIX rename(2) guarantees: write a hidden temporary file in the same
directory, fsync it, rename it over the target, fsync the directory so the rename survives a
power cut. A reader sees the old file or the new one, never a partial one.
"""

from __future__ import annotations

import os
import tempfile


def fsync_dir(path: str) -> None:
    """fsync a directory so that renames inside it survive a power cut."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, data: bytes) -> None:
    """Write data to path through a hidden temporary file in the same directory, fsync, rename."""
    directory = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.rename(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(directory)


def pid_alive(pid: int) -> bool:
    """Return True if process pid exists (a leftover file's writer that may still be writing)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True
