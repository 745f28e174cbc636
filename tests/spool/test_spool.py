"""The spool lifecycle and the incoming/ watcher, in-process on temporary directories."""

from __future__ import annotations

import hashlib
import stat
import subprocess
import sys
import os
import socket
import threading

import pytest

from conftest import put

from opt_ds_ops import spool as sp
from opt_ds_ops.fsutil import utc_now
from opt_ds_ops.spool import DONE, FAILED, INCOMING, PROCESSING, SpoolError


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
        for suffix in (sp.RESULT_SUFFIX, sp.ERROR_SUFFIX):
            side = sp.sidecar_name(name, suffix)
            assert len(os.fsencode(side)) <= 255 and side.endswith(suffix)
    assert sp.sidecar_name(a, sp.RESULT_SUFFIX) != sp.sidecar_name(b, sp.RESULT_SUFFIX)
    assert sp.sidecar_name("short.csv", sp.RESULT_SUFFIX) == "short.csv.result.json"


@pytest.mark.parametrize("name", ["", ".", "..", "../etc/passwd", "a/b", "x\0y"])
def test_a_name_that_is_not_one_path_component_is_refused(spool, name):
    with pytest.raises(SpoolError):
        spool.path(INCOMING, name)


# ---- claiming: the bytes, not the name --------------------------------------------------------------

def in_thread(fn, timeout_s=30.0):
    """Run fn in a thread; fail if it blocks (a FIFO opened for reading blocks forever)."""
    box = {}
    t = threading.Thread(target=lambda: box.update(value=fn()), daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), f"{fn} blocked (opened a FIFO?)"
    return box["value"]


def test_claim_copies_the_bytes_into_a_daemon_owned_file_and_drops_the_users_inode(spool):
    data = b"1,2\n3,4\n" * 1000
    put(spool, INCOMING, "a.csv", data)
    c = sp.claim(spool, "a.csv", 10**6)
    assert c.outcome == "claimed" and c.record["state"] == "claimed"
    assert c.record["sha256"] == hashlib.sha256(data).hexdigest() and c.record["size_bytes"] == len(data)
    copy = spool.job_path(c.job_id, c.record["data_file"])
    assert c.record["data_file"] == "dataset.csv" and open(copy, "rb").read() == data
    assert stat.S_IMODE(os.stat(copy).st_mode) == 0o600
    assert sorted(os.listdir(spool.job_dir(c.job_id))) == ["dataset.csv", "job.json"]
    assert sp.read_record(spool, c.job_id) == c.record
    assert os.listdir(spool.dir(INCOMING)) == []


@pytest.mark.parametrize("kind", ["fifo", "dir", "socket", "symlink"])
def test_claim_never_opens_renames_or_reads_what_is_not_a_regular_file(spool, kind):
    path = spool.path(INCOMING, "v.csv")
    sock = None
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        os.mkdir(path, 0o755)
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(path)
    else:
        os.symlink("/etc/passwd", path)
    try:
        c = in_thread(lambda: sp.claim(spool, "v.csv", 10**6))
    finally:
        if sock:
            sock.close()
    assert c.outcome == "ignored" and "only regular files are taken" in c.reason
    assert os.path.lexists(path) and os.listdir(spool.dir(PROCESSING)) == []


def test_a_hard_link_is_refused_and_its_other_name_left_alone(spool, tmp_path):
    """An inode with another name may be another member's file (a link Bob made to
    Alice's group-writable .part): who dropped it cannot be told, so it is refused, not trained."""
    put(spool, INCOMING, "linked.csv")
    os.link(spool.path(INCOMING, "linked.csv"), str(tmp_path / "other-name"))
    c = sp.claim(spool, "linked.csv", 1000)
    assert c.outcome == "refused" and "2 hard links" in c.reason
    assert (tmp_path / "other-name").read_bytes() == b"1,2\n3,4\n"


