"""Several waiting datasets trained in one job process as one stacked model (``daemon.stack_max``).

The real daemon in this process, its job processes forked by its forkserver, real training on this machine's CPU:
what a fleet's first training looks like, small. Each job of a stack must end as it would alone: its
own result, model and version, the same threshold as training its file alone, its own failure.
"""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest

from daemon_kit import (
    done_names, failed_names, in_process_daemon, job_record, read_json, spool_dir, stop_in_process, tick_until, write_config
)

DEADLINE_S = 300  # a generous end for one test's jobs on a shared 2-core machine (not a measurement)


def start(tmp_path, monkeypatch, *, stack: str = "4", epochs: int = 3, batch_size: int = 128,
          max_bytes: int = 8 * 1024**2, max_jobs: str = "auto"):
    """Return (daemon, journal events sent, conffile path) on tmp_path: device cpu, stacks of 2 to ``stack``."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    conf = write_config(tmp_path, settle_s=0, epochs=epochs, batch_size=batch_size, quiet_s=0,
                        extra=["daemon:", f"  stack_max: {stack}", "  stack_min: 2", f"  stack_max_bytes: {max_bytes}",
                               f"  max_jobs: {max_jobs}"])
    d, sent = in_process_daemon(conf)
    return d, sent, conf


def drop(tmp_path, name: str, rows: int, seed: int) -> None:
    """Write rows x 4 numbers (each host its own offset) into incoming/NAME."""
    rng = np.random.default_rng(seed)
    np.savetxt(spool_dir(tmp_path, "incoming") / name, rng.normal(size=(rows, 4)) + rng.uniform(-5, 5, size=4),
               delimiter=",", fmt="%.6f")


def run(d, until, sent, *, fail_ok: bool = False, tmp_path=None) -> list[list[str]]:
    """Tick the daemon until ``until()`` (nothing failed unless ``fail_ok``); return the job ids it held after each tick."""
    return tick_until(d, until, sent, lambda: sorted(d.jobs), no_failures_in=None if fail_ok else tmp_path,
                      deadline_s=DEADLINE_S)


def metadata(tmp_path, name: str) -> dict:
    doc = read_json(spool_dir(tmp_path, "done") / f"{name}.result.json")
    with open(f"{doc['model_dir']}/metadata.json") as f:
        return json.load(f)


def test_waiting_files_of_one_shape_train_as_one_stack_each_as_it_would_alone(tmp_path, monkeypatch):
    """Three files of 400 rows and one of 300 wait: the four are claimed together and start in one
    process; the three of one shape train as one stack, the fourth is handed back and trains
    alone. Each has its own result and model, and each stacked model's threshold and weights are
    what training its file alone gives."""
    import dataclasses

    import torch

    from opt_ds_ops.config.conffile import load_config

    d, sent, conf = start(tmp_path, monkeypatch)
    names = ["h1.csv", "h2.csv", "h3.csv", "odd.csv"]
    for i, name in enumerate(names):
        drop(tmp_path, name, 300 if name == "odd.csv" else 400, i)
    seen = run(d, lambda: done_names(tmp_path) == set(names), sent, tmp_path=tmp_path)
    d.watcher.stop()
    assert any(len(s) == 4 for s in seen), "the four were never held together"
    for name in names[:3]:
        md = metadata(tmp_path, name)
        assert md["step_mode"] == "stacked (3 models)", md["step_mode"]
        assert md["dataset"]["file"] == name and md["job_id"]
        assert read_json(spool_dir(tmp_path, "done") / f"{name}.result.json")["step_mode"] == "stacked (3 models)"
    assert metadata(tmp_path, "odd.csv")["step_mode"] != "stacked (3 models)"
    messages = [e["MESSAGE"] for e in sent]
    assert any(m.startswith("4 datasets claimed together into one job process") for m in messages), messages
    assert any(m.startswith("odd.csv: not trained in the stack: no other dataset of its shape (300 rows x 4 columns)")
               for m in messages), messages
    saved = [e for e in sent if e["MESSAGE"].startswith(tuple(f"{n}: model saved to" for n in names))]
    assert {e.get("DS_DATASET_FILE") for e in saved} == set(names), messages
    assert os.listdir(spool_dir(tmp_path, "processing")) == []
    # the same file trained alone, with the same configuration, gives the same model
    alone_cfg = load_config(str(conf))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the job process (OMP_NUM_THREADS=1): a sum's order follows the threads
    try:
        compare_alone(tmp_path, names[:3], dataclasses.replace(alone_cfg, models_dir=str(tmp_path / "alone")))
    finally:
        torch.set_num_threads(threads)


def compare_alone(tmp_path, names, cfg) -> None:
    """Each of ``names`` (in done/) trained alone with ``cfg`` gives its stacked model's threshold and weights."""
    import torch

    from opt_ds_ops.training.job import run_job

    for name in names:
        md = metadata(tmp_path, name)
        alone = run_job(str(spool_dir(tmp_path, "done") / name), cfg, name=name.split(".")[0])
        assert abs(alone.metadata["threshold"] - md["threshold"]) <= 1e-5 * abs(md["threshold"]), (name, alone.metadata["threshold"], md["threshold"])
        ours = torch.load(f"{read_json(spool_dir(tmp_path, 'done') / f'{name}.result.json')['model_dir']}/model.pt",
                          weights_only=True)
        theirs = torch.load(os.path.join(alone.model_dir, "model.pt"), weights_only=True)
        for key, value in theirs["state_dict"].items():
            torch.testing.assert_close(ours["state_dict"][key], value, rtol=1e-5, atol=1e-6)


