"""The memory each job process may hold, so that all of them together fit the daemon's cgroup.

``job.memory_max`` (default 50 % of RAM) is what one job may use. The daemon runs up to
``daemon.max_jobs`` jobs at once (``auto``: one per GPU), and a distributed job
(``daemon.distributed_min_bytes``) is a job process plus N torchrun ranks, each inheriting the
job's ``RLIMIT_DATA``. Each of them with ``memory_max`` on its own would exceed the unit's
``MemoryMax=`` (75 % of RAM), and the kernel would kill the largest job: a crash counted against a
dataset that fits alone. So a job process gets

    min(job.memory_max, (min(cgroup memory.max, RAM) - UNIT_SHARE_BYTES) / processes)

where the cgroup limit is read for this process (the daemon's, under systemd the unit's
``MemoryMax=``; RAM where there is none) and ``processes`` is the most job processes that may hold
memory at once (:func:`job_processes`). The matrix budget (``job.max_matrix_bytes`` 0) follows
from that figure: :meth:`opt_ds_ops.config.conffile.JobConfig.matrix_budget_bytes` of :func:`job_config`.
"""

from __future__ import annotations

import dataclasses
import os

from ..config.conffile import Config
from ..config.sizes import JOB_BASE_BYTES, mem_total_bytes, parse_size

# The unit's own share beside its jobs: the forkserver imports torch (about 230 MB resident with
# the CPU build, measured; the daemon's own process, without torch, about 40 MB), torchrun's
# launcher for a distributed job a second time; the rest is room for page cache and the daemon's
# records. Kept at 1 GiB, as when the daemon held torch too: not measured again.
UNIT_SHARE_BYTES = 1024**3
GIB = 1024**3
V1_UNLIMITED = 1 << 62  # cgroup v1 writes "no limit" as the largest page count in bytes (about 2**63)


def _read_limit(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except OSError:
        return None
    if not text.isdigit() or int(text) >= V1_UNLIMITED:  # "max" (v2), or v1's page counter maximum
        return None
    return int(text)


def cgroup_memory_max(proc_cgroup: str = "/proc/self/cgroup", cgroup_root: str = "/sys/fs/cgroup") -> int | None:
    """Return the memory limit (bytes) of this process's cgroup and its ancestors, the smallest
    (cgroup v2 ``memory.max``; v1 ``memory/…/memory.limit_in_bytes``), or None where none is set or
    the files cannot be read (no cgroup file system, a path of another namespace)."""
    try:
        with open(proc_cgroup, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            base, name = cgroup_root, "memory.max"
        elif "memory" in controllers.split(","):
            base, name = os.path.join(cgroup_root, "memory"), "memory.limit_in_bytes"
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            limit = _read_limit(os.path.join(base, *parts[:depth], name))
            if limit is not None:
                limits.append(limit)
    return min(limits) if limits else None


def job_processes(cfg: Config, gpu_count: int | None, nproc: int = 1, pinned: bool = False) -> int:
    """Return how many job processes may hold memory at once: ``nproc`` + 1 for a distributed job
    (its process and its ranks; it runs alone), else ``daemon.max_jobs`` (``auto``: one per GPU the
    daemon sees, ``gpu_count``; 1 without GPUs or on a pinned device)."""
    if nproc > 1:
        return nproc + 1
    limit = cfg.daemon.max_jobs_limit()
    if limit is not None:
        return limit
    return 1 if pinned or not gpu_count else gpu_count


@dataclasses.dataclass(frozen=True)
class MemoryBudget:
    """What one job process may hold (``per_process`` bytes) and how that figure came about."""

    per_process: int
    processes: int
    memory_max: int  # job.memory_max in bytes
    room: int  # min(cgroup limit, RAM) less the unit's share: what all job processes share
    unit_limit: int | None  # the cgroup's limit (bytes), None where there is none
    ram: int

    @property
    def cut(self) -> bool:
        """True when the processes' share is smaller than job.memory_max."""
        return self.per_process < self.memory_max

    def line(self) -> str:
        """One line for the start-up event and ``check-config``."""
        where = ("the cgroup's memory limit" if self.unit_limit is not None and self.unit_limit < self.ram
                 else "RAM")
        fit = (f"{self.processes} at once in {self.room / GIB:.1f} GiB: {where} less {UNIT_SHARE_BYTES / GIB:.1f} "
               "GiB for the daemon")
        if self.cut:
            return (f"memory per job process {self.per_process / GIB:.2f} GiB (job.memory_max "
                    f"{self.memory_max / GIB:.2f} GiB cut to fit {fit})")
        return f"memory per job process {self.per_process / GIB:.2f} GiB (job.memory_max; {fit})"

    def problem(self) -> str | None:
        """Why a job process cannot work with this figure (below what it holds before any data), or None."""
        if self.per_process >= JOB_BASE_BYTES:
            return None
        return (f"{self.line()}: less than the {JOB_BASE_BYTES / GIB:.2f} GiB a job process holds before any data; "
                "lower daemon.max_jobs or daemon.distributed_nproc, or raise the unit's MemoryMax=")


def memory_budget(cfg: Config, processes: int, *, unit_limit: int | None, ram: int) -> MemoryBudget:
    """Given the configuration, the job processes at once and the limits (bytes; a percentage in
    ``job.memory_max`` is of ``ram``), return their MemoryBudget."""
    memory_max = parse_size(cfg.job.memory_max, ram)
    room = max((min(unit_limit, ram) if unit_limit is not None else ram) - UNIT_SHARE_BYTES, 0)
    return MemoryBudget(per_process=min(memory_max, room // max(processes, 1)), processes=processes,
                        memory_max=memory_max, room=room, unit_limit=unit_limit, ram=ram)


def this_process_budget(cfg: Config, processes: int, proc_cgroup: str = "/proc/self/cgroup",
                        cgroup_root: str = "/sys/fs/cgroup") -> MemoryBudget:
    """Return the MemoryBudget of ``processes`` job processes under this process's cgroup and RAM."""
    return memory_budget(cfg, processes, unit_limit=cgroup_memory_max(proc_cgroup, cgroup_root),
                         ram=mem_total_bytes())


def job_config(cfg: Config, budget: MemoryBudget) -> Config:
    """Return cfg with ``job.memory_max`` set to the budget's bytes per process (what the job
    process sets as RLIMIT_DATA and derives its matrix budget from)."""
    if not budget.cut:
        return cfg
    return dataclasses.replace(cfg, job=dataclasses.replace(cfg.job, memory_max=str(budget.per_process)))