def test_an_oversized_file_is_refused_and_an_empty_one_removed(spool):
    put(spool, INCOMING, "big.csv", b"x" * 101)
    put(spool, INCOMING, "empty.csv", b"")
    big = sp.claim(spool, "big.csv", 100)
    assert big.outcome == "refused" and "101 bytes, larger than spool.max_dataset_bytes (100 bytes)" in big.reason
    assert sp.finish(spool, big.job_id, big.record, FAILED, {"job_id": big.job_id}) == "big.csv"
    assert open(spool.path(FAILED, "big.csv"), "rb").read() == b"x" * 101
    empty = sp.claim(spool, "empty.csv", 100)
    assert empty.outcome == "empty" and not os.path.exists(spool.job_path(empty.job_id, sp.SOURCE_FILE))
    sp.discard_job(spool, empty.job_id)
    assert os.listdir(spool.dir(INCOMING)) == [] and os.listdir(spool.dir(PROCESSING)) == []


def test_an_unreadable_file_is_refused_as_the_service_user_sees_it(spool):
    """Run as a service user would: as root, in a process without the DAC-override capabilities."""
    from daemon_kit import base_env, drop_dac_capabilities

    path = put(spool, INCOMING, "secret.csv")
    os.chmod(path, 0)
    code = ("import sys; from opt_ds_ops import spool as sp; "
            "c = sp.claim(sp.Spool(sys.argv[1]), 'secret.csv', 1000); print(c.outcome, c.reason)")
    r = subprocess.run([sys.executable, "-c", code, spool.root], capture_output=True, text=True, env=base_env(),
                       preexec_fn=drop_dac_capabilities if os.geteuid() == 0 else None, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("refused unreadable: permission denied (mode ----------, owner uid")


def test_a_writer_that_keeps_writing_after_the_claim_changes_nothing_trained(spool):
    """The owner appends, truncates and rewrites through an fd kept open."""
    f = open(spool.path(INCOMING, "w.csv"), "wb")
    f.write(b"1,2\n3,4\n")
    f.flush()
    c = sp.claim(spool, "w.csv", 1000)
    assert c.outcome == "claimed"
    f.write(b"5,6\n")
    f.truncate(0)
    f.write(b"garbage")
    f.close()
    assert open(spool.job_path(c.job_id, "dataset.csv"), "rb").read() == b"1,2\n3,4\n"
    assert c.record["sha256"] == hashlib.sha256(b"1,2\n3,4\n").hexdigest()
    assert os.listdir(spool.dir(INCOMING)) == []


def test_a_file_that_changes_while_it_is_copied_is_put_back_untouched(spool, monkeypatch):
    put(spool, INCOMING, "grow.csv", b"1,2\n" * 1000)
    real_read = os.read

    def read_then_append(fd, n):  # the owner appends while the daemon copies (a second writer, not a fake)
        with open(spool.job_path(job_dirs()[0], sp.SOURCE_FILE), "ab") as w:
            w.write(b"3,4\n")
        return real_read(fd, n)

    def job_dirs():
        return sp.job_ids(spool)

    monkeypatch.setattr(os, "read", read_then_append)  # the copy in opt_ds_ops.spool.claiming reads with os.read
    c = sp.claim(spool, "grow.csv", 10**6)
    monkeypatch.undo()
    assert c.outcome == "busy" and "changed while being copied" in c.reason
    assert os.listdir(spool.dir(PROCESSING)) == []
    assert open(spool.path(INCOMING, "grow.csv"), "rb").read().count(b"3,4\n") >= 1


def test_a_claim_cut_by_sigkill_is_finished_or_undone_at_recovery(spool):
    # killed after the rename, before the copy: the copy is made at recovery
    put(spool, INCOMING, "k.csv")
    job = sp.new_job_id()
    os.mkdir(spool.job_dir(job))
    record = {"job_id": job, "dataset": "k.csv", "state": "claiming", "claimed_at": utc_now()}
    sp.write_json(spool.job_path(job, sp.JOB_FILE), record)
    os.rename(spool.path(INCOMING, "k.csv"), spool.job_path(job, sp.SOURCE_FILE))
    c = sp.recover_claim(spool, job, record, 1000)
    assert c.outcome == "claimed" and open(spool.job_path(job, "dataset.csv"), "rb").read() == b"1,2\n3,4\n"
    assert not os.path.exists(spool.job_path(job, sp.SOURCE_FILE))
    # killed before the rename: nothing of a user's in the job directory, which goes
    job2 = sp.new_job_id()
    os.mkdir(spool.job_dir(job2))
    r2 = {"job_id": job2, "dataset": "never.csv", "state": "claiming"}
    sp.write_json(spool.job_path(job2, sp.JOB_FILE), r2)
    assert sp.recover_claim(spool, job2, r2, 1000).outcome == "gone"
    assert sp.job_ids(spool) == [job]


def test_a_claim_killed_after_its_copy_before_its_sidecar_takes_the_sidecar_at_recovery(spool, monkeypatch):
    """Found reviewing the puller's sweep of lone sidecars: a daemon killed after the record said
    ``claimed`` and before the sidecar was renamed in left the sidecar in incoming/ for good (the
    recovery took it only if it was half taken), so the job ran under its file's name, not the one
    the sidecar gave. Now the record says when the sidecar step is done, and recovery does it if not."""
    from opt_ds_ops.spool import claiming

    put(spool, INCOMING, "h.train-1.yaml", b"name: h\n")
    put(spool, INCOMING, "h.train-1.csv")

    class Killed(BaseException):
        pass

    def killed(*_a, **_k):
        raise Killed

    monkeypatch.setattr(claiming, "take_sidecar", killed)
    with pytest.raises(Killed):
        sp.claim(spool, "h.train-1.csv", 1000)
    monkeypatch.undo()
    (job,) = sp.job_ids(spool)
    record = sp.read_json(spool.job_path(job, sp.JOB_FILE))
    assert record["state"] == "claimed" and "sidecar_done" not in record
    assert os.path.exists(spool.path(INCOMING, "h.train-1.yaml"))
    c = sp.recover_claim(spool, job, record, 1000)
    assert c.outcome == "claimed" and c.record["sidecar"] == "h.train-1.yaml" and c.record["sidecar_done"]
    assert open(spool.job_path(job, sp.SIDECAR_FILE), "rb").read() == b"name: h\n"
    assert not os.path.exists(spool.path(INCOMING, "h.train-1.yaml"))
    # a claim that took its sidecar (or found none) is not looked at again: a later drop's sidecar of
    # the same name stays the later drop's
    put(spool, INCOMING, "h.train-1.yaml", b"name: later\n")
    again = sp.recover_claim(spool, job, sp.read_json(spool.job_path(job, sp.JOB_FILE)), 1000)
    assert again.outcome == "claimed" and os.path.exists(spool.path(INCOMING, "h.train-1.yaml"))
    # killed after the sidecar was copied in, before the record said so: the copy stands, the later
    # drop's sidecar is not taken over it
    record = sp.read_json(spool.job_path(job, sp.JOB_FILE))
    del record["sidecar_done"]
    sp.write_json(spool.job_path(job, sp.JOB_FILE), record)
    again = sp.recover_claim(spool, job, record, 1000)
    assert again.record["sidecar_done"] and open(spool.job_path(job, sp.SIDECAR_FILE), "rb").read() == b"name: h\n"
    assert open(spool.path(INCOMING, "h.train-1.yaml"), "rb").read() == b"name: later\n"


# ---- finishing -----------------------------------------------------------------------------------

def claimed(spool, name, data=b"1,2\n3,4\n"):
    put(spool, INCOMING, name, data)
    c = sp.claim(spool, name, 10**6)
    assert c.outcome == "claimed"
    return c


def test_finish_numbers_a_second_dataset_of_the_same_name_instead_of_replacing(spool):
    for i in range(3):
        c = claimed(spool, "m.csv", f"rows {i}".encode())
        final = sp.finish(spool, c.job_id, c.record, DONE, {"job_id": c.job_id})
        assert final == ["m.csv", "m.csv.1", "m.csv.2"][i]
        assert sp.read_json(os.path.join(spool.dir(DONE), final + ".result.json"))["dataset_file"] == final
    assert open(spool.path(DONE, "m.csv"), "rb").read() == b"rows 0"
    assert os.listdir(spool.dir(PROCESSING)) == []


def test_finish_of_a_job_killed_after_its_move_reuses_its_json(spool):
    c = claimed(spool, "m.csv")
    sp.write_json(os.path.join(spool.dir(DONE), "m.csv.result.json"), {"job_id": c.job_id, "partial": True})
    os.rename(spool.job_path(c.job_id, "dataset.csv"), spool.path(DONE, "m.csv"))  # killed right after this
    assert sp.finish(spool, c.job_id, c.record, DONE, {"job_id": c.job_id}) == "m.csv"
    assert "partial" not in sp.read_json(os.path.join(spool.dir(DONE), "m.csv.result.json"))
    assert os.listdir(spool.dir(PROCESSING)) == []


def test_finish_of_a_job_killed_between_its_json_and_its_move_reuses_the_name(spool):
    # found by the CI fuzz soak (seed 18): the replay moved the dataset to done/m.csv.1 beside a stale
    # m.csv.result.json, so one dataset had two results and none under its own name
    c = claimed(spool, "m.csv")
    sp.write_json(os.path.join(spool.dir(DONE), "m.csv.result.json"), {"job_id": c.job_id, "partial": True})
    assert sp.finish(spool, c.job_id, c.record, DONE, {"job_id": c.job_id}) == "m.csv"
    assert sorted(os.listdir(spool.dir(DONE))) == ["m.csv", "m.csv.result.json"]
    assert "partial" not in sp.read_json(os.path.join(spool.dir(DONE), "m.csv.result.json"))


def test_finish_does_not_take_the_name_of_another_jobs_json(spool):
    c = claimed(spool, "m.csv")
    sp.write_json(os.path.join(spool.dir(DONE), "m.csv.result.json"), {"job_id": "another"})
    assert sp.finish(spool, c.job_id, c.record, DONE, {"job_id": c.job_id}) == "m.csv.1"


def test_odd_names_survive_the_whole_lifecycle_literally(spool):
    names = ["-rf --no-preserve-root.csv", "a  b.csv", "données ü 日本.csv", os.fsdecode(b"bad-\xff-utf8.csv"),
             "new\nline.csv", "job.json", "lock", "v.error.json"]
    for name in names:
        c = claimed(spool, name)
        assert sp.finish(spool, c.job_id, c.record, DONE, {"job_id": c.job_id, "dataset": name}) == name
        assert sp.read_json(os.path.join(spool.dir(DONE), sp.sidecar_name(name, sp.RESULT_SUFFIX)))["dataset"] == name
    done = sorted(n for n in os.listdir(spool.dir(DONE)) if not n.endswith((".result.json",)) or n in names)
    assert set(names) <= set(done)
    assert os.listdir(os.path.dirname(spool.root)) == ["spool"]  # nothing written outside the spool


def test_failed_keeps_the_newest_max_failed(spool):
    for i in range(5):
        c = claimed(spool, f"bad-{i}.csv")
        sp.finish(spool, c.job_id, c.record, FAILED, {"job_id": c.job_id})
        os.utime(spool.path(FAILED, f"bad-{i}.csv.error.json"), ns=(i * 10**9, i * 10**9))  # when it failed
    assert sp.prune_failed(spool, 3) == ["bad-0.csv", "bad-1.csv"]
    assert sorted(os.listdir(spool.dir(FAILED))) == sorted(
        [f"bad-{i}.csv" for i in (2, 3, 4)] + [f"bad-{i}.csv.error.json" for i in (2, 3, 4)])


def test_datasets_an_older_ds_ops_left_in_processing_go_back_to_incoming(spool):
    put(spool, PROCESSING, "old.csv")
    put(spool, PROCESSING, ".old.csv.job.json", b"{}")
    put(spool, INCOMING, "old.csv", b"a newer drop of the same name")
    assert sp.migrate_legacy(spool) == ["old.csv.1"]
    assert os.listdir(spool.dir(PROCESSING)) == []
    assert open(spool.path(INCOMING, "old.csv"), "rb").read() == b"a newer drop of the same name"


def test_checkpoint_round_trips_with_weights_only_and_a_broken_one_is_reported(spool):
    import torch

    c = claimed(spool, "a.csv")
    sp.save_checkpoint(spool, c.job_id, {"job_id": "j", "checkpoint": {"w": torch.ones(3), "epoch": 2}})
    obj, why = sp.load_checkpoint(spool, c.job_id)
    assert why == "" and obj["checkpoint"]["epoch"] == 2 and torch.equal(obj["checkpoint"]["w"], torch.ones(3))
    with open(spool.job_path(c.job_id, sp.CHECKPOINT_FILE), "wb") as f:
        f.write(b"not a checkpoint")
    obj, why = sp.load_checkpoint(spool, c.job_id)
    assert obj is None and "unreadable" in why


def test_job_lock_is_exclusive_and_dies_with_its_holder(spool):
    c = claimed(spool, "a.csv")
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
        "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)"),
        spool.job_path(c.job_id, sp.LOCK_FILE)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert sp.lock_job(spool, c.job_id) is None
    finally:
        holder.kill()
        holder.wait()
    fd = sp.lock_job(spool, c.job_id)
    assert fd is not None
    os.close(fd)