def test_a_bad_file_in_a_stack_fails_alone_and_the_others_are_saved(tmp_path, monkeypatch):
    d, sent, _conf = start(tmp_path, monkeypatch)
    for i, name in enumerate(["a.csv", "b.csv"]):
        drop(tmp_path, name, 400, i)
    (spool_dir(tmp_path, "incoming") / "bad.csv").write_text("1,2,3,4\n5,6,seven,8\n" * 50)
    run(d, lambda: done_names(tmp_path) == {"a.csv", "b.csv"} and failed_names(tmp_path) == {"bad.csv"}, sent,
        fail_ok=True)
    d.watcher.stop()
    assert metadata(tmp_path, "a.csv")["step_mode"] == "stacked (2 models)"
    err = read_json(spool_dir(tmp_path, "failed") / "bad.csv.error.json")
    assert err["stage"] == "dataset", err
    started = [e["MESSAGE"] for e in sent if "datasets claimed together into one job process" in e["MESSAGE"]]
    assert len(started) == 1 and started[0].startswith("3 datasets") and "bad.csv" in started[0], started


def test_two_files_for_one_model_name_in_a_stack_train_one_after_the_other(tmp_path, monkeypatch):
    """Sidecars give a.csv and b.csv the same model name: the second is handed back, so the name's
    owner check and the duplicate rule see the first's version, as they would one job at a time."""
    d, sent, _conf = start(tmp_path, monkeypatch)
    incoming = spool_dir(tmp_path, "incoming")
    for i, name in enumerate(["a", "b", "c"]):
        if name != "c":
            (incoming / f"{name}.yaml").write_text("name: web\n")
        drop(tmp_path, f"{name}.csv", 400, i)
    run(d, lambda: {"a.csv", "b.csv", "c.csv"} <= done_names(tmp_path), sent, tmp_path=tmp_path)  # with the sidecars
    d.watcher.stop()
    messages = [e["MESSAGE"] for e in sent]
    assert any(m.startswith(("a.csv: not trained in the stack: b.csv of the same stack has the same model name",
                             "b.csv: not trained in the stack: a.csv of the same stack has the same model name"))
               for m in messages), messages
    versions = sorted(os.listdir(tmp_path / "models" / "web"))
    assert len([v for v in versions if v != "current" and not v.startswith(".")]) == 2, versions


NAMES = ("a.csv", "b.csv", "c.csv")


@pytest.mark.recovery
def test_a_stack_that_dies_while_training_counts_one_crash_each_and_they_train_alone(tmp_path, monkeypatch):
    """SIGKILL of the stack's process while it trains: each job counts the crash and runs again,
    never in a stack again (so one bad file cannot hold the others back twice); all are saved."""
    d, sent, _conf = start(tmp_path, monkeypatch, epochs=40, batch_size=16)
    for i, name in enumerate(NAMES):
        drop(tmp_path, name, 400, i)
    run(d, lambda: all((job_record(tmp_path, n) or {}).get("stage") == "training" for n in NAMES), sent,
        tmp_path=tmp_path)
    pids = {(job_record(tmp_path, n) or {}).get("job_pid") for n in NAMES}
    assert len(pids) == 1, pids
    os.kill(pids.pop(), signal.SIGKILL)
    seen = run(d, lambda: done_names(tmp_path) == set(NAMES), sent, tmp_path=tmp_path)
    d.watcher.stop()
    alone_from = next(i for i, s in enumerate(seen) if len(s) <= 1)  # the stack's jobs handled: one at a time since
    assert all(len(s) <= 1 for s in seen[alone_from:]), "the crashed jobs were stacked again"
    crashed = [e["MESSAGE"] for e in sent if "the job process died in stage training" in e["MESSAGE"]]
    assert len(crashed) == 3, [e["MESSAGE"] for e in sent]
    for name in NAMES:
        assert read_json(spool_dir(tmp_path, "done") / f"{name}.result.json")["crashes"] == 1
        assert not metadata(tmp_path, name)["step_mode"].startswith("stacked"), "a crashed job joined a stack again"


