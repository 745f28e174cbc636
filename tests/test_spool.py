"""The spool lifecycle and the incoming/ watcher, in-process on temporary directories."""

from __future__ import annotations

import errno
import os
import socket
import threading
import time

import pytest

from opt_ds_ops import spool as sp
from opt_ds_ops.spool import DONE, FAILED, INCOMING, PROCESSING, SpoolError
from opt_ds_ops.watcher import IncomingWatcher


@pytest.fixture
def spool(tmp_path):
    return sp.open_spool(str(tmp_path / "spool"))


def put(spool, which, name, data=b"1,2\n3,4\n"):
    path = spool.path(which, name)
    with open(path, "wb") as f:
        f.write(data)
    return path


# ---- names ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, ignored", [
    (".hidden.csv", True), ("upload.csv.part", True), ("upload.csv.tmp", True), ("UPLOAD.PART", True),
    ("machine-1-2.txt.gz", False), ("-rf.csv", False), ("part.csv", False), ("a b ü.csv", False),
])
def test_dot_files_and_part_and_tmp_names_are_ignored(name, ignored):
    assert sp.is_ignored(name) is ignored


def test_sidecar_names_of_a_255_byte_dataset_name_fit_and_stay_distinct():
    a, b = "é" * 120 + "a.csv", "é" * 120 + "b.csv"  # 245 bytes each
    for name in (a, b):
        for suffix, hidden in ((sp.RESULT_SUFFIX, False), (sp.JOB_SUFFIX, True), (sp.CHECKPOINT_SUFFIX, True)):
            side = sp.sidecar_name(name, suffix, hidden=hidden)
            assert len(os.fsencode(side)) <= 255 and side.endswith(suffix)
            assert side.startswith(".") is hidden
    assert sp.sidecar_name(a, sp.RESULT_SUFFIX) != sp.sidecar_name(b, sp.RESULT_SUFFIX)
    assert sp.sidecar_name("short.csv", sp.RESULT_SUFFIX) == "short.csv.result.json"


@pytest.mark.parametrize("name", ["", ".", "..", "../etc/passwd", "a/b", "x\0y"])
def test_a_name_that_is_not_one_path_component_is_refused(spool, name):
    with pytest.raises(SpoolError):
        spool.path(INCOMING, name)


# ---- what may be taken ---------------------------------------------------------------------------

def test_inspect_refuses_links_special_files_and_oversized_without_opening(spool, tmp_path):
    incoming = spool.dir(INCOMING)
    os.mkfifo(os.path.join(incoming, "fifo.csv"))
    os.symlink("/etc/passwd", os.path.join(incoming, "link.csv"))
    os.mkdir(os.path.join(incoming, "dir.csv"))
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(os.path.join(incoming, "sock.csv"))
    put(spool, INCOMING, "linked.csv")
    os.link(os.path.join(incoming, "linked.csv"), str(tmp_path / "other-name"))
    put(spool, INCOMING, "big.csv", b"x" * 101)
    put(spool, INCOMING, "fine.csv", b"x" * 100)
    results = {}

    def inspect_all():  # a FIFO opened for reading would block this thread forever
        for name in os.listdir(incoming):
            results[name] = sp.inspect_entry(os.path.join(incoming, name), max_bytes=100)[1]

    t = threading.Thread(target=inspect_all, daemon=True)
    t.start()
    t.join(30)
    sock.close()
    assert not t.is_alive(), "inspect_entry blocked (opened a FIFO?)"
    assert "FIFO" in results["fifo.csv"]
    assert "symbolic link (to '/etc/passwd')" in results["link.csv"]
    assert "a directory" in results["dir.csv"]
    assert "a socket" in results["sock.csv"]
    assert "hard link (2 names" in results["linked.csv"]
    assert "101 bytes, larger than spool.max_dataset_bytes (100 bytes)" in results["big.csv"]
    assert results["fine.csv"] is None
    assert sp.inspect_entry(os.path.join(incoming, "gone.csv"), 100) == (None, None)


def test_check_claimed_notices_a_file_replaced_after_the_first_look(spool):
    path = put(spool, PROCESSING, "x.csv")
    first = os.lstat(path)
    os.unlink(path)
    put(spool, PROCESSING, "x.csv", b"1,2\n3,4\n5,6\n")
    assert "replaced or written to" in sp.check_claimed(path, first, 1000)
    assert sp.check_claimed(path, os.lstat(path), 1000) is None


def test_check_claimed_reports_an_unreadable_file(spool):
    """Run as a service user would: as root, in a process without the DAC-override capabilities."""
    import subprocess
    import sys

    from daemon_kit import base_env, drop_dac_capabilities

    path = put(spool, PROCESSING, "secret.csv")
    os.chmod(path, 0)
    code = ("import os, sys; from opt_ds_ops.spool import check_claimed; "
            "print(check_claimed(sys.argv[1], os.lstat(sys.argv[1]), 1000))")
    r = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, env=base_env(),
                       preexec_fn=drop_dac_capabilities if os.geteuid() == 0 else None, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "unreadable: Permission denied (mode ----------, owner uid" in r.stdout