def test_read_json_never_blocks_on_a_fifo_or_follows_a_link(spool):
    os.mkfifo(spool.path(FAILED, "v.error.json"))
    os.symlink("/etc/passwd", spool.path(DONE, "x.result.json"))
    assert in_thread(lambda: sp.read_json(spool.path(FAILED, "v.error.json"))) is None
    assert sp.read_json(spool.path(DONE, "x.result.json")) is None


def test_open_spool_names_the_path_that_cannot_be_used(tmp_path):
    (tmp_path / "spool").write_text("a file")
    with pytest.raises(SpoolError, match=f"spool directory {tmp_path / 'spool'}/incoming is not usable"):
        sp.open_spool(str(tmp_path / "spool"))


def test_spool_status_shows_queue_ignored_entries_jobs_and_latest_results(spool):
    put(spool, INCOMING, "queued.csv")
    put(spool, INCOMING, "upload.part")
    os.mkfifo(spool.path(INCOMING, "pipe.csv"))
    os.mkdir(spool.path(INCOMING, "adir"))
    busy = claimed(spool, "busy.csv")
    busy.record.update(state="running", epoch=3, epochs=5, pid=os.getpid(), boot_id=sp.boot_id())
    sp.save_record(spool, busy.record)
    put(spool, INCOMING, "queued.csv")
    other = claimed(spool, "other.csv")
    other.record.update(state="running", pid=2**22 + 7)
    sp.save_record(spool, other.record)
    sp.write_json(os.path.join(spool.dir(DONE), "old.csv.result.json"), {"job_id": "j9", "model_dir": "/m"})
    os.mkfifo(spool.path(FAILED, "x.error.json"))
    st = in_thread(lambda: sp.spool_status(spool))
    assert st["queue"] == ["queued.csv"]
    assert st["ignored"] == [{"name": "adir", "kind": "a directory"}, {"name": "pipe.csv", "kind": "a FIFO (named pipe)"}]
    first, second = st["processing"]
    assert first["dataset"] == "busy.csv" and first["epoch"] == 3 and first["daemon_alive"] is True
    assert second["daemon_alive"] is False and second["checkpoint"] is False
    assert st["done_count"] == 1 and st["recent_done"][0]["model_dir"] == "/m"




