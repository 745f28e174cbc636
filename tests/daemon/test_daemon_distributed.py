"""One dataset on several processes under the daemon (``daemon.distributed_min_bytes``).

The real daemon in this process, its jobs forked by its forkserver, each distributed job's ranks under
real torchrun with gloo on this machine's CPUs (``device: cpu``, ``distributed_nproc: 2``): what
CI can run. On GPUs the same code gives each rank a GPU (nccl); that needs GPUs that are real.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import time

import numpy as np
import pytest

from daemon_kit import (
    done_names, in_process_daemon, job_context, job_record, read_json, spool_dir, stop_in_process, tick_until, write_config
)

DEADLINE_S = 300  # a generous end for one test's jobs on a shared 2-core machine (not a measurement)


def start(tmp_path, monkeypatch, *, epochs: int = 2, batch_size: int = 256, nproc: str = "2",
          differences: bool = False):
    """Return (daemon, journal events sent) on tmp_path: device cpu, max_jobs 2, datasets of at
    least 40,000 bytes on ``nproc`` processes. Levels alone (``train.input_differences: false``)
    unless ``differences``: a distributed run reads single rows, and the shipped default trains a
    large dataset in one process instead (test below)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    conf = write_config(tmp_path, settle_s=0, epochs=epochs, batch_size=batch_size, quiet_s=0,
                        train_keys=() if differences else ("input_differences: false",),
                        extra=["daemon:", "  max_jobs: 2", "  distributed_min_bytes: 40000",
                               f"  distributed_nproc: {nproc}"])
    return in_process_daemon(conf)


def drop(tmp_path, name: str, rows: int, seed: int = 0) -> int:
    """Write rows x 4 numbers into incoming/NAME; return its size (bytes)."""
    path = spool_dir(tmp_path, "incoming") / name
    np.savetxt(path, np.random.default_rng(seed).normal(size=(rows, 4)), delimiter=",", fmt="%.8f")
    return path.stat().st_size


def run(d, tmp_path, until, sent) -> list[list[tuple[str, int]]]:
    """Tick the daemon until ``until()``; return, after each tick, the (dataset, processes) of every job it held."""
    return tick_until(d, until, sent, lambda: sorted((d.records[j.job_id]["dataset"], j.nproc) for j in d.jobs.values()),
                      no_failures_in=tmp_path, deadline_s=DEADLINE_S)


def metadata(tmp_path, name: str) -> dict:
    doc = read_json(spool_dir(tmp_path, "done") / f"{name}.result.json")
    with open(f"{doc['model_dir']}/metadata.json") as f:
        return json.load(f)


def test_a_dataset_over_distributed_min_bytes_trains_alone_on_two_gloo_ranks(tmp_path, monkeypatch):
    """Dropped in the order a, big, b (max_jobs 2): a.csv trains in one process; big.csv (>=
    40,000 bytes) waits for it, then trains alone on 2 processes under torchrun; b.csv, behind it
    in the queue, waits until it has ended (first come, first served; never beside it)."""
    import glob
    import tempfile

    outside = set(glob.glob(f"{tempfile.gettempdir()}/ds-ops-ddp-*"))
    d, sent = start(tmp_path, monkeypatch)
    assert drop(tmp_path, "a.csv", 300, 1) < 40_000
    time.sleep(0.05)
    assert drop(tmp_path, "big.csv", 3000, 3) >= 40_000
    time.sleep(0.05)
    assert drop(tmp_path, "b.csv", 300, 2) < 40_000
    seen = run(d, tmp_path, lambda: done_names(tmp_path) == {"a.csv", "b.csv", "big.csv"}, sent)
    d.watcher.stop()
    assert [("big.csv", 2)] in seen  # it ran, on 2 processes
    assert all(s == [("big.csv", 2)] for s in seen if ("big.csv", 2) in s), "it ran beside another job"
    assert all(n == 1 for s in seen for name, n in s if name != "big.csv")
    first = {name: min(i for i, s in enumerate(seen) if any(n == name for n, _ in s)) for name in ("a.csv", "big.csv", "b.csv")}
    last_big = max(i for i, s in enumerate(seen) if ("big.csv", 2) in s)
    assert first["a.csv"] < first["big.csv"] and first["b.csv"] > last_big, (first, last_big)
    big = metadata(tmp_path, "big.csv")
    assert big["distributed"]["world_size"] == 2 and big["distributed"]["backend"] == "gloo", big["distributed"]
    assert big["dataset"]["rows"] == 3000
    assert all(metadata(tmp_path, n)["distributed"] is None for n in ("a.csv", "b.csv"))
    result = read_json(spool_dir(tmp_path, "done") / "big.csv.result.json")
    assert result["distributed"] == {"world_size": 2, "backend": "gloo"}
    # the ranks' copy of the matrix lived in the job's directory (gone with it), not in /tmp
    assert set(glob.glob(f"{tempfile.gettempdir()}/ds-ops-ddp-*")) == outside
    assert os.listdir(spool_dir(tmp_path, "processing")) == []
    messages = [e["MESSAGE"] for e in sent]
    assert any(m.startswith("big.csv: ") and "daemon.distributed_min_bytes: trains alone with 2 processes under "
               "torchrun, on 2 CPU processes (gloo)" in m for m in messages), messages


