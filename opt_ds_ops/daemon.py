"""The ``ds-trainer`` daemon: one job at a time from the spool, for months without attention.

The main loop (one thread) does, in order: reload the conffile after SIGHUP; rescan incoming/
when due; run a job left in processing/ (crash recovery, deferred jobs) or claim the oldest ready
file in incoming/; else sleep a tick. One job: claim (rename into processing/) -> health gate ->
train (:func:`opt_ds_ops.job.run_job`) -> model store -> done/ or failed/ with a JSON beside the
dataset. Every failure is caught at that boundary, reported with its stage, and the loop goes on.
Only an unusable configuration or an unwritable spool or models directory stops the daemon.

Never trained twice: the job record (processing/.NAME.job.json) is marked ``saved`` with the
model directory before the dataset moves to done/; a SIGKILL between the model store's rename and
that mark is caught at start-up by finding a version of the model whose metadata has the
dataset's sha256 and a training start after the claim. SIGTERM: the training loop stops at the
next batch, the checkpoint (model, optimizer, GradScaler, epoch) goes to processing/ atomically
and the process exits 0; the next start resumes from it.
"""

from __future__ import annotations

import os
import signal
import time
import traceback
import uuid
from datetime import datetime, timezone

from .config import DEFAULT_CONFIG_PATH, Config, ConfigError, config_to_dict, load_config
from .dataset import dataset_stem, file_sha256
from .health import gate_job, summary_line
from .job import JobError, run_job
from .journal import LOG_ERR, LOG_INFO, LOG_WARNING, EventLog, safe_text
from .notify import Notifier
from .spool import (
    DONE, FAILED, INCOMING, PROCESSING, Spool, SpoolError, check_claimed, check_writable_dir, claim, finish,
    inspect_entry, load_checkpoint, open_spool, processing_datasets, read_json, remove_orphans, save_checkpoint,
    write_json, boot_id,
)
from .store import METADATA_FILE, StoreError, list_versions, safe_model_name
from .train import GPU_HEADROOM_BYTES, EpochStats, TrainingInterrupted, utc_now
from .watcher import IncomingWatcher

TICK_S = 0.5  # idle loop period (seconds): the latency of SIGTERM, SIGHUP and new files when idle
STEP_BUDGET_S = 120.0  # watchdog budget for one loop tick or one training batch/epoch end (seconds)
LOAD_BYTES_PER_S = 5e6  # pessimistic dataset parse rate for the watchdog budget of a job's first step
STOP_EXTEND_S = 30.0  # EXTEND_TIMEOUT_USEC asked for while writing a checkpoint on SIGTERM
CRASH_STATES = ("claimed", "running")  # a record found in these states at start-up means the daemon died


def new_job_id() -> str:
    """Return a job id that sorts by claim time: ``20261130T014242Z-3f9a2c``."""
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ-") + uuid.uuid4().hex[:6]


def _parse_utc(stamp: str) -> float | None:
    try:
        return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc).timestamp()
    except (TypeError, ValueError):
        return None


def matrix_bytes_estimate(name: str, size_bytes: int) -> int:
    """Return the float32 matrix size (bytes) a dataset file is expected to load to, for the
    watchdog budget of parsing it. Rough: text holds about 2 bytes per float32 byte, gzip about 4x
    more; arrays hold the matrix itself."""
    low = name.lower()
    if low.endswith(".gz"):
        return 4 * size_bytes
    if low.endswith((".npy", ".npz", ".pt")):
        return 2 * size_bytes
    return size_bytes


def result_doc(record: dict, metadata: dict) -> dict:
    """Return NAME.result.json's content from the job record and the model's metadata.json."""
    claimed = _parse_utc(record.get("claimed_at", ""))
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
        "claimed_at": record.get("claimed_at"),
        "finished_at": utc_now(),
        "duration_s": round(time.time() - claimed, 3) if claimed else None,
        "resumed_from_epoch": record.get("resumed_from_epoch"),
        "crashes": record.get("crashes", 0),
    }