def test_temporary_json_files_a_sigkill_left_are_removed_at_start_up(spool):
    """Found by the soak: a kill between write_json's temporary file and its rename in done/."""
    put(spool, DONE, ".tmp-a3oihku_", b'{"job_id": "j"}')
    put(spool, FAILED, ".tmp-zz", b"{")
    put(spool, DONE, "m.csv")
    removed = sp.remove_stale_temps(spool)
    assert sorted(os.path.basename(p) for p in removed) == [".tmp-a3oihku_", ".tmp-zz"]
    assert os.listdir(spool.dir(DONE)) == ["m.csv"] and os.listdir(spool.dir(FAILED)) == []


def test_a_job_being_claimed_by_a_live_daemon_is_alive_in_status(spool):
    """A record in state claiming has no job pid yet: the spool's daemon (the pid in .daemon.lock) has it."""
    job_id = sp.new_job_id()
    os.mkdir(spool.job_dir(job_id))
    sp.write_json(spool.job_path(job_id, sp.JOB_FILE), {"job_id": job_id, "dataset": "big.csv", "state": "claiming"})
    st = sp.spool_status(spool)
    assert st["daemon_pid"] is None and st["processing"][0]["daemon_alive"] is False
    fd = sp.lock_spool(spool)  # this process stands in for the daemon
    try:
        st = sp.spool_status(spool)
        assert st["daemon_pid"] == os.getpid() and st["processing"][0]["daemon_alive"] is True
    finally:
        os.close(fd)
    assert sp.spool_status(spool)["daemon_pid"] is None  # the lock file stays, with this live pid in it


