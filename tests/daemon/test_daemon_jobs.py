"""Parallel jobs (``daemon.max_jobs``): the real daemon in this process, its jobs in processes
of its forkserver that really train (on the CPU, behind a fake CUDA runtime), on a host of two fake GPUs.

Fakes only at the library boundary (tests/fakes/scripted_gate.py: ``two_gpus`` for NVML,
``slot_gate`` for torch's CUDA device map and runtime in each job process, then the real health
gate). Concurrency is shown by state, never by timing: ``slot_gate``'s barrier lets a job pass its
health stage only when the other job is in its health stage too, and the daemon is seen holding
both jobs, each with its own GPU, with both records on disk saying ``running``.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import os
import time

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from daemon_kit import (
    done_names, failed_names, in_process_daemon, job_context, job_record, read_json, spool_dir, stop_in_process, write_config
)
from fakes import scripted_gate
from fakes.fake_pynvml import FakeNvml, install
from fakes.scripted_gate import GPU_UUIDS

DEADLINE_S = 300  # a generous end for one test's jobs on a shared 2-core machine (not a measurement)
JOB_EVENTS = ("job-health", "job-epoch", "job-saved", "job-resumed", "job-interrupted")


def start(tmp_path, monkeypatch, nvml: FakeNvml, *, max_jobs: str | None = None, epochs: int = 2,
          batch_size: int = 2048, extra: list[str] | None = None, barrier: int = 0, env: dict | None = None):
    """Return (daemon, journal events sent) for a daemon on tmp_path with ``device: auto`` and
    ``amp: off``, NVML answered by ``nvml`` in this process and its jobs' gate ``slot_gate``."""
    install(monkeypatch, nvml)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    if barrier:
        (tmp_path / "barrier").mkdir()
        monkeypatch.setenv("DS_OPS_TEST_BARRIER", f"{tmp_path / 'barrier'}:{barrier}")
    (tmp_path / "prom").mkdir()
    lines = ["job:", "  health_timeout_s: 200", "metrics:", f"  textfile_dir: {tmp_path / 'prom'}"]
    lines += ["daemon:", f"  max_jobs: {max_jobs}"] if max_jobs else []
    conf = write_config(tmp_path, settle_s=0, epochs=epochs, batch_size=batch_size, quiet_s=0, extra=lines + (extra or []))
    conf.write_text(conf.read_text().replace("device: cpu", "device: auto\namp: 'off'"))
    return in_process_daemon(conf, gate=scripted_gate.slot_gate)


def drop(tmp_path, *names: str, rows: int = 400) -> None:
    for i, name in enumerate(names):
        np.savetxt(spool_dir(tmp_path, "incoming") / name, np.random.default_rng(i).normal(size=(rows, 4)),
                   delimiter=",")


def run(d, tmp_path, until, sent) -> list[dict]:
    """Tick the daemon until ``until()``; return what was seen after each tick: the GPU UUIDs (""
    for a CPU job) of the jobs it held, the datasets whose records on disk said running, and, the
    first time two ran, what ``ds-ops status`` printed (``status``), its JSON's jobs (``json``) and
    the daemon's ds_ops.prom (``prom``)."""
    from opt_ds_ops.commands.status import _print
    from opt_ds_ops.spool import spool_status

    d.watcher.scan()
    seen = []
    deadline = time.monotonic() + DEADLINE_S
    while not until():
        assert time.monotonic() < deadline, [e["MESSAGE"] for e in sent]
        d._tick()
        assert not failed_names(tmp_path), [e["MESSAGE"] for e in sent]
        running = {n for n in ("a.csv", "b.csv") if (job_record(tmp_path, n) or {}).get("state") == "running"}
        seen.append({"gpus": sorted((j.gpu or {}).get("uuid", "") for j in d.jobs.values()), "running": running})
        if len(running) == 2 and not any("status" in s for s in seen):
            st = spool_status(d.spool)
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                _print(st)
            seen[-1].update(status=out.getvalue(), json=st["processing"],
                            prom=(tmp_path / "prom" / "ds_ops.prom").read_text())
    return seen


def result(tmp_path, name: str) -> dict:
    return read_json(spool_dir(tmp_path, "done") / f"{name}.result.json")


