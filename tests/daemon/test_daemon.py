"""The real ``ds-ops daemon`` process on temporary spool and models directories."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import threading
import time

import numpy as np
import pytest

from conftest import SMD_TRAIN, run_cli
from daemon_kit import (
    SMD_ROWS, START_TIMEOUT_S, Daemon, NotifySocket, base_env, copy_smd, done_names, drop_dac_capabilities,
    failed_names, job_context, job_dir, job_in_processing, job_record, read_json, run_until, save_version, spool_dir,
    versions, write_config,
)


def sha256(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def started(d: Daemon, root) -> None:
    """Wait until the daemon has made its spool directories and logged that it is ready."""
    d.wait_until(lambda: "ds-trainer ready" in d.log(), "the daemon to be ready", timeout_s=START_TIMEOUT_S)


def slow_write(path, data: bytes, seconds: float, chunks: int = 20) -> None:
    """Write data to path in chunks over about `seconds`, keeping the file open all along."""
    with open(path, "wb") as f:
        step = len(data) // chunks + 1
        for i in range(0, len(data), step):
            f.write(data[i:i + step])
            f.flush()
            time.sleep(seconds / chunks)


# ---- acceptance 1 ---------------------------------------------------------------------------------

@pytest.mark.slow  # a long run: see the marker in pyproject.toml
def test_twenty_datasets_dropped_at_once_are_each_trained_exactly_once(tmp_path):
    d = Daemon(write_config(tmp_path, epochs=1, settle_s=1.0))
    try:
        started(d, tmp_path)
        incoming = spool_dir(tmp_path, "incoming")
        outside = tmp_path / "staging"
        outside.mkdir()
        data = SMD_TRAIN.read_bytes()
        writer = threading.Thread(target=slow_write, args=(incoming / "slow-writer.txt.gz", data, 4.0))
        t0 = time.monotonic()
        writer.start()
        for i in range(10):  # copied in directly
            shutil.copyfile(SMD_TRAIN, incoming / f"copy-{i:02d}.txt.gz")
        for i in range(6):  # the documented contract: a .part name, then a rename
            copy_smd(incoming / f"renamed-{i:02d}.txt.gz.part")
            os.rename(incoming / f"renamed-{i:02d}.txt.gz.part", incoming / f"renamed-{i:02d}.txt.gz")
        for i in range(3):  # written elsewhere on the file system, moved in
            copy_smd(outside / f"moved-{i:02d}.txt.gz")
            os.rename(outside / f"moved-{i:02d}.txt.gz", incoming / f"moved-{i:02d}.txt.gz")
        writer.join()
        expected = {f"copy-{i:02d}.txt.gz" for i in range(10)} | {f"renamed-{i:02d}.txt.gz" for i in range(6)} \
            | {f"moved-{i:02d}.txt.gz" for i in range(3)} | {"slow-writer.txt.gz"}
        assert len(expected) == 20
        d.wait_until(lambda: done_names(tmp_path) == expected, "20 datasets in done/", timeout_s=600, poll_s=0.5)
        elapsed = time.monotonic() - t0
        assert d.alive()
        rc, _ = d.stop()
        assert rc == 0
    finally:
        d.kill()
    print(f"\n20 SMD files (23,694 x 38, 1 epoch each): all in done/ {elapsed:.1f} s after the first drop")
    assert failed_names(tmp_path) == set()
    assert list(spool_dir(tmp_path, "incoming").iterdir()) == []
    assert list(spool_dir(tmp_path, "processing").iterdir()) == []
    model_dirs = set()
    for name in expected:
        stem = name[: -len(".txt.gz")]
        assert len(versions(tmp_path, stem)) == 1, f"{stem} trained {len(versions(tmp_path, stem))} times"
        result = read_json(spool_dir(tmp_path, "done") / f"{name}.result.json")
        assert result["rows"] == SMD_ROWS and result["columns"] == 38
        assert result["sha256"] == sha256(SMD_TRAIN)  # the slow writer's file was claimed complete
        assert os.path.isfile(os.path.join(result["model_dir"], "model.pt"))
        assert result["device"] == "cpu" and result["epochs"] == 1 and result["duration_s"] > 0
        model_dirs.add(result["model_dir"])
    assert len(model_dirs) == 20
    assert sha256(spool_dir(tmp_path, "done") / "slow-writer.txt.gz") == sha256(SMD_TRAIN)


# ---- acceptance 2 ---------------------------------------------------------------------------------

def _bad_inputs(stage_dir, incoming, tmp_path) -> dict:
    """Create every bad-input kind; return {name in incoming: (stage, reason pattern)}."""
    def text(name, body):
        (stage_dir / name).write_text(body)

    text("one-row.csv", "1,2,3\n")
    text("non-numeric.csv", "1,2,3\n4,x,6\n")
    text("ragged.csv", "1,2,3\n4,5\n")
    text("nan.csv", "1,2,3\n4,nan,6\n")
    np.save(stage_dir / "rank3.npy", np.zeros((2, 3, 4), np.float32))
    np.save(stage_dir / "object.npy", np.array([[1, "a"], [2, "b"]], dtype=object), allow_pickle=True)
    text("table.xlsx", "1,2\n3,4\n")
    text("unreadable.csv", "1,2,3\n4,5,6\n")
    os.chmod(stage_dir / "unreadable.csv", 0)
    with open(stage_dir / "oversized.csv", "wb") as f:  # sparse: larger than max_dataset_bytes, nothing written
        f.truncate(10_000_000)
    for name in os.listdir(stage_dir):
        os.rename(stage_dir / name, incoming / name)
    return {
        "one-row.csv": ("dataset", r"1 row\(s\); at least 2"),
        "non-numeric.csv": ("dataset", r"line 2, column 2: 'x' is not a number"),
        "ragged.csv": ("dataset", r"line 2: ragged rows"),
        "nan.csv": ("dataset", r"line 2, column 2: a missing value \(empty, NA or NaN\)"),
        "rank3.npy": ("dataset", r"rank 3"),
        "object.npy": ("dataset", r"not a plain numeric \.npy"),
        "table.xlsx": ("dataset", r"unknown dataset format"),
        "unreadable.csv": ("spool", r"unreadable: permission denied"),
        "oversized.csv": ("spool", r"10000000 bytes, larger than spool.max_dataset_bytes \(9000000 bytes\)"),
    }


def _left_alone(incoming) -> dict:
    """Entries that are not regular files: reported once, never opened, moved or read."""
    os.symlink(SMD_TRAIN, incoming / "symlink.txt.gz")
    os.mkfifo(incoming / "fifo.csv")
    os.mkdir(incoming / "a-directory.csv")
    return {"symlink.txt.gz": "a symbolic link", "fifo.csv": "a FIFO", "a-directory.csv": "a directory"}


def test_every_bad_input_ends_in_failed_with_a_reason_and_the_next_good_file_is_served(tmp_path):
    import re

    # 9 MB: the good SMD file inflates to 8.3 MB, and decompressed bytes count against this limit too
    conf = write_config(tmp_path, max_dataset_bytes=9_000_000, settle_s=0.5)
    # As root, the daemon runs without the capabilities that let root read a mode-000 file.
    d = Daemon(conf, preexec_fn=drop_dac_capabilities if os.geteuid() == 0 else None)
    try:
        started(d, tmp_path)
        stage_dir = tmp_path / "staging"
        stage_dir.mkdir()
        incoming = spool_dir(tmp_path, "incoming")
        expected = _bad_inputs(stage_dir, incoming, tmp_path)
        left = _left_alone(incoming)
        (incoming / "empty.csv").write_text("")
        odd_name = "-rf  données ünï (2).csv"  # taken literally: leading dash, spaces, unicode
        np.savetxt(stage_dir / odd_name, np.loadtxt(SMD_TRAIN, delimiter=",")[:2000], delimiter=",")
        time.sleep(1.0)  # the good files come after every bad one
        os.rename(stage_dir / odd_name, incoming / odd_name)
        copy_smd(incoming / "good.txt.gz")
        d.wait_until(lambda: done_names(tmp_path) == {"good.txt.gz", odd_name}, "the good files in done/")
        d.wait_until(lambda: failed_names(tmp_path) == set(expected), "every bad input in failed/", timeout_s=60)
        assert d.alive()
        rc, _ = d.stop()
        assert rc == 0
    finally:
        d.kill()
    failed = spool_dir(tmp_path, "failed")
    for name, (stage, pattern) in expected.items():
        err = read_json(failed / f"{name}.error.json")
        assert err["stage"] == stage, (name, err)
        assert re.search(pattern, err["reason"]), (name, err["reason"])
        assert err["exception_type"] and err["failed_at"] and err["job_id"]
    import stat

    for name, what in left.items():
        assert os.path.lexists(incoming / name) and f"incoming/{name} is {what}" in d.log()
    assert stat.S_ISFIFO(os.lstat(incoming / "fifo.csv").st_mode) and os.path.islink(incoming / "symlink.txt.gz")
    assert not (incoming / "empty.csv").exists() and "incoming/empty.csv: an empty file (0 bytes); removed" in d.log()
    from opt_ds_ops.store.versions import safe_model_name

    assert sorted(os.listdir(tmp_path / "models")) == sorted(["good", safe_model_name(odd_name[:-4])])  # nothing else
    assert list(spool_dir(tmp_path, "processing").iterdir()) == []
    assert "Traceback" not in d.log()


# ---- acceptance 3 ---------------------------------------------------------------------------------

LONG_TRAINING = {"epochs": 60, "batch_size": 128}  # 185 batches, ~0.15 s an epoch: the signal lands mid-run


@pytest.mark.recovery
def test_sigkill_during_training_then_restart_completes_with_exactly_one_model(tmp_path):
    conf = write_config(tmp_path, **LONG_TRAINING)
    d = Daemon(conf)
    try:
        started(d, tmp_path)
        copy_smd(spool_dir(tmp_path, "incoming") / "machine-1-2.txt.gz")
        d.wait_until(lambda: (job_record(tmp_path, "machine-1-2.txt.gz") or {}).get("epoch"), "epoch 1 to finish")
        job_pid = job_record(tmp_path, "machine-1-2.txt.gz")["job_pid"]
        d.proc.kill()
        d.proc.wait(30)
        deadline = time.monotonic() + 30  # the job process dies with its daemon (PR_SET_PDEATHSIG)
        while time.monotonic() < deadline and os.path.exists(f"/proc/{job_pid}") and \
                open(f"/proc/{job_pid}/stat").read().split()[2] != "Z":
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{job_pid}") or open(f"/proc/{job_pid}/stat").read().split()[2] == "Z"
    finally:
        d.kill()
    jdir = job_dir(tmp_path, "machine-1-2.txt.gz")
    assert sha256(jdir / "dataset.txt.gz") == sha256(SMD_TRAIN)  # nothing lost
    assert versions(tmp_path, "machine-1-2") == []  # nothing half-written visible
    assert job_record(tmp_path, "machine-1-2.txt.gz")["state"] == "running"

    run_until(conf, lambda: done_names(tmp_path) == {"machine-1-2.txt.gz"}, "the job to complete after restart")
    assert len(versions(tmp_path, "machine-1-2")) == 1
    result = read_json(spool_dir(tmp_path, "done") / "machine-1-2.txt.gz.result.json")
    # the daemon's death is not the dataset's fault: a restart, not a crash of the job
    assert result["crashes"] == 0 and result["restarts"] == 1
    assert result["epochs"] == 60 and len(result["history"]) == 60
    assert sha256(spool_dir(tmp_path, "done") / "machine-1-2.txt.gz") == sha256(SMD_TRAIN)
    assert list(spool_dir(tmp_path, "processing").iterdir()) == []


@pytest.mark.recovery
@pytest.mark.parametrize("published", [False, True])
def test_a_model_saved_just_before_a_sigkill_is_published_and_not_trained_again(tmp_path, published):
    """Killed after the version's rename (before or after the `current`
    swap), with the clock stepped back (the version sorts before the claim): found by job id."""
    conf = write_config(tmp_path)
    job_id = "20991130T000000Z-abcdef01"  # claimed "in the future": a clock step back since
    job_in_processing(tmp_path, "machine-1-2.txt.gz", job_id, claimed_at="2099-11-30T00:00:00.000000Z")
    model_dir = save_version(tmp_path, "machine-1-2", job_id, publish=published)
    current = tmp_path / "models" / "machine-1-2" / "current"
    assert current.is_symlink() is published
    d = run_until(conf, lambda: done_names(tmp_path) == {"machine-1-2.txt.gz"}, "the job to be finished")
    assert versions(tmp_path, "machine-1-2") == [os.path.basename(model_dir)]
    assert os.readlink(current) == os.path.basename(model_dir)
    result = read_json(spool_dir(tmp_path, "done") / "machine-1-2.txt.gz.result.json")
    assert result["model_dir"] == model_dir and result["job_id"] == job_id
    assert "not training again" in d.log()
    assert list(spool_dir(tmp_path, "processing").iterdir()) == []
    score = run_cli("score", str(tmp_path / "models" / "machine-1-2"), str(SMD_TRAIN), "--json")
    assert score.returncode == (3 if json.loads(score.stdout)["flagged"] else 0), score.stderr


def test_a_model_of_the_same_file_by_another_job_does_not_count(tmp_path):
    """An older model of identical content is not this job's model (find_job_version goes by job id).
    Its metadata records no dataset options or train: configuration (as an older ds-ops wrote it), so
    the same-bytes rule (tests/spool/test_duplicate.py) cannot call the drop a duplicate either: it trains."""
    conf = write_config(tmp_path)
    save_version(tmp_path, "machine-1-2", "20261129T000000Z-00000000", publish=True)
    job_in_processing(tmp_path, "machine-1-2.txt.gz", "20261130T000000Z-abcdef01")
    run_until(conf, lambda: done_names(tmp_path) == {"machine-1-2.txt.gz"}, "the job to be trained")
    assert len(versions(tmp_path, "machine-1-2")) == 2


@pytest.mark.recovery
def test_a_job_whose_process_keeps_dying_goes_to_failed_after_max_crashes(tmp_path):
    """The OOM killer (here: a real SIGKILL of the job process) takes the job, not the daemon."""
    conf = write_config(tmp_path, max_crashes=2, **LONG_TRAINING)
    d = Daemon(conf)
    try:
        started(d, tmp_path)
        copy_smd(spool_dir(tmp_path, "incoming") / "poison.txt.gz")
        for attempt in (1, 2):
            rec = d.wait_until(lambda: (r := job_record(tmp_path, "poison.txt.gz")) and r.get("state") == "running"
                               and r.get("crashes", 0) == attempt - 1 and r.get("epoch") and r, f"attempt {attempt}")
            os.kill(rec["job_pid"], signal.SIGKILL)
        d.wait_until(lambda: failed_names(tmp_path) == {"poison.txt.gz"}, "the job to be given up")
        copy_smd(spool_dir(tmp_path, "incoming") / "after.txt.gz")
        d.wait_until(lambda: done_names(tmp_path) == {"after.txt.gz"}, "the next good dataset")
        assert d.alive()
        assert d.stop()[0] == 0
    finally:
        d.kill()
    err = read_json(spool_dir(tmp_path, "failed") / "poison.txt.gz.error.json")
    assert err["stage"] == "training" and err["crashes"] == 2 and err["exception_type"] == "JobCrashed"
    assert "died 2 times" in err["reason"] and "SIGKILL" in err["reason"]
    assert versions(tmp_path, "poison") == []
    assert "the job process died in stage training: killed by SIGKILL" in d.log()


@pytest.mark.recovery
def test_sigterm_during_training_exits_0_within_the_units_stop_timeout_and_the_restart_resumes_the_checkpoint(tmp_path):
    """The unit gives a stop TimeoutStopSec=2min and the daemon asks for more while it checkpoints
    (EXTEND_TIMEOUT_USEC): it exits 0 within half that, checkpointed. (It takes 2-4 s idle; the 10 s
    this test asserted before failed at 17.9 s beside a CPU hog and a second suite.)"""
    conf = write_config(tmp_path, **LONG_TRAINING)
    sock = NotifySocket(tmp_path / "notify.sock")
    d = Daemon(conf, env=base_env(NOTIFY_SOCKET=sock.path))
    try:
        started(d, tmp_path)
        copy_smd(spool_dir(tmp_path, "incoming") / "machine-1-2.txt.gz")
        before = d.wait_until(lambda: (r := job_record(tmp_path, "machine-1-2.txt.gz")) and r.get("epoch", 0) >= 2 and r,
                              "epoch 2 to finish")
        rc, seconds = d.stop(signal.SIGTERM)
    finally:
        d.kill()
    print(f"\nSIGTERM during training: exit {rc} after {seconds:.2f} s")
    assert rc == 0
    assert seconds < 60
    msgs = sock.drain()
    sock.close()
    stop = next(i for i, m in enumerate(msgs) if "STOPPING=1" in m)
    assert any(m.startswith("EXTEND_TIMEOUT_USEC=") for m in msgs[stop:]), "\n".join(msgs[stop - 2:])  # asked for while checkpointing
    record = job_record(tmp_path, "machine-1-2.txt.gz")
    assert record["state"] == "interrupted" and record["epoch"] >= before["epoch"]
    assert (job_dir(tmp_path, "machine-1-2.txt.gz") / "checkpoint.pt").is_file()
    assert versions(tmp_path, "machine-1-2") == []
    status = run_cli("status", "--config", str(conf), "--json")
    assert status.returncode == 0, status.stderr
    job = json.loads(status.stdout)["processing"][0]
    assert job["dataset"] == "machine-1-2.txt.gz" and job["checkpoint"] is True and job["daemon_alive"] is False

    d2 = run_until(conf, lambda: done_names(tmp_path) == {"machine-1-2.txt.gz"}, "the resumed job to complete")
    result = read_json(spool_dir(tmp_path, "done") / "machine-1-2.txt.gz.result.json")
    assert result["resumed_from_epoch"] == record["epoch"] + 1
    assert result["crashes"] == 0 and len(result["history"]) == 60
    # the epochs before the stop are kept as they were, not trained again
    assert result["history"][before["epoch"] - 1]["train_loss"] == pytest.approx(before["loss"], rel=1e-9)
    assert len(versions(tmp_path, "machine-1-2")) == 1
    assert "resuming from the checkpoint" in d2.log()
    assert list(spool_dir(tmp_path, "processing").iterdir()) == []


# ---- acceptance 4 ---------------------------------------------------------------------------------

@pytest.mark.recovery
def test_files_present_at_start_up_and_dropped_while_the_daemon_was_down_are_processed(tmp_path):
    conf = write_config(tmp_path)
    incoming = spool_dir(tmp_path, "incoming")
    incoming.mkdir(parents=True)
    copy_smd(incoming / "before-start.txt.gz")
    run_until(conf, lambda: done_names(tmp_path) == {"before-start.txt.gz"}, "the file present at start-up")
    copy_smd(incoming / "while-down.txt.gz")
    run_until(conf, lambda: "while-down.txt.gz" in done_names(tmp_path), "the file dropped while down")
    assert len(versions(tmp_path, "before-start")) == 1 and len(versions(tmp_path, "while-down")) == 1


def test_polling_watcher_takes_files_without_inotify(tmp_path):
    d = Daemon(write_config(tmp_path, watcher="poll"))
    try:
        started(d, tmp_path)
        assert "polling every" in d.log()
        copy_smd(spool_dir(tmp_path, "incoming") / "polled.txt.gz")
        d.wait_until(lambda: done_names(tmp_path) == {"polled.txt.gz"}, "the polled file")
        assert d.stop()[0] == 0
    finally:
        d.kill()


# ---- the process: sd_notify, SIGHUP, start-up errors, status ----------------------------------------

def test_sd_notify_ready_status_watchdog_and_stopping(tmp_path):
    sock = NotifySocket(tmp_path / "notify.sock")
    env = base_env(NOTIFY_SOCKET=sock.path, WATCHDOG_USEC="1000000")
    d = Daemon(write_config(tmp_path, epochs=2), env=env)
    try:
        d.wait_until(lambda: any("READY=1" in m for m in sock.drain()), "READY=1", timeout_s=START_TIMEOUT_S)
        assert spool_dir(tmp_path, "incoming").is_dir()  # READY comes after the spool and the start-up scan
        copy_smd(spool_dir(tmp_path, "incoming") / "machine-1-2.txt.gz")
        d.wait_until(lambda: done_names(tmp_path), "the job")
        d.wait_until(lambda: any(m == "WATCHDOG=1" for m in sock.drain()), "a WATCHDOG=1 ping", timeout_s=10)
        rc, _ = d.stop()
        assert rc == 0
    finally:
        d.kill()
    msgs = sock.drain()
    sock.close()
    statuses = [m for m in msgs if m.startswith("STATUS=")]
    assert any("idle; 0 in incoming/" in m for m in msgs)
    assert any("training machine-1-2.txt.gz" in s and "epoch 2/2" in s for s in statuses)
    stopping = [i for i, m in enumerate(msgs) if "STOPPING=1" in m]
    assert stopping and "WATCHDOG=1" not in msgs[stopping[0]:]  # no pings once on the way out


def test_sighup_reloads_the_config_and_keeps_the_old_one_when_the_new_is_invalid(tmp_path):
    conf = write_config(tmp_path, epochs=1)
    d = Daemon(conf)
    try:
        started(d, tmp_path)
        write_config(tmp_path, epochs=2)
        d.proc.send_signal(signal.SIGHUP)
        d.wait_until(lambda: "configuration reloaded" in d.log(), "the reload")
        copy_smd(spool_dir(tmp_path, "incoming") / "after-reload.txt.gz")
        d.wait_until(lambda: done_names(tmp_path) == {"after-reload.txt.gz"}, "the first job")
        conf.write_text(conf.read_text().replace("epochs: 2", "epochs: -4"))
        d.proc.send_signal(signal.SIGHUP)
        d.wait_until(lambda: "configuration not reloaded" in d.log(), "the rejected reload")
        copy_smd(spool_dir(tmp_path, "incoming") / "after-bad-reload.txt.gz")
        d.wait_until(lambda: len(done_names(tmp_path)) == 2, "the second job")
        assert d.stop()[0] == 0
    finally:
        d.kill()
    line = conf.read_text().splitlines().index("  epochs: -4") + 1
    assert f"{conf}: line {line}, column 3: key 'train.epochs' must be an integer >= 1" in d.log()
    done = spool_dir(tmp_path, "done")
    assert read_json(done / "after-reload.txt.gz.result.json")["epochs"] == 2
    assert read_json(done / "after-bad-reload.txt.gz.result.json")["epochs"] == 2


def test_an_unwritable_models_directory_stops_the_start_with_the_path_and_why(tmp_path):
    (tmp_path / "models").write_text("a file, not a directory")
    r = run_cli("daemon", "--config", str(write_config(tmp_path)), timeout=120)
    assert r.returncode == 1
    assert f"models directory {tmp_path / 'models'} is not usable" in r.stderr
    assert "Not a directory" in r.stderr or "File exists" in r.stderr


def _catches_sigterm(pid: int) -> bool:
    """Whether process pid has a handler for SIGTERM (its SigCgt mask in /proc)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(mask & (1 << (signal.SIGTERM - 1)))