def test_a_job_killed_inside_finish_keeps_the_name_its_sidecar_gave_it(spool, monkeypatch):
    # the hostile review of 2560ed3: a kill after finish() moved sidecar.yaml to done/ but before the
    # job directory went made the job run again under the file's stem ('a'), missing its saved
    # version of 'disk-latency' (trained again under the wrong name, or ended as a duplicate and its
    # dataset deleted); now the sidecar moves after the dataset, and a saved job keeps its reported name
    from opt_ds_ops.daemon import worker
    from opt_ds_ops.config.conffile import Config
    from opt_ds_ops.spool import filing as finishing

    put(spool, INCOMING, "a.yaml", b"name: disk-latency\n")
    c = claimed(spool, "a.csv")
    sp.take_sidecar(spool, c.job_id, c.record)
    cfg = Config()
    assert worker.name_job(spool, c.job_id, c.record, cfg)[:2] == ("disk-latency", True)
    record = dict(c.record, state="saved", model_name="disk-latency", name_explicit=True)
    sp.save_record(spool, record)

    class Killed(BaseException):
        pass

    moves = []
    real_replace = os.replace

    def replace(src, dst):
        moves.append((os.path.basename(src), os.path.lexists(spool.job_path(c.job_id, "dataset.csv"))))
        raise Killed

    monkeypatch.setattr(finishing.os, "replace", replace)
    with pytest.raises(Killed):
        sp.finish(spool, c.job_id, record, DONE, {"job_id": c.job_id})
    assert moves == [("sidecar.yaml", False)]  # the dataset is in done/ before its sidecar moves
    assert worker.name_job(spool, c.job_id, record, cfg)[:2] == ("disk-latency", True)
    monkeypatch.setattr(finishing.os, "replace", real_replace)

    real_rmtree = finishing.shutil.rmtree
    monkeypatch.setattr(finishing.shutil, "rmtree", lambda path: (_ for _ in ()).throw(Killed()))
    with pytest.raises(Killed):  # killed after the sidecar moved too, before the job directory went
        sp.finish(spool, c.job_id, record, DONE, {"job_id": c.job_id})
    monkeypatch.setattr(finishing.shutil, "rmtree", real_rmtree)
    assert not os.path.lexists(spool.job_path(c.job_id, "sidecar.yaml"))
    assert worker.name_job(spool, c.job_id, record, cfg)[:2] == ("disk-latency", True)
    assert sp.finish(spool, c.job_id, record, DONE, {"job_id": c.job_id}) == "a.csv"
    assert sorted(os.listdir(spool.dir(DONE))) == ["a.csv", "a.csv.result.json", "a.csv.sidecar.yaml"]


