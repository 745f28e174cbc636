"""sd_notify(3) for the daemon, through systemd-python's ``systemd.daemon.notify``.

Messages: ``READY=1`` after the start-up scan, ``STATUS=...`` kept current, ``WATCHDOG=1`` while
the main loop is alive, ``EXTEND_TIMEOUT_USEC=...`` around long start-up and stop steps,
``RELOADING=1`` on SIGHUP and ``STOPPING=1`` on the way out. Without ``NOTIFY_SOCKET`` (not run
by systemd) every call is a no-op.

The watchdog: a small thread sends ``WATCHDOG=1`` every half ``WATCHDOG_USEC`` (set by the unit's
``WatchdogSec=``) for as long as the main thread has promised to be alive: the main loop calls
:meth:`Notifier.keepalive` with a budget (seconds) on every tick and every training batch, and a
larger one before a step that cannot report progress (reading a large dataset). A main thread
that hangs past its budget stops the pings and systemd restarts the service.
"""

from __future__ import annotations

import os
import threading
import time


def _watchdog_interval_s(environ) -> float | None:
    """Return the ping interval (half of WATCHDOG_USEC, seconds) if the watchdog is on for this process."""
    usec = environ.get("WATCHDOG_USEC", "")
    pid = environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if pid and pid != str(os.getpid()):
        return None
    return int(usec) / 2e6


class Notifier:
    """Sends sd_notify messages; ``enabled`` is False where NOTIFY_SOCKET is not set."""

    def __init__(self, environ=None):
        environ = os.environ if environ is None else environ
        self.enabled = bool(environ.get("NOTIFY_SOCKET"))
        self.watchdog_interval_s = _watchdog_interval_s(environ) if self.enabled else None
        self._alive_until = 0.0
        self._last_status = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def send(self, *lines: str) -> None:
        """Send one sd_notify message made of ``KEY=value`` lines (a no-op without NOTIFY_SOCKET)."""
        if not self.enabled:
            return
        from systemd import daemon

        daemon.notify("\n".join(lines))

    def ready(self, status: str) -> None:
        """READY=1 with STATUS=status: start-up (or a SIGHUP reload) is complete."""
        self._last_status = status
        self.send("READY=1", f"STATUS={status}")

    def status(self, text: str) -> None:
        """Send STATUS=text unless it is what was last sent."""
        if text != self._last_status:
            self._last_status = text
            self.send(f"STATUS={text}")

    def extend_timeout(self, seconds: float) -> None:
        """Ask systemd for seconds more before the start or stop timeout (EXTEND_TIMEOUT_USEC)."""
        self.send(f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}")

    def reloading(self) -> None:
        """RELOADING=1 with MONOTONIC_USEC (a READY=1 follows when the reload is done)."""
        monotonic_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self.send("RELOADING=1", f"MONOTONIC_USEC={monotonic_usec}")

    def stopping(self, status: str) -> None:
        """STOPPING=1 with STATUS=status: the service is on its way out."""
        self.send("STOPPING=1", f"STATUS={status}")

    def keepalive(self, budget_s: float) -> None:
        """Promise that the main thread reports again within budget_s seconds (keeps WATCHDOG=1 going)."""
        self._alive_until = time.monotonic() + budget_s

    def start_watchdog(self) -> None:
        """Start the thread that sends WATCHDOG=1 (only if the unit set WatchdogSec=)."""
        if self.watchdog_interval_s is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._pinger, name="sd-watchdog", daemon=True)
        self._thread.start()

    def stop_watchdog(self) -> None:
        """Stop the WATCHDOG=1 thread (waits at most 2 s)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)

    def _pinger(self) -> None:
        while not self._stop.is_set():
            if time.monotonic() < self._alive_until:
                self.send("WATCHDOG=1")
            self._stop.wait(self.watchdog_interval_s)