# ---- lifecycle -----------------------------------------------------------------------------------

def test_claim_writes_the_record_first_and_moves_the_file(spool):
    put(spool, INCOMING, "a.csv")
    assert sp.claim(spool, "a.csv", {"job_id": "j1"})
    assert os.path.exists(spool.path(PROCESSING, "a.csv")) and not os.path.exists(spool.path(INCOMING, "a.csv"))
    assert sp.read_json(spool.record_path("a.csv")) == {"job_id": "j1"}
    assert not sp.claim(spool, "vanished.csv", {"job_id": "j2"})
    assert not os.path.exists(spool.record_path("vanished.csv"))


def test_claim_never_replaces_a_dataset_already_in_processing(spool):
    put(spool, PROCESSING, "a.csv", b"first")
    put(spool, INCOMING, "a.csv", b"second")
    assert not sp.claim(spool, "a.csv", {"job_id": "j"})
    assert open(spool.path(PROCESSING, "a.csv"), "rb").read() == b"first"


def test_finish_numbers_a_second_dataset_of_the_same_name_instead_of_replacing(spool):
    for i, job in enumerate(["j1", "j2", "j3"]):
        put(spool, PROCESSING, "m.csv", f"rows {i}".encode())
        sp.write_json(spool.record_path("m.csv"), {"job_id": job})
        final = sp.finish(spool, "m.csv", PROCESSING, DONE, {"job_id": job})
        assert final == ["m.csv", "m.csv.1", "m.csv.2"][i]
        assert sp.read_json(os.path.join(spool.dir(DONE), final + ".result.json"))["dataset_file"] == final
    assert open(spool.path(DONE, "m.csv"), "rb").read() == b"rows 0"
    assert os.listdir(spool.dir(PROCESSING)) == []


def test_finish_reuses_the_json_of_an_earlier_attempt_of_the_same_job(spool):
    sp.write_json(os.path.join(spool.dir(DONE), "m.csv.result.json"), {"job_id": "j1", "partial": True})
    put(spool, PROCESSING, "m.csv")
    assert sp.finish(spool, "m.csv", PROCESSING, DONE, {"job_id": "j1"}) == "m.csv"
    assert "partial" not in sp.read_json(os.path.join(spool.dir(DONE), "m.csv.result.json"))


def test_refusing_from_incoming_leaves_another_jobs_files_in_processing_alone(spool):
    put(spool, PROCESSING, "same.csv")
    sp.write_json(spool.record_path("same.csv"), {"job_id": "running"})
    os.mkfifo(spool.path(INCOMING, "same.csv"))
    sp.finish(spool, "same.csv", INCOMING, FAILED, {"job_id": "refused", "reason": "a FIFO"})
    assert sp.read_json(spool.record_path("same.csv")) == {"job_id": "running"}


def test_odd_names_survive_the_whole_lifecycle_literally(spool):
    names = ["-rf --no-preserve-root.csv", "a  b.csv", "données ü 日本.csv", os.fsdecode(b"bad-\xff-utf8.csv"),
             "new\nline.csv"]
    for name in names:
        put(spool, INCOMING, name)
        assert sp.claim(spool, name, {"job_id": name})
        assert sp.finish(spool, name, PROCESSING, DONE, {"job_id": name, "dataset": name}) == name
        assert sp.read_json(os.path.join(spool.dir(DONE), sp.sidecar_name(name, sp.RESULT_SUFFIX)))["dataset"] == name
    assert sorted(n for n in os.listdir(spool.dir(DONE)) if not n.endswith(".json")) == sorted(names)
    assert os.listdir(os.path.dirname(spool.root)) == ["spool"]  # nothing written outside the spool


def test_orphaned_job_files_are_removed_and_a_datasets_own_are_kept(spool):
    put(spool, PROCESSING, "live.csv")
    sp.write_json(spool.record_path("live.csv"), {"job_id": "a"})
    sp.write_json(spool.record_path("gone.csv"), {"job_id": "b"})
    put(spool, PROCESSING, ".tmp-abc123", b"half a checkpoint")
    assert sorted(sp.remove_orphans(spool)) == [".gone.csv.job.json", ".tmp-abc123"]
    assert sorted(os.listdir(spool.dir(PROCESSING))) == [".live.csv.job.json", "live.csv"]


def test_checkpoint_round_trips_with_weights_only_and_a_broken_one_is_reported(spool):
    import torch

    put(spool, PROCESSING, "a.csv")
    sp.save_checkpoint(spool, "a.csv", {"job_id": "j", "checkpoint": {"w": torch.ones(3), "epoch": 2}})
    obj, why = sp.load_checkpoint(spool, "a.csv")
    assert why == "" and obj["checkpoint"]["epoch"] == 2 and torch.equal(obj["checkpoint"]["w"], torch.ones(3))
    with open(spool.checkpoint_path("a.csv"), "wb") as f:
        f.write(b"not a checkpoint")
    obj, why = sp.load_checkpoint(spool, "a.csv")
    assert obj is None and "unreadable" in why
    assert sp.load_checkpoint(spool, "none.csv") == (None, "no checkpoint")


