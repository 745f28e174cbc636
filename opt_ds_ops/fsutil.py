"""Primitives shared by the spool and the model store: fsync'ed atomic writes, writer liveness,
non-blocking file locks and the UTC time stamps written into records and metadata.

The pattern is the one POSIX rename(2) guarantees: write a hidden temporary file in the same
directory, fsync it, rename it over the target, fsync the directory so the rename survives a
power cut. A reader sees the old file or the new one, never a partial one.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import stat
import tempfile
from datetime import datetime, timezone


def utc_now() -> str:
    """Return the current UTC time as ISO 8601 with microseconds (``2026-11-30T01:02:03.123456Z``)."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def try_lock(path: str, mode: int = 0o600) -> int | None:
    """Open (creating it) path and take an exclusive ``flock`` without waiting; return the fd, or
    None if another open file description holds the lock. The kernel drops the lock when the
    holder's last fd closes (its process dies), so a crash never leaves it held. Raises OSError."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def fsync_dir(path: str) -> None:
    """fsync a directory so that renames inside it survive a power cut."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, data: bytes, prefix: str = ".tmp-", mode: int = 0o644, replace: bool = True) -> None:
    """Write data to path (file ``mode``) through a hidden temporary file (``prefix`` + random) in
    the same directory, fsync, rename. ``replace`` False: never over a file that is there
    (:func:`rename_noreplace`: FileExistsError, the temporary file removed)."""
    directory = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=prefix)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        if replace:
            os.rename(tmp, path)
        else:
            rename_noreplace(tmp, path)
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


_RENAME_NOREPLACE = 1  # linux/fs.h
_libc = None


def rename_noreplace(src: str, dst: str) -> None:
    """Rename src to dst, failing with FileExistsError if dst exists (``renameat2(RENAME_NOREPLACE)``).

    Used wherever a user's name must never be overwritten (putting a file back into incoming/).
    Falls back to check-then-rename where the kernel or file system lacks renameat2 (EINVAL,
    ENOSYS), which is only safe when no one else creates dst meanwhile. Raises OSError.
    """
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    at_fdcwd = -100
    if _libc.renameat2(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
        return
    err = ctypes.get_errno()
    if err not in (errno.EINVAL, errno.ENOSYS):
        raise OSError(err, os.strerror(err), dst if err == errno.EEXIST else src)
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), dst)
    os.rename(src, dst)


def open_regular(path: str) -> tuple[int, os.stat_result]:
    """Open path read-only without following a symlink or blocking; return (fd, fstat).

    ``O_NOFOLLOW | O_NONBLOCK | O_NOCTTY``: a symlink fails (ELOOP), a FIFO does not block, a
    terminal is not acquired. Raises OSError, and IsADirectoryError / OSError(ENXIO-like) with
    "not a regular file" when the opened object is not a regular file (the fd is then closed).
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", path)
    return fd, st


def read_small(path: str, max_bytes: int = 1 << 20) -> bytes:
    """Return the bytes of a small regular file (at most max_bytes) without following links or
    blocking on a FIFO. Raises OSError for anything else (not regular, too large, unreadable)."""
    fd, st = open_regular(path)
    try:
        if st.st_size > max_bytes:
            raise OSError(errno.EFBIG, f"larger than {max_bytes} bytes", path)
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(max_bytes + 1)[:max_bytes]
    finally:
        os.close(fd)


def user_name(uid) -> str:
    """Return ``uid 1002 (bob)`` for messages that name who owns a file (``uid 1002`` where the
    account is unknown)."""
    import pwd

    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (KeyError, TypeError, OverflowError):
        return f"uid {uid}"
