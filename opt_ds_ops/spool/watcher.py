"""Watching the spool's ``incoming/``: when is a dropped dataset complete and ready to claim?

Events come from watchdog's inotify observer (open, close-after-write, close-without-write,
modification, moves in and out, creation, deletion); a scan at start-up and every
``spool.scan_interval_s`` catches what events cannot tell (files that arrived while the daemon was
down). If inotify cannot be used (instance or watch limit reached) or ``spool.watcher`` is
``poll``, the directory is rescanned every :data:`POLL_INTERVAL_S` instead.

A regular file is ready when no one has it open (opens minus closes seen by inotify, carried
across renames, so a ``.part`` file still open when renamed stays busy), or when the only opens
since its last close-after-write are reads and it has been unchanged for ``spool.quiet_s``:
another member who opens a dataset and keeps it open cannot hold it up (a writer's write while
it is open keeps it busy until the close; the claim's copy puts back a file that changes), and:

* it arrived by ``rename(2)`` into incoming/: at once (the safe way to drop a file);
* it was closed after writing: once unchanged for ``spool.settle_s``;
* it was only found by a scan (present at start-up, or no event seen: polling, an inotify queue
  overflow): once unchanged for ``spool.quiet_s``. Whether a writer still holds such a file open
  cannot be known (another user's /proc is hidden from the service), hence the longer wait.

Anything that is not a regular file is ready at once, to be looked at and reported once; the
daemon then marks it ignored, and it is not offered again until its inode changes.
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

from . import is_ignored

POLL_INTERVAL_S = 1.0


class _ShutdownNoise(logging.Filter):
    """Drop watchdog's benign "queue_events() called when the thread is inactive" on observer stop."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "called when the thread is inactive" not in record.getMessage()


logging.getLogger("watchdog.observers.inotify").addFilter(_ShutdownNoise())


@dataclass
class _Entry:
    seq: int  # arrival order (first come, first served)
    how: str  # moved (arrived by rename), closed (closed after writing), open (being written), scan
    opens: int = 0  # opens minus closes seen by inotify
    written: bool = False  # written while open since the last close-after-write: a writer holds it
    sig: tuple | None = None  # (size, mtime_ns, inode, link count) at the last look
    stable_since: float = 0.0  # monotonic seconds since which sig is unchanged
    ignored_ino: int | None = None  # not a regular file: reported once, left alone while this inode stays
    not_before: float = 0.0  # monotonic seconds: not offered again before (it changed while being copied)


class _Handler(FileSystemEventHandler):
    """Forwards watchdog events (on the observer thread) to the watcher."""

    def __init__(self, watcher: "IncomingWatcher"):
        self.watcher = watcher

    def on_any_event(self, event) -> None:
        kind = event.event_type
        if kind == "moved":
            self.watcher.moved(event.src_path or None, event.dest_path or None)
        elif kind == "closed":
            self.watcher.note(event.src_path, "closed")
        elif kind == "closed_no_write":
            self.watcher.note(event.src_path, "closed_no_write")
        elif kind == "opened":
            self.watcher.note(event.src_path, "opened")
        elif kind == "created":
            self.watcher.note(event.src_path, "created")
        elif kind == "modified" and not event.is_directory:
            self.watcher.note(event.src_path, "writing")
        elif kind == "deleted":
            self.watcher.note(event.src_path, "gone")


class _OverflowSignal(logging.Handler):
    """watchdog reports a kernel inotify queue overflow only as a log warning: turn it into a rescan."""

    def __init__(self, watcher: "IncomingWatcher"):
        super().__init__(logging.WARNING)
        self.watcher = watcher

    def emit(self, record: logging.LogRecord) -> None:
        if "overflow" in record.getMessage().lower():
            self.watcher.overflowed()