def test_open_spool_names_the_path_that_cannot_be_used(tmp_path):
    (tmp_path / "spool").write_text("a file")
    with pytest.raises(SpoolError, match=f"spool directory {tmp_path / 'spool'}/incoming is not usable"):
        sp.open_spool(str(tmp_path / "spool"))


def test_spool_status_shows_queue_running_job_and_latest_results(spool):
    put(spool, INCOMING, "queued.csv")
    put(spool, INCOMING, "upload.part")
    put(spool, PROCESSING, "busy.csv")
    sp.write_json(spool.record_path("busy.csv"), {"job_id": "j1", "state": "running", "epoch": 3, "epochs": 5,
                                                  "pid": os.getpid(), "boot_id": sp.boot_id()})
    put(spool, PROCESSING, "other.csv")
    sp.write_json(spool.record_path("other.csv"), {"job_id": "j0", "state": "running", "pid": 2**22 + 7})
    sp.write_json(os.path.join(spool.dir(DONE), "old.csv.result.json"), {"job_id": "j9", "model_dir": "/m"})
    st = sp.spool_status(spool)
    assert st["queue"] == ["queued.csv"]
    busy, other = st["processing"]
    assert busy["dataset"] == "busy.csv" and busy["epoch"] == 3 and busy["daemon_alive"] is True
    assert other["daemon_alive"] is False and other["checkpoint"] is False
    assert st["done_count"] == 1 and st["recent_done"][0]["model_dir"] == "/m" and st["failed_count"] == 0


# ---- the watcher ---------------------------------------------------------------------------------

def make_watcher(spool, settle_s=0.3, **kw) -> IncomingWatcher:
    return IncomingWatcher(spool.dir(INCOMING), settle_s=settle_s, rescan_s=kw.pop("rescan_s", 60.0), **kw)


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
    w = make_watcher(spool)
    assert w.start() == "inotify"
    try:
        w.tick()
        put(spool, INCOMING, "b-first.csv")
        time.sleep(0.05)
        put(spool, INCOMING, "a-second.csv")
        put(spool, INCOMING, "ignored.csv.part")
        wait_ready(w, ["b-first.csv", "a-second.csv"])
    finally:
        w.stop()


def test_a_file_held_open_by_a_slow_writer_is_not_ready_until_closed(spool):
    w = make_watcher(spool, settle_s=0.2)
    w.start()
    try:
        w.tick()
        with open(spool.path(INCOMING, "slow.csv"), "wb") as f:
            for _ in range(10):  # pauses longer than settle_s, file kept open
                f.write(b"1,2\n")
                f.flush()
                time.sleep(0.3)
                assert w.ready() == []
        wait_ready(w, ["slow.csv"])
    finally:
        w.stop()


def test_a_file_still_growing_is_not_ready_without_any_event(spool):
    w = make_watcher(spool, settle_s=0.5, mode="poll")
    w.start()
    path = put(spool, INCOMING, "growing.csv")
    w.tick()
    for _ in range(5):
        with open(path, "ab") as f:
            f.write(b"5,6\n")
        time.sleep(0.2)
        assert w.ready() == []
    wait_ready(w, ["growing.csv"])


def test_special_files_are_ready_at_once_to_be_refused(spool):
    w = make_watcher(spool, settle_s=3600)
    w.start()
    try:
        os.mkfifo(spool.path(INCOMING, "fifo.csv"))
        wait_ready(w, ["fifo.csv"])
    finally:
        w.stop()


def test_inotify_limit_reached_falls_back_to_polling(spool, monkeypatch):
    import watchdog.observers.inotify as wi

    class Exhausted:
        def __init__(self, *a, **kw):
            raise OSError(errno.EMFILE, "inotify instance limit reached")

    monkeypatch.setattr(wi, "InotifyObserver", Exhausted)
    w = make_watcher(spool, settle_s=0.1)
    how = w.start()
    assert w.polling and "inotify instance limit reached EMFILE" in how and "max_user_instances" in how
    put(spool, INCOMING, "found-by-polling.csv")
    wait_ready(w, ["found-by-polling.csv"], timeout_s=10)


def test_a_lost_close_event_is_recovered_by_the_rescan(spool):
    w = make_watcher(spool, settle_s=0.0, rescan_s=0.2)
    put(spool, INCOMING, "x.csv")
    w.note(spool.path(INCOMING, "x.csv"), "writing")  # its close-after-write event never comes
    assert w.ready() == []
    w.tick(now=time.monotonic())  # the first scan sees events since the last one: still writing
    assert w.ready() == []
    w.tick(now=time.monotonic() + 1)  # no event for a whole scan interval: taken as closed
    assert w.ready() == ["x.csv"]


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
