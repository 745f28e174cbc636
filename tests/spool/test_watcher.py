"""The incoming/ watcher (opt_ds_ops.spool.watcher): when a dropped file is complete, on real inotify."""

from __future__ import annotations

import contextlib
import errno
import os
import time

from conftest import put

from opt_ds_ops.spool import INCOMING
from opt_ds_ops.spool.watcher import IncomingWatcher


# ---- the watcher ---------------------------------------------------------------------------------

@contextlib.contextmanager
def watching(w: IncomingWatcher):
    """Start w (inotify unless it falls back), yield (w, how it watches), stop it at the end."""
    how = w.start()
    try:
        yield w, how
    finally:
        w.stop()


def make_watcher(spool, settle_s=0.3, quiet_s=3600.0, **kw) -> IncomingWatcher:
    return IncomingWatcher(spool.dir(INCOMING), settle_s=settle_s, quiet_s=quiet_s, rescan_s=kw.pop("rescan_s", 60.0),
                           **kw)


def wait_ready(w: IncomingWatcher, expect, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        w.tick()
        got = w.ready()
        if got == expect:
            return got
        time.sleep(0.05)
    raise AssertionError(f"ready() is {w.ready()}, expected {expect}")


def test_a_copied_in_file_is_ready_after_close_and_settle_in_arrival_order(spool):
    with watching(make_watcher(spool)) as (w, how):
        assert how == "inotify"
        w.tick()
        put(spool, INCOMING, "b-first.csv")
        time.sleep(0.05)
        put(spool, INCOMING, "a-second.csv")
        put(spool, INCOMING, "ignored.csv.part")
        wait_ready(w, ["b-first.csv", "a-second.csv"])


def test_a_file_held_open_by_a_paused_writer_is_not_ready_until_closed(spool):
    """A writer that pauses longer than settle_s, quiet_s and the rescan interval."""
    with watching(make_watcher(spool, settle_s=0.1, quiet_s=0.2, rescan_s=0.1)) as (w, how):
        w.tick()
        with open(spool.path(INCOMING, "slow.csv"), "wb") as f:
            for _ in range(4):
                f.write(b"1,2\n")
                f.flush()
                deadline = time.monotonic() + 0.6  # a pause 3x quiet_s, 6x the rescan interval
                while time.monotonic() < deadline:
                    w.tick()
                    assert w.ready() == []
                    time.sleep(0.05)
        wait_ready(w, ["slow.csv"])


def test_a_file_renamed_in_is_ready_at_once_without_settling(spool):
    with watching(make_watcher(spool, settle_s=3600)) as (w, how):
        w.tick()
        put(spool, INCOMING, "a.csv.part")
        os.rename(spool.path(INCOMING, "a.csv.part"), spool.path(INCOMING, "a.csv"))
        outside = os.path.join(os.path.dirname(spool.root), "b.csv")
        with open(outside, "wb") as f:
            f.write(b"1,2\n")
        os.rename(outside, spool.path(INCOMING, "b.csv"))
        t0 = time.monotonic()
        wait_ready(w, ["a.csv", "b.csv"], timeout_s=10)
        assert time.monotonic() - t0 < 3600


def test_a_part_file_renamed_while_its_writer_still_has_it_open_waits_for_the_close(spool):
    with watching(make_watcher(spool, settle_s=0.0)) as (w, how):
        w.tick()
        f = open(spool.path(INCOMING, "c.csv.part"), "wb")
        f.write(b"1,2\n")
        f.flush()
        os.rename(spool.path(INCOMING, "c.csv.part"), spool.path(INCOMING, "c.csv"))
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            assert w.ready() == []
            time.sleep(0.05)
        f.write(b"3,4\n")
        f.close()
        wait_ready(w, ["c.csv"])


def test_a_file_found_by_a_scan_waits_quiet_s(spool):
    put(spool, INCOMING, "old.csv")  # there before the daemon started: no event will ever say it is complete
    w = make_watcher(spool, settle_s=0.0, quiet_s=0.5)
    w.tick(now=100.0)
    assert w.ready(now=100.0) == []
    assert w.ready(now=100.4) == []
    assert w.ready(now=100.6) == ["old.csv"]


def test_a_file_still_growing_is_not_ready_without_any_event(spool):
    w = make_watcher(spool, settle_s=0.0, quiet_s=0.5, mode="poll")
    w.start()
    path = put(spool, INCOMING, "growing.csv")
    w.tick()
    for _ in range(5):
        with open(path, "ab") as f:
            f.write(b"5,6\n")
        time.sleep(0.2)
        assert w.ready() == []
    wait_ready(w, ["growing.csv"])


def test_special_files_are_offered_once_and_then_left_alone_until_replaced(spool):
    with watching(make_watcher(spool, settle_s=3600)) as (w, how):
        os.mkfifo(spool.path(INCOMING, "fifo.csv"))
        wait_ready(w, ["fifo.csv"])
        w.ignore("fifo.csv")
        assert w.ready() == [] and w.ignored() == 1 and w.queued() == 0
        os.unlink(spool.path(INCOMING, "fifo.csv"))
        os.mkdir(spool.path(INCOMING, "fifo.csv"))  # a new inode under the same name is looked at again
        wait_ready(w, ["fifo.csv"])


def test_inotify_limit_reached_falls_back_to_polling(spool, monkeypatch):
    import watchdog.observers.inotify as wi

    class Exhausted:
        def __init__(self, *a, **kw):
            raise OSError(errno.EMFILE, "inotify instance limit reached")

    monkeypatch.setattr(wi, "InotifyObserver", Exhausted)
    w = make_watcher(spool, settle_s=0.1, quiet_s=0.1)
    how = w.start()
    assert w.polling and "inotify instance limit reached EMFILE" in how and "max_user_instances" in how
    put(spool, INCOMING, "found-by-polling.csv")
    wait_ready(w, ["found-by-polling.csv"], timeout_s=10)


def test_an_inotify_overflow_forgets_open_counts_and_falls_back_to_quiet_s(spool):
    w = make_watcher(spool, settle_s=0.0, quiet_s=0.5)
    put(spool, INCOMING, "x.csv")
    w.note(spool.path(INCOMING, "x.csv"), "opened")
    w.note(spool.path(INCOMING, "x.csv"), "writing")  # its writer's close event was lost in the overflow
    w.tick(now=10.0)
    assert w.ready(now=20.0) == []
    assert w.ready(now=30.0) == []  # held by a writer: busy however long it is unchanged
    w.overflowed()
    assert w.ready(now=30.1) == ["x.csv"]  # judged as scan-found: unchanged since 20.0, over quiet_s


def test_an_inotify_overflow_does_not_restart_the_wait_of_a_file_already_quiet(spool):
    """A member who floods incoming/ to overflow the queue every few seconds must
    not keep everyone's files from ever becoming ready."""
    w = make_watcher(spool, settle_s=0.0, quiet_s=0.5)
    put(spool, INCOMING, "y.csv")
    w.tick(now=10.0)
    assert w.ready(now=10.1) == []  # scan-found: waits quiet_s from its first look
    w.overflowed()
    assert w.ready(now=10.7) == ["y.csv"]


def test_a_file_that_changed_while_being_copied_is_offered_again_only_after_a_delay(spool):
    w = make_watcher(spool, settle_s=0.0, quiet_s=0.0, mode="poll")
    put(spool, INCOMING, "y.csv")
    w.tick()
    assert w.ready() == ["y.csv"]
    w.retry_later("y.csv", 0.5)
    assert w.ready() == []
    time.sleep(0.6)
    assert w.ready() == ["y.csv"]


def test_forget_and_vanished_files_leave_the_queue(spool):
    w = make_watcher(spool, settle_s=0.0, mode="poll")
    w.start()
    put(spool, INCOMING, "a.csv")
    put(spool, INCOMING, "b.csv")
    w.tick()
    assert w.queued() == 2
    w.forget("a.csv")
    os.unlink(spool.path(INCOMING, "b.csv"))
    assert w.ready() == [] and w.queued() == 0