class IncomingWatcher:
    """Tracks names in incoming/ and says which are ready to claim, oldest arrival first.

    ``settle_s``, ``quiet_s`` and ``rescan_s`` are seconds (``spool.settle_s``, ``spool.quiet_s``,
    ``spool.scan_interval_s``); ``mode`` is ``inotify`` or ``poll`` (``spool.watcher``).
    Thread-safe: watchdog's thread calls :meth:`note`/:meth:`moved`, the daemon's main thread the rest.
    """

    def __init__(self, incoming: str, *, settle_s: float, rescan_s: float, quiet_s: float = 60.0,
                 mode: str = "inotify"):
        self.incoming = os.path.abspath(incoming)
        self.settle_s, self.rescan_s, self.quiet_s, self.mode = settle_s, rescan_s, quiet_s, mode
        self.polling_reason: str | None = None
        self._entries: dict[str, _Entry] = {}
        self._opens_hidden: dict[str, int] = {}  # opens of ignored names (.part files being written)
        self._written_hidden: set[str] = set()  # ignored names written while open (a writer holds them)
        self._lock = threading.Lock()
        self._seq = itertools.count()
        self._observer = None
        self._overflow_handler = None
        self._next_scan = 0.0
        self.wakeup = threading.Event()  # set on every event: the daemon's idle wait ends at once

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
                self._overflow_handler = _OverflowSignal(self)
                logging.getLogger("watchdog.observers.inotify_c").addHandler(self._overflow_handler)
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
        if self._overflow_handler is not None:
            logging.getLogger("watchdog.observers.inotify_c").removeHandler(self._overflow_handler)
            self._overflow_handler = None

    def set_timing(self, settle_s: float, rescan_s: float, quiet_s: float | None = None) -> None:
        """Apply new ``spool.settle_s`` / ``spool.scan_interval_s`` / ``spool.quiet_s`` (SIGHUP reload)."""
        with self._lock:
            self.settle_s, self.rescan_s = settle_s, rescan_s
            if quiet_s is not None:
                self.quiet_s = quiet_s
            self._next_scan = 0.0

    def _name(self, path: str | None) -> str | None:
        if not path or os.path.dirname(path) != self.incoming:
            return None
        return os.path.basename(path) or None

    def _entry(self, name: str, how: str) -> _Entry:
        entry = self._entries.get(name)
        if entry is None:
            entry = self._entries[name] = _Entry(next(self._seq), how=how)
        return entry

    def note(self, path: str, what: str) -> None:
        """Record an event for path: ``created``, ``opened``, ``writing``, ``closed``,
        ``closed_no_write`` or ``gone``."""
        name = self._name(path)
        if name is None:
            return
        self.wakeup.set()
        with self._lock:
            if is_ignored(name):
                n = self._opens_hidden.get(name, 0) + {"opened": 1, "closed": -1, "closed_no_write": -1}.get(what, 0)
                if what == "gone" or n <= 0:
                    self._opens_hidden.pop(name, None)
                else:
                    self._opens_hidden[name] = n
                if what == "writing" and n > 0:
                    self._written_hidden.add(name)
                elif what in ("closed", "gone") or n <= 0:
                    self._written_hidden.discard(name)
                return
            if what == "gone":
                self._entries.pop(name, None)
                return
            entry = self._entry(name, "open")
            if what == "opened":
                entry.opens += 1
            elif what in ("closed", "closed_no_write"):
                entry.opens = max(0, entry.opens - 1)
                if what == "closed":
                    entry.how, entry.written = "closed", False
            elif what == "writing":
                entry.how = "open"
                entry.written = entry.opens > 0

    def moved(self, src: str | None, dest: str | None) -> None:
        """Record a rename: src leaves incoming/ (or None: came from elsewhere), dest arrives (or None)."""
        src_name, dest_name = self._name(src), self._name(dest)
        self.wakeup.set()
        with self._lock:
            opens, written = 0, False
            if src_name is not None:
                if is_ignored(src_name):
                    opens = self._opens_hidden.pop(src_name, 0)
                    written = src_name in self._written_hidden
                    self._written_hidden.discard(src_name)
                else:
                    old = self._entries.pop(src_name, None)
                    opens, written = (old.opens, old.written) if old else (0, False)
            if dest_name is None:
                return
            if is_ignored(dest_name):
                if opens:
                    self._opens_hidden[dest_name] = opens
                if written:
                    self._written_hidden.add(dest_name)
                return
            entry = self._entries.get(dest_name)
            if entry is None:
                entry = self._entries[dest_name] = _Entry(next(self._seq), how="moved")
            entry.how, entry.opens, entry.sig = "moved", opens, None
            entry.written = written and opens > 0  # renamed in while its writer still holds it: wait for the close

    def idle(self, timeout_s: float) -> None:
        """Wait up to timeout_s seconds for the next event (the daemon's idle sleep)."""
        self.wakeup.wait(timeout_s)
        self.wakeup.clear()

    def overflowed(self) -> None:
        """The kernel dropped inotify events: forget open counts, judge every file as scan-found."""
        with self._lock:
            self._opens_hidden.clear()
            self._written_hidden.clear()
            for entry in self._entries.values():
                # an unchanged file is no less quiet for the lost events: its stable_since stays (a
                # member who floods incoming/ to overflow the queue must not restart everyone's wait)
                entry.opens, entry.how, entry.written = 0, "scan", False
            self._next_scan = 0.0

    def scan(self) -> None:
        """List incoming/: add new names (as scan-found), drop vanished ones."""
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
                self._entry(name, "scan")

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
                if entry.ignored_ino is not None:
                    if entry.ignored_ino == st.st_ino:
                        continue
                    entry.ignored_ino = None
                if not stat.S_ISREG(st.st_mode):
                    out.append(name)
                    continue
                if now < entry.not_before:
                    continue
                sig = (st.st_size, st.st_mtime_ns, st.st_ino, st.st_nlink)
                if sig != entry.sig:
                    entry.sig, entry.stable_since = sig, now
                if entry.opens > 0:  # held open: by its writer (wait for the close) or by a reader
                    if not entry.written and st.st_size and now - entry.stable_since >= self.quiet_s:
                        out.append(name)  # only read while open, unchanged for quiet_s: a reader cannot hold it up
                    continue
                if entry.how == "moved":
                    out.append(name)
                elif entry.how == "closed" and now - entry.stable_since >= self.settle_s:
                    out.append(name)
                elif entry.how in ("scan", "open") and now - entry.stable_since >= self.quiet_s:
                    out.append(name)
        return out

    def ignore(self, name: str) -> None:
        """Leave name alone (not a regular file, already reported) until its inode changes."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                return
            try:
                entry.ignored_ino = os.lstat(os.path.join(self.incoming, name)).st_ino
            except FileNotFoundError:
                self._entries.pop(name, None)

    def retry_later(self, name: str, delay_s: float) -> None:
        """name changed while being copied: offer it again only after it was closed (or quiet_s)
        and not before delay_s seconds."""
        with self._lock:
            entry = self._entry(name, "open")
            entry.how, entry.sig = "open", None
            entry.not_before = time.monotonic() + delay_s

    def forget(self, name: str) -> None:
        """Stop tracking name (it was claimed or refused)."""
        with self._lock:
            self._entries.pop(name, None)

    def queued(self) -> int:
        """Return how many regular files in incoming/ are tracked (ready or still settling)."""
        with self._lock:
            return sum(1 for e in self._entries.values() if e.ignored_ino is None)

    def ignored(self) -> int:
        """Return how many entries are left alone (not regular files)."""
        with self._lock:
            return sum(1 for e in self._entries.values() if e.ignored_ino is not None)
