"""A job's directory in ``processing/`` and its record: listing the jobs, reading and saving
``job.json``, the job's lock, its checkpoint, whether the process a record names still runs, and
the start-up clean-up of what a killed daemon (or an older ds-ops) left in processing/.
"""

from __future__ import annotations

import os
import shutil
import stat

from ..fsutil import fsync_dir, pid_alive, rename_noreplace, try_lock, write_atomic
from .layout import (
    CHECKPOINT_FILE, DONE, FAILED, INCOMING, JOB_FILE, LOCK_FILE, PROCESSING, Spool, is_job_id, read_json, write_json,
)


def job_ids(spool: Spool) -> list[str]:
    """Return the job directories in processing/, oldest claim first."""
    try:
        names = os.listdir(spool.dir(PROCESSING))
    except FileNotFoundError:
        return []
    return sorted(n for n in names if is_job_id(n) and os.path.isdir(spool.job_dir(n))
                  and not os.path.islink(spool.job_dir(n)))


def read_record(spool: Spool, job_id: str) -> dict | None:
    """Return processing/JOB/job.json, or None if it is missing or unreadable."""
    return read_json(spool.job_path(job_id, JOB_FILE))


def save_record(spool: Spool, record: dict) -> None:
    """Atomically write the job's record to processing/JOB/job.json."""
    write_json(spool.job_path(record["job_id"], JOB_FILE), record)


def lock_job(spool: Spool, job_id: str) -> int | None:
    """Take the job's lock (``flock`` on processing/JOB/lock); return its fd, or None if a live
    process (the job's own process, or one of a daemon that was killed) still holds it. The job
    process holds it for its lifetime; the kernel drops it when the holder dies."""
    return try_lock(spool.job_path(job_id, LOCK_FILE))


def discard_job(spool: Spool, job_id: str) -> None:
    """Remove a job directory that holds nothing of a user's (an empty or vanished claim)."""
    shutil.rmtree(spool.job_dir(job_id), ignore_errors=True)


def save_checkpoint(spool: Spool, job_id: str, obj: dict) -> str:
    """Atomically write obj (tensors, numbers, strings) to processing/JOB/checkpoint.pt; return its path."""
    import io

    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    path = spool.job_path(job_id, CHECKPOINT_FILE)
    write_atomic(path, buf.getvalue())
    return path


def load_checkpoint(spool: Spool, job_id: str) -> tuple[dict | None, str]:
    """Return (checkpoint dict, "") for the job, or (None, why not) if it is absent or unusable.

    Loaded with ``torch.load(weights_only=True)`` on the CPU: no pickled code runs.
    """
    import torch

    path = spool.job_path(job_id, CHECKPOINT_FILE)
    if not os.path.exists(path):
        return None, "no checkpoint"
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises UnpicklingError, RuntimeError, EOFError, ... on a bad file
        return None, f"checkpoint {path} unreadable ({type(e).__name__}: {e})"
    if not isinstance(obj, dict) or "checkpoint" not in obj:
        return None, f"checkpoint {path} has an unknown layout"
    return obj, ""


def boot_id() -> str:
    """Return this boot's id (/proc/sys/kernel/random/boot_id), or "" where there is none."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


def process_start_ticks(pid: int) -> int | None:
    """Return when process pid started (``/proc/PID/stat`` field 22, clock ticks since boot), or
    None if it does not exist or /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat_line = f.read()
        return int(stat_line.rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def process_alive(pid: int | None, boot: str | None, start_ticks: int | None = None) -> bool:
    """Return True if the process pid of a record runs now. With ``start_ticks`` (the record's
    :func:`process_start_ticks` of pid) the same pid must have started then: that tells a reused pid
    apart without the boot id, which differs between a sandboxed unit and a shell in a container
    (ProtectKernelTunables= hides nspawn's boot id). Without it: pid runs and the boot id matches."""
    if not pid:
        return False
    if start_ticks is not None:
        return process_start_ticks(pid) == start_ticks
    if boot and boot != boot_id():
        return False
    return pid_alive(pid)


def remove_stale_temps(spool: Spool) -> list[str]:
    """Remove the hidden ``.tmp-*`` files :func:`write_json` leaves in done/, failed/ and
    processing/ when killed between writing and renaming (only the daemon writes there; call at
    start-up, before any write). Returns the paths removed."""
    removed = []
    for which in (DONE, FAILED, PROCESSING):
        try:
            names = os.listdir(spool.dir(which))
        except FileNotFoundError:
            continue
        for name in names:
            path = spool.path(which, name)
            if name.startswith(".tmp-") and not os.path.isdir(path):
                os.unlink(path)
                removed.append(path)
    return removed


def migrate_legacy(spool: Spool) -> list[str]:
    """Requeue datasets an older ds-ops left in processing/ (processing/NAME with hidden
    .NAME.job.json): each goes back to incoming/ (never over a file there) and the hidden files are
    removed. Returns the names requeued."""
    moved = []
    for entry in sorted(os.listdir(spool.dir(PROCESSING))):
        path = spool.path(PROCESSING, entry)
        if entry.startswith("."):
            if not is_job_id(entry) and os.path.isfile(path) and not os.path.islink(path):
                os.unlink(path)
            continue
        if is_job_id(entry):
            continue
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode):
            for n in range(100):
                target = entry if n == 0 else f"{entry}.{n}"
                try:
                    rename_noreplace(path, spool.path(INCOMING, target))
                    moved.append(target)
                    break
                except FileExistsError:
                    continue
    if moved:
        fsync_dir(spool.dir(INCOMING))
    return moved