def metadata(doc: dict) -> dict:
    with open(f"{doc['model_dir']}/metadata.json") as f:
        return json.load(f)


def events_of(sent: list[dict], dataset_file: str) -> list[dict]:
    from opt_ds_ops.observe.journal import MESSAGE_IDS

    ids = {MESSAGE_IDS[e] for e in JOB_EVENTS}
    return [e for e in sent if e.get("MESSAGE_ID") in ids and e.get("DS_DATASET_FILE") == dataset_file]


def both_done(tmp_path):
    return lambda: done_names(tmp_path) == {"a.csv", "b.csv"}


def test_two_datasets_train_at_the_same_time_one_per_gpu(tmp_path, monkeypatch):
    from opt_ds_ops.spool import lock_spool

    d, sent = start(tmp_path, monkeypatch, scripted_gate.two_gpus(), barrier=2)
    lock = lock_spool(d.spool)  # as start_daemon takes it: status names this process as the daemon
    drop(tmp_path, "a.csv", "b.csv")
    try:
        seen = run(d, tmp_path, both_done(tmp_path), sent)
    finally:
        os.close(lock)
    together = [s for s in seen if s["gpus"] == sorted(GPU_UUIDS) and s["running"] == {"a.csv", "b.csv"}]
    assert together, seen
    status = next(s for s in seen if "status" in s)
    assert f"daemon: running, pid {os.getpid()}, 2 jobs running" in status["status"], status["status"]
    lines = [line for line in status["status"].splitlines() if "job " in line and "daemon pid" in line]
    assert len(lines) == 2 and all("training" in line for line in lines), status["status"]
    assert all(sum(f"(GPU {i} {u})" in line for line in lines) == 1 for i, u in enumerate(GPU_UUIDS)), lines
    assert sorted((j["gpu_index"], j["gpu_uuid"], j["daemon_alive"]) for j in status["json"]) == [
        (0, GPU_UUIDS[0], True), (1, GPU_UUIDS[1], True)]
    prom = {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(status["prom"]) for s in f.samples}
    assert prom[("ds_ops_jobs_running", ())] == 2 and prom[("ds_ops_job_running", ())] == 1
    assert {k[1] for k in prom if k[0] == "ds_ops_slot_job_running"} == {
        (("gpu", str(i)), ("slot", str(i)), ("uuid", u)) for i, u in enumerate(GPU_UUIDS)}
    a, b = result(tmp_path, "a.csv"), result(tmp_path, "b.csv")
    assert {a["gpu_uuid"], b["gpu_uuid"]} == set(GPU_UUIDS)
    for doc in (a, b):
        assert doc["gpu_index"] == GPU_UUIDS.index(doc["gpu_uuid"])
        assert doc["device"] == "cuda:0"  # the job sees only its GPU, as cuda:0
        decision = metadata(doc)["health"]["decision"]  # what the job's own health gate chose
        assert decision["gpu"] == {"index": doc["gpu_index"], "uuid": doc["gpu_uuid"]}
        assert metadata(doc)["health"]["torch"]["visible_devices"] == doc["gpu_uuid"]
        assert not any("torch sees" in f["message"] for f in metadata(doc)["health"]["findings"])
        events = events_of(sent, doc["dataset"])
        assert {e["MESSAGE_ID"] for e in events} >= {e for e in map(_id, ("job-health", "job-epoch", "job-saved"))}
        assert all(e["DS_GPU_UUID"] == doc["gpu_uuid"] and e["DS_GPU_INDEX"] == str(doc["gpu_index"])
                   for e in events), events
    assert len(d.metrics.jobs) == 0 and not d.jobs


def _id(event: str) -> str:
    from opt_ds_ops.observe.journal import MESSAGE_IDS

    return MESSAGE_IDS[event]


