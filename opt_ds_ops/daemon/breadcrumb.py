"""Which job the daemon is handling, kept on disk: no job can stop the service twice.

The daemon handles one job at a time on its main loop (a claim, a start, a message, an end, a
recovery). Any exception while doing so is that job's failure (see
:meth:`opt_ds_ops.daemon.service.Daemon._for_job`). What an exception cannot catch (a segfault, an
out-of-memory kill, the watchdog's SIGABRT) ends the daemon; this module makes sure it cannot do
that forever. Before handling a job the daemon writes the job id to ``SPOOL/.handling`` and
empties the file afterwards (two system calls, no fsync: only the daemon process dying has to
find it, not a power loss). At the next start :meth:`Breadcrumb.deaths` reads what was left
there: the same job id left by two deaths in a row (``SPOOL/.handling-deaths`` counts them) means
that job is quarantined to failed/ with that reason instead of being handled a third time. A
clean stop, or a death while idle or handling another job, breaks the row.
"""

from __future__ import annotations

import contextlib
import json
import os

from ..fsutil import read_small, write_atomic

HANDLING_FILE, DEATHS_FILE = ".handling", ".handling-deaths"
QUARANTINE_AFTER = 2  # deaths in a row while handling one job


class Breadcrumb:
    """``SPOOL/.handling``: the id of the job the daemon is handling now, empty when none."""

    def __init__(self, root: str):
        self.path = os.path.join(root, HANDLING_FILE)
        self.deaths_path = os.path.join(root, DEATHS_FILE)
        self._fd: int | None = None

    def deaths(self) -> tuple[str, int]:
        """Call once at start-up, before :meth:`open`: return (the job id the last daemon was
        handling when it died, how many deaths in a row left that same id), or ("", 0) after a
        clean stop or a death with no job in hand. Records the count for the next start."""
        try:
            job_id = read_small(self.path, 256).decode("ascii", "replace").strip()
        except OSError:
            job_id = ""
        try:
            last = json.loads(read_small(self.deaths_path, 4096))
        except (OSError, ValueError):
            last = {}
        if not job_id:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.deaths_path)
            return "", 0
        count = (last.get("count", 0) if isinstance(last, dict) and last.get("job_id") == job_id else 0) + 1
        write_atomic(self.deaths_path, json.dumps({"job_id": job_id, "count": count}).encode("ascii"))
        return job_id, count

    def open(self) -> None:
        """Open the breadcrumb for the daemon's life (empty: no job in hand)."""
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o640)
        os.ftruncate(self._fd, 0)

    def close(self) -> None:
        """Empty and close it (a clean stop leaves no job in hand)."""
        if self._fd is not None:
            self.mark(None)
            os.close(self._fd)
            self._fd = None

    def mark(self, job_id: str | None) -> None:
        """Say that job_id is in hand now (None: no job)."""
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            if job_id:
                os.pwrite(self._fd, job_id.encode("ascii"), 0)

    @contextlib.contextmanager
    def holding(self, job_id: str | None):
        """Mark job_id as in hand for the duration of the block."""
        self.mark(job_id)
        try:
            yield
        finally:
            self.mark(None)