def test_only_root_requeues_another_uploaders_file(spool, monkeypatch):
    # as the service user the copies could not be given back to their uploader: offered again as the
    # service's own files they would train any model, whoever dropped them (hostile review of 2560ed3)
    from opt_ds_ops.spool import filing as finishing

    c = claimed(spool, "x.csv")
    record = dict(c.record, uploader_uid=1001)
    sp.finish(spool, c.job_id, record, FAILED, {"job_id": c.job_id, "dataset": "x.csv", "uploader_uid": 1001})
    monkeypatch.setattr(finishing.os, "geteuid", lambda: 4242)  # the service user, not root
    with pytest.raises(SpoolError, match="dropped by uid 1001: only root can requeue it"):
        sp.requeue(spool, "x.csv")
    assert os.path.lexists(spool.path(FAILED, "x.csv"))  # nothing moved
    monkeypatch.setattr(finishing.os, "geteuid", lambda: 1001)  # its uploader
    assert sp.requeue(spool, "x.csv")["dataset"] == "x.csv"


@pytest.mark.parametrize("by, cleared", [(1001, True), (1002, False)])
def test_a_later_success_clears_a_failure_only_if_the_same_uploader_dropped_it(spool, by, cleared):
    # hostile review of 2560ed3: another member's success of a file of the same name cleared
    # someone's failure from status (the headline's N failed and "latest failed")
    put(spool, FAILED, "x.csv", b"bad")
    sp.write_json(spool.path(FAILED, "x.csv.error.json"),
                  {"job_id": "j1", "dataset": "x.csv", "failed_at": "2026-12-01T10:00:00.000000Z", "uploader_uid": 1001})
    put(spool, DONE, "x.csv", b"1,2\n")
    sp.write_json(spool.path(DONE, "x.csv.result.json"),
                  {"job_id": "j2", "dataset": "x.csv", "finished_at": "2026-12-01T11:00:00.000000Z", "uploader_uid": by})
    assert (sp.spool_status(spool)["recent_failed"] == []) is cleared