def test_a_gpu_failing_its_health_check_takes_no_job_and_the_other_trains_both(tmp_path, monkeypatch):
    d, sent = start(tmp_path, monkeypatch, scripted_gate.two_gpus(failing=1), env={"DS_OPS_TEST_FAILING_GPU": "1"})
    drop(tmp_path, "a.csv", "b.csv")
    seen = run(d, tmp_path, both_done(tmp_path), sent)
    assert max(len(s["gpus"]) for s in seen) == 1 and {g for s in seen for g in s["gpus"]} == {GPU_UUIDS[0]}
    for name in ("a.csv", "b.csv"):
        doc = result(tmp_path, name)
        assert (doc["gpu_uuid"], doc["gpu_index"], doc["device"]) == (GPU_UUIDS[0], 0, "cuda:0")
        events = events_of(sent, name)
        assert events and all(e["DS_GPU_UUID"] == GPU_UUIDS[0] for e in events)
    down = [e for e in sent if e.get("DS_GPU_UUID") == GPU_UUIDS[1]]
    assert len(down) == 1 and "GPU 1 (" + GPU_UUIDS[1] + ") fails its health check: ecc:" in down[0]["MESSAGE"]
    assert "it takes no jobs for 300 s (health.retry_s), the other GPUs go on" in down[0]["MESSAGE"]


def test_max_jobs_1_runs_one_job_at_a_time_on_the_first_healthy_gpu(tmp_path, monkeypatch):
    d, sent = start(tmp_path, monkeypatch, scripted_gate.two_gpus(), max_jobs="1")
    drop(tmp_path, "a.csv", "b.csv")
    seen = run(d, tmp_path, both_done(tmp_path), sent)
    assert max(len(s["gpus"]) for s in seen) == 1 and max(len(s["running"]) for s in seen) == 1
    assert {result(tmp_path, n)["gpu_uuid"] for n in ("a.csv", "b.csv")} == {GPU_UUIDS[0]}


def test_a_cpu_host_with_auto_runs_one_job_at_a_time_without_gpu_fields(tmp_path, monkeypatch):
    import pynvml

    d, sent = start(tmp_path, monkeypatch, FakeNvml(gpus=[], init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND),
                    env={"DS_OPS_TEST_NO_GPU": "1"})
    drop(tmp_path, "a.csv", "b.csv")
    seen = run(d, tmp_path, both_done(tmp_path), sent)
    assert max(len(s["gpus"]) for s in seen) == 1 and {g for s in seen for g in s["gpus"]} == {""}
    for name in ("a.csv", "b.csv"):
        doc = result(tmp_path, name)
        assert doc["gpu_uuid"] is None and doc["gpu_index"] is None and doc["device"] == "cpu"
        events = events_of(sent, name)
        assert events and all("DS_GPU_UUID" not in e and "DS_GPU_INDEX" not in e for e in events)


@pytest.mark.recovery
def test_sigterm_checkpoints_every_running_job_and_the_restart_resumes_each_on_a_gpu(tmp_path, monkeypatch):
    """A stop while two jobs train: both write their checkpoint (state interrupted); a new daemon
    on the same spool resumes both from their checkpoints, again one per GPU at once, and a second
    stop checkpoints both again, later. The jobs have more epochs than any run of this test could
    train, so neither can end before a stop however the two are scheduled (a job that ran ahead of
    the other and finished made this test fail once in CI); the single-job test in test_daemon.py
    follows a resumed job to its saved model."""
    from opt_ds_ops.daemon import service as daemon_mod
    from opt_ds_ops.daemon.notify import Notifier

    d, sent = start(tmp_path, monkeypatch, scripted_gate.two_gpus(), epochs=100_000, batch_size=64, barrier=2)
    drop(tmp_path, "a.csv", "b.csv", rows=1000)

    def training(after: dict | None = None):
        """Both records say running, each at least one epoch past ``after`` (its stopped record)."""
        def check():
            recs = {n: job_record(tmp_path, n) or {} for n in ("a.csv", "b.csv")}
            return all(r.get("state") == "running" and (r.get("epoch") or 0) > ((after or {}).get(n) or {}).get("epoch", 0)
                       for n, r in recs.items())
        return check

    def stop(daemon) -> dict:
        stop_in_process(daemon, DEADLINE_S)
        stopped = {n: job_record(tmp_path, n) for n in ("a.csv", "b.csv")}
        assert all((r or {}).get("state") == "interrupted" for r in stopped.values()), (
            stopped, done_names(tmp_path), failed_names(tmp_path), [e["MESSAGE"] for e in sent][-10:])
        assert done_names(tmp_path) == set()
        return stopped

    run(d, tmp_path, training(), sent)
    stopped = stop(d)

    again = daemon_mod.Daemon(d.cfg, d.spool, d.log, Notifier({}), d.config_path,
                              mp_context=job_context(), gate=scripted_gate.slot_gate, health_in_process=True)
    again.recovery.recover()
    assert sorted(again.pending) == sorted(r["job_id"] for r in stopped.values())
    (tmp_path / "barrier").rename(tmp_path / "barrier-1")
    (tmp_path / "barrier").mkdir()  # the resumed jobs meet at the barrier too: both run at once again
    seen = run(again, tmp_path, training(after=stopped), sent)
    assert any(s["gpus"] == sorted(GPU_UUIDS) for s in seen)
    resumed = {n: job_record(tmp_path, n) for n in ("a.csv", "b.csv")}
    for name, record in stopped.items():
        assert resumed[name]["resumed_from_epoch"] == record["epoch"] + 1
        assert resumed[name]["job_id"] == record["job_id"]
        assert any(e["MESSAGE"].startswith(f"{name}: resuming from the checkpoint in epoch {record['epoch'] + 1} ")
                   for e in events_of(sent, name)), [e["MESSAGE"] for e in events_of(sent, name)]
    assert {r["gpu_uuid"] for r in resumed.values()} == set(GPU_UUIDS)
    second = stop(again)
    assert all(second[n]["epoch"] > stopped[n]["epoch"] for n in stopped)


