"""The ``ds-trainer`` daemon: the spool's jobs, each in its own process, for months.

The main loop (one thread) never parses or trains and never blocks on anything a user controls.
In order, each tick: reload the conffile after SIGHUP; rescan incoming/ when due; look after the
running jobs (their messages, their exits, a stall, a stop); then, while a job slot is free, start
a queued job or claim the oldest ready file in incoming/ (:func:`opt_ds_ops.spool.claim`: the
bytes are copied into the job's own directory); else sleep a tick.

**Job slots** (issue 12, ``daemon.max_jobs``). Under ``auto`` each GPU that passes the daemon's
NVML health check (:func:`opt_ds_ops.health.judge_gpu`, read before each assignment, at most every
:data:`GPU_CHECK_S` seconds, in a thread given up on after the health timeout) runs one job, which
sees only that GPU (``CUDA_VISIBLE_DEVICES=<UUID>``, see :mod:`opt_ds_ops.worker`); an integer N
allows N jobs, each on the healthy GPU with the fewest jobs. A GPU that fails the check (or whose
job's own gate finds it failing) takes no new job for ``health.retry_s`` seconds, then is read
again; the other GPUs go on. With no usable GPU (a CPU host, no NVML, every GPU failing) jobs get
no GPU and their own gate decides as before (``health.on_fail``): one at a time, or N on a host
without GPUs. ``device: cpu``, ``mps`` or ``cuda:N`` pins jobs, 1 at a time under ``auto``.

A job: health gate -> dataset -> training -> model store, in a process of its own (:mod:`opt_ds_ops.worker`), then done/ or failed/ with a JSON beside the
dataset.

**Blame where it belongs.** What a user dropped can fail only its own job: it is refused to
failed/ with the stage and reason, or (not a regular file) reported once and left in incoming/.
An out-of-memory kill, SIGBUS or crash of a job process is that job's crash (``crashes`` in its
record; failed/ after ``spool.max_crashes``). An error of the file system itself (ENOSPC, EDQUOT,
EROFS, EIO on the spool or the model store) pauses intake with a ``STATUS=`` line and retries with
back-off (5 s doubling to 5 min) while the watchdog stays fed; it counts against no dataset. A
death of the daemon (SIGKILL, OOM kill, power loss) counts against no dataset either: at start-up
every job in processing/ is run again, resumed from its checkpoint if it has one; only a job the
daemon was handling at two deaths in a row is quarantined to failed/ (:mod:`opt_ds_ops.handling`).

**The daemon never parses a user's bytes** (issue 18): it moves files, reads its own records and
talks to jobs. The sidecar, the dataset and torch are read in the job process only; any exception
while the daemon handles one job is that job's failure (:meth:`Daemon._for_job`).

**Recovery by identity.** A job's model version records the job id in metadata.json. When a
job (re)starts, its process first asks the store for a version with its job id
(:func:`opt_ds_ops.store.find_job_version`): if there is one, publishing ``current`` is replayed
in claim order (:func:`opt_ds_ops.store.publish_job`) and the job finishes in done/ without
training again, whatever the clocks say.

SIGTERM: each job in its health or dataset stage is killed at once (it restarts from scratch on the
next start); each training job writes its checkpoint and stops at the next batch; once all have
stopped the daemon exits 0.
"""

from __future__ import annotations

import dataclasses
import multiprocessing.connection
import os
import signal
import threading
import time
import traceback
from datetime import datetime, timezone

from . import EARLY_STOP, gpustats, nvml, worker
from .budget import job_config, job_processes, this_process_budget
from .config import DEFAULT_CONFIG_PATH, SIDECAR_MAX_BYTES, Config, ConfigError, load_config
from .dataset import dataset_stem
from .duplicate import end_duplicate
from .fsutil import user_name, utc_now
from .health import gate_job, judge_gpu, summary_line
from .handling import QUARANTINE_AFTER, Breadcrumb
from .job import columns_note, stopping_note
from .journal import LOG_ERR, LOG_INFO, LOG_NOTICE, LOG_WARNING, EventLog, safe_text
from .metrics import MetricsWriter
from .notify import Notifier
from .sandbox import without_unusable
from .scorer import ScoreSlot
from .spool import (
    DONE, FAILED, INCOMING, Spool, SpoolError, boot_id, check_writable_dir, claim, discard_job, finish,
    STORAGE_ERRNOS, is_ignored, is_storage_error, job_ids, lock_job, lock_spool, migrate_legacy, open_spool, prune_failed,
    read_record, process_start_ticks, prune_retention, recover_claim, remove_stale_temps, save_record,
)
from .retrain import Retrainer
from .store import GATED, HELD, StoreError, prune
from .train import GPU_HEADROOM_BYTES, EpochStats
from .watcher import IncomingWatcher

METRICS_REFRESH_S = 60.0  # ds_ops.prom is rewritten at least this often (seconds), besides every state change
TICK_S = 0.5  # idle loop period (seconds): the latency of SIGTERM, SIGHUP and new files when idle
STEP_BUDGET_S = 120.0  # watchdog budget for one loop tick (seconds); the loop never waits on a job
STOP_EXTEND_S = 30.0  # EXTEND_TIMEOUT_USEC asked for while a job writes its checkpoint on SIGTERM
START_EXTEND_S = 300.0  # EXTEND_TIMEOUT_USEC while the forkserver imports torch at start-up
BACKOFF_S = (5.0, 300.0)  # first and longest pause of intake after a file system error (seconds)
HEALTH_LOG_TIMEOUT_S = 30.0  # the start-up health report gives up waiting on NVML after this (seconds)
GPU_CHECK_S = 2.0  # the daemon's NVML reading for job slots is reused for this long (seconds)


def _parse_utc(stamp) -> float | None:
    try:
        return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc).timestamp()
    except (TypeError, ValueError):
        return None


def _changed_keys(old: Config, new: Config) -> list[str]:
    """Return ``key: old -> new`` for each dotted conffile key whose value differs (issue 11)."""
    from .config import config_to_dict

    out = []

    def walk(a: dict, b: dict, prefix: str) -> None:
        for key in sorted(set(a) | set(b)):
            va, vb = a.get(key), b.get(key)
            if isinstance(va, dict) and isinstance(vb, dict):
                walk(va, vb, f"{prefix}{key}.")
            elif va != vb:
                out.append(f"{prefix}{key} {va!r} -> {vb!r}")

    walk(config_to_dict(old), config_to_dict(new), "")
    return out


def result_doc(record: dict, metadata: dict) -> dict:
    """Return NAME.result.json's content from the job record and the model's metadata.json.

    ``duration_s`` runs from the claim to now (seconds, wall clock: informative only).
    """
    claimed = record.get("claimed_at")
    since = _parse_utc(claimed)
    return {
        "job_id": record["job_id"],
        "dataset": record.get("dataset"),
        "model_name": metadata.get("name"),
        "model_dir": metadata.get("model_dir"),
        "version": metadata.get("version"),
        "rows": metadata["dataset"]["rows"],
        "columns": metadata["dataset"]["columns"],
        "sha256": metadata["dataset"]["sha256"],
        "epochs": metadata.get("epochs"),
        "final_train_loss": metadata.get("final_train_loss"),
        "final_val_loss": metadata.get("final_val_loss"),
        "history": metadata.get("history"),
        "threshold": metadata.get("threshold"),
        "threshold_quantile": metadata.get("threshold_quantile"),
        "samples_per_s": metadata.get("samples_per_s"),
        "device": metadata.get("device"),
        "amp_dtype": metadata.get("amp_dtype"),
        "training_duration_s": metadata.get("duration_s"),
        "claimed_at": claimed,
        "finished_at": utc_now(),
        "duration_s": round(time.time() - since, 3) if since else None,
        "resumed_from_epoch": record.get("resumed_from_epoch"),
        "gpu_index": record.get("gpu_index"),
        "gpu_uuid": record.get("gpu_uuid"),
        "distributed": metadata.get("distributed"),  # {"world_size", "backend"} of a torchrun job, else None
        "crashes": record.get("crashes", 0),
        "restarts": record.get("restarts", 0),
    }


