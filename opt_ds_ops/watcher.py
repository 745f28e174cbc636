"""Watching the spool's ``incoming/``: when is a dropped dataset complete and ready to claim?

Events come from watchdog's inotify observer (close-after-write, moves in and out, creation,
modification); a scan at start-up and a rescan every ``spool.scan_interval_s`` catch what events
miss (files that arrived while the daemon was down, an inotify queue overflow). If inotify cannot
be used (instance or watch limit reached) or ``spool.watcher`` is ``poll``, the directory is
rescanned every :data:`POLL_INTERVAL_S` instead.

A regular file is ready once it is not being written (a close-after-write or a move into
incoming/ was seen since its last modification, or it was found by a scan) and its size, mtime,
inode and link count have not changed for ``spool.settle_s``. Anything that is not a regular file
is ready at once: it will be refused without being opened. The writer contract (write under a
hidden or .part/.tmp name, then rename) makes a file ready after the settle time alone.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import stat
import threading
import time
from dataclasses import dataclass

from watchdog.events import FileSystemEventHandler

from .spool import is_ignored

POLL_INTERVAL_S = 1.0


class _ShutdownNoise(logging.Filter):
    """Drop watchdog's benign "queue_events() called when the thread is inactive" on observer stop."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "called when the thread is inactive" not in record.getMessage()


logging.getLogger("watchdog.observers.inotify").addFilter(_ShutdownNoise())


@dataclass
class _Entry:
    seq: int  # arrival order (first come, first served)
    writing: bool  # a modification was seen after the last close-after-write
    evented: bool  # an event arrived since the last scan
    sig: tuple | None = None  # (size, mtime_ns, inode, link count) at the last look
    stable_since: float = 0.0  # monotonic seconds since which sig is unchanged


class _Handler(FileSystemEventHandler):
    """Forwards watchdog events (on the observer thread) to the watcher."""

    def __init__(self, watcher: "IncomingWatcher"):
        self.watcher = watcher

    def on_any_event(self, event) -> None:
        kind = event.event_type
        if kind == "moved":
            if event.src_path:
                self.watcher.note(event.src_path, "gone")
            if event.dest_path:
                self.watcher.note(event.dest_path, "complete")
        elif kind == "closed":
            self.watcher.note(event.src_path, "complete")
        elif kind == "created":
            self.watcher.note(event.src_path, "created")
        elif kind == "modified" and not event.is_directory:
            self.watcher.note(event.src_path, "writing")
        elif kind == "deleted":
            self.watcher.note(event.src_path, "gone")


