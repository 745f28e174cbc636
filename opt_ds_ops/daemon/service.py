"""The ``ds-trainer`` daemon: the spool's jobs, each in its own process, for months.

The main loop (one thread) never parses or trains and never blocks on anything a user controls.
In order, each tick: reload the conffile after SIGHUP; rescan incoming/ when due; look after the
running jobs (their messages, their exits, a stall, a stop); then, while a job slot is free, start
a queued job or claim the oldest ready file in incoming/ (:func:`opt_ds_ops.spool.claim`: the
bytes are copied into the job's own directory); else sleep a tick.

This module is the main loop, its signals and the boundary of one unit of work. The daemon's
other roles live in modules named for them (none imports this one):

* :mod:`opt_ds_ops.daemon.slots`: job slots and the GPU each job gets (``daemon.max_jobs``);
* :mod:`opt_ds_ops.daemon.dispatch`: a job's claim, start and messages;
* :mod:`opt_ds_ops.daemon.outcome`: a job's end (done/ and NAME.result.json, failed/, deferred, crashed);
* :mod:`opt_ds_ops.daemon.recovery`: the jobs found in processing/ at start-up;
* :mod:`opt_ds_ops.daemon.duties`: metrics, retention, reload, health logging, STATUS= lines;
* :mod:`opt_ds_ops.daemon.pacing`: the tick, the watchdog budgets and the back-off, in seconds;
* :mod:`opt_ds_ops.daemon.scoreslot` and :mod:`opt_ds_ops.daemon.retrainer`: the scoring spool and retraining.

A job: health gate -> dataset -> training -> model store, in a process of its own (:mod:`opt_ds_ops.daemon.worker`), then done/ or failed/ with a JSON beside the
dataset.

**Blame where it belongs.** What a user dropped can fail only its own job: it is refused to
failed/ with the stage and reason, or (not a regular file) reported once and left in incoming/.
An out-of-memory kill, SIGBUS or crash of a job process is that job's crash (``crashes`` in its
record; failed/ after ``spool.max_crashes``). An error of the file system itself (ENOSPC, EDQUOT,
EROFS, EIO on the spool or the model store) pauses intake with a ``STATUS=`` line and retries with
back-off (5 s doubling to 5 min) while the watchdog stays fed; it counts against no dataset. A
death of the daemon (SIGKILL, OOM kill, power loss) counts against no dataset either
(:mod:`opt_ds_ops.daemon.recovery`).

**The daemon never parses a user's bytes** (docs/trust.md): it moves files, reads its own records and
talks to jobs. The sidecar, the dataset and torch are read in the job process only; any exception
while the daemon handles one job is that job's failure (:meth:`Daemon.for_job`).

SIGTERM: each job in its health or dataset stage is killed at once (it restarts from scratch on the
next start); each training job writes its checkpoint and stops at the next batch; once all have
stopped the daemon exits 0.
"""

from __future__ import annotations

import importlib.util
import os
import runpy
import signal
import time
import traceback

from .. import EARLY_STOP
from ..config.conffile import DEFAULT_CONFIG_PATH, Config
from ..observe.journal import LOG_ERR, LOG_INFO, LOG_WARNING, EventLog, safe_text
from ..observe.metrics import MetricsWriter
from ..spool import (
    INCOMING, Spool, SpoolError, check_writable_dir, is_ignored, is_storage_error, lock_spool, open_spool,
    read_record
)
from ..spool.watcher import IncomingWatcher
from ..store.model_dir import CurrentModels
from . import worker
from .breadcrumb import Breadcrumb
from .dispatch import Dispatch
from .duties import Duties
from .notify import Notifier
from .outcome import Outcome
from .pacing import BACKOFF_S, METRICS_MIN_GAP_S, METRICS_REFRESH_S, START_EXTEND_S, STEP_BUDGET_S, TICK_S
from .recovery import Recovery
from .retrainer import Retrainer
from .scoreslot import ScoreSlot
from .slots import Slots