def test_auto_on_a_host_without_gpus_trains_the_large_dataset_in_one_process(tmp_path, monkeypatch):
    """distributed_nproc auto means one rank per healthy GPU: none here, so one process (gloo ranks
    on two cores are slower than one process, docs/performance.md)."""
    d, sent = start(tmp_path, monkeypatch, nproc="auto")
    drop(tmp_path, "big.csv", 3000, 3)
    seen = run(d, tmp_path, lambda: done_names(tmp_path) == {"big.csv"}, sent)
    d.watcher.stop()
    assert seen and all(s in ([], [("big.csv", 1)]) for s in seen)
    assert metadata(tmp_path, "big.csv")["distributed"] is None


def test_with_differences_as_shipped_the_large_dataset_trains_in_one_process_reading_them(tmp_path, monkeypatch):
    """train.input_differences (shipped true) reads each row beside the one before it, which a
    distributed run does not: the large dataset trains in one process, with its differences, and its
    notes say why (not a failure, not levels alone)."""
    d, sent = start(tmp_path, monkeypatch, differences=True)
    drop(tmp_path, "big.csv", 3000, 3)
    run(d, tmp_path, lambda: done_names(tmp_path) == {"big.csv"}, sent)  # its slots were held for 2 processes
    d.watcher.stop()
    md = metadata(tmp_path, "big.csv")
    assert md["distributed"] is None and md["input_differences"] is True, md["distributed"]
    assert ("trained in one process, not 2 (daemon.distributed_min_bytes): train.input_differences is true"
            in md["dataset"]["notes"]), md["dataset"]["notes"]


@pytest.mark.recovery
def test_a_stop_ends_the_ranks_keeps_no_checkpoint_and_the_restart_trains_from_epoch_1(tmp_path, monkeypatch):
    from opt_ds_ops.daemon import service as daemon_mod
    from opt_ds_ops.daemon.notify import Notifier

    d, sent = start(tmp_path, monkeypatch, epochs=100_000, batch_size=64)
    drop(tmp_path, "big.csv", 3000, 3)

    def training():
        r = job_record(tmp_path, "big.csv") or {}
        return r.get("state") == "running" and (r.get("epoch") or 0) >= 1

    def ranks() -> list[str]:
        """The pids of this test's processes running the rank module (read from /proc): those whose
        TMPDIR, the job's out_dir (run_ranks), lies under tmp_path; other tests' ranks may run beside."""
        found, mine = [], b"TMPDIR=" + str(tmp_path).encode()
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = f.read().split(b"\0")
            except OSError:
                continue
            if (b"opt_ds_ops.training.distributed" in argv and b"torch.distributed.run" not in argv
                    and any(e.startswith(mine) for e in env)):
                found.append(pid)
        return found

    run(d, tmp_path, training, sent)
    assert len(ranks()) == 2
    from opt_ds_ops.commands.status import _print
    from opt_ds_ops.spool import spool_status

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        _print(spool_status(d.spool))
    assert "with 2 processes under torchrun" in out.getvalue(), out.getvalue()
    stop_in_process(d, DEADLINE_S)
    record = job_record(tmp_path, "big.csv")
    assert record["state"] == "interrupted" and record["epoch"] == 0, record
    assert not (spool_dir(tmp_path, "processing") / record["job_id"] / "checkpoint.pt").exists()
    assert ranks() == []
    assert any("big.csv: stopped; a distributed run keeps no checkpoint, so it trains again from epoch 1" in e["MESSAGE"]
               for e in sent)

    again = daemon_mod.Daemon(d.cfg, d.spool, d.log, Notifier({}), d.config_path,
                              mp_context=job_context(), health_in_process=True)
    again.recovery.recover()
    assert again.pending == [record["job_id"]]
    seen = run(again, tmp_path, training, sent)
    assert [("big.csv", 2)] in seen
    assert "resumed_from_epoch" not in job_record(tmp_path, "big.csv")
    stop_in_process(again, DEADLINE_S)
    assert ranks() == []