class IncomingWatcher:
    """Tracks names in incoming/ and says which are ready to claim, oldest arrival first.

    ``settle_s`` and ``rescan_s`` are seconds (``spool.settle_s``, ``spool.scan_interval_s``);
    ``mode`` is ``inotify`` or ``poll`` (``spool.watcher``). Thread-safe: watchdog's thread calls
    :meth:`note`, the daemon's main thread everything else.
    """

    def __init__(self, incoming: str, *, settle_s: float, rescan_s: float, mode: str = "inotify"):
        self.incoming = os.path.abspath(incoming)
        self.settle_s, self.rescan_s, self.mode = settle_s, rescan_s, mode
        self.polling_reason: str | None = None
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()
        self._seq = itertools.count()
        self._observer = None
        self._next_scan = 0.0

    @property
    def polling(self) -> bool:
        return self.polling_reason is not None

    def start(self) -> str:
        """Start watching; return how ("inotify" or "polling every 1.0 s: <why>").

        An OSError from inotify (EMFILE: instance limit, ENOSPC: watch limit, or any other)
        switches to polling rather than failing.
        """
        if self.mode == "poll":
            self.polling_reason = "spool.watcher is 'poll'"
        else:
            try:
                from watchdog.observers.inotify import InotifyObserver

                observer = InotifyObserver(generate_full_events=True)
                observer.schedule(_Handler(self), self.incoming)
                observer.start()
                self._observer = observer
            except OSError as e:
                name = errno.errorcode.get(e.errno, "") if e.errno else ""
                hint = " (raise fs.inotify.max_user_instances / max_user_watches)" if e.errno in (
                    errno.EMFILE, errno.ENOSPC) else ""
                self.polling_reason = f"inotify cannot be used: {e.strerror or e}{' ' + name if name else ''}{hint}"
        return f"polling every {POLL_INTERVAL_S} s: {self.polling_reason}" if self.polling else "inotify"

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the observer thread (waits at most timeout_s seconds)."""
        if self._observer is not None:
            self._observer.stop()
            self._observer.join(timeout_s)
            self._observer = None

    def set_timing(self, settle_s: float, rescan_s: float) -> None:
        """Apply new ``spool.settle_s`` / ``spool.scan_interval_s`` (after a SIGHUP reload)."""
        with self._lock:
            self.settle_s, self.rescan_s = settle_s, rescan_s
            self._next_scan = 0.0

    def note(self, path: str, what: str) -> None:
        """Record an event for path: ``created``, ``writing``, ``complete`` or ``gone``."""
        if os.path.dirname(path) != self.incoming:
            return
        name = os.path.basename(path)
        if not name or is_ignored(name):
            return
        with self._lock:
            if what == "gone":
                self._entries.pop(name, None)
                return
            entry = self._entries.get(name)
            if entry is None:
                entry = self._entries[name] = _Entry(next(self._seq), writing=False, evented=True)
            entry.evented = True
            if what == "complete":
                entry.writing = False
            elif what == "writing":
                entry.writing = True
            elif what == "created":
                entry.writing = self._opened_for_writing(path)

    @staticmethod
    def _opened_for_writing(path: str) -> bool:
        """A created regular file with one link is being written (its close event will follow)."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return False
        return stat.S_ISREG(st.st_mode) and st.st_nlink == 1

    def scan(self) -> None:
        """List incoming/: add new names, drop vanished ones; a name still marked as being
        written with no event since the last scan is taken as closed (its event was lost)."""
        names = []
        with os.scandir(self.incoming) as it:
            for e in it:
                if not is_ignored(e.name):
                    try:
                        names.append((e.stat(follow_symlinks=False).st_mtime_ns, e.name))
                    except FileNotFoundError:
                        pass
        present = {n for _, n in names}
        with self._lock:
            for name in list(self._entries):
                if name not in present:
                    del self._entries[name]
            for _, name in sorted(names):
                entry = self._entries.get(name)
                if entry is None:
                    self._entries[name] = _Entry(next(self._seq), writing=False, evented=False)
                else:
                    if entry.writing and not entry.evented:
                        entry.writing = False
                    entry.evented = False

    def tick(self, now: float | None = None) -> bool:
        """Rescan if one is due (every rescan_s, or POLL_INTERVAL_S when polling); return True if it ran."""
        now = time.monotonic() if now is None else now
        if now < self._next_scan:
            return False
        self.scan()
        self._next_scan = now + (POLL_INTERVAL_S if self.polling else self.rescan_s)
        return True

    def ready(self, now: float | None = None) -> list[str]:
        """Return the names ready to claim, oldest arrival first (see the module docstring)."""
        now = time.monotonic() if now is None else now
        out = []
        with self._lock:
            for name, entry in sorted(self._entries.items(), key=lambda kv: kv[1].seq):
                try:
                    st = os.lstat(os.path.join(self.incoming, name))
                except FileNotFoundError:
                    del self._entries[name]
                    continue
                if not stat.S_ISREG(st.st_mode):
                    out.append(name)
                    continue
                if entry.writing:
                    continue
                sig = (st.st_size, st.st_mtime_ns, st.st_ino, st.st_nlink)
                if sig != entry.sig:
                    entry.sig, entry.stable_since = sig, now
                if now - entry.stable_since >= self.settle_s:
                    out.append(name)
        return out

    def forget(self, name: str) -> None:
        """Stop tracking name (it was claimed or refused)."""
        with self._lock:
            self._entries.pop(name, None)

    def queued(self) -> int:
        """Return how many names in incoming/ are tracked (ready or still settling)."""
        with self._lock:
            return len(self._entries)