@pytest.mark.recovery
@pytest.mark.parametrize("after_s", [0.2, 1.0])
def test_sigterm_while_the_daemon_is_still_starting_is_a_clean_exit(tmp_path, after_s):
    """Found by the soak: a stop during the seconds torch takes to import killed the daemon (-15).
    The stop comes ``after_s`` after the daemon has its SIGTERM handler (the first thing it does),
    not after its exec: beside a CPU hog the interpreter alone took longer than 0.2 s to start, and
    no process can handle a signal before it runs."""
    d = Daemon(write_config(tmp_path))
    try:
        deadline = time.monotonic() + 120
        while not _catches_sigterm(d.proc.pid) and d.alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(after_s)
        rc, _ = d.stop(signal.SIGTERM)
    finally:
        d.kill()
    assert rc == 0, d.log()


def test_a_second_daemon_on_the_same_spool_refuses_to_start(tmp_path):
    conf = write_config(tmp_path)
    d = Daemon(conf)
    try:
        started(d, tmp_path)
        r = run_cli("daemon", "--config", str(conf), timeout=120)
        assert r.returncode == 1
        assert f"is served by another ds-trainer (pid {d.proc.pid}); one daemon per spool" in r.stderr
        assert d.alive()
        assert d.stop()[0] == 0
    finally:
        d.kill()


