"""The daemon's scoring slot (docs/scoring.md): telemetry dropped in ``SPOOL/score/`` is scored by its
model's ``current`` version, one file at a time, beside (never behind) the training jobs.

A file in score/ is claimed exactly as one in incoming/ (:func:`opt_ds_ops.spool.claim` with
``drop=SCORE``: the bytes copied into ``processing/JOB/``, the record of kind ``score``) and scored
in a job process of the forkserver (:func:`score_main`, where torch and the scoring code are
preloaded), which runs :func:`opt_ds_ops.scoring.job.score_job`: it parses the copy and its sidecar,
names the model, scores with the carried series state and writes ``RESULTS/NAME/`` (the daemon
never parses a user's bytes). One scoring job runs at a time, in claim order, so a model's chunks
are scored in order; a training job never holds it up (its own slot).

From the job's summary the daemon writes the journal (an ``incident-opened`` and an
``incident-closed`` entry per incident, PRIORITY warning, or crit for one that opens critical; an
``incident-escalated`` one at crit when a warning becomes critical; a
``scored`` line at info; a reset of
the carried state at notice) and the Prometheus gauges (:meth:`MetricsWriter.score_done`). A
scored file's bytes are not kept (its results are its record); a refused one goes to failed/ with
its stage and reason. A job the daemon was handling when it died runs again at the next start
(``score_job`` is idempotent by job id), with the same crash count and quarantine as training jobs.
Results older than ``scoring.results_max_age_days`` or beyond ``scoring.results_max_bytes`` (per
model) are removed: every model's at start and hourly, the scored model's after each of its jobs;
``state.json`` never is.
"""

from __future__ import annotations

import multiprocessing.connection
import os
import signal
import time
import traceback

from ..observe.incident_entries import incident_entry, num as _num
from ..observe.journal import LOG_ERR, LOG_INFO, LOG_NOTICE, LOG_WARNING, safe_text
from ..scoring.results import _restarted, model_view, model_views, prune_results, read_model
from .dispatch import job_fields

STAGE = "scoring"
SWEEP_S = 3600.0  # the retention of results walks every model's at start and then at most this often


# ---- the job process -----------------------------------------------------------------------------

def score_main(conn, stop_event, spool_root: str, job_id: str, record: dict, cfg, gate=None,
               gpu: dict | None = None, nproc: int = 1, gpus: list[dict] | None = None) -> None:
    """The scoring job process (the arguments of :func:`opt_ds_ops.daemon.worker.job_main`; ``gate``,
    ``gpu``, ``nproc`` and ``gpus`` are unused: scoring runs on the CPU): score processing/JOB's
    copy, then send one final message, ``scored`` with the summary or ``failed`` with the stage
    and reason (``transient`` for a job lock still held, ``errno`` for a storage error)."""
    from ..training.common import is_out_of_memory
    from .worker import _die_with_parent, _limit_memory

    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _limit_memory(cfg.job.memory_max_bytes())

    from ..dataset import DatasetError
    from ..training.job import JobError
    from ..model.detection import ScoreError
    from ..spool import Spool, lock_job

    spool = Spool(spool_root)

    def send(kind: str, **fields) -> None:
        try:
            conn.send((kind, fields))
        except OSError:  # the daemon is gone; its successor runs this job again
            os._exit(1)

    lock_fd = lock_job(spool, job_id)
    if lock_fd is None:
        send("failed", stage="recovery", reason="another process of this job still runs", type="JobLocked",
             transient=True)
        return
    try:
        send("stage", stage=STAGE)
        from ..scoring import job as scoring

        refused = (DatasetError, ScoreError, JobError, scoring.ScoringError)
        try:
            summary = scoring.score_job(spool.job_dir(job_id), cfg)
        except refused as e:
            stage = getattr(e, "stage", None) or ("dataset" if isinstance(e, DatasetError) else STAGE)
            send("failed", stage=stage, reason=str(e), type=type(e).__name__, errno=getattr(e, "errno", None))
            return
        send("scored", summary=summary)
    except BaseException as e:  # noqa: BLE001 - everything is reported; the daemon decides
        reason = (f"out of memory while scoring ({type(e).__name__})" if is_out_of_memory(e)
                  else f"unexpected {type(e).__name__}: {e}")
        send("failed", stage=STAGE, reason=reason, type=type(e).__name__, errno=getattr(e, "errno", None),
             traceback=traceback.format_exc())
    finally:
        os.close(lock_fd)
        conn.close()