def test_a_death_while_one_dataset_is_read_counts_against_that_job_alone(tmp_path, monkeypatch):
    """The stack's process dies while it reads big.csv.gz (a stand-in for a file that crashes the
    parser): big counts the crash; the others were not being read and are handed back, crash-free."""
    import gzip

    from opt_ds_ops.daemon.jobstack import StackMember

    d, sent, _conf = start(tmp_path, monkeypatch, max_jobs="2", max_bytes=64 * 1024**2)
    block = "".join(f"{r[0]:.4f},{r[1]:.4f},{r[2]:.4f},{r[3]:.4f}\n" for r in np.random.default_rng(9).normal(size=(1000, 4)))
    stage = tmp_path / "stage"
    stage.mkdir()
    with gzip.open(stage / "big.csv.gz", "wt", compresslevel=1) as f:
        for _ in range(3000):  # 3 million rows: a second or more to read, a small file to drop
            f.write(block)
    for i, name in enumerate(["a.csv", "b.csv"]):
        drop(tmp_path, name, 400, i)
    os.rename(stage / "big.csv.gz", spool_dir(tmp_path, "incoming") / "big.csv.gz")  # all three wait together
    d.watcher.scan()
    deadline = time.monotonic() + DEADLINE_S
    big = None
    while big is None:
        assert time.monotonic() < deadline, [e["MESSAGE"] for e in sent]
        d._tick()
        for stack in {m.stack for m in d.jobs.values() if isinstance(m, StackMember)}:
            if stack.reading and d.records[stack.reading]["dataset"] == "big.csv.gz":
                # stopped, then every message it sent before is read: on a loaded machine it may
                # have moved on since the daemon heard of the read (then it goes on, and we wait again)
                os.kill(stack.proc.pid, signal.SIGSTOP)
                stack.pump(0)
                if stack.reading and d.records[stack.reading]["dataset"] == "big.csv.gz":
                    big = stack
                else:
                    os.kill(stack.proc.pid, signal.SIGCONT)
    os.kill(big.proc.pid, signal.SIGKILL)  # stopped while it reads big.csv.gz
    run(d, lambda: {"a.csv", "b.csv"} <= done_names(tmp_path) and (job_record(tmp_path, "big.csv.gz") or {}).get("crashes"),
        sent, tmp_path=tmp_path)
    crashes = {n: read_json(spool_dir(tmp_path, "done") / f"{n}.result.json")["crashes"] for n in ("a.csv", "b.csv")}
    assert crashes == {"a.csv": 0, "b.csv": 0}, crashes
    assert job_record(tmp_path, "big.csv.gz")["crashes"] == 1
    stop_in_process(d)


@pytest.mark.recovery
def test_a_stop_interrupts_every_job_of_the_stack_and_keeps_no_checkpoint(tmp_path, monkeypatch):
    d, sent, _conf = start(tmp_path, monkeypatch, epochs=100_000, batch_size=16)
    for i, name in enumerate(["a.csv", "b.csv"]):
        drop(tmp_path, name, 400, i)
    run(d, lambda: all((job_record(tmp_path, n) or {}).get("epoch") for n in ("a.csv", "b.csv")), sent,
        tmp_path=tmp_path)
    stop_in_process(d)
    for n in ("a.csv", "b.csv"):
        r = job_record(tmp_path, n)
        assert r["state"] == "interrupted", r
    assert not any(p.name.startswith("checkpoint") for p in (spool_dir(tmp_path, "processing")).rglob("*"))
    assert done_names(tmp_path) == set() and failed_names(tmp_path) == set()


def test_a_stack_takes_one_job_slot(tmp_path, monkeypatch):
    """max_jobs 2: a stack of three jobs is one process, so a file dropped later starts beside it."""
    from opt_ds_ops.daemon.jobstack import StackMember
    from opt_ds_ops.daemon.worker import JobProcess

    d, sent, _conf = start(tmp_path, monkeypatch, epochs=100_000, batch_size=16, max_jobs="2")
    for i, name in enumerate(NAMES):
        drop(tmp_path, name, 400, i)
    run(d, lambda: all((job_record(tmp_path, n) or {}).get("stage") == "training" for n in NAMES), sent,
        tmp_path=tmp_path)
    drop(tmp_path, "later.csv", 300, 7)
    run(d, lambda: any(isinstance(j, JobProcess) for j in d.jobs.values()), sent, tmp_path=tmp_path)
    assert sum(isinstance(j, StackMember) for j in d.jobs.values()) == 3, list(d.jobs)
    stop_in_process(d)
