"""Job slots and GPU assignment (``daemon.max_jobs``): which job may start now, on which GPU.

Under ``auto`` each GPU that passes the daemon's NVML health check (:func:`opt_ds_ops.health.findings.judge_gpu`,
read before each assignment, at most every :data:`opt_ds_ops.daemon.pacing.GPU_CHECK_S` seconds, in a
thread given up on after the health timeout) runs one job, which sees only that GPU
(``CUDA_VISIBLE_DEVICES=<UUID>``, see :mod:`opt_ds_ops.daemon.worker`); an integer N allows N jobs, each
on the healthy GPU with the fewest jobs. A GPU that fails the check (or whose job's own gate finds
it failing) takes no new job for ``health.retry_s`` seconds, then is read again; the other GPUs go
on. With no usable GPU (a CPU host, no NVML, every GPU failing) jobs get no GPU and their own gate
decides as before (``health.on_fail``): one at a time, or N on a host without GPUs. ``device:
cpu``, ``mps`` or ``cuda:N`` pins jobs, 1 at a time under ``auto``. A dataset of at least
``daemon.distributed_min_bytes`` trains alone on several ranks (:meth:`Slots.ranks`).

The daemon reads NVML here only, never a user's bytes.
"""

from __future__ import annotations

import dataclasses
import threading
import time

from ..config.conffile import Config
from ..config.sizes import GPU_HEADROOM_BYTES
from ..health import nvml
from ..health.findings import judge_gpu
from ..observe.journal import LOG_WARNING
from .budget import job_processes, this_process_budget
from .pacing import GPU_CHECK_S, HEALTH_LOG_TIMEOUT_S
from .sandbox import without_unusable