# ---- the daemon's side ------------------------------------------------------------------------------

SAID_FILE = "said"  # processing/JOB/said: the keys of the journal entries of a scored job already said


def _said(path: str) -> set[str]:
    """The keys in a job's :data:`SAID_FILE` (none when it does not exist yet)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return set(f.read().split())
    except FileNotFoundError:
        return set()


class ScoreSlot:
    """The daemon's scoring role: the score/ watcher, its queue and its one job process.

    ``daemon`` is the :class:`opt_ds_ops.daemon.service.Daemon` it serves (its configuration, spool,
    journal, breadcrumb, metrics and its way of failing a job to failed/ are used, not copied).
    """

    def __init__(self, daemon):
        from ..spool import SCORE
        from ..spool.watcher import IncomingWatcher

        self.d = daemon
        sp = daemon.cfg.spool
        self.watcher = IncomingWatcher(daemon.spool.dir(SCORE), settle_s=sp.settle_s, quiet_s=sp.quiet_s,
                                       rescan_s=sp.scan_interval_s, mode=sp.watcher)
        self.watcher.wakeup = daemon.watcher.wakeup  # a drop in score/ ends the daemon's idle wait too
        self.pending: list[str] = []  # score jobs in processing/ to (re)run, oldest claim first
        self.job = None  # the running worker.JobProcess, or None
        self.record: dict = {}
        self._swept: float | None = None  # time.monotonic() of the last sweep of every model's results

    def start(self) -> None:
        """Start watching score/ and read each model's counters back from its state.json."""
        how = self.watcher.start()
        self.d.log.event("watcher", f"watching {self.watcher.incoming} with {how}",
                         priority=LOG_WARNING if self.watcher.polling else LOG_INFO)
        self.d.metrics.scores = model_views(self.d.cfg.scoring.results_dir)
        self.d.guarded(self.retention)  # the full sweep at start

    def stop(self) -> None:
        """Kill a running scoring job (it runs again at the next start) and stop watching."""
        if self.job is not None:
            self.job.kill("the daemon is stopping", crash=False)
            self.job.close()
            self.job = None
        self.watcher.stop()

    def conns(self) -> list:
        """The running job's pipe, for the daemon's wait on its jobs."""
        return [self.job.conn] if self.job is not None else []

    def step(self, wait_s: float, intake: bool) -> bool:
        """Look after the running scoring job (waiting up to wait_s seconds for its message), or
        (``intake``: not paused or stopping) start the next queued one or claim the oldest ready
        file in score/; return True if something was done or runs."""
        self.watcher.tick()
        if self.job is not None:
            if wait_s > 0:
                try:
                    multiprocessing.connection.wait([self.job.conn], wait_s)
                except OSError:
                    pass
            self._for_job(self.job.job_id, self._watch, hold=False)
            return True
        if not intake:
            return False
        if self.pending:
            job_id = self.pending.pop(0)
            self._for_job(job_id, self._start, job_id)
            return True
        return any(self._take(name) for name in self.watcher.ready()[:1])

    def _for_job(self, job_id: str | None, step, *args, name: str = "", hold: bool = True):
        """:meth:`Daemon.for_job` for a scoring job: an exception is that job's failure (or, before
        it has a job directory, score/NAME is offered again later), never the daemon's."""
        from ..spool import SpoolError, is_storage_error

        try:
            with self.d.breadcrumb.holding(job_id if hold else None):
                return step(*args)
        except Exception as e:  # noqa: BLE001 - one job's exception is that job's failure
            if is_storage_error(e) or isinstance(e, SpoolError):
                raise
            self._job_exception(job_id, name, e)
            return True

    def _job_exception(self, job_id: str | None, name: str, e: Exception) -> None:
        """Fail the job after an exception while the daemon handled it (see :meth:`_for_job`)."""
        if self.job is not None and self.job.job_id == job_id:
            self.job.kill(f"the daemon failed handling it ({type(e).__name__})", crash=False)
            self.job.close()
            self.job = None
        if job_id is None:
            self.d.log.event("internal-error", f"score/{safe_text(name)}: {type(e).__name__}: {e}\n"
                             f"{traceback.format_exc()}", priority=LOG_ERR, dataset_file=name)
            self.watcher.retry_later(name, 60.0)
        else:
            self.pending = [j for j in self.pending if j != job_id]
            self.d.job_exception(job_id, name, e)

    def _take(self, name: str) -> bool:
        """Claim score/NAME as incoming/ files are claimed, then start its job or refuse it."""
        from .pacing import STEP_BUDGET_S
        from ..spool import SCORE, claim, discard_job

        box: dict = {}

        def on_job(job_id: str) -> None:
            box["job_id"] = job_id
            self.d.breadcrumb.mark(job_id)

        def take() -> bool:
            try:
                c = claim(self.d.spool, name, self.d.cfg.spool.max_dataset_bytes, on_job=on_job, drop=SCORE,
                          kind="score", progress=lambda: self.d.notifier.keepalive(STEP_BUDGET_S))
            finally:
                self.d.breadcrumb.mark(None)
            if c.outcome == "gone":
                self.watcher.forget(name)
                return False
            if c.outcome == "ignored":
                self.watcher.ignore(name)
                self.d.log.event("entry-ignored", f"score/{safe_text(name)} is {c.reason}; left where it is (remove "
                                 "it, or drop the data as a regular file)", priority=LOG_WARNING, dataset_file=name)
                return True
            if c.outcome == "busy":
                self.watcher.retry_later(name, max(1.0, 2 * self.d.cfg.spool.settle_s))
                self.d.log.event("entry-busy", f"score/{safe_text(name)}: not taken yet: {c.reason}", dataset_file=name)
                return True
            self.watcher.forget(name)
            if c.outcome == "empty":
                discard_job(self.d.spool, c.job_id)
                self.d.log.event("entry-removed", f"score/{safe_text(name)}: {c.reason}", priority=LOG_WARNING,
                                 **job_fields(c.record))
                return True
            if c.outcome == "refused":
                self.d.outcome.fail(c.record, "spool", c.reason, "SpoolRefused")
                return True
            if c.record.get("sidecars_foreign"):
                self.d.dispatch.refuse_foreign_sidecars(c.record)
            self._start(c.job_id)
            return True

        from ..spool import SpoolError, is_storage_error

        try:
            return take()
        except Exception as e:  # noqa: BLE001 - one file's exception is that file's failure
            if is_storage_error(e) or isinstance(e, SpoolError):
                raise
            self._job_exception(box.get("job_id"), name, e)
            return True

    def _start(self, job_id: str) -> None:
        """Start the scoring job's process (or wait a second while a killed daemon's one still runs)."""
        from . import worker
        from .budget import job_config
        from ..fsutil import utc_now
        from ..spool import boot_id, lock_job, process_start_ticks, read_record, save_record

        record = read_record(self.d.spool, job_id)
        if record is None:
            return
        lock = lock_job(self.d.spool, job_id)
        if lock is None:  # the job process of a killed daemon still runs (it dies with its forkserver)
            self.pending.insert(0, job_id)
            return
        os.close(lock)
        self.job = worker.JobProcess(self.d.spool.root, job_id, record,
                                     job_config(self.d.cfg, self.d.slots.memory_budget()), self.d.mp_context,
                                     main=score_main, stage=STAGE)
        self.record = record
        record.update(state="running", pid=os.getpid(), pid_start=process_start_ticks(os.getpid()),
                      job_pid=self.job.proc.pid, boot_id=boot_id(), started_at=utc_now(), stage=STAGE)
        save_record(self.d.spool, record)

    def _watch(self) -> None:
        """Handle the running job's messages and its end (a stall past job.stall_timeout_s kills
        it as its crash; a stop kills it: it runs again at the next start)."""
        job, record = self.job, self.record
        job.receive(0)
        if job.exitcode() is None:
            if self.d.stop_requested:
                job.kill("the daemon is stopping", crash=False)
            elif time.monotonic() - job.last_heard > self.d.cfg.job.stall_timeout_s:
                job.kill(f"no word from the scoring job for {time.monotonic() - job.last_heard:.0f} s", crash=True)
            else:
                return
        with self.d.breadcrumb.holding(job.job_id):
            job.receive(0)
            self.job = None
            job.close()
            if job.final is not None:
                self._on_final(record, *job.final)
            elif job.crashed:
                self._on_crash(record, job)

    def _on_final(self, record: dict, kind: str, f: dict) -> None:
        from ..spool import STORAGE_ERRNOS, discard_job, is_storage_error

        if kind == "scored":
            try:
                self._report(record, f["summary"])
            except OSError as e:  # the spool's file system (the said file): the job stays, its replay says the rest
                if not is_storage_error(e):
                    raise
                self._requeue(record, f"its alerts could not be noted as said: {e}")
                return
            self.d.guarded(lambda: self.d.retrainer.on_scored(f["summary"]))  # due for retraining?
            discard_job(self.d.spool, record["job_id"])  # the results are its record, not the bytes
            self.d.outcome.forget(record["job_id"])
            self.d.guarded(lambda: self.retention(str(f["summary"].get("model"))))
            self.d.duties.write_metrics(soon=True)  # with the other chunks of this second
            return
        if f.get("errno") in STORAGE_ERRNOS or f.get("transient"):
            self._requeue(record, f["reason"])
            return
        if f.get("traceback"):
            self.d.log.event("internal-error", f"{safe_text(record['dataset'])}: {f['traceback']}", priority=LOG_ERR,
                             **job_fields(record))
        self.d.outcome.fail(record, f["stage"], f["reason"], f.get("type", "ScoreError"))

    def _requeue(self, record: dict, reason: str) -> None:
        """A fault of the spool's file system, not the file's: the job goes back to the head of the
        scoring queue and intake pauses with back-off."""
        from ..spool import save_record

        record["state"] = "claimed"
        save_record(self.d.spool, record)
        self.pending.insert(0, record["job_id"])
        self.d.pause(f"{safe_text(record['dataset'])}: {reason}")

    def _on_crash(self, record: dict, job) -> None:
        """The job process ended without a final message: a crash of this file, as for training."""
        from ..spool import save_record

        code = job.exitcode()
        how = job.killed_for or (f"killed by {signal.Signals(-code).name}" if code is not None and code < 0
                                 else f"exited with status {code}")
        record["crashes"] = record.get("crashes", 0) + 1
        record["state"] = "claimed"
        if record["crashes"] >= self.d.cfg.spool.max_crashes:
            self.d.outcome.fail(record, STAGE, f"the scoring process died {record['crashes']} times: {how}; not trying "
                         "again", "JobCrashed")
            return
        save_record(self.d.spool, record)
        self.d.log.event("job-crashed", f"{safe_text(record['dataset'])}: the scoring process died: {how}; running "
                         f"it again ({record['crashes']} of {self.d.cfg.spool.max_crashes})", priority=LOG_WARNING,
                         failed_stage=STAGE, **job_fields(record))
        self.pending.insert(0, record["job_id"])

    def _report(self, record: dict, s: dict) -> None:
        """Journal and metrics from a scored file's summary (see the module docstring).

        Each journal entry of the summary is said at least once and at most once, whatever is
        killed when: the job stays in processing/ until all are said, and after each one its key
        (``event:N``, ``reset:N``, ``scored``) is appended to the job's :data:`SAID_FILE`, under the
        summary it belongs to. A kill between an entry and its key says that one entry again (a
        window of one ``write``). A job
        that runs again after a restart returns the kept summary (``replayed``); only what that
        file does not list is said then. The append is one ``write`` right after the entry is
        sent, not fsync'ed: a SIGKILL of the daemon loses neither (the page cache keeps the
        write), and after a power loss journald's own unsynced entries go with it."""
        model, version = str(s.get("model")), s.get("version")
        log, file, job_id = self.d.log, safe_text(record["dataset"]), record["job_id"]
        replayed = bool(s.get("replayed"))  # scored before a restart: what was not said yet is said now
        said_path = self.d.spool.job_path(job_id, SAID_FILE)
        said = _said(said_path)
        # the keys count only for the summary they were said of (its result directory): a job scored
        # anew after its kept summary went, or whose state moved on, says its own entries
        of = f"summary:{os.path.basename(str(s.get('result_dir') or ''))}"
        if of not in said:
            said = set()
        fd = os.open(said_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640)
        if of not in said:
            os.write(fd, f"{of}\n".encode())
        data_file = record["dataset"]
        try:
            def mark(key: str) -> None:  # right after its entry was sent
                os.write(fd, f"{key}\n".encode())

            # a reset first: the events that follow (an incident closed by a new version) are its effects
            for i, note in enumerate(s.get("resets") or []):
                if f"reset:{i}" not in said:
                    log.event("score-reset", f"{model}: the carried series state was reset: {safe_text(str(note))}",
                              priority=LOG_NOTICE, model=model, version=version, reason=str(note), job_id=job_id, dataset_file=data_file)
                    mark(f"reset:{i}")
            for i, ev in enumerate(s.get("events") or []):
                if f"event:{i}" in said:
                    continue
                entry = incident_entry(ev, model=model, version=version, file=file)
                if entry is not None:
                    name, message, priority, fields = entry
                    log.event(name, message, priority=priority, job_id=job_id, dataset_file=data_file, **fields)
                mark(f"event:{i}")
            if "scored" not in said:
                flagged = s.get("flagged") or 0
                notes = "".join(f"; {safe_text(str(n))}" for n in s.get("notes") or [])  # the file's own
                log.event("scored", f"{model}: {file} scored with version {version}: {s.get('rows')} rows, {flagged} "
                          f"flagged, last score {_num(s.get('last_score'))} (threshold {_num(s.get('threshold'))})"
                          f"{', incident open' if s.get('active') else ''}{' (replayed)' if replayed else ''}{notes}",
                          model=model, version=version, rows=s.get("rows"), flagged_rows=flagged, job_id=job_id, dataset_file=data_file)
                mark("scored")
        finally:
            os.close(fd)
        view = model_view(model, read_model(self.d.cfg.scoring.results_dir, model)[0], s)
        old = self.d.metrics.scores.get(model)
        if old is not None and _restarted(old, view):  # removed and made again since the daemon last looked
            self.d.duties.series_replaced(old)
        self.d.metrics.score_done(view)

    def retention(self, model: str | None = None) -> None:
        """Remove result directories past scoring.results_max_age_days / results_max_bytes: every
        model's at the first call and then at most once per SWEEP_S, else only ``model``'s (the one
        just scored), so a scored file never walks every model's results."""
        sc, now = self.d.cfg.scoring, time.monotonic()
        if self._swept is None or now - self._swept >= SWEEP_S:
            self._swept, models = now, None
            from ..scoring.results import sweep_removed
            for left in sweep_removed(sc.results_dir):  # a `ds-ops models rm` killed midway
                self.d.log.event("results-pruned", f"{sc.results_dir}/{safe_text(left)} removed: the rest of a "
                                 "model's scoring series whose removal was cut short", results=left)
        elif model is not None:
            models = [model]
        else:
            return
        for old in prune_results(sc.results_dir, sc.results_max_age_days, sc.results_max_bytes, models=models):
            self.d.log.event("results-pruned", f"{sc.results_dir}/{safe_text(old)} removed: past the retention of "
                             f"scoring results (scoring.results_max_age_days {sc.results_max_age_days:g}, "
                             f"scoring.results_max_bytes {sc.results_max_bytes})", results=old)