def test_a_job_whose_gpu_fails_its_own_gate_is_deferred_to_the_other_gpu(tmp_path, monkeypatch):
    """The daemon's NVML check passes both GPUs, but GPU 1's CUDA smoke test fails in its job's
    process (an illegal memory access): under health.on_fail defer the job goes back to the queue
    at once, GPU 1 takes no jobs for health.retry_s, and both datasets train on GPU 0."""
    d, sent = start(tmp_path, monkeypatch, scripted_gate.two_gpus(), extra=["health:", "  on_fail: defer"],
                    env={"DS_OPS_TEST_SMOKE_FAIL_UUID": GPU_UUIDS[1]})
    drop(tmp_path, "a.csv", "b.csv")
    run(d, tmp_path, both_done(tmp_path), sent)
    assert {result(tmp_path, n)["gpu_uuid"] for n in ("a.csv", "b.csv")} == {GPU_UUIDS[0]}
    messages = [e["MESSAGE"] for e in sent]
    assert any(f"GPU 1 ({GPU_UUIDS[1]}) fails its health check: its job's health gate: cuda: CUDA smoke test "
               "failed" in m for m in messages), messages
    assert any("its GPU 1 failed, back in the queue for another GPU" in m for m in messages), messages


def test_a_job_forked_from_the_forkserver_sees_only_its_gpu_before_cuda_initialises(tmp_path, spool):
    """The daemon's real job path (the forkserver that preloads torch and ds-ops): the job process
    has CUDA_VISIBLE_DEVICES set to its GPU's UUID when its health gate runs, and CUDA is not
    initialised there (the server imported torch, nothing more); a job without a GPU gets none."""
    from opt_ds_ops.daemon import worker
    from opt_ds_ops.config.conffile import Config
    from opt_ds_ops.spool import INCOMING, claim

    answers = {}
    try:
        for name, gpu in (("a.csv", {"index": 1, "uuid": GPU_UUIDS[1]}), ("b.csv", None)):
            (tmp_path / "spool" / INCOMING / name).write_text("1,2\n3,4\n5,6\n")
            c = claim(spool, name, 1 << 20)
            job = worker.JobProcess(spool.root, c.job_id, c.record, Config(), gate=scripted_gate.visible_gate, gpu=gpu)
            deadline = time.monotonic() + DEADLINE_S
            while job.final is None and job.exitcode() is None:
                assert time.monotonic() < deadline
                job.receive(0.5)
            job.receive(0)
            job.close()
            answers[name] = job.final
            del job  # its Event's semaphore is unlinked now, while the resource tracker still runs
            gc.collect()
    finally:
        worker.shut_down()
    assert answers["a.csv"][0] == "failed" and answers["a.csv"][1]["reason"] == (
        f"CUDA_VISIBLE_DEVICES={GPU_UUIDS[1]}; cuda initialised: False"), answers
    assert answers["b.csv"][1]["reason"] == "CUDA_VISIBLE_DEVICES=None; cuda initialised: False", answers