class Daemon:
    """The running daemon: configuration, spool, watcher, sd_notify and the job in hand.

    ``config_path`` is re-read on SIGHUP (``missing_ok``: a missing file means defaults). Create
    with :func:`start_daemon`, which checks the directories first.
    """

    def __init__(self, cfg: Config, spool: Spool, log: EventLog, notifier: Notifier,
                 config_path: str, missing_ok: bool = False):
        self.cfg, self.spool, self.log, self.notifier = cfg, spool, log, notifier
        self.config_path, self.missing_ok = config_path, missing_ok
        self.watcher = IncomingWatcher(spool.dir(INCOMING), settle_s=cfg.spool.settle_s,
                                       rescan_s=cfg.spool.scan_interval_s, mode=cfg.spool.watcher)
        self.pending: list[str] = []  # names in processing/ to (re)run, oldest claim first
        self.retry_at = 0.0  # monotonic time before which a deferred job is not retried
        self.defer_reason = ""
        self.stop_requested = False
        self.reload_requested = False
        self._stopping_sent = False

    # ---- signals -------------------------------------------------------------------------------
    def _on_stop(self, signum, frame) -> None:
        self.stop_requested = True

    def _on_hup(self, signum, frame) -> None:
        self.reload_requested = True

    def run(self) -> int:
        """Run until SIGTERM/SIGINT; return the exit code (0 after a clean stop, 1 if the spool broke)."""
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        signal.signal(signal.SIGHUP, self._on_hup)
        self.notifier.keepalive(STEP_BUDGET_S)
        self.notifier.start_watchdog()
        how = self.watcher.start()
        self.log.event("watcher", f"watching {self.spool.dir(INCOMING)} with {how}",
                       priority=LOG_WARNING if self.watcher.polling else LOG_INFO)
        code = 0
        try:
            self.notifier.extend_timeout(STEP_BUDGET_S)
            self._recover()
            self.watcher.tick()
            self.notifier.ready(self._idle_status())
            self._log_health()
            self.log.event(
                "daemon-started",
                f"ds-trainer ready: spool {self.spool.root}, models {self.cfg.models_dir}, device "
                f"{self.cfg.device} amp {self.cfg.amp}, {self.watcher.queued()} in incoming/, "
                f"{len(self.pending)} to resume",
                spool=self.spool.root, model_dir=self.cfg.models_dir,
            )
            while not self.stop_requested:
                self.notifier.keepalive(STEP_BUDGET_S)
                if self.reload_requested:
                    self._reload()
                self.watcher.tick()
                if not self._step():
                    self.notifier.status(self._idle_status())
                    time.sleep(TICK_S)
        except (OSError, SpoolError) as e:
            self.log.event("daemon-stopping", f"spool {self.spool.root} cannot be written any more: {e}; "
                           "stopping (the job in processing/ resumes on the next start)", priority=LOG_ERR)
            code = 1
        finally:
            self._stopping()
            self.watcher.stop()
        if code == 0:
            self.log.event("daemon-stopping", "ds-trainer stopped")
        return code

    def _stopping(self) -> None:
        """On the way out (first call only): stop the WATCHDOG=1 pings, send STOPPING=1."""
        if not self._stopping_sent:
            self._stopping_sent = True
            self.notifier.stop_watchdog()
            self.notifier.stopping("stopping")

    def _step(self) -> bool:
        """Run or claim one job if there is one; return False if there was nothing to do."""
        if self.pending:
            if time.monotonic() < self.retry_at:
                return False
            self._run_claimed(self.pending.pop(0))
            return True
        for name in self.watcher.ready():
            if self._take(name):
                return True
        return False

    def _idle_status(self) -> str:
        queued = self.watcher.queued()
        if self.pending and time.monotonic() < self.retry_at:
            left = self.retry_at - time.monotonic()
            return f"deferred {safe_text(self.pending[0])}: {self.defer_reason}; retry in {left:.0f} s; {queued} queued"
        mode = " (polling)" if self.watcher.polling else ""
        return f"idle; {queued} in incoming/{mode}"

    def _log_health(self) -> None:
        """Run the health gate once at start-up and log its verdict (warning unless ok) with DS_* fields."""
        try:
            decision = gate_job(self.cfg, GPU_HEADROOM_BYTES)
        except Exception as e:  # a broken NVML must not stop the daemon; jobs report it again
            self.log.event("health", f"health check could not run: {type(e).__name__}: {e}", priority=LOG_WARNING)
            return
        verdict = decision.report.get("verdict", "?")
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
        kept = []
        for key in ("dir", "watcher"):
            if getattr(new.spool, key) != getattr(self.cfg.spool, key):
                kept.append(f"spool.{key} stays {getattr(self.cfg.spool, key)!r} until a restart")
        if kept:
            import dataclasses

            spool_cfg = dataclasses.replace(new.spool, dir=self.cfg.spool.dir, watcher=self.cfg.spool.watcher)
            new = dataclasses.replace(new, spool=spool_cfg)
        self.cfg = new
        self.watcher.set_timing(new.spool.settle_s, new.spool.scan_interval_s)
        note = f" ({'; '.join(kept)})" if kept else ""
        self.log.event("config-reloaded", f"configuration reloaded from {self.config_path}{note}")
        self.notifier.ready(self._idle_status())

    # ---- claiming ------------------------------------------------------------------------------
    def _fields(self, name: str, record: dict) -> dict:
        return {"job_id": record.get("job_id"), "dataset": dataset_stem(name), "dataset_file": name}

    def _take(self, name: str) -> bool:
        """Claim incoming/NAME and run it, or refuse it to failed/; return False if it vanished."""
        src = self.spool.path(INCOMING, name)
        st, reason = inspect_entry(src, self.cfg.spool.max_dataset_bytes)
        self.watcher.forget(name)
        if st is None:
            return False
        record = {"job_id": new_job_id(), "dataset": name, "claimed_at": utc_now(), "state": "claimed",
                  "crashes": 0, "pid": os.getpid(), "boot_id": boot_id(), "size_bytes": st.st_size}
        if reason is None:
            try:
                record["model_name"] = safe_model_name(dataset_stem(name))
            except StoreError as e:
                reason = f"no model name can be made from this file name: {e}"
        if reason is not None:
            self._fail(name, record, "spool", reason, "SpoolRefused", source=INCOMING)
            return True
        if not claim(self.spool, name, record):
            return False
        self.log.event("job-claimed", f"{safe_text(name)}: claimed as job {record['job_id']} "
                       f"({st.st_size} bytes)", **self._fields(name, record))
        why = check_claimed(self.spool.path(PROCESSING, name), st, self.cfg.spool.max_dataset_bytes)
        if why is not None:
            self._fail(name, record, "spool", why, "SpoolRefused")
            return True
        self._run_claimed(name, record)
        return True

    # ---- one job -------------------------------------------------------------------------------
    def _run_claimed(self, name: str, record: dict | None = None) -> None:
        """Gate, train and store the claimed dataset processing/NAME; finish it in done/ or failed/."""
        cfg = self.cfg
        record = record or read_json(self.spool.record_path(name)) or {}
        path = self.spool.path(PROCESSING, name)
        fields = self._fields(name, record)
        size = record.get("size_bytes") or os.lstat(path).st_size
        try:
            # The GPU must hold the model, optimizer and batches; the data itself can stay in pinned
            # host memory when it does not fit (train._place), so it does not count here.
            decision = gate_job(cfg, GPU_HEADROOM_BYTES)
        except Exception as e:  # the gate must never take the daemon down; the job says why
            self._fail(name, record, "health", f"the health check could not run: {type(e).__name__}: {e}",
                       type(e).__name__)
            return
        plan = decision.plan
        self.log.event("job-health", f"{safe_text(name)}: health gate says {decision.action}"
                       + (f" on {plan.describe()}" if plan else "")
                       + (f": {decision.reason}" if decision.reason and not (plan and plan.reason == decision.reason) else ""),
                       device=str(plan.device) if plan else None, amp_dtype=plan.amp_name if plan else None,
                       verdict=decision.report.get("verdict"), **fields)
        if decision.action == "defer":
            record["state"] = "deferred"
            write_json(self.spool.record_path(name), record)
            self.pending.insert(0, name)
            self.retry_at = time.monotonic() + cfg.health.retry_s
            self.defer_reason = decision.reason or "health gate deferred the job"
            self.log.event("job-deferred", f"{safe_text(name)}: deferred for {cfg.health.retry_s:.0f} s: "
                           f"{self.defer_reason}", priority=LOG_WARNING, **fields)
            return
        if decision.action != "run" or plan is None:
            self._fail(name, record, "health", decision.reason or f"health gate answered {decision.action!r}",
                       "HealthRefused", report=decision.report)
            return
        if self.stop_requested:
            record["state"] = "interrupted"
            write_json(self.spool.record_path(name), record)
            return
        resume = self._resume_checkpoint(name, record, cfg, plan.amp_name)
        record.update(state="running", pid=os.getpid(), boot_id=boot_id(), device=str(plan.device),
                      amp_dtype=plan.amp_name, epochs=cfg.train.epochs, started_at=utc_now())
        write_json(self.spool.record_path(name), record)
        self.notifier.status(f"training {safe_text(name)} ({record['job_id']}): loading; {self.watcher.queued()} queued")
        self.notifier.keepalive(STEP_BUDGET_S + matrix_bytes_estimate(name, size) / LOAD_BYTES_PER_S)

        def on_epoch(s: EpochStats) -> None:
            self._on_epoch(name, record, s, fields, plan)

        def should_stop() -> bool:
            self.notifier.keepalive(STEP_BUDGET_S)
            if self.stop_requested:
                self._stopping()
            return self.stop_requested

        try:
            job = run_job(path, cfg, name=record["model_name"], plan=plan, health=decision.report,
                          on_epoch=on_epoch, should_stop=should_stop, resume=resume)
        except TrainingInterrupted as ti:
            self._save_checkpoint(name, record, ti.checkpoint, cfg, plan.amp_name)
            return
        except JobError as e:
            self._fail(name, record, e.stage, str(e).replace(path, name), e.cause_type)
            return
        except Exception as e:  # a bug or an environment failure (out of memory): fail this job only
            self.log.event("internal-error", f"{safe_text(name)}: unexpected error: {traceback.format_exc()}",
                           priority=LOG_ERR, **fields)
            self._fail(name, record, "internal", f"unexpected {type(e).__name__}: {e}", type(e).__name__)
            return
        record.update(state="saved", model_dir=job.model_dir, saved_at=utc_now())
        write_json(self.spool.record_path(name), record)
        self._finish_done(name, record, job.metadata)

    def _on_epoch(self, name: str, record: dict, s: EpochStats, fields: dict, plan) -> None:
        total = self.cfg.train.epochs
        self.log.event(
            "job-epoch",
            f"{safe_text(name)}: {s.line(total)}",
            epoch=s.epoch, epochs=total, loss=s.train_loss, val_loss=s.val_loss, samples_per_s=s.samples_per_s,
            device=str(plan.device), amp_dtype=plan.amp_name, **fields,
        )
        record.update(epoch=s.epoch, loss=s.train_loss, val_loss=s.val_loss, samples_per_s=s.samples_per_s,
                      updated_at=utc_now())
        write_json(self.spool.record_path(name), record)
        self.notifier.status(f"training {safe_text(name)} ({record['job_id']}): epoch {s.epoch}/{total} "
                             f"loss {s.train_loss:.4g}; {self.watcher.queued()} queued")
        self.notifier.keepalive(STEP_BUDGET_S)

    def _resume_checkpoint(self, name: str, record: dict, cfg: Config, amp_name: str) -> dict | None:
        """Return the checkpoint to resume from, or None (with the reason logged) to start at epoch 1.

        A checkpoint is used only by its own job, under the training configuration and AMP dtype it
        was made with (a different batch size or epoch count would not continue the same run).
        """
        obj, why = load_checkpoint(self.spool, name)
        fields = self._fields(name, record)
        if obj is None:
            if why != "no checkpoint":
                self.log.event("job-resumed", f"{safe_text(name)}: {why}; starting at epoch 1",
                               priority=LOG_WARNING, **fields)
            return None
        if obj.get("job_id") != record.get("job_id"):
            why = "the checkpoint belongs to another job"
        elif obj.get("train_config") != config_to_dict(cfg)["train"]:
            why = "the training configuration changed since the checkpoint"
        elif obj.get("amp_dtype") != amp_name:
            why = f"the checkpoint was made with amp {obj.get('amp_dtype')}, this run uses {amp_name}"
        else:
            ckpt = obj["checkpoint"]
            done = len(ckpt.get("history", []))
            record["resumed_from_epoch"] = done + 1
            self.log.event("job-resumed", f"{safe_text(name)}: resuming from the checkpoint in epoch {done + 1} "
                           f"(batch {ckpt.get('batch')})", epoch=done + 1, **fields)
            return ckpt
        self.log.event("job-resumed", f"{safe_text(name)}: {why}; starting at epoch 1", priority=LOG_WARNING, **fields)
        return None

    def _save_checkpoint(self, name: str, record: dict, ckpt: dict, cfg: Config, amp_name: str) -> None:
        self.notifier.extend_timeout(STOP_EXTEND_S)
        self.notifier.status(f"stopping: writing the checkpoint of {safe_text(name)}")
        save_checkpoint(self.spool, name, {"job_id": record["job_id"], "train_config": config_to_dict(cfg)["train"],
                                           "amp_dtype": amp_name, "saved_at": utc_now(), "checkpoint": ckpt})
        done = len(ckpt.get("history", []))
        record.update(state="interrupted", epoch=done, checkpoint_at=utc_now())
        write_json(self.spool.record_path(name), record)
        self.log.event("job-interrupted", f"{safe_text(name)}: stopped in epoch {done + 1}; checkpoint saved, "
                       "the job resumes on the next start", epoch=done + 1, **self._fields(name, record))

    def _finish_done(self, name: str, record: dict, metadata: dict) -> None:
        doc = result_doc(record, metadata)
        final = finish(self.spool, name, PROCESSING, DONE, doc)
        self.log.event(
            "job-saved",
            f"{safe_text(name)}: model saved to {doc['model_dir']} (final loss {doc['final_train_loss']:.6f}, "
            f"threshold {doc['threshold']:.4f}, {doc['device']} amp {doc['amp_dtype']}); dataset in done/{safe_text(final)}",
            model_dir=doc["model_dir"], loss=doc["final_train_loss"], val_loss=doc["final_val_loss"],
            device=doc["device"], amp_dtype=doc["amp_dtype"], epoch=doc["epochs"], **self._fields(name, record),
        )

    def _fail(self, name: str, record: dict, stage: str, reason: str, exception_type: str, *,
              source: str = PROCESSING, report: dict | None = None) -> None:
        doc = {"job_id": record.get("job_id"), "dataset": name, "stage": stage, "reason": reason,
               "exception_type": exception_type, "failed_at": utc_now(), "claimed_at": record.get("claimed_at"),
               "crashes": record.get("crashes", 0), "health": report}
        final = finish(self.spool, name, source, FAILED, doc)
        self.log.event("job-failed", f"{safe_text(name)}: failed in stage {stage}: {reason}; "
                       f"dataset in failed/{safe_text(final)}", priority=LOG_ERR, failed_stage=stage,
                       **self._fields(name, record))

    # ---- crash recovery ------------------------------------------------------------------------
    def _recover(self) -> None:
        """Finish or re-queue every dataset found in processing/ at start-up (see the module docstring)."""
        remove_orphans(self.spool)
        found = []
        for name in processing_datasets(self.spool):
            path = self.spool.path(PROCESSING, name)
            record = read_json(self.spool.record_path(name))
            if record is None:  # claim() writes the record before the rename; a lost record is rebuilt
                st = os.lstat(path)
                record = {"job_id": new_job_id(), "dataset": name, "state": "claimed", "crashes": 0,
                          "claimed_at": datetime.fromtimestamp(st.st_ctime, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
                          "size_bytes": st.st_size}
            fields = self._fields(name, record)
            st, reason = inspect_entry(path, self.cfg.spool.max_dataset_bytes)
            if reason is None and "model_name" not in record:
                try:
                    record["model_name"] = safe_model_name(dataset_stem(name))
                except StoreError as e:
                    reason = str(e)
            if reason is not None:
                self._fail(name, record, "spool", reason, "SpoolRefused")
                continue
            metadata = self._saved_model(name, record)
            if metadata is not None:
                record.update(state="saved", model_dir=metadata.get("model_dir"))
                write_json(self.spool.record_path(name), record)
                self.log.event("job-recovered", f"{safe_text(name)}: its model {metadata.get('model_dir')} was saved "
                               "before the restart; not training again", model_dir=metadata.get("model_dir"), **fields)
                self._finish_done(name, record, metadata)
                continue
            if record.get("state") in CRASH_STATES:
                record["crashes"] = record.get("crashes", 0) + 1
            if record["crashes"] >= self.cfg.spool.max_crashes:
                self._fail(name, record, "recovery",
                           f"the daemon stopped unexpectedly {record['crashes']} times while running this job "
                           f"(last state {record.get('state')}); not trying again. Look for an out-of-memory kill "
                           f"or a crash: journalctl -u ds-trainer DS_JOB_ID={record['job_id']}", "DaemonCrashed")
                continue
            record.update(state="claimed", pid=os.getpid(), boot_id=boot_id())
            write_json(self.spool.record_path(name), record)
            self.log.event("job-claimed", f"{safe_text(name)}: job {record['job_id']} found in processing/ at start-up "
                           f"({record['crashes']} crash(es) so far); running it again", **fields)
            found.append((record.get("claimed_at", ""), name))
        self.pending = [name for _, name in sorted(found)]

    def _saved_model(self, name: str, record: dict) -> dict | None:
        """Return the metadata of the model this job already saved, or None if there is none.

        Either the record names it (state ``saved``), or a version of the model has the dataset's
        sha256 and started training after the claim (SIGKILL between the store's rename and the record).
        """
        if record.get("model_dir"):
            md = read_json(os.path.join(record["model_dir"], METADATA_FILE))
            if md is not None:
                return md
        claimed = record.get("claimed_at", "")
        name_dir = os.path.join(self.cfg.models_dir, record["model_name"])
        candidates = []
        for version in reversed(list_versions(name_dir)):
            md = read_json(os.path.join(name_dir, version, METADATA_FILE))
            if md is not None and md.get("started_at", "") >= claimed:
                candidates.append(md)
        if not candidates:
            return None
        sha = file_sha256(self.spool.path(PROCESSING, name))
        return next((md for md in candidates if md.get("dataset", {}).get("sha256") == sha), None)


def start_daemon(cfg: Config, config_path: str, *, missing_ok: bool = False, log: EventLog | None = None) -> int:
    """Check the spool and models directories, then run the daemon; return its exit code.

    Raises SpoolError naming the path and the reason if either directory cannot be created or
    written (the daemon does not start).
    """
    spool = open_spool(cfg.spool.dir)
    check_writable_dir(cfg.models_dir, "models directory")
    return Daemon(cfg, spool, log or EventLog(), Notifier(), config_path, missing_ok).run()


def config_path_from(arg: str | None) -> tuple[str, bool]:
    """Return (conffile path, missing_ok) from --config, then $DS_OPS_CONFIG, then the default."""
    path = arg or os.environ.get("DS_OPS_CONFIG")
    return (path, False) if path else (DEFAULT_CONFIG_PATH, True)