class Slots:
    """The daemon's job slots: its GPU readings, the GPUs resting after a failure, and the rules
    that give a starting job a slot and a GPU.

    ``daemon`` is the :class:`opt_ds_ops.daemon.service.Daemon` served: its configuration (``cfg``, read
    anew each call: a reload changes it), its running jobs (``jobs``) and its journal (``log``)
    are read, never changed.
    """

    def __init__(self, daemon):
        self.d = daemon
        self.gpu_down: dict[str, tuple[float, str]] = {}  # GPU UUID -> (monotonic time it is read again, why)
        self.reading: tuple[float, list[dict] | None] | None = None  # (monotonic time, GPUs) of the last read
        self.hung_read: threading.Thread | None = None  # an NVML read that did not answer (hung)

    def pinned(self) -> bool:
        """True when the conffile pins the device (cpu, mps, cuda:N): jobs get no GPU of their own."""
        return self.d.cfg.device in ("cpu", "mps") or self.d.cfg.device.startswith("cuda:")

    def free_slot(self) -> tuple[bool, dict | None]:
        """Return (a job may start now, the GPU it gets: ``{"index", "uuid", "name"}`` or None).

        A stack's jobs (:mod:`opt_ds_ops.daemon.jobstack`) share one process and count as one job.
        See the module docstring: one job per healthy GPU under ``max_jobs: auto``, N jobs spread
        over them under an integer N; no GPU (the job's own gate decides) on a pinned device, a
        host without a usable GPU reading (``auto``: 1 job, N: N jobs) or when every GPU fails (1 job).
        """
        limit = self.d.cfg.daemon.max_jobs_limit()
        running = list({id(getattr(j, "stack", j)): j for j in self.d.jobs.values()}.values())  # a stack's jobs: one
        n = len(running)
        if any(j.nproc > 1 for j in self.d.jobs.values()):
            return False, None  # a distributed job has every GPU (or the CPUs) to itself
        if self.pinned():
            return n < (limit or 1), None
        if limit is not None and n >= limit:
            return False, None  # full: no NVML read
        healthy = self.healthy_gpus()
        if healthy is None:  # no GPU here, or no answer from NVML
            return n < (limit or 1), None
        if not healthy:  # every GPU fails: one job at a time, its gate applies health.on_fail
            return not any(j.gpu is None for j in running), None
        counts = {g["uuid"]: 0 for g in healthy}
        for j in running:
            if j.gpu is not None and j.gpu["uuid"] in counts:
                counts[j.gpu["uuid"]] += 1
        candidates = [g for g in healthy if limit is not None or counts[g["uuid"]] == 0]
        if not candidates:
            return False, None
        g = min(candidates, key=lambda g: (counts[g["uuid"]], g["index"]))
        return True, {"index": g["index"], "uuid": g["uuid"], "name": g["name"]}

    def healthy_gpus(self) -> list[dict] | None:
        """Return the GPUs that pass the daemon's NVML check and are not resting after a failure
        (``{"index", "uuid", "name", ...}``, by index; empty when every GPU fails), or None when
        there is no GPU here or NVML does not answer. Logs a GPU that fails, or passes again."""
        gpus = self.check_gpus()
        if gpus is None:
            return None
        now = time.monotonic()
        healthy = []
        for g in gpus:
            down = self.gpu_down.get(g["uuid"])
            if down is not None and now < down[0]:
                continue
            if g["verdict"] == "fail":
                self.gpu_failed(g["index"], g["uuid"], g["why"])
                continue
            if down is not None:
                del self.gpu_down[g["uuid"]]
                self.d.log.event("health", f"GPU {g['index']} ({g['uuid']}) passes its health check again; it takes "
                                 "jobs", gpu_index=g["index"], gpu_uuid=g["uuid"], verdict=g["verdict"])
            healthy.append(g)
        return healthy

    def distributed(self, record: dict | None) -> bool:
        """True when the job's dataset is at least ``daemon.distributed_min_bytes`` large (not 0)."""
        least = self.d.cfg.daemon.distributed_min_bytes
        return bool(least) and record is not None and record.get("size_bytes", 0) >= least

    def ranks(self) -> tuple[int, list[dict] | None]:
        """Return (processes, their GPUs or None) for a distributed job starting now (no other job
        runs): ``daemon.distributed_nproc`` ranks, ``auto`` one per healthy GPU; on the CPU (a host
        without GPUs, or ``device: cpu``) N gloo ranks, none for ``auto``. (1, None) where that is
        fewer than 2, or the device is pinned to one GPU or MPS: the job trains in one process."""
        want = self.d.cfg.daemon.distributed_ranks()
        if self.d.cfg.device == "cpu":
            return (want, None) if want else (1, None)
        if self.pinned():
            return 1, None
        healthy = self.healthy_gpus()
        if healthy is None:  # a host without GPUs
            return (want, None) if want else (1, None)
        n = len(healthy) if want is None else min(want, len(healthy))
        return (n, healthy[:n]) if n >= 2 else (1, None)

    def memory_budget(self, nproc: int = 1):
        """Return what one job process (of ``nproc`` ranks) may hold so that all the job processes that
        may run at once fit this process's cgroup (:mod:`opt_ds_ops.daemon.budget`)."""
        gpus = None if self.pinned() else self.check_gpus()
        return this_process_budget(self.d.cfg, job_processes(self.d.cfg, len(gpus) if gpus else None, nproc,
                                                           self.pinned()))

    def usable(self, cfg: Config) -> Config:
        """Return cfg without the features this process's sandbox refuses, each logged with why."""
        cfg, why = without_unusable(cfg)
        if why:
            self.d.log.event("feature-refused", f"{why}; datasets of any size train in one process",
                             priority=LOG_WARNING)
        return cfg

    def line(self) -> str:
        """Say how many jobs may run at once now (for the start-up line): ``max_jobs auto: 2 jobs,
        one per healthy GPU (GPU 0, GPU 1)``; reads NVML (see :meth:`check_gpus`)."""
        limit = self.d.cfg.daemon.max_jobs_limit()
        head = f"max_jobs {self.d.cfg.daemon.max_jobs}"
        if self.pinned():
            return f"{head}: {limit or 1} job(s) at once on device {self.d.cfg.device}"
        gpus = self.check_gpus()
        if gpus is None:
            return f"{head}: {limit or 1} job(s) at once, no GPU to give"
        ok = [g for g in gpus if g["verdict"] != "fail"]
        if not ok:
            return f"{head}: 1 job at a time, no GPU passes the health check (health.on_fail decides)"
        names = ", ".join(f"GPU {g['index']}" for g in ok) or "none"
        n = len(ok) if limit is None else limit
        return f"{head}: {n} job(s) at once on the GPUs that pass the health check ({names})"

    def check_gpus(self) -> list[dict] | None:
        """Read NVML and judge each GPU (the health gate's GPU checks, with the bytes a job needs);
        return ``[{"index", "uuid", "name", "verdict", "why"}]`` (GPUs without a UUID left out), or
        None when there is no GPU to give: no NVML library or driver, a broken driver, no GPU, or a
        read that did not answer within the health timeout (the thread is left behind; no new
        read starts while it hangs). A reading is reused for :data:`GPU_CHECK_S` seconds."""
        now = time.monotonic()
        if self.reading is not None and now - self.reading[0] < GPU_CHECK_S:
            return self.reading[1]
        if self.hung_read is not None and self.hung_read.is_alive():
            return None
        box: dict = {}

        def read() -> None:
            try:
                box["host"] = nvml.read_host()
            except Exception as e:  # noqa: BLE001 - a broken NVML means no GPU to give; jobs report it
                box["error"] = e

        t = threading.Thread(target=read, name="gpu-check", daemon=True)
        t.start()
        timeout_s = min(HEALTH_LOG_TIMEOUT_S, self.d.cfg.job.health_timeout_s)
        t.join(timeout_s)
        gpus = None
        if t.is_alive():
            self.hung_read = t
            self.d.log.event("health", f"the GPU check for job slots did not answer within {timeout_s:.0f} s (a hung "
                             "NVML call?); jobs start without a GPU of their own, one at a time", priority=LOG_WARNING)
        elif "host" in box:
            host = box["host"]
            gpus = self.slot_gpus({"host": {"status": host.status}, "gpus": [
                dict(g.as_dict(), findings=[dataclasses.asdict(f)
                                            for f in judge_gpu(g, self.d.cfg.health, GPU_HEADROOM_BYTES)])
                for g in host.gpus]})
        self.reading = (time.monotonic(), gpus)
        return gpus

    @staticmethod
    def slot_gpus(report: dict) -> list[dict] | None:
        """Given a health report's ``host.status`` and ``gpus`` (each with its ``findings``), return
        the GPUs jobs may be given, ``[{"index", "uuid", "name", "verdict", "why"}]`` (those without
        a UUID left out), or None when NVML reads no GPU (no driver, a broken one, none there)."""
        if (report.get("host") or {}).get("status") != "ok":
            return None
        gpus = []
        for g in report.get("gpus") or []:
            if not isinstance(g.get("uuid"), str) or not g["uuid"].startswith(("GPU-", "MIG-")):
                continue
            found = g.get("findings") or []
            gpus.append({"index": g["index"], "uuid": g["uuid"], "name": str(g.get("name")),
                         "verdict": max((f["level"] for f in found), key=("ok", "warn", "fail").index, default="ok"),
                         "why": "; ".join(f"{f['check']}: {f['message']}" for f in found if f["level"] == "fail")})
        return gpus or None

    def gpu_failed(self, index, uuid: str, why: str) -> None:
        """Take GPU ``uuid`` out of the slots for health.retry_s seconds (logged once per outage)."""
        if uuid in self.gpu_down and time.monotonic() < self.gpu_down[uuid][0]:
            return
        self.gpu_down[uuid] = (time.monotonic() + self.d.cfg.health.retry_s, why)
        self.d.log.event("health", f"GPU {index} ({uuid}) fails its health check: {why}; it takes no jobs for "
                         f"{self.d.cfg.health.retry_s:.0f} s (health.retry_s), the other GPUs go on",
                         priority=LOG_WARNING, gpu_index=index, gpu_uuid=uuid, verdict="fail")

    def judge_job_gpu(self, record: dict, f: dict) -> None:
        """A job's own health gate found the GPU it was given failing (a failed CUDA smoke test, a
        reading that changed since the daemon's): that GPU takes no jobs for health.retry_s."""
        uuid = record.get("gpu_uuid")
        g = next((g for g in (f.get("report") or {}).get("gpus") or [] if uuid and g.get("uuid") == uuid), None)
        if g is not None and g.get("verdict") == "fail":
            why = "; ".join(f"{x['check']}: {x['message']}"
                            for x in g.get("findings") or [] if x.get("level") == "fail")
            self.gpu_failed(g.get("index"), uuid, f"its job's health gate: {why}")
