"""The spool's layout: its directories and fixed names, the :class:`Spool` paths, opening the spool
and the single-daemon lock, and the small helpers every stage uses (job ids, JSON files, the names
beside a dataset in done/ and failed/). The directories and how a dataset moves between them are
described in :mod:`opt_ds_ops.spool`.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
import tempfile
import uuid
from datetime import datetime, timezone

from ..config.sidecar import SIDECAR_SUFFIXES
from ..dataset import dataset_stem
from ..fsutil import pid_alive, read_small, try_lock, write_atomic

INCOMING, PROCESSING, DONE, FAILED = "incoming", "processing", "done", "failed"
SCORE = "score"  # the scoring drop directory, claimed exactly as incoming/ (jobs of kind "score")
SUBDIRS = (INCOMING, SCORE, PROCESSING, DONE, FAILED)
IGNORED_SUFFIXES = (".part", ".tmp")
RESULT_SUFFIX, ERROR_SUFFIX, SIDECAR_SUFFIX = ".result.json", ".error.json", ".sidecar.yaml"
JOB_FILE, CHECKPOINT_FILE, SOURCE_FILE, LOCK_FILE = "job.json", "checkpoint.pt", "source", "lock"
SIDECAR_FILE, SIDECAR_SOURCE = "sidecar.yaml", "sidecar.source"
DATA_PREFIX = "dataset"
NAME_MAX_BYTES = 255
COPY_CHUNK = 1 << 20
_JOB_ID = re.compile(r"^\d{8}T\d{6}(\.\d{6})?Z-[0-9a-f]{6,32}$")
# errno values that mean the file system (not one dataset) is in trouble: intake pauses, retries
STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO)


class SpoolError(RuntimeError):
    """The spool (or models) directory cannot be used; the message names the path and why."""


def is_storage_error(e: BaseException) -> bool:
    """Return True for an OSError that is the file system's fault (ENOSPC, EDQUOT, EROFS, EIO)."""
    return isinstance(e, OSError) and e.errno in STORAGE_ERRNOS


def is_ignored(name: str) -> bool:
    """Return True for names the daemon never claims on their own in incoming/: '.NAME',
    'NAME.part', 'NAME.tmp' and sidecars ('STEM.yaml', 'STEM.yml': taken with their dataset)."""
    return name.startswith(".") or name.lower().endswith(IGNORED_SUFFIXES + SIDECAR_SUFFIXES)


def sidecar_names(name: str) -> list[str]:
    """Return the sidecar names dataset ``name`` may have in incoming/: ``STEM.yaml``, ``STEM.yml``."""
    return [dataset_stem(name) + suffix for suffix in SIDECAR_SUFFIXES]


def is_job_id(name: str) -> bool:
    """Return True if name has the shape of a job id (a processing/ directory of this daemon)."""
    return bool(_JOB_ID.match(name))


def new_job_id() -> str:
    """Return a unique job id that sorts by claim time: ``20261130T014242.123456Z-3f9a2c1b``."""
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ-") + uuid.uuid4().hex[:8]


def sidecar_name(name: str, suffix: str) -> str:
    """Return the JSON file name beside dataset ``name`` in done/ or failed/: ``NAME.result.json``.

    If that would exceed NAME_MAX (255 bytes), the name is cut and a hash of the full name keeps
    it unique: ``<first bytes>~<sha1 prefix><suffix>``.
    """
    full = name + suffix
    if len(os.fsencode(full)) <= NAME_MAX_BYTES:
        return full
    digest = "~" + hashlib.sha1(os.fsencode(name)).hexdigest()[:12]
    room = NAME_MAX_BYTES - len(os.fsencode(digest + suffix))
    return os.fsdecode(os.fsencode(name)[:room]) + digest + suffix


def write_json(path: str, obj: dict) -> None:
    """Atomically write obj as indented JSON (non-ASCII escaped, so any file name round-trips)."""
    write_atomic(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("ascii"))


