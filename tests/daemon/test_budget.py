"""Memory budgets that add up: all the job processes that may run at once fit the
cgroup the daemon runs in, less the daemon's own share.

The arithmetic with cgroup file trees written here (v2 and v1, passed as paths); then a real daemon
with ``max_jobs: 4``: its start-up line gives the figure per job, and its job process runs with
that figure as RLIMIT_DATA (before: job.memory_max, 50 % of RAM, for each of the four).
"""

from __future__ import annotations

import dataclasses

import pytest

from daemon_kit import Daemon, job_record, spool_dir, write_config
from opt_ds_ops.daemon.budget import (
    UNIT_SHARE_BYTES, cgroup_memory_max, job_config, job_processes, memory_budget, this_process_budget,
)
from opt_ds_ops.config.conffile import Config, DaemonConfig, JobConfig
from opt_ds_ops.dataset import DatasetLimits

GIB = 1024**3


def cgroup_tree(tmp_path, proc_line: str, files: dict[str, str]):
    """Write a /proc/self/cgroup of proc_line and cgroup files {relative path: content}; return both paths."""
    proc = tmp_path / "cgroup"
    proc.write_text(proc_line + "\n")
    root = tmp_path / "sys-fs-cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text + "\n")
    return str(proc), str(root)


def cfg_with(max_jobs: str = "auto", memory_max: str = "50%") -> Config:
    return Config(daemon=DaemonConfig(max_jobs=max_jobs), job=JobConfig(memory_max=memory_max))


def test_cgroup_v2_limit_of_the_unit_is_read_and_the_smallest_ancestor_wins(tmp_path):
    proc, root = cgroup_tree(tmp_path, "0::/system.slice/ds-trainer.service", {
        "system.slice/ds-trainer.service/memory.max": str(96 * GIB), "system.slice/memory.max": "max",
        "memory.max": "max"})
    assert cgroup_memory_max(proc, root) == 96 * GIB
    (tmp_path / "sys-fs-cgroup/system.slice/memory.max").write_text(f"{64 * GIB}\n")
    assert cgroup_memory_max(proc, root) == 64 * GIB


def test_cgroup_v1_memory_limit_and_its_unlimited_value(tmp_path):
    proc, root = cgroup_tree(tmp_path, "9:name=systemd:/\n4:memory:/system.slice/ds-trainer.service\n0::/", {
        "memory/system.slice/ds-trainer.service/memory.limit_in_bytes": str(12 * GIB),
        "memory/memory.limit_in_bytes": "9223372036854771712"})
    assert cgroup_memory_max(proc, root) == 12 * GIB
    (tmp_path / "sys-fs-cgroup/memory/system.slice/ds-trainer.service/memory.limit_in_bytes").write_text(
        "9223372036854771712\n")
    assert cgroup_memory_max(proc, root) is None


def test_no_readable_cgroup_means_no_limit(tmp_path):
    assert cgroup_memory_max(str(tmp_path / "missing"), str(tmp_path)) is None
    proc, root = cgroup_tree(tmp_path, "0::/elsewhere", {})  # a path of another namespace
    assert cgroup_memory_max(proc, root) is None


def test_eight_gpu_jobs_under_a_75_percent_unit_each_get_an_eighth_of_what_is_left():
    ram = 1024 * GIB
    cfg = cfg_with()
    b = memory_budget(cfg, job_processes(cfg, gpu_count=8), unit_limit=ram * 3 // 4, ram=ram)
    assert b.processes == 8
    assert b.per_process == (768 * GIB - UNIT_SHARE_BYTES) // 8 and b.cut
    assert b.processes * b.per_process + UNIT_SHARE_BYTES <= ram * 3 // 4  # they add up
    assert b.line() == ("memory per job process 95.88 GiB (job.memory_max 512.00 GiB cut to fit 8 at once in 767.0 "
                        "GiB: the cgroup's memory limit less 1.0 GiB for the daemon)")


def test_one_job_keeps_job_memory_max_where_it_fits():
    ram = 64 * GIB
    b = memory_budget(cfg_with(), 1, unit_limit=ram * 3 // 4, ram=ram)
    assert (b.per_process, b.cut, b.problem()) == (32 * GIB, False, None)
    assert job_config(cfg_with(), b) == cfg_with()


def test_a_distributed_job_counts_its_process_and_each_rank():
    cfg = cfg_with()
    assert job_processes(cfg, gpu_count=4, nproc=4) == 5
    assert job_processes(cfg_with(max_jobs="3"), gpu_count=None) == 3
    assert job_processes(cfg, gpu_count=None) == 1
    assert job_processes(cfg, gpu_count=8, pinned=True) == 1
    ram = 16 * GIB
    b = memory_budget(cfg, 5, unit_limit=None, ram=ram)   # no cgroup limit: RAM
    assert b.per_process == (16 * GIB - UNIT_SHARE_BYTES) // 5
    assert "in 15.0 GiB: RAM less 1.0 GiB" in b.line()


def test_the_job_config_carries_the_budget_into_rlimit_and_the_matrix_budget():
    cfg = cfg_with(max_jobs="4", memory_max="8G")
    b = memory_budget(cfg, 4, unit_limit=9 * GIB, ram=32 * GIB)
    assert b.per_process == 2 * GIB
    job = job_config(cfg, b).job
    assert job.memory_max_bytes() == 2 * GIB
    assert DatasetLimits.from_config(job).max_matrix_bytes == job.matrix_budget_bytes() == (2 * GIB - 400 * 1024**2) // 4
    assert dataclasses.replace(job, memory_max=cfg.job.memory_max) == cfg.job  # nothing else changes


def test_a_share_below_what_a_job_process_holds_is_a_problem():
    b = memory_budget(cfg_with(max_jobs="8"), 8, unit_limit=3 * GIB, ram=4 * GIB)
    assert b.per_process == 256 * 1024**2
    assert "less than the 0.39 GiB a job process holds before any data; lower daemon.max_jobs" in b.problem()


def test_a_real_daemon_logs_the_budget_per_job_and_its_job_process_runs_under_it(tmp_path):
    """Before: no figure at start-up and each of the 4 job processes had RLIMIT_DATA = 50 % of RAM."""
    conf = write_config(tmp_path, epochs=100_000, batch_size=64, extra=["daemon:", "  max_jobs: 4"])
    from opt_ds_ops.config.conffile import load_config

    expected = this_process_budget(load_config(str(conf)), 4)  # this test runs in the daemon's cgroup
    if not expected.cut:
        pytest.skip("this machine has so little RAM that 4 jobs do not cut job.memory_max")
    d = Daemon(conf)
    try:
        d.wait_until(lambda: "ds-trainer ready" in d.log(), "the daemon to start")
        assert f", {expected.line()}, " in d.log(), d.log()
        assert "cut to fit 4 at once" in expected.line()
        incoming = spool_dir(tmp_path, "incoming")
        (incoming / "long.csv.part").write_text("".join(f"{i % 7},{i % 5},{i % 3}\n" for i in range(2000)))
        (incoming / "long.csv.part").rename(incoming / "long.csv")
        record = d.wait_until(lambda: (r := job_record(tmp_path, "long.csv")) and (r.get("epoch") or 0) >= 1 and r,
                              "the job to train")
        limits = open(f"/proc/{record['job_pid']}/limits").read()
        line = next(line for line in limits.splitlines() if line.startswith("Max data size"))
        assert line.split()[3:5] == [str(expected.per_process)] * 2, line
        assert d.stop()[0] == 0
    finally:
        d.kill()