def test_an_unusable_spool_or_config_stops_the_start_with_a_message(tmp_path):
    conf = write_config(tmp_path)
    (tmp_path / "spool").write_text("not a directory")
    r = run_cli("daemon", "--config", str(conf), timeout=120)
    assert r.returncode == 1 and f"spool directory {tmp_path / 'spool'}" in r.stderr
    conf.write_text(conf.read_text() + "  settle: 3\n")
    r = run_cli("daemon", "--config", str(conf), timeout=120)
    assert r.returncode == 1 and "unknown key 'spool.settle'" in r.stderr


def test_status_text_lists_queue_and_latest_results(tmp_path):
    conf = write_config(tmp_path)
    d = Daemon(conf)
    try:
        started(d, tmp_path)
        copy_smd(spool_dir(tmp_path, "incoming") / "ok.txt.gz")
        (spool_dir(tmp_path, "incoming") / "bad.csv").write_text("1,2\n")
        d.wait_until(lambda: done_names(tmp_path) and failed_names(tmp_path), "both jobs")
        d.stop()
    finally:
        d.kill()
    (spool_dir(tmp_path, "incoming") / "waiting.csv").write_text("1,2\n3,4\n")
    r = run_cli("status", "--config", str(conf))
    assert r.returncode == 0, r.stderr
    assert "1 queued, 0 in processing, 1 done, 1 failed" in r.stdout
    assert "queued  waiting.csv" in r.stdout
    assert "ok.txt.gz  -> " + str(tmp_path / "models" / "ok") in r.stdout
    assert "bad.csv  [dataset] bad.csv: 1 row(s)" in r.stdout