class Daemon:
    """The running daemon: configuration, spool, watcher, sd_notify, the queue and the running jobs.

    ``config_path`` is re-read on SIGHUP (``missing_ok``: a missing file means defaults). Create
    with :func:`start_daemon`, which checks the directories first. ``mp_context`` is the
    multiprocessing context jobs start in (None: the forkserver of :mod:`opt_ds_ops.worker`);
    ``gate`` replaces the health gate in the job processes (tests only, see worker.job_main).
    """

    def __init__(self, cfg: Config, spool: Spool, log: EventLog, notifier: Notifier,
                 config_path: str, missing_ok: bool = False, mp_context=None, gate=None):
        self.cfg, self.spool, self.log, self.notifier = cfg, spool, log, notifier
        self.config_path, self.missing_ok = config_path, missing_ok
        self.mp_context, self.gate = mp_context, gate
        self.watcher = IncomingWatcher(spool.dir(INCOMING), settle_s=cfg.spool.settle_s, quiet_s=cfg.spool.quiet_s,
                                       rescan_s=cfg.spool.scan_interval_s, mode=cfg.spool.watcher)
        self.pending: list[str] = []  # job ids in processing/ to (re)run, oldest claim first
        self.retry_at: dict[str, float] = {}  # job id -> monotonic time before which it is not retried
        self.defer_reason: dict[str, str] = {}
        self.records: dict[str, dict] = {}  # job id -> its record (job.json), the daemon's copy
        self.jobs: dict[str, worker.JobProcess] = {}  # job id -> its running process, oldest start first
        self.gpu_down: dict[str, tuple[float, str]] = {}  # GPU UUID -> (monotonic time it is read again, why)
        self._gpu_reading: tuple[float, list[dict] | None] | None = None  # (monotonic time, GPUs) of the last read
        self._gpu_thread: threading.Thread | None = None  # an NVML read that did not answer (hung)
        self.paused_until = 0.0
        self.pause_reason = ""
        self._backoff = BACKOFF_S[0]
        self.stop_requested = False
        self.reload_requested = False
        self._stopping_sent = False
        # issue 11: Prometheus textfile metrics (opt_ds_ops.metrics), written on every state change
        import torch

        self.metrics = MetricsWriter(cfg.metrics.textfile_dir, cfg.models_dir, torch_version=torch.__version__,
                                     cuda_version=torch.version.cuda or "")
        self.metrics_written_at = 0.0  # time.monotonic() of the last write (METRICS_REFRESH_S)
        self.breadcrumb = Breadcrumb(spool.root)  # issue 18: the job in hand, for a death's quarantine
        self.cfg = self._usable(cfg)
        self.scorer = ScoreSlot(self)  # issue 19: score/ and its one scoring job (opt_ds_ops.scorer)
        self.retrainer = Retrainer(self)  # issue 20: retraining queued after scored files (opt_ds_ops.retrain)

    @property
    def job(self) -> worker.JobProcess | None:
        """The oldest running job, or None when none runs (the one job under ``max_jobs: 1``)."""
        return next(iter(self.jobs.values()), None)

    # ---- signals -------------------------------------------------------------------------------
    def _on_stop(self, signum, frame) -> None:
        self.stop_requested = True
        self.watcher.wakeup.set()

    def _on_hup(self, signum, frame) -> None:
        self.reload_requested = True
        self.watcher.wakeup.set()

    def run(self) -> int:
        """Run until SIGTERM/SIGINT and the running job has stopped; return the exit code (0)."""
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        signal.signal(signal.SIGHUP, self._on_hup)
        if EARLY_STOP:  # a stop that came while the daemon was still importing (see opt_ds_ops.cli)
            self.stop_requested = True
        self.notifier.keepalive(START_EXTEND_S)
        self.notifier.start_watchdog()
        self.notifier.extend_timeout(START_EXTEND_S)
        how = self.watcher.start()
        self.log.event("watcher", f"watching {self.spool.dir(INCOMING)} with {how}",
                       priority=LOG_WARNING if self.watcher.polling else LOG_INFO)
        self.scorer.start()
        try:
            if self.mp_context is None and not self.stop_requested:
                worker.warm_up()
            try:
                quarantine = self.breadcrumb.deaths()
            except OSError as e:  # a full or read-only spool: no quarantine this time; the loop pauses on it
                quarantine = ("", 0)
                self.log.event("internal-error", f"{self.breadcrumb.deaths_path}: {e}", priority=LOG_ERR)
            self._guarded(self.breadcrumb.open)
            self._guarded(lambda: self._recover(quarantine))
            self.watcher.tick()
            self.notifier.ready(self._idle_status())
            self._log_health()
            self.log.event(
                "daemon-started",
                f"ds-trainer ready: spool {self.spool.root}, models {self.cfg.models_dir}, device "
                f"{self.cfg.device} amp {self.cfg.amp}, {self._slots_line()}, {self._memory_budget().line()}, "
                f"{self.watcher.queued()} in incoming/, "
                f"{len(self.pending)} to resume",
                spool=self.spool.root, model_dir=self.cfg.models_dir,
            )
            self._start_metrics()
            while not (self.stop_requested and not self.jobs):
                self.notifier.keepalive(STEP_BUDGET_S)
                if self.reload_requested:
                    self._reload()
                busy = self._guarded(self._tick)
                if not busy:
                    self.notifier.status(self._idle_status())
                    self.watcher.idle(TICK_S)  # ends early when a file event arrives
        finally:
            for job in self.jobs.values():
                job.kill("the daemon is stopping", crash=False)
            self.scorer.stop()
            self.breadcrumb.close()
            self._stopping()
            self.watcher.stop()
            if self.mp_context is None:
                worker.shut_down()
        self.log.event("daemon-stopping", "ds-trainer stopped")
        return 0

    # ---- issue 11: metrics and retention ---------------------------------------------------------
    def _start_metrics(self) -> None:
        """Say once where metrics go (or why they are off), prune done/ and failed/, write metrics."""
        if self.metrics.enabled:
            self.log.event("metrics", f"Prometheus metrics: {self.metrics.path} (node_exporter textfile collector)")
        else:
            self.log.event("metrics", f"Prometheus metrics off: {self.metrics.why_off}")
        self._guarded(self._retention)
        self._write_metrics()

    def _write_metrics(self) -> None:
        """Write ds_ops.prom with the queue, the running jobs (those whose process has not ended:
        a job just finished is not counted before it is reaped) and the last results; a failure is
        a warning logged once per reason, never a stop."""
        m = self.metrics
        if not m.enabled:
            return
        m.queued = self.watcher.queued() + len(self.pending)
        m.paused = time.monotonic() < self.paused_until
        m.jobs = [{"epoch": self.records.get(j.job_id, {}).get("epoch") or 0, "epochs": self.cfg.train.epochs,
                   "slot": j.slot, "gpu": str(j.gpu["index"]) if j.gpu else "", "uuid": j.gpu["uuid"] if j.gpu else ""}
                  for j in self.jobs.values() if j.exitcode() is None]
        self.metrics_written_at = time.monotonic()
        problem = m.write()
        if problem:
            self.log.event("metrics", f"Prometheus metrics not written: {problem}", priority=LOG_WARNING)

    def _prune_versions(self, metadata: dict) -> None:
        """After a job: keep store.keep_versions versions of its model (never current or pinned)."""
        name, keep = metadata.get("name"), self.cfg.store.keep_versions
        if not name or keep <= 0:
            return
        try:
            removed = prune(self.cfg.models_dir, name, keep)
        except StoreError as e:
            self.log.event("model-pruned", f"{safe_text(name)}: old versions not pruned: {e}", priority=LOG_WARNING,
                           model_name=name)
            return
        for version in removed:
            self.log.event("model-pruned", f"{safe_text(name)}/{version} removed: the model keeps its newest "
                           f"{keep} versions (store.keep_versions), current and pinned ones", model_name=name)

    def _retention(self) -> None:
        """Remove datasets past the retention of done/ and failed/ (spool.*_max_age_days, *_max_bytes)."""
        sp = self.cfg.spool
        for dest, days, max_bytes in ((DONE, sp.done_max_age_days, sp.done_max_bytes),
                                      (FAILED, sp.failed_max_age_days, sp.failed_max_bytes)):
            for old in prune_retention(self.spool, dest, days, max_bytes):
                self.log.event("spool-pruned", f"{dest}/{safe_text(old)} removed with its JSON: past the retention "
                               f"of {dest}/ (spool.{dest}_max_age_days {days:g}, spool.{dest}_max_bytes "
                               f"{max_bytes})", dataset_file=old)

    def _guarded(self, step) -> bool:
        """Run step(); an OSError of the spool or store pauses intake with back-off instead of
        stopping the daemon (the watchdog stays fed). Any other exception (a bug outside any one
        job: those are the job's, see :meth:`_for_job`) is logged with its traceback and pauses
        intake the same way: the daemon never exits into a restart loop. Return step's result,
        False after an error."""
        try:
            return bool(step())
        except (OSError, SpoolError) as e:
            self._pause(f"spool {self.spool.root}: {getattr(e, 'strerror', None) or e}"
                        + (f" ({e.filename})" if getattr(e, "filename", None) else ""))
            return False
        except Exception as e:  # noqa: BLE001 - see the docstring
            self.log.event("internal-error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}", priority=LOG_ERR)
            self._pause(f"internal error {type(e).__name__}: {e}")
            return False

    def _for_job(self, job_id: str | None, step, *args, name: str = "", hold: bool = True):
        """Run step(*args) while handling one job (a claim of incoming/NAME, a start, a message,
        its end, its recovery): the job id is in hand (:mod:`opt_ds_ops.handling`; ``hold=False``:
        step marks what it does itself), and any exception but a storage error (which pauses
        intake, see :meth:`_guarded`) is that job's failure: logged with its type and traceback,
        the job failed to failed/, the loop goes on. Return step's result (True after a failure:
        something was done)."""
        try:
            with self.breadcrumb.holding(job_id if hold else None):
                return step(*args)
        except Exception as e:  # noqa: BLE001 - one job's exception is that job's failure
            if is_storage_error(e) or isinstance(e, SpoolError):
                raise
            self._job_exception(job_id, name, e)
            return True

    def _job_exception(self, job_id: str | None, name: str, e: Exception) -> None:
        """Fail the job (or, before it has a job directory, retry incoming/NAME later) after an
        exception while the daemon handled it (see :meth:`_for_job`)."""
        where = f"job {job_id}" if job_id else f"incoming/{safe_text(name)}"
        self.log.event("internal-error", f"{where}: {type(e).__name__}: {e}\n{traceback.format_exc()}",
                       priority=LOG_ERR, job_id=job_id, dataset_file=name or None)
        job = self.jobs.pop(job_id, None) if job_id else None
        if job is not None:
            job.kill(f"the daemon failed handling it ({type(e).__name__})", crash=False)
            job.close()
        record = (self.records.get(job_id) or read_record(self.spool, job_id)) if job_id else None
        if record is None:
            if job_id:
                self._forget(job_id)
                self.pending = [j for j in self.pending if j != job_id]
            if name and not is_ignored(name):  # a sidecar's name is never a dataset to offer
                self.watcher.retry_later(name, 60.0)
            return
        self.pending = [j for j in self.pending if j != job_id]
        try:
            with self.breadcrumb.holding(job_id):
                self._fail(record, record.get("stage") or "spool",
                           f"the daemon failed handling this job: {type(e).__name__}: {e}", type(e).__name__)
        except Exception as e2:  # noqa: BLE001 - it stays in processing/ for the next start; the loop goes on
            self._forget(job_id)
            self.log.event("internal-error", f"job {job_id}: could not be moved to failed/ either: "
                           f"{type(e2).__name__}: {e2}; it stays in processing/", priority=LOG_ERR, job_id=job_id)

    def _pause(self, reason: str) -> None:
        """Pause intake for the current back-off, log it (error) and say so in STATUS=."""
        delay = self._backoff
        self._backoff = min(BACKOFF_S[1], self._backoff * 2)
        self.paused_until = time.monotonic() + delay
        self.pause_reason = reason
        self.log.event("intake-paused", f"intake paused for {delay:.0f} s: {reason}", priority=LOG_ERR)
        self.notifier.status(self._idle_status())
        self._write_metrics()

    def _stopping(self) -> None:
        """On the way out (first call only): stop the WATCHDOG=1 pings, send STOPPING=1."""
        if not self._stopping_sent:
            self._stopping_sent = True
            self.notifier.stop_watchdog()
            self.notifier.stopping("stopping")

    def _tick(self) -> bool:
        """Do one thing; return False if there was nothing to do (the loop then sleeps a tick)."""
        if self.stop_requested:
            self._stopping()  # STOPPING=1 first, then EXTEND_TIMEOUT_USEC while a checkpoint is written
        self.watcher.tick()
        if self.metrics.enabled and time.monotonic() - self.metrics_written_at > METRICS_REFRESH_S:
            self._write_metrics()  # ages stay current and `ds-ops models` changes show, even when idle
        intake = not (self.stop_requested or time.monotonic() < self.paused_until)
        scoring = self._guarded(lambda: self.scorer.step(0.0 if self.jobs else TICK_S, intake))  # never behind training
        if self.jobs and self._watch_jobs():  # waits up to a tick for a message from any of them
            return True  # a job ended: its slot is given again on the next tick
        if not intake:
            return bool(self.jobs) or scoring
        return self._start_next() or bool(self.jobs) or scoring

    def _start_next(self) -> bool:
        """Start the first due job of the queue, else claim the oldest ready file, if a job slot
        is free; return True if something was done."""
        now = time.monotonic()
        due = [job_id for job_id in self.pending if now >= self.retry_at.get(job_id, 0.0)]
        if not due and self.pending:  # a deferred job keeps its place: first come, first served
            return False
        names = [] if due else self.watcher.ready()
        if not due and not names:
            return False
        if due and self.jobs and self._distributed(self.records.get(due[0]) or read_record(self.spool, due[0])):
            return False  # it runs alone, once the running jobs have ended (first come, first served)
        free, gpu = self._free_slot()
        if not free:
            return False
        if due:
            self.pending.remove(due[0])
            self._for_job(due[0], self._start, due[0], gpu)
            return True
        for name in names:
            if self._take(name, gpu):
                return True
        return False

    # ---- job slots (issue 12) --------------------------------------------------------------------
    def _pinned(self) -> bool:
        """True when the conffile pins the device (cpu, mps, cuda:N): jobs get no GPU of their own."""
        return self.cfg.device in ("cpu", "mps") or self.cfg.device.startswith("cuda:")

    def _free_slot(self) -> tuple[bool, dict | None]:
        """Return (a job may start now, the GPU it gets: ``{"index", "uuid", "name"}`` or None).

        See the module docstring: one job per healthy GPU under ``max_jobs: auto``, N jobs spread
        over them under an integer N; no GPU (the job's own gate decides) on a pinned device, a
        host without a usable GPU reading (``auto``: 1 job, N: N jobs) or when every GPU fails (1 job).
        """
        limit = self.cfg.daemon.max_jobs_limit()
        n = len(self.jobs)
        if any(j.nproc > 1 for j in self.jobs.values()):
            return False, None  # a distributed job has every GPU (or the CPUs) to itself
        if self._pinned():
            return n < (limit or 1), None
        if limit is not None and n >= limit:
            return False, None  # full: no NVML read
        healthy = self._healthy_gpus()
        if healthy is None:  # no GPU here, or no answer from NVML
            return n < (limit or 1), None
        if not healthy:  # every GPU fails: one job at a time, its gate applies health.on_fail
            return not any(j.gpu is None for j in self.jobs.values()), None
        counts = {g["uuid"]: 0 for g in healthy}
        for j in self.jobs.values():
            if j.gpu is not None and j.gpu["uuid"] in counts:
                counts[j.gpu["uuid"]] += 1
        candidates = [g for g in healthy if limit is not None or counts[g["uuid"]] == 0]
        if not candidates:
            return False, None
        g = min(candidates, key=lambda g: (counts[g["uuid"]], g["index"]))
        return True, {"index": g["index"], "uuid": g["uuid"], "name": g["name"]}

    def _healthy_gpus(self) -> list[dict] | None:
        """Return the GPUs that pass the daemon's NVML check and are not resting after a failure
        (``{"index", "uuid", "name", ...}``, by index; empty when every GPU fails), or None when
        there is no GPU here or NVML does not answer. Logs a GPU that fails, or passes again."""
        gpus = self._check_gpus()
        if gpus is None:
            return None
        now = time.monotonic()
        healthy = []
        for g in gpus:
            down = self.gpu_down.get(g["uuid"])
            if down is not None and now < down[0]:
                continue
            if g["verdict"] == "fail":
                self._gpu_failed(g["index"], g["uuid"], g["why"])
                continue
            if down is not None:
                del self.gpu_down[g["uuid"]]
                self.log.event("health", f"GPU {g['index']} ({g['uuid']}) passes its health check again; it takes "
                               "jobs", gpu_index=g["index"], gpu_uuid=g["uuid"], verdict=g["verdict"])
            healthy.append(g)
        return healthy

    def _distributed(self, record: dict | None) -> bool:
        """True when the job's dataset is at least ``daemon.distributed_min_bytes`` large (not 0)."""
        least = self.cfg.daemon.distributed_min_bytes
        return bool(least) and record is not None and record.get("size_bytes", 0) >= least

    def _ranks(self) -> tuple[int, list[dict] | None]:
        """Return (processes, their GPUs or None) for a distributed job starting now (no other job
        runs): ``daemon.distributed_nproc`` ranks, ``auto`` one per healthy GPU; on the CPU (a host
        without GPUs, or ``device: cpu``) N gloo ranks, none for ``auto``. (1, None) where that is
        fewer than 2, or the device is pinned to one GPU or MPS: the job trains in one process."""
        want = self.cfg.daemon.distributed_ranks()
        if self.cfg.device == "cpu":
            return (want, None) if want else (1, None)
        if self._pinned():
            return 1, None
        healthy = self._healthy_gpus()
        if healthy is None:  # a host without GPUs
            return (want, None) if want else (1, None)
        n = len(healthy) if want is None else min(want, len(healthy))
        return (n, healthy[:n]) if n >= 2 else (1, None)

    def _memory_budget(self, nproc: int = 1):
        """issue 18: what one job process (of ``nproc`` ranks) may hold so that all the job processes that
        may run at once fit this process's cgroup (:mod:`opt_ds_ops.budget`)."""
        gpus = None if self._pinned() else self._check_gpus()
        return this_process_budget(self.cfg, job_processes(self.cfg, len(gpus) if gpus else None, nproc,
                                                           self._pinned()))

    def _usable(self, cfg: Config) -> Config:
        """issue 18: cfg without the features this process's sandbox refuses, each logged with why."""
        cfg, why = without_unusable(cfg)
        if why:
            self.log.event("feature-refused", f"{why}; datasets of any size train in one process", priority=LOG_WARNING)
        return cfg

    def _slots_line(self) -> str:
        """Say how many jobs may run at once now (for the start-up line): ``max_jobs auto: 2 jobs,
        one per healthy GPU (GPU 0, GPU 1)``; reads NVML (see :meth:`_check_gpus`)."""
        limit = self.cfg.daemon.max_jobs_limit()
        head = f"max_jobs {self.cfg.daemon.max_jobs}"
        if self._pinned():
            return f"{head}: {limit or 1} job(s) at once on device {self.cfg.device}"
        gpus = self._check_gpus()
        if gpus is None:
            return f"{head}: {limit or 1} job(s) at once, no GPU to give"
        ok = [g for g in gpus if g["verdict"] != "fail"]
        if not ok:
            return f"{head}: 1 job at a time, no GPU passes the health check (health.on_fail decides)"
        names = ", ".join(f"GPU {g['index']}" for g in ok) or "none"
        n = len(ok) if limit is None else limit
        return f"{head}: {n} job(s) at once on the GPUs that pass the health check ({names})"

    def _check_gpus(self) -> list[dict] | None:
        """Read NVML and judge each GPU (the health gate's GPU checks, with the bytes a job needs);
        return ``[{"index", "uuid", "name", "verdict", "why"}]`` (GPUs without a UUID left out), or
        None when there is no GPU to give: no NVML library or driver, a broken driver, no GPU, or a
        read that did not answer within the health timeout (the thread is left behind; no new
        read starts while it hangs). A reading is reused for :data:`GPU_CHECK_S` seconds."""
        now = time.monotonic()
        if self._gpu_reading is not None and now - self._gpu_reading[0] < GPU_CHECK_S:
            return self._gpu_reading[1]
        if self._gpu_thread is not None and self._gpu_thread.is_alive():
            return None
        box: dict = {}

        def read() -> None:
            try:
                box["host"] = nvml.read_host()
            except Exception as e:  # noqa: BLE001 - a broken NVML means no GPU to give; jobs report it
                box["error"] = e

        t = threading.Thread(target=read, name="gpu-check", daemon=True)
        t.start()
        timeout_s = min(HEALTH_LOG_TIMEOUT_S, self.cfg.job.health_timeout_s)
        t.join(timeout_s)
        gpus = None
        if t.is_alive():
            self._gpu_thread = t
            self.log.event("health", f"the GPU check for job slots did not answer within {timeout_s:.0f} s (a hung "
                           "NVML call?); jobs start without a GPU of their own, one at a time", priority=LOG_WARNING)
        elif "host" in box:
            host = box["host"]
            gpus = self._slot_gpus({"host": {"status": host.status}, "gpus": [
                dict(g.as_dict(), findings=[dataclasses.asdict(f) for f in judge_gpu(g, self.cfg.health, GPU_HEADROOM_BYTES)])
                for g in host.gpus]})
        self._gpu_reading = (time.monotonic(), gpus)
        return gpus

    @staticmethod
    def _slot_gpus(report: dict) -> list[dict] | None:
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

    def _gpu_failed(self, index, uuid: str, why: str) -> None:
        """Take GPU ``uuid`` out of the slots for health.retry_s seconds (logged once per outage)."""
        if uuid in self.gpu_down and time.monotonic() < self.gpu_down[uuid][0]:
            return
        self.gpu_down[uuid] = (time.monotonic() + self.cfg.health.retry_s, why)
        self.log.event("health", f"GPU {index} ({uuid}) fails its health check: {why}; it takes no jobs for "
                       f"{self.cfg.health.retry_s:.0f} s (health.retry_s), the other GPUs go on", priority=LOG_WARNING,
                       gpu_index=index, gpu_uuid=uuid, verdict="fail")

    def _idle_status(self) -> str:
        queued = self.watcher.queued()
        ignored = self.watcher.ignored()
        tail = f"; {ignored} non-regular entries ignored" if ignored else ""
        now = time.monotonic()
        if now < self.paused_until:
            return f"paused: {self.pause_reason}; retry in {self.paused_until - now:.0f} s; {queued} queued{tail}"
        if self.pending:
            job_id = self.pending[0]
            name = self.records.get(job_id, {}).get("dataset", job_id)
            left = self.retry_at.get(job_id, 0.0) - now
            return (f"deferred {safe_text(name)}: {self.defer_reason.get(job_id, '')}; retry in {max(left, 0):.0f} s; "
                    f"{queued} queued{tail}")
        mode = " (polling)" if self.watcher.polling else ""
        return f"idle; {queued} in incoming/{mode}{tail}"

    def _log_health(self) -> None:
        """Run the health gate once at start-up, in a thread that is given up on after
        HEALTH_LOG_TIMEOUT_S (a hung NVML call), and log its verdict (warning unless ok)."""
        box: dict = {}

        def run() -> None:
            try:
                # no CUDA smoke test here: the daemon holds no CUDA context; each job runs it in its process
                box["decision"] = gate_job(self.cfg, GPU_HEADROOM_BYTES, smoke=False)
            except Exception as e:  # a broken NVML must not stop the daemon; jobs report it again
                box["error"] = e

        t = threading.Thread(target=run, name="health-at-start", daemon=True)
        t.start()
        t.join(min(HEALTH_LOG_TIMEOUT_S, self.cfg.job.health_timeout_s))
        if t.is_alive():
            self._gpu_thread = t  # no NVML read for job slots starts while this one hangs
            self.log.event("health", f"health check did not answer within {self.cfg.job.health_timeout_s:.0f} s "
                           "(a hung NVML call?); jobs run it again in their own process", priority=LOG_WARNING)
            return
        if "error" in box:
            e = box["error"]
            self.log.event("health", f"health check could not run: {type(e).__name__}: {e}", priority=LOG_WARNING)
            return
        decision = box["decision"]
        self._gpu_reading = (time.monotonic(), self._slot_gpus(decision.report))  # the first job's slot uses it
        verdict = decision.report.get("verdict", "?")
        self.metrics.health(decision.report)
        plan = decision.plan
        self.log.event("health", summary_line(decision), priority=LOG_INFO if verdict == "ok" else LOG_WARNING,
                       verdict=verdict, action=decision.action, device=str(plan.device) if plan else None,
                       amp_dtype=plan.amp_name if plan else None, gpus=len(decision.report.get("gpus", [])))

    # ---- configuration -------------------------------------------------------------------------
    def _reload(self) -> None:
        """Re-read the conffile (SIGHUP); keep the running configuration if the new one is unusable."""
        self.reload_requested = False
        self.notifier.reloading()
        try:
            new = load_config(self.config_path, missing_ok=self.missing_ok)
            check_writable_dir(new.models_dir, "models directory")
        except (ConfigError, SpoolError) as e:
            self.log.event("config-rejected", f"configuration not reloaded, keeping the running one: {e}",
                           priority=LOG_WARNING)
            self.notifier.ready(self._idle_status())
            return
        new = self._usable(new)
        kept = []
        for key in ("dir", "watcher"):
            if getattr(new.spool, key) != getattr(self.cfg.spool, key):
                kept.append(f"spool.{key} stays {getattr(self.cfg.spool, key)!r} until a restart")
        if kept:
            spool_cfg = dataclasses.replace(new.spool, dir=self.cfg.spool.dir, watcher=self.cfg.spool.watcher)
            new = dataclasses.replace(new, spool=spool_cfg)
        if new.metrics != self.cfg.metrics:  # issue 11: the unit's sandbox binds the directory at start
            kept.append(f"metrics.textfile_dir stays {self.cfg.metrics.textfile_dir!r} until a restart")
            new = dataclasses.replace(new, metrics=self.cfg.metrics)
        changed = _changed_keys(self.cfg, new)  # issue 11: a good reload says what changed
        self.cfg = new
        for w in (self.watcher, self.scorer.watcher):
            w.set_timing(new.spool.settle_s, new.spool.scan_interval_s, new.spool.quiet_s)
        note = f" ({'; '.join(kept)})" if kept else ""
        note += f": {', '.join(changed)}" if changed else ": nothing changed"
        self.log.event("config-reloaded", f"configuration reloaded from {self.config_path}{note}")
        self.metrics.models_dir = new.models_dir
        self.notifier.ready(self._idle_status())
        self._write_metrics()

    # ---- claiming ------------------------------------------------------------------------------
    @staticmethod
    def _fields(record: dict, gpu_index: int | None = None) -> dict:
        """The journal fields of a job's events: DS_JOB_ID, DS_DATASET, DS_DATASET_FILE, and
        DS_GPU_INDEX, DS_GPU_UUID while the job holds a GPU (issue 12; absent on the CPU).
        ``gpu_index``: the NVML index of a reading from the job's GPU, for a job without a GPU slot."""
        name = record.get("dataset") or ""
        return {"job_id": record.get("job_id"), "dataset": dataset_stem(name), "dataset_file": name,
                "gpu_index": record.get("gpu_index") if gpu_index is None else gpu_index,
                "gpu_uuid": record.get("gpu_uuid")}

    def _take(self, name: str, gpu: dict | None = None) -> bool:
        """Claim incoming/NAME and start its job (on ``gpu``, see :meth:`_free_slot`), refuse it
        to failed/, or report it and leave it; return True if something was done. The copy pings
        the watchdog as it goes (a file near spool.max_dataset_bytes takes minutes); an exception
        is that file's failure (:meth:`_job_exception`), never the daemon's."""
        box: dict = {}

        def on_job(job_id: str) -> None:
            box["job_id"] = job_id
            self.breadcrumb.mark(job_id)

        try:
            try:
                c = claim(self.spool, name, self.cfg.spool.max_dataset_bytes, on_job=on_job,
                          progress=lambda: self.notifier.keepalive(STEP_BUDGET_S))
                return self._claimed(name, c, gpu)
            finally:
                self.breadcrumb.mark(None)
        except Exception as e:  # noqa: BLE001 - one file's exception is that file's failure
            if is_storage_error(e) or isinstance(e, SpoolError):
                raise
            self._job_exception(box.get("job_id"), name, e)
            return True

    def _claimed(self, name: str, c, gpu: dict | None) -> bool:
        """What :meth:`_take` does with a claim's outcome."""
        if c.outcome == "gone":
            self.watcher.forget(name)
            return False
        if c.outcome == "ignored":
            self.watcher.ignore(name)
            self.log.event("entry-ignored", f"incoming/{safe_text(name)} is {c.reason}; left where it is "
                           "(remove it, or drop the data as a regular file)", priority=LOG_WARNING,
                           dataset_file=name)
            return True
        if c.outcome == "busy":
            self.watcher.retry_later(name, max(1.0, 2 * self.cfg.spool.settle_s))
            self.log.event("entry-busy", f"incoming/{safe_text(name)}: not taken yet: {c.reason}",
                           dataset_file=name)
            return True
        self.watcher.forget(name)
        record = c.record
        self.records[c.job_id] = record
        if c.outcome == "empty":
            discard_job(self.spool, c.job_id)
            self.log.event("entry-removed", f"incoming/{safe_text(name)}: {c.reason}", priority=LOG_WARNING,
                           **self._fields(record))
            return True
        if c.outcome == "refused":
            self._fail(record, "spool", c.reason, "SpoolRefused")
            return True
        self.log.event("job-claimed", f"{safe_text(name)}: claimed as job {record['job_id']} "
                       f"({record['size_bytes']} bytes, sha256 {record['sha256'][:12]})", **self._fields(record))
        if record.get("sidecars_foreign"):
            self._refuse_foreign_sidecars(record)
        self._start(c.job_id, gpu)
        return True

    def _refuse_foreign_sidecars(self, record: dict) -> None:
        """Sidecars of the dataset's name that other users dropped (squatted names, see
        :func:`opt_ds_ops.spool.take_sidecar`) were not applied: say so, and move each aside to
        failed/ as its own entry (its owner can look at it there; the uploader could not remove
        it). Whatever happens to a foreign file is its own matter, never the uploader's job's."""
        foreign = record.pop("sidecars_foreign")
        save_record(self.spool, record)
        for f in foreign:
            side = f["name"]
            why = (f"{f.get('drop', INCOMING)}/{side} belongs to {user_name(f['uid'])}, {f['kind']}; {record['dataset']} was dropped "
                   f"by {user_name(record.get('uploader_uid'))}: a sidecar applies only to a dataset of the same uploader")
            self.log.event("sidecar-refused", f"{safe_text(record['dataset'])}: {safe_text(why)}; it trains without "
                           "it", priority=LOG_WARNING, **self._fields(record))
            self._for_job(None, self._move_foreign_sidecar, f, why, name=side)

    def _move_foreign_sidecar(self, f: dict, why: str) -> None:
        """Move one foreign sidecar (``{"name", "uid", "ino"}`` as seen) to failed/, if that same
        file is still there; report it and leave it if it is not a regular file."""
        drop = f.get("drop", INCOMING)  # score/ for a file to score (issue 19)
        try:
            st = os.lstat(self.spool.path(drop, f["name"]))
        except FileNotFoundError:
            return
        if (st.st_uid, st.st_ino) != (f["uid"], f["ino"]):
            return  # replaced since it was seen: not the file this is about
        c = claim(self.spool, f["name"], SIDECAR_MAX_BYTES, drop=drop)
        if c.outcome in ("claimed", "refused"):
            self._fail(c.record, "spool", f"{why}; not applied, moved aside", "SidecarForeign")
        elif c.outcome == "empty":
            discard_job(self.spool, c.job_id)
        elif c.outcome == "ignored":  # not a regular file: left where it is, listed by ds-ops status
            self.log.event("entry-ignored", f"{drop}/{safe_text(f['name'])} is {c.reason}; left where it is "
                           "(its owner can remove it)", priority=LOG_WARNING, dataset_file=f["name"])

    # ---- one job -------------------------------------------------------------------------------
    def _start(self, job_id: str, gpu: dict | None = None) -> None:
        """Start the job's process (limited to ``gpu`` if given), or finish it at once if its model
        is already in the store."""
        record = self.records.get(job_id) or read_record(self.spool, job_id)
        if record is None:
            return
        self.records[job_id] = record
        for stale in ("gpu_index", "gpu_uuid"):  # from an earlier attempt (before a restart or a defer)
            record.pop(stale, None)
        lock = lock_job(self.spool, job_id)
        if lock is None:  # the job process of a killed daemon still runs (it dies with its forkserver)
            self.pending.append(job_id)
            self.retry_at[job_id] = time.monotonic() + 1.0
            return
        os.close(lock)
        for stale in ("epoch", "loss", "val_loss", "samples_per_s", "updated_at", "nproc"):
            record.pop(stale, None)
        nproc, gpus = 1, None
        if self._distributed(record):
            if self.jobs:  # it runs alone: back to the head of the queue until the others have ended
                self.pending.insert(0, job_id)
                return
            nproc, gpus = self._ranks()
            if nproc > 1:
                gpu = None
                on = (f"GPUs {', '.join(str(g['index']) for g in gpus)} (nccl)" if gpus
                      else f"{nproc} CPU processes (gloo)")
                self.log.event("job-claimed", f"{safe_text(record['dataset'])}: {record.get('size_bytes', 0):,} bytes "
                               f">= daemon.distributed_min_bytes: trains alone with {nproc} processes under "
                               f"torchrun, on {on} (in one process if its data streams, being over "
                               "job.max_matrix_bytes, or train.input_window > 1)", **self._fields(record))
        slot = min(set(range(len(self.jobs) + 1)) - {j.slot for j in self.jobs.values()})
        job = worker.JobProcess(self.spool.root, job_id, record, job_config(self.cfg, self._memory_budget(nproc)),
                                self.mp_context, self.gate,
                                gpu=gpu, slot=slot, nproc=nproc, gpus=gpus)
        self.jobs[job_id] = job
        if gpu is not None:
            record.update(gpu_index=gpu["index"], gpu_uuid=gpu["uuid"])
        if nproc > 1:
            record["nproc"] = nproc
            if gpus:
                record.update(gpu_index=",".join(str(g["index"]) for g in gpus),
                              gpu_uuid=",".join(g["uuid"] for g in gpus))
        record.update(state="running", pid=os.getpid(), pid_start=process_start_ticks(os.getpid()),  # issue 11
                      job_pid=job.proc.pid, boot_id=boot_id(),
                      started_at=utc_now(), epochs=self.cfg.train.epochs, stage="health")
        save_record(self.spool, record)
        self.notifier.status(self._busy_status())
        self._write_metrics()

    def _busy_status(self) -> str:
        """The STATUS= line while jobs run: how many, and per job its dataset, stage or epoch and GPU."""
        parts = []
        for job in self.jobs.values():
            r = self.records.get(job.job_id, {})
            if r.get("epoch"):
                what = f"epoch {r['epoch']}/{self.cfg.train.epochs} loss {r.get('loss', float('nan')):.4g}"
            else:
                what = "health check" if job.stage == "health" else job.stage
            where = (f" on GPU {job.gpu['index']}" if job.gpu else
                     f" on {job.nproc} processes" + (f" (GPUs {r.get('gpu_index')})" if job.gpus else "")
                     if job.nproc > 1 else "")
            parts.append(f"training {safe_text(r.get('dataset', ''))} ({job.job_id}): {what}{where}")
        n = len(self.jobs)
        return f"{n} job{'' if n == 1 else 's'} running: {'; '.join(parts)}; {self.watcher.queued()} queued"

    def _watch_jobs(self) -> bool:
        """Wait up to a tick for a message from any running job, then look after each of them;
        return True if one of them ended."""
        try:
            multiprocessing.connection.wait([j.conn for j in self.jobs.values()] + self.scorer.conns(), TICK_S)
        except OSError:
            pass
        before = len(self.jobs)
        for job in list(self.jobs.values()):
            self._for_job(job.job_id, self._watch_job, job, hold=False)  # _watch_job holds it for the end
        return len(self.jobs) < before

    def _watch_job(self, job) -> None:
        """Handle one running job's messages, its end, a stall, a hung health check or a stop."""
        record = self.records[job.job_id]
        for kind, fields in job.receive(0):
            self._on_message(record, kind, fields)
        now = time.monotonic()
        code = job.exitcode()
        if code is None:
            if self.stop_requested and not job.stop_sent:
                job.stop_sent = True
                self._stopping()
                if job.stage in ("health", "dataset"):
                    job.kill(f"stopping during the {job.stage} stage", crash=False)
                    record.update(state="interrupted", stage=job.stage)
                    save_record(self.spool, record)
                    self.log.event("job-interrupted", f"{safe_text(record['dataset'])}: stopped in the {job.stage} "
                                   "stage; it runs again on the next start", **self._fields(record))
                else:
                    self.notifier.extend_timeout(STOP_EXTEND_S)
                    self.notifier.status(f"stopping: {safe_text(record['dataset'])} writes its checkpoint; "
                                         f"{len(self.jobs)} job{'' if len(self.jobs) == 1 else 's'} running")
                    job.stop_event.set()
                    return
            elif job.stage == "health" and now - job.stage_since > self.cfg.job.health_timeout_s:
                job.kill(f"the health check did not answer within {self.cfg.job.health_timeout_s:.0f} s "
                         "(a hung NVML call?)", crash=False)
                self._defer(record, job.killed_for)
            elif now - job.last_heard > self._stall_budget(record, job):
                job.kill(f"no word from the job for {now - job.last_heard:.0f} s in stage {job.stage}", crash=True)
            else:
                return
        with self.breadcrumb.holding(job.job_id):  # a job's end (moving files, the store) is in hand, not its progress
            for kind, fields in job.receive(0):
                self._on_message(record, kind, fields)
            if job.final is not None:
                self._on_final(record, *job.final)
            elif job.crashed:
                self._on_crash(record, job)
            job.close()
            self.jobs.pop(job.job_id, None)

    def _stall_budget(self, record: dict, job) -> float:
        """Seconds the job may stay silent: job.stall_timeout_s, more while parsing a large file
        (a pessimistic 5 MB/s for text, 4x that for gzip's inflation)."""
        budget = self.cfg.job.stall_timeout_s
        if job.stage == "dataset":
            budget += 4 * record.get("size_bytes", 0) / 5e6
        return budget

    def _on_message(self, record: dict, kind: str, f: dict) -> None:
        fields = self._fields(record)
        name = safe_text(record["dataset"])
        if kind == "stage":
            record["stage"] = f["stage"]
            save_record(self.spool, record)
            self.notifier.status(self._busy_status())
        elif kind == "named":  # the job process read its sidecar (the daemon never does)
            record.update(model_name=f["model_name"], name_explicit=f["explicit"])
            save_record(self.spool, record)
        elif kind == "health":
            where = f" on {f['describe']}" if f.get("describe") else ""
            if record.get("gpu_uuid"):  # the job sees only this GPU (as cuda:0)
                where += f" (GPU {record.get('gpu_index')} {record['gpu_uuid']})"
            why = f": {f['reason']}" if f.get("reason") and f.get("reason") != f.get("plan_reason") else ""
            self.log.event("job-health", f"{name}: health gate says {f['action']}{where}{why}", device=f.get("device"),
                           amp_dtype=f.get("amp_dtype"), verdict=(f.get("report") or {}).get("verdict"), **fields)
            record.update(device=f.get("device"), amp_dtype=f.get("amp_dtype"))
            self.metrics.health(f.get("report"))
            self._judge_job_gpu(record, f)
        elif kind == "resumed":
            if f.get("why"):
                record.pop("resumed_from_epoch", None)  # a checkpoint taken at first and then dropped
                self.log.event("job-resumed", f"{name}: {f['why']}; starting at epoch 1", priority=LOG_WARNING, **fields)
            else:
                record["resumed_from_epoch"] = f["epoch"]
                self.log.event("job-resumed", f"{name}: resuming from the checkpoint in epoch {f['epoch']} "
                               f"(batch {f.get('batch')})", epoch=f["epoch"], **fields)
        elif kind == "epoch":
            s = EpochStats(**f)
            total = self.cfg.train.epochs
            g = s.gpu or {}
            self.log.event("job-epoch", f"{name}: {s.line(total)}", epoch=s.epoch, epochs=total, loss=s.train_loss,
                           val_loss=s.val_loss, samples_per_s=s.samples_per_s, device=record.get("device"),
                           amp_dtype=record.get("amp_dtype"), gpu_temp_c=gpustats.field(g, "temperature_c"),
                           gpu_power_w=gpustats.field(g, "power_draw_w"), gpu_sm_clock_mhz=gpustats.field(g, "sm_clock_mhz"),
                           gpu_mem_used_mib=gpustats.field(g, "memory_used_mib"),
                           gpu_proc_mem_mib=gpustats.field(g, "process_memory_mib"),
                           gpu_util_pct=gpustats.field(g, "utilization_gpu_pct"),
                           gpu_throttle=gpustats.field(g, "clocks_event_reasons"), **fields)
            if g.get("throttle_started"):  # a thermal/power slowdown that began during this job
                self.log.event("job-gpu-throttle", f"{name}: GPU {g.get('index')} started throttling in epoch "
                               f"{s.epoch}: {gpustats.throttle_words(g['throttle_started'])}", priority=LOG_WARNING,
                               epoch=s.epoch, gpu_throttle_started=",".join(g["throttle_started"]),
                               gpu_temp_c=gpustats.field(g, "temperature_c"), gpu_power_w=gpustats.field(g, "power_draw_w"),
                               **self._fields(record, gpu_index=g.get("index")))
            record.update(epoch=s.epoch, loss=s.train_loss, val_loss=s.val_loss, samples_per_s=s.samples_per_s,
                          updated_at=utc_now())
            save_record(self.spool, record)
            self.notifier.status(self._busy_status())
            self._write_metrics()

    def _judge_job_gpu(self, record: dict, f: dict) -> None:
        """A job's own health gate found the GPU it was given failing (a failed CUDA smoke test, a
        reading that changed since the daemon's): that GPU takes no jobs for health.retry_s."""
        uuid = record.get("gpu_uuid")
        g = next((g for g in (f.get("report") or {}).get("gpus") or [] if uuid and g.get("uuid") == uuid), None)
        if g is not None and g.get("verdict") == "fail":
            why = "; ".join(f"{x['check']}: {x['message']}" for x in g.get("findings") or [] if x.get("level") == "fail")
            self._gpu_failed(g.get("index"), uuid, f"its job's health gate: {why}")

    def _on_final(self, record: dict, kind: str, f: dict) -> None:
        name = safe_text(record["dataset"])
        fields = self._fields(record)
        if kind == "saved":
            md = f["metadata"]
            record.update(state="saved", model_dir=md["model_dir"], saved_at=utc_now())
            save_record(self.spool, record)
            if f.get("recovered"):
                self.log.event("job-recovered", f"{name}: its model {md['model_dir']} was saved before the restart; "
                               "not training again", model_dir=md["model_dir"], **fields)
            self._finish_done(record, md)
            self._backoff = BACKOFF_S[0]
        elif kind == "deferred":
            self._defer(record, f["reason"])
        elif kind == "duplicate":  # issue 22: the same bytes again, not trained (opt_ds_ops.duplicate)
            end_duplicate(self, record, f)
        elif kind == "interrupted" and f.get("checkpoint") is False:
            for stale in ("loss", "val_loss", "samples_per_s"):  # of an epoch the next start does again
                record.pop(stale, None)
            record.update(state="interrupted", epoch=0)
            save_record(self.spool, record)
            self.log.event("job-interrupted", f"{name}: stopped; a distributed run keeps no checkpoint, so it "
                           "trains again from epoch 1 on the next start", **fields)
        elif kind == "interrupted":
            record.update(state="interrupted", epoch=f["epoch"] - 1, checkpoint_at=utc_now())
            save_record(self.spool, record)
            self.log.event("job-interrupted", f"{name}: stopped in epoch {f['epoch']}; checkpoint saved, "
                           "the job resumes on the next start", epoch=f["epoch"], **fields)
        elif kind == "failed":
            if f.get("errno") in STORAGE_ERRNOS or f.get("transient"):
                record["state"] = "claimed"
                save_record(self.spool, record)
                self.pending.insert(0, record["job_id"])
                self._pause(f"{name}: {f['reason']}")
                return
            if f.get("traceback"):
                self.log.event("internal-error", f"{name}: {f['traceback']}", priority=LOG_ERR, **fields)
            self._fail(record, f["stage"], f["reason"], f.get("type", "JobError"), report=f.get("report"))

    def _on_crash(self, record: dict, job) -> None:
        """The job process ended without a final message: count a crash in its last stage."""
        code = job.exitcode()
        how = job.killed_for or (f"killed by {signal.Signals(-code).name}" if code is not None and code < 0
                                 else f"exited with status {code}")
        hint = " (an out-of-memory kill?)" if code == -signal.SIGKILL and not job.killed_for else ""
        record["crashes"] = record.get("crashes", 0) + 1
        record["state"] = "claimed"
        fields = self._fields(record)
        if record["crashes"] >= self.cfg.spool.max_crashes:
            self._fail(record, job.stage, f"the job process died {record['crashes']} times, last in stage {job.stage}: "
                       f"{how}{hint}; not trying again. journalctl -u ds-trainer DS_JOB_ID={record['job_id']}",
                       "JobCrashed")
            return
        save_record(self.spool, record)
        self.log.event("job-crashed", f"{safe_text(record['dataset'])}: the job process died in stage {job.stage}: "
                       f"{how}{hint}; running it again ({record['crashes']} of {self.cfg.spool.max_crashes})",
                       priority=LOG_WARNING, failed_stage=job.stage, **fields)
        self.pending.insert(0, record["job_id"])

    def _defer(self, record: dict, reason: str) -> None:
        """Put the job back at the head of the queue for health.retry_s seconds; at once when it
        was deferred because the GPU it was given has failed (another GPU may take it)."""
        job_id = record["job_id"]
        record["state"] = "deferred"
        save_record(self.spool, record)
        self.pending.insert(0, job_id)
        down = self.gpu_down.get(record.get("gpu_uuid") or "")
        wait_s = 0.0 if down is not None and time.monotonic() < down[0] else self.cfg.health.retry_s
        self.retry_at[job_id] = time.monotonic() + wait_s
        self.defer_reason[job_id] = reason
        when = (f"deferred for {wait_s:.0f} s" if wait_s else
                f"its GPU {record.get('gpu_index')} failed, back in the queue for another GPU")
        self.log.event("job-deferred", f"{safe_text(record['dataset'])}: {when}: {reason}", priority=LOG_WARNING,
                       **self._fields(record))
        self._write_metrics()

    def _finish_done(self, record: dict, metadata: dict) -> None:
        doc = result_doc(record, metadata)
        final = finish(self.spool, record["job_id"], record, DONE, doc)
        self._forget(record["job_id"])
        self.log.event(
            "job-saved",
            f"{safe_text(record['dataset'])}: model saved to {doc['model_dir']} (final loss {doc['final_train_loss']:.6f}, "
            f"threshold {doc['threshold']:.4f}, {doc['device']} amp {doc['amp_dtype']}); dataset in done/{safe_text(final)}"
            f"{safe_text(columns_note(metadata.get('dataset') or {}))}"
            + (f"; {metadata['data_placement_note']}" if metadata.get("data_placement_note") else "")
            + stopping_note(metadata)
            + (f"; not made current: {safe_text(metadata['not_current'])}" if metadata.get("not_current") else ""),
            model_dir=doc["model_dir"], loss=doc["final_train_loss"], val_loss=doc["final_val_loss"],
            device=doc["device"], amp_dtype=doc["amp_dtype"], epoch=doc["epochs"], threshold=doc["threshold"],
            **self._fields(record),
        )
        for warning in metadata.get("warnings") or []:  # issue 21: published, but suspect
            self.log.event("model-suspect", f"{safe_text(record['dataset'])}: {safe_text(warning)}", priority=LOG_WARNING,
                           model_dir=doc["model_dir"], **self._fields(record))
        kept = str(metadata.get("not_current") or "")  # issue 20: the operator's hold, the promotion gate
        if kept.startswith(HELD):
            self.log.event("model-held", f"{safe_text(record['dataset'])}: {safe_text(kept)}", priority=LOG_NOTICE,
                           model_dir=doc["model_dir"], reason=kept, **self._fields(record))
        elif kept.startswith(GATED):
            self.log.event("model-not-promoted", f"{safe_text(record['dataset'])}: {safe_text(kept)}",
                           priority=LOG_NOTICE, model_dir=doc["model_dir"], reason=kept, **self._fields(record))
        if metadata.get("report_warning"):  # issue 11: the picture failed, the job did not
            self.log.event("report-failed", f"{safe_text(record['dataset'])}: {metadata['report_warning']}; the model "
                           f"is saved; redraw it with ds-ops report {doc['model_dir']}", priority=LOG_WARNING,
                           model_dir=doc["model_dir"], **self._fields(record))
        self._prune_versions(metadata)
        self.metrics.job_done(doc)
        self._guarded(self._retention)  # a file system error here pauses intake; the job is done
        self._write_metrics()

    def _fail(self, record: dict, stage: str, reason: str, exception_type: str, *, report: dict | None = None) -> None:
        doc = {"job_id": record.get("job_id"), "dataset": record.get("dataset"), "stage": stage, "reason": reason,
               "exception_type": exception_type, "failed_at": utc_now(), "claimed_at": record.get("claimed_at"),
               "sha256": record.get("sha256"), "crashes": record.get("crashes", 0), "health": report,
               "uploader_uid": record.get("uploader_uid"), "drop": record.get("drop")}
        final = finish(self.spool, record["job_id"], record, FAILED, doc)
        self._forget(record["job_id"])
        self.log.event("job-failed", f"{safe_text(record.get('dataset', ''))}: failed in stage {stage}: {reason}; "
                       f"dataset in failed/{safe_text(final)}", priority=LOG_ERR, failed_stage=stage,
                       reason=reason, **self._fields(record))
        for old in prune_failed(self.spool, self.cfg.spool.max_failed):
            self.log.event("failed-pruned", f"failed/{safe_text(old)} removed: failed/ keeps the newest "
                           f"{self.cfg.spool.max_failed} (spool.max_failed)", dataset_file=old)
        self.metrics.job_failed()
        self._guarded(self._retention)
        self._write_metrics()

    def _forget(self, job_id: str) -> None:
        self.records.pop(job_id, None)
        self.retry_at.pop(job_id, None)
        self.defer_reason.pop(job_id, None)

    # ---- crash recovery ------------------------------------------------------------------------
    def _recover(self, quarantine: tuple[str, int] = ("", 0)) -> None:
        """Queue every job found in processing/ at start-up; finish interrupted claims. A daemon's
        death counts against no dataset (``restarts`` counts them, for the record), except that a
        job the daemon was handling when it died, twice in a row (``quarantine``: the job id and
        deaths in a row, from :meth:`opt_ds_ops.handling.Breadcrumb.deaths`), is quarantined to
        failed/ instead: no dataset can hold the service in a restart loop."""
        remove_stale_temps(self.spool)
        for name in migrate_legacy(self.spool):
            self.log.event("job-claimed", f"{safe_text(name)}: left in processing/ by an older ds-ops; "
                           "back in incoming/", dataset_file=name)
        for job_id in job_ids(self.spool):
            self._for_job(job_id, self._recover_job, job_id, quarantine, hold=False)

    def _recover_job(self, job_id: str, quarantine: tuple[str, int]) -> None:
        """:meth:`_recover` for one job directory. Only copying an interrupted claim in again
        holds the job (:mod:`opt_ds_ops.handling`): the rest reads the daemon's own record, and a
        kill then (a restart loop of the harness or of systemd) must not count against it. A job
        whose model is saved is never quarantined: its process replays the publish and it is done."""
        record = read_record(self.spool, job_id)
        if record is None or not record.get("dataset"):
            discard_job(self.spool, job_id)  # killed before its record was written: nothing of a user's
            return
        self.records[job_id] = record
        if quarantine[0] == job_id and quarantine[1] >= QUARANTINE_AFTER and record.get("state") != "saved":
            stage = record.get("stage") or ("spool" if record.get("state") == "claiming" else "daemon")
            self._fail(record, stage, f"the daemon died {quarantine[1]} times in a row while handling this job "
                       f"(state {record.get('state')}, stage {stage}); quarantined so that it cannot stop the service "
                       "again. ds-ops requeue NAME runs it once more", "Quarantined")
            return
        with self.breadcrumb.holding(job_id if record.get("state") == "claiming" else None):
            c = recover_claim(self.spool, job_id, record, self.cfg.spool.max_dataset_bytes,
                              progress=lambda: self.notifier.keepalive(STEP_BUDGET_S))
        if c.outcome in ("gone", "busy"):
            self._forget(job_id)
            return
        if c.outcome == "empty":
            discard_job(self.spool, job_id)
            self._forget(job_id)
            return
        if c.outcome == "refused":
            self._fail(record, "spool", c.reason, "SpoolRefused")
            return
        if record.get("sidecars_foreign"):
            self._refuse_foreign_sidecars(record)
        for stale in ("gpu_index", "gpu_uuid"):  # the GPU of the last run; the next start chooses again
            record.pop(stale, None)
        if record.get("state") in ("running", "claimed", "interrupted", "deferred"):
            if record.get("state") == "running":
                record["restarts"] = record.get("restarts", 0) + 1
            record["state"] = "claimed"
            save_record(self.spool, record)
        self.log.event("job-claimed", f"{safe_text(record['dataset'])}: job {job_id} found in processing/ at "
                       "start-up; running it again", **self._fields(record))
        (self.scorer.pending if record.get("kind") == "score" else self.pending).append(job_id)


def start_daemon(cfg: Config, config_path: str, *, missing_ok: bool = False, log: EventLog | None = None) -> int:
    """Check the spool and models directories, then run the daemon; return its exit code.

    Raises SpoolError naming the path and the reason if either directory cannot be created or
    written, or another daemon serves the spool (the daemon does not start).
    """
    spool = open_spool(cfg.spool.dir)
    check_writable_dir(cfg.models_dir, "models directory")
    lock = lock_spool(spool)
    try:
        return Daemon(cfg, spool, log or EventLog(), Notifier(), config_path, missing_ok).run()
    finally:
        os.close(lock)


def config_path_from(arg: str | None) -> tuple[str, bool]:
    """Return (conffile path, missing_ok) from --config, then $DS_OPS_CONFIG, then the default."""
    path = arg or os.environ.get("DS_OPS_CONFIG")
    return (path, False) if path else (DEFAULT_CONFIG_PATH, True)