def test_a_sparse_drop_stays_sparse_in_the_daemons_copy(spool):
    """`truncate -s 512M` (nothing on disk) then a line at the end: the daemon's copy, which goes
    to failed/ when it does not parse, takes the blocks of that line, not 512 MiB of the
    service's. Before, every hole was written out: 1,000 such 4 GiB drops held about 4 TiB."""
    import hashlib

    path = spool.path(INCOMING, "holes.csv")
    with open(path, "wb") as f:
        f.truncate(512 << 20)
        f.seek(0, os.SEEK_END)
        f.write(b"1,2\n")
    c = sp.claim(spool, "holes.csv", 1 << 30)
    assert c.outcome == "claimed"
    copy = os.path.join(spool.job_dir(c.job_id), c.record["data_file"])
    st = os.stat(copy)
    print(f"\ncopy: {st.st_size:,} bytes long, {st.st_blocks * 512:,} bytes on disk")
    assert st.st_size == (512 << 20) + 4 and st.st_blocks * 512 <= 1 << 20
    h = hashlib.sha256()
    with open(copy, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    assert c.record["sha256"] == h.hexdigest() and c.record["size_bytes"] == st.st_size
    sp.finish(spool, c.job_id, c.record, FAILED, {"job_id": c.job_id})
    assert os.stat(spool.path(FAILED, "holes.csv")).st_blocks * 512 <= 1 << 20