def torch_build() -> tuple[str, str]:
    """Return torch's version and the CUDA version it was built with ("" for a CPU build), as
    ``torch.__version__`` and ``torch.version.cuda`` say, read from torch/version.py without
    importing torch: the daemon's process never does (its jobs get it from the forkserver)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return "", ""
    found = runpy.run_path(os.path.join(list(spec.submodule_search_locations)[0], "version.py"))
    return str(found.get("__version__", "")), found.get("cuda") or ""


class Daemon:
    """The running daemon: configuration, spool, watcher, sd_notify, the queue and the running jobs.

    ``config_path`` is re-read on SIGHUP (``missing_ok``: a missing file means defaults). Create
    with :func:`start_daemon`, which checks the directories first. ``mp_context`` is the
    multiprocessing context jobs start in (None: the forkserver of :mod:`opt_ds_ops.daemon.worker`);
    ``gate`` replaces the health gate in the job processes (tests only, see worker.job_main);
    ``health_in_process`` runs the start-up health check in this process, with torch, instead of
    a process of the forkserver (tests only: a daemon in the test's process, with its fakes of NVML
    and CUDA).

    Its roles are objects of their own, each in a module named for it and given the daemon, whose
    state (configuration, spool, queue, job records, running jobs) they share: a job's claim,
    start and messages (``dispatch``, :class:`opt_ds_ops.daemon.dispatch.Dispatch`), its end
    (``outcome``, :class:`opt_ds_ops.daemon.outcome.Outcome`), recovery at start-up
    (``recovery``, :class:`opt_ds_ops.daemon.recovery.Recovery`), the periodic duties
    (``duties``, :class:`opt_ds_ops.daemon.duties.Duties`), the job slots (``slots``,
    :class:`opt_ds_ops.daemon.slots.Slots`), scoring (``scorer``) and retraining (``retrainer``).
    A role calls another through the daemon (``self.d.outcome.fail(...)``), never through
    inheritance.
    """

    def __init__(self, cfg: Config, spool: Spool, log: EventLog, notifier: Notifier,
                 config_path: str, missing_ok: bool = False, mp_context=None, gate=None,
                 health_in_process: bool = False):
        self.cfg, self.spool, self.log, self.notifier = cfg, spool, log, notifier
        self.config_path, self.missing_ok = config_path, missing_ok
        self.mp_context, self.gate = mp_context, gate
        self.health_in_process = health_in_process  # the start-up health check here (tests), not in a job process
        self.watcher = IncomingWatcher(spool.dir(INCOMING), settle_s=cfg.spool.settle_s, quiet_s=cfg.spool.quiet_s,
                                       rescan_s=cfg.spool.scan_interval_s, mode=cfg.spool.watcher)
        self.pending: list[str] = []  # job ids in processing/ to (re)run, oldest claim first
        self.retry_at: dict[str, float] = {}  # job id -> monotonic time before which it is not retried
        self.defer_reason: dict[str, str] = {}
        self.records: dict[str, dict] = {}  # job id -> its record (job.json), the daemon's copy
        self.jobs: dict[str, worker.JobProcess] = {}  # job id -> its running process, oldest start first
        self.paused_until = 0.0
        self.pause_reason = ""
        self.backoff = BACKOFF_S[0]
        self.stop_requested = False
        self.reload_requested = False
        self._stopping_sent = False
        # Prometheus textfile metrics (opt_ds_ops.observe.metrics), written on every state change
        torch_version, cuda_version = torch_build()
        self.metrics = MetricsWriter(cfg.metrics.textfile_dir, cfg.models_dir, torch_version=torch_version,
                                     cuda_version=cuda_version, read_models=CurrentModels(),
                                     retrain_every_s=cfg.retrain.every_s)
        self.metrics_written_at = 0.0  # time.monotonic() of the last write (METRICS_REFRESH_S)
        self.metrics_dirty = False  # a state change not yet written (METRICS_MIN_GAP_S)
        self.breadcrumb = Breadcrumb(spool.root)  # the job in hand, for a death's quarantine
        self.slots = Slots(self)  # job slots and the GPU each job gets (opt_ds_ops.daemon.slots)
        self.cfg = self.slots.usable(cfg)
        self.scorer = ScoreSlot(self)  # score/ and its one scoring job (opt_ds_ops.daemon.scoreslot)
        self.dispatch = Dispatch(self)  # a job's claim, start and messages
        self.outcome = Outcome(self)  # a job's end
        self.recovery = Recovery(self)  # what a previous daemon left in processing/
        self.duties = Duties(self)  # metrics, retention, reload, STATUS= lines
        self.retrainer = Retrainer(self)  # retraining queued after scored files (opt_ds_ops.daemon.retrainer)

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
            self.guarded(self.breadcrumb.open)
            self.guarded(lambda: self.recovery.recover(quarantine))
            self.watcher.tick()
            self.notifier.ready(self.duties.idle_status())
            if not self.stop_requested:  # a stop before ready: no forkserver started for the check
                self.duties.log_health()
            self.log.event(
                "daemon-started",
                f"ds-trainer ready: spool {self.spool.root}, models {self.cfg.models_dir}, device "
                f"{self.cfg.device} amp {self.cfg.amp}, {self.slots.line()}, {self.slots.memory_budget().line()}, "
                f"{self.watcher.queued()} in incoming/, "
                f"{len(self.pending)} to resume",
                spool=self.spool.root, model_dir=self.cfg.models_dir,
            )
            self.duties.start_metrics()
            while not (self.stop_requested and not self.jobs):
                self.notifier.keepalive(STEP_BUDGET_S)
                if self.reload_requested:
                    self.duties.reload()
                busy = self.guarded(self._tick)
                if not busy:
                    self.notifier.status(self.duties.idle_status())
                    self.watcher.idle(TICK_S)  # ends early when a file event arrives
        finally:
            for job in self.jobs.values():
                job.kill("the daemon is stopping", crash=False)
            self.scorer.stop()
            if self.metrics_dirty:
                self.guarded(self.duties.write_metrics)  # the last chunks' figures, before the exit
            self.breadcrumb.close()
            self.stopping()
            self.watcher.stop()
            if self.mp_context is None:
                worker.shut_down()
        self.log.event("daemon-stopping", "ds-trainer stopped")
        return 0

    def guarded(self, step) -> bool:
        """Run step(); an OSError of the spool or store pauses intake with back-off instead of
        stopping the daemon (the watchdog stays fed). Any other exception (a bug outside any one
        job: those are the job's, see :meth:`_for_job`) is logged with its traceback and pauses
        intake the same way: the daemon never exits into a restart loop. Return step's result,
        False after an error."""
        try:
            return bool(step())
        except (OSError, SpoolError) as e:
            self.pause(f"spool {self.spool.root}: {getattr(e, 'strerror', None) or e}"
                        + (f" ({e.filename})" if getattr(e, "filename", None) else ""))
            return False
        except Exception as e:  # noqa: BLE001 - see the docstring
            self.log.event("internal-error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}", priority=LOG_ERR)
            self.pause(f"internal error {type(e).__name__}: {e}")
            return False

    def for_job(self, job_id: str | None, step, *args, name: str = "", hold: bool = True):
        """Run step(*args) while handling one job (a claim of incoming/NAME, a start, a message,
        its end, its recovery): the job id is in hand (:mod:`opt_ds_ops.daemon.breadcrumb`; ``hold=False``:
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
            self.job_exception(job_id, name, e)
            return True

    def job_exception(self, job_id: str | None, name: str, e: Exception) -> None:
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
                self.outcome.forget(job_id)
                self.pending = [j for j in self.pending if j != job_id]
            if name and not is_ignored(name):  # a sidecar's name is never a dataset to offer
                self.watcher.retry_later(name, 60.0)
            return
        self.pending = [j for j in self.pending if j != job_id]
        try:
            with self.breadcrumb.holding(job_id):
                self.outcome.fail(record, record.get("stage") or "spool",
                           f"the daemon failed handling this job: {type(e).__name__}: {e}", type(e).__name__)
        except Exception as e2:  # noqa: BLE001 - it stays in processing/ for the next start; the loop goes on
            self.outcome.forget(job_id)
            self.log.event("internal-error", f"job {job_id}: could not be moved to failed/ either: "
                           f"{type(e2).__name__}: {e2}; it stays in processing/", priority=LOG_ERR, job_id=job_id)

    def pause(self, reason: str) -> None:
        """Pause intake for the current back-off, log it (error) and say so in STATUS=."""
        delay = self.backoff
        self.backoff = min(BACKOFF_S[1], self.backoff * 2)
        self.paused_until = time.monotonic() + delay
        self.pause_reason = reason
        self.log.event("intake-paused", f"intake paused for {delay:.0f} s: {reason}", priority=LOG_ERR)
        self.notifier.status(self.duties.idle_status())
        self.duties.write_metrics()

    def stopping(self) -> None:
        """On the way out (first call only): stop the WATCHDOG=1 pings, send STOPPING=1."""
        if not self._stopping_sent:
            self._stopping_sent = True
            self.notifier.stop_watchdog()
            self.notifier.stopping("stopping")

    def _tick(self) -> bool:
        """Do one thing; return False if there was nothing to do (the loop then sleeps a tick)."""
        if self.stop_requested:
            self.stopping()  # STOPPING=1 first, then EXTEND_TIMEOUT_USEC while a checkpoint is written
        self.watcher.tick()
        since = time.monotonic() - self.metrics_written_at
        if self.metrics.enabled and (since > METRICS_REFRESH_S or self.metrics_dirty and since >= METRICS_MIN_GAP_S):
            self.duties.write_metrics()  # ages stay current and `ds-ops models` changes show, even when idle
        elif not self.metrics.enabled:
            self.duties.forget_removed_series()  # a removed series' open incident is said closed, metrics or not
        intake = not (self.stop_requested or time.monotonic() < self.paused_until)
        scoring = self.guarded(lambda: self.scorer.step(0.0 if self.jobs else TICK_S, intake))  # never behind training
        if self.jobs and self.dispatch.watch_jobs():  # waits up to a tick for a message from any of them
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
        if due and self.jobs and self.slots.distributed(self.records.get(due[0]) or read_record(self.spool, due[0])):
            return False  # it runs alone, once the running jobs have ended (first come, first served)
        free, gpu = self.slots.free_slot()
        if not free:
            return False
        if due:
            self.pending.remove(due[0])
            self.for_job(due[0], self.dispatch.start, due[0], gpu)
            return True
        stack = self.dispatch.stack_candidates(names)
        if stack:  # many small files wait: one process trains several as one stack
            return self.dispatch.take_stack(stack, gpu)
        for name in names:
            if self.dispatch.take(name, gpu):
                return True
        return False


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