# ---- the health gate's answers (in-process, with the gate replaced) --------------------------------

def test_a_deferred_job_waits_in_processing_and_a_refused_one_goes_to_failed_with_the_report(tmp_path, monkeypatch):
    """The job processes (forked by the test's own forkserver, as the daemon's are: a fork of this
    test process, whose OpenMP pool other tests started, could hang) answer the health gate from a script; everything else is the real daemon."""
    import io

    from fakes import scripted_gate
    from opt_ds_ops.daemon import service as daemon_mod
    from opt_ds_ops.config.conffile import load_config
    from opt_ds_ops.observe.journal import EventLog
    from opt_ds_ops.daemon.notify import Notifier
    from opt_ds_ops.spool import open_spool

    script = tmp_path / "gate"
    script.mkdir()
    (script / "answers.json").write_text(json.dumps([["defer", "GPU 0 too hot", "fail"],
                                                     ["refuse", "GPU 0 has 61 retired pages", "fail"],
                                                     ["run", "", "ok"]]))
    monkeypatch.setenv("DS_OPS_TEST_GATE", str(script))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cfg = load_config(str(write_config(tmp_path, settle_s=0)))
    log = io.StringIO()
    d = daemon_mod.Daemon(cfg, open_spool(cfg.spool.dir), EventLog(journal=False, stream=log), Notifier({}),
                          str(tmp_path / "trainer.yaml"), mp_context=job_context(),
                          gate=scripted_gate.gate, health_in_process=True)

    def run_job_to_end():
        deadline = time.monotonic() + 300
        while d.job is not None:
            assert time.monotonic() < deadline, log.getvalue()
            d._tick()

    incoming = spool_dir(tmp_path, "incoming")
    np.savetxt(incoming / "a.csv", np.random.default_rng(0).normal(size=(200, 4)), delimiter=",")
    np.savetxt(incoming / "b.csv", np.random.default_rng(1).normal(size=(200, 4)), delimiter=",")
    assert d.dispatch.take("a.csv")
    run_job_to_end()
    assert job_record(tmp_path, "a.csv")["state"] == "deferred" and len(d.pending) == 1
    assert "deferred a.csv: GPU 0 too hot; retry in" in d.duties.idle_status()
    assert not d._tick()  # held until retry_s: b.csv waits behind it, first come first served
    assert (incoming / "b.csv").exists()
    d.retry_at.clear()
    assert d._tick()
    run_job_to_end()
    err = read_json(spool_dir(tmp_path, "failed") / "a.csv.error.json")
    assert err["stage"] == "health" and err["reason"] == "GPU 0 has 61 retired pages"
    assert err["health"]["verdict"] == "fail"
    d.watcher.scan()
    assert d.dispatch.take("b.csv")
    run_job_to_end()
    assert done_names(tmp_path) == {"b.csv"} and len(versions(tmp_path, "b")) == 1, log.getvalue()
    assert "health gate says defer" in log.getvalue()