def read_json(path: str) -> dict | None:
    """Return the JSON object in path, or None if it is missing, not a regular file (a FIFO or
    link is never opened in a blocking way or followed), larger than 1 MiB, or not an object."""
    try:
        obj = json.loads(read_small(path))
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def check_writable_dir(path: str, what: str) -> None:
    """Create directory path if needed and prove it writable by creating and removing a file.

    Raises SpoolError naming ``what`` (e.g. "models directory"), the path and the OS error.
    """
    try:
        os.makedirs(path, 0o755, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        where = e.filename or path
        raise SpoolError(f"{what} {path} is not usable: {e.strerror or e} ({where})") from None


def data_suffix(name: str) -> str:
    """Return the format suffix of a dataset name, lower-cased (``.txt.gz``, ``.npy``, or "")."""
    low = name.lower()
    gz = ".gz" if low.endswith(".gz") else ""
    base = low[: -len(gz)] if gz else low
    ext = os.path.splitext(base)[1]
    return ext + gz if ext and len(ext) <= 8 and ext[1:].isalnum() else ""


def kind_of(mode: int) -> str:
    """Return what a non-regular file is, in words ("a FIFO (named pipe)", "a directory", ...)."""
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device node"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    return "not a regular file"


class Spool:
    """The four spool directories under ``root``; every path the daemon touches comes from here."""

    def __init__(self, root: str):
        self.root = os.path.abspath(root)

    def dir(self, which: str) -> str:
        """Return the directory incoming/, processing/, done/ or failed/."""
        return os.path.join(self.root, which)

    def path(self, which: str, name: str) -> str:
        """Return the path of name inside one spool directory.

        Raises SpoolError for a name that is not exactly one path component ('', '.', '..', '/').
        """
        if name in ("", ".", "..") or "/" in name or "\0" in name:
            raise SpoolError(f"refusing spool entry name {name!r}: not a single file name")
        return os.path.join(self.root, which, name)

    def job_dir(self, job_id: str) -> str:
        """processing/JOB: the job's own directory."""
        return self.path(PROCESSING, job_id)

    def job_path(self, job_id: str, name: str) -> str:
        """A fixed-name file in the job's directory: job.json, checkpoint.pt, dataset.<ext>, ..."""
        return os.path.join(self.job_dir(job_id), name)


def open_spool(root: str) -> Spool:
    """Create the spool directories if needed and check they are writable and on one file system.

    Raises SpoolError naming the directory and the reason (claims are renames, which only work
    within one file system).
    """
    spool = Spool(root)
    devices = {}
    for which in SUBDIRS:
        path = spool.dir(which)
        check_writable_dir(path, "spool directory")
        devices[which] = os.stat(path).st_dev
    if len(set(devices.values())) > 1:
        raise SpoolError(
            f"spool directory {spool.root}: incoming/, processing/, done/ and failed/ must be on one "
            f"file system (a claim is a rename); device ids: {devices}"
        )
    return spool


DAEMON_LOCK = ".daemon.lock"


def lock_spool(spool: Spool) -> int:
    """Take the spool's single-daemon lock (``flock`` on ``spool.dir/.daemon.lock``, holding the
    pid); return its fd, to keep open for the daemon's life (the kernel drops the lock when the
    process dies). Raises SpoolError naming the other daemon's pid if one holds it."""
    path = os.path.join(spool.root, DAEMON_LOCK)
    fd = try_lock(path, 0o640)
    if fd is None:
        try:
            other = read_small(path, 64).decode("ascii", "replace").strip() or "?"
        except OSError:
            other = "?"
        raise SpoolError(f"spool directory {spool.root} is served by another ds-trainer (pid {other}); "
                         "one daemon per spool")
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode("ascii"))
    return fd


def daemon_pid(spool: Spool) -> int | None:
    """Return the pid of the daemon serving the spool, or None if no process holds its lock.

    Read from ``/proc/locks`` (the kernel's table of held locks: a FLOCK on the inode of
    ``.daemon.lock``), never by taking the lock, so a status never stands in a daemon's way; where
    /proc/locks cannot be read, the pid written in the lock file, if that process runs.
    """
    path = os.path.join(spool.root, DAEMON_LOCK)
    try:
        ino = os.stat(path).st_ino
    except OSError:
        return None
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 5 and fields[1] == "FLOCK" and fields[5].rsplit(":", 1)[-1] == str(ino):
                    return int(fields[4]) if fields[4].isdigit() else None
        return None
    except OSError:
        pass
    try:
        pid = int(read_small(path, 64).decode("ascii").strip())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return pid if pid_alive(pid) else None
