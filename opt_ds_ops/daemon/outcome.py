"""A job's end in the daemon: done/ with NAME.result.json, failed/ with NAME.error.json, or back in the queue.

Where a job's end is handled. Once a job process has ended (:meth:`opt_ds_ops.daemon.dispatch.Dispatch._watch_job`):

* ``saved``: the model is in the store; the dataset moves to done/ with its result document
  (:func:`result_doc`: add a field to NAME.result.json there), old versions are pruned
  (:meth:`Outcome._finish_done`).
* ``failed``: failed/ with the stage and reason (:meth:`Outcome.fail`); an error of the file
  system itself (ENOSPC, EROFS, EIO, ...) instead pauses intake and keeps the job at the head of
  the queue: it counts against no dataset.
* ``deferred`` (the health gate said wait, or the job's GPU failed): back at the head of the queue
  for ``health.retry_s`` seconds, at once where another GPU may take it (:meth:`Outcome.defer`).
* ``interrupted`` (SIGTERM): its record says where the next start resumes.
* no final message (an out-of-memory kill, SIGBUS, a crash): a crash of that job, in its last
  stage (``crashes`` in its record; failed/ after ``spool.max_crashes``, :meth:`Outcome.on_crash`).

Each move is :func:`opt_ds_ops.spool.finish`: the dataset is in exactly one of processing/,
done/ or failed/ whatever is killed when.
"""

from __future__ import annotations

import signal
import time
from datetime import datetime, timezone

from ..fsutil import utc_now
from ..observe.journal import LOG_ERR, LOG_NOTICE, LOG_WARNING, safe_text
from ..spool import DONE, FAILED, STORAGE_ERRNOS, finish, prune_failed, save_record
from ..store.model_dir import GATED, HELD
from ..training.records import columns_note, stopping_note
from .dispatch import job_fields
from .pacing import BACKOFF_S


def _parse_utc(stamp) -> float | None:
    try:
        return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc).timestamp()
    except (TypeError, ValueError):
        return None

def result_doc(record: dict, metadata: dict) -> dict:
    """Return NAME.result.json's content from the job record and the model's metadata.json.

    ``duration_s`` runs from the claim to now (seconds, wall clock: informative only).
    """
    claimed = record.get("claimed_at")
    since = _parse_utc(claimed)
    return {
        "job_id": record["job_id"],
        "dataset": record.get("dataset"),
        "uploader_uid": record.get("uploader_uid"),  # who dropped it: status clears only their own failures
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
        "step_mode": metadata.get("step_mode"),  # how it trained: "stacked (K models)" in a stack of K
        # None when this version became current; else why current stayed where it was (the operator's
        # hold after a rollback or pin, store.promote's gate): the journal's "not made current: ..."
        "not_current": metadata.get("not_current"),
        "crashes": record.get("crashes", 0),
        "restarts": record.get("restarts", 0),
    }


class Outcome:
    """A job's end: the daemon's ``outcome``, given the daemon (:class:`opt_ds_ops.daemon.service.Daemon`).

    It moves the job's dataset out of processing/ (:func:`opt_ds_ops.spool.finish`), forgets the
    daemon's copy of its record, or puts it back in the queue (``pending``, ``retry_at``), and
    logs, prunes and writes the metrics that follow.
    """

    def __init__(self, daemon):
        self.d = daemon  # its spool, queue, job records, journal, metrics

    def on_final(self, record: dict, kind: str, f: dict) -> None:
        name = safe_text(record["dataset"])
        fields = job_fields(record)
        if kind == "saved":
            md = f["metadata"]
            record.update(state="saved", model_dir=md["model_dir"], saved_at=utc_now())
            save_record(self.d.spool, record)
            if f.get("recovered"):
                self.d.log.event("job-recovered", f"{name}: its model {md['model_dir']} was saved before the restart; "
                               "not training again", model_dir=md["model_dir"], **fields)
            self._finish_done(record, md)
            self.d.backoff = BACKOFF_S[0]
        elif kind == "deferred":
            self.defer(record, f["reason"])
        elif kind == "duplicate":  # the same bytes again, not trained (opt_ds_ops.spool.duplicate)
            self._end_duplicate(record, f)
        elif kind == "interrupted" and f.get("checkpoint") is False:
            for stale in ("loss", "val_loss", "samples_per_s"):  # of an epoch the next start does again
                record.pop(stale, None)
            record.update(state="interrupted", epoch=0)
            save_record(self.d.spool, record)
            run = "a stacked run" if record.pop("stacked", None) else "a distributed run"
            self.d.log.event("job-interrupted", f"{name}: stopped; {run} keeps no checkpoint, so it "
                           "trains again from epoch 1 on the next start", **fields)
        elif kind == "interrupted":
            record.update(state="interrupted", epoch=f["epoch"] - 1, checkpoint_at=utc_now())
            save_record(self.d.spool, record)
            self.d.log.event("job-interrupted", f"{name}: stopped in epoch {f['epoch']}; checkpoint saved, "
                           "the job resumes on the next start", epoch=f["epoch"], **fields)
        elif kind == "failed":
            if f.get("errno") in STORAGE_ERRNOS or f.get("transient"):
                record["state"] = "claimed"
                save_record(self.d.spool, record)
                self.d.pending.insert(0, record["job_id"])
                self.d.pause(f"{name}: {f['reason']}")
                return
            if f.get("traceback"):
                self.d.log.event("internal-error", f"{name}: {f['traceback']}", priority=LOG_ERR, **fields)
            self.fail(record, f["stage"], f["reason"], f.get("type", "JobError"), report=f.get("report"))

    def _end_duplicate(self, record: dict, fields: dict) -> None:
        """Given a job's record and its ``duplicate`` message's fields, end the job: the
        dataset goes to done/ (nothing a user dropped is lost, and the dropper, who may not read the
        journal, sees it there) with a ``NAME.result.json`` whose ``duplicate_of`` names the version it
        repeats, and one ``job-duplicate`` notice in the journal."""
        doc = {"job_id": record["job_id"], "dataset": record.get("dataset"), "duplicate_of": fields["model_dir"],
               "sha256": fields["sha256"], "trained_from": fields.get("trained_from"), "claimed_at": record.get("claimed_at"),
               "finished_at": utc_now(), "uploader_uid": record.get("uploader_uid"), "model_name": record.get("model_name")}
        final = finish(self.d.spool, record["job_id"], record, DONE, doc)
        name = safe_text(record.get("dataset") or "")
        self.d.log.event(
            "job-duplicate",
            f"{name}: the same bytes (sha256 {fields['sha256'][:12]}), dataset options and train: configuration as "
            f"{fields['model_dir']} (trained from {safe_text(str(fields.get('trained_from')))} at "
            f"{fields.get('trained_at')}); not trained again; dataset in done/{safe_text(final)} (its result says "
            "duplicate_of). To train it again, change train: or the sidecar, or remove that version (ds-ops models rm)",
            priority=LOG_NOTICE, model_dir=fields["model_dir"], **job_fields(record))
        self.forget(record["job_id"])
        self.d.duties.write_metrics()

    def on_crash(self, record: dict, job) -> None:
        """The job process ended without a final message: count a crash in its last stage."""
        code = job.exitcode()
        how = job.killed_for or (f"killed by {signal.Signals(-code).name}" if code is not None and code < 0
                                 else f"exited with status {code}")
        hint = " (an out-of-memory kill?)" if code == -signal.SIGKILL and not job.killed_for else ""
        record["crashes"] = record.get("crashes", 0) + 1
        record["state"] = "claimed"
        fields = job_fields(record)
        if record["crashes"] >= self.d.cfg.spool.max_crashes:
            self.fail(record, job.stage, f"the job process died {record['crashes']} times, last in stage {job.stage}: "
                       f"{how}{hint}; not trying again. journalctl -u ds-trainer DS_JOB_ID={record['job_id']}",
                       "JobCrashed")
            return
        save_record(self.d.spool, record)
        self.d.log.event("job-crashed", f"{safe_text(record['dataset'])}: the job process died in stage {job.stage}: "
                       f"{how}{hint}; running it again ({record['crashes']} of {self.d.cfg.spool.max_crashes})",
                       priority=LOG_WARNING, failed_stage=job.stage, **fields)
        self.d.pending.insert(0, record["job_id"])

    def defer(self, record: dict, reason: str) -> None:
        """Put the job back at the head of the queue for health.retry_s seconds; at once when it
        was deferred because the GPU it was given has failed (another GPU may take it)."""
        job_id = record["job_id"]
        record["state"] = "deferred"
        save_record(self.d.spool, record)
        self.d.pending.insert(0, job_id)
        down = self.d.slots.gpu_down.get(record.get("gpu_uuid") or "")
        wait_s = 0.0 if down is not None and time.monotonic() < down[0] else self.d.cfg.health.retry_s
        self.d.retry_at[job_id] = time.monotonic() + wait_s
        self.d.defer_reason[job_id] = reason
        when = (f"deferred for {wait_s:.0f} s" if wait_s else
                f"its GPU {record.get('gpu_index')} failed, back in the queue for another GPU")
        self.d.log.event("job-deferred", f"{safe_text(record['dataset'])}: {when}: {reason}", priority=LOG_WARNING,
                       **job_fields(record))
        self.d.duties.write_metrics()

    def _finish_done(self, record: dict, metadata: dict) -> None:
        doc = result_doc(record, metadata)
        final = finish(self.d.spool, record["job_id"], record, DONE, doc)
        self.forget(record["job_id"])
        if record.get("kind") == "retrain":
            self.d.guarded(lambda: self.d.retrainer.on_saved(record))
        self.d.log.event(
            "job-saved",
            f"{safe_text(record['dataset'])}: model saved to {doc['model_dir']} (final loss {doc['final_train_loss']:.6f}, "
            f"threshold {doc['threshold']:.4f}, {doc['device']} amp {doc['amp_dtype']}); dataset in done/{safe_text(final)}"
            f"{safe_text(columns_note(metadata.get('dataset') or {}))}"
            + (f"; {metadata['data_placement_note']}" if metadata.get("data_placement_note") else "")
            + stopping_note(metadata)
            + (f"; not made current: {safe_text(metadata['not_current'])}" if metadata.get("not_current") else ""),
            model_dir=doc["model_dir"], loss=doc["final_train_loss"], val_loss=doc["final_val_loss"],
            device=doc["device"], amp_dtype=doc["amp_dtype"], epoch=doc["epochs"], threshold=doc["threshold"],
            **job_fields(record),
        )
        for warning in metadata.get("warnings") or []:  # published, but suspect
            self.d.log.event("model-suspect", f"{safe_text(record['dataset'])}: {safe_text(warning)}", priority=LOG_WARNING,
                           model_dir=doc["model_dir"], **job_fields(record))
        kept = str(metadata.get("not_current") or "")  # the operator's hold, the promotion gate
        if kept.startswith(HELD):
            self.d.log.event("model-held", f"{safe_text(record['dataset'])}: {safe_text(kept)}", priority=LOG_NOTICE,
                           model_dir=doc["model_dir"], reason=kept, **job_fields(record))
        elif kept.startswith(GATED):
            self.d.log.event("model-not-promoted", f"{safe_text(record['dataset'])}: {safe_text(kept)}",
                           priority=LOG_NOTICE, model_dir=doc["model_dir"], reason=kept, **job_fields(record))
        if metadata.get("report_warning"):  # the picture failed, the job did not
            self.d.log.event("report-failed", f"{safe_text(record['dataset'])}: {metadata['report_warning']}; the model "
                           f"is saved; redraw it with ds-ops report {doc['model_dir']}", priority=LOG_WARNING,
                           model_dir=doc["model_dir"], **job_fields(record))
        self.d.duties.prune_versions(metadata)
        self.d.metrics.job_done(doc)
        self.d.guarded(self.d.duties.retention)  # a file system error here pauses intake; the job is done
        self.d.duties.write_metrics()

    def fail(self, record: dict, stage: str, reason: str, exception_type: str, *, report: dict | None = None) -> None:
        doc = {"job_id": record.get("job_id"), "dataset": record.get("dataset"), "stage": stage, "reason": reason,
               "exception_type": exception_type, "failed_at": utc_now(), "claimed_at": record.get("claimed_at"),
               "sha256": record.get("sha256"), "crashes": record.get("crashes", 0), "health": report,
               "uploader_uid": record.get("uploader_uid"), "drop": record.get("drop"), "kind": record.get("kind")}
        final = finish(self.d.spool, record["job_id"], record, FAILED, doc)
        self.forget(record["job_id"])
        self.d.log.event("job-failed", f"{safe_text(record.get('dataset', ''))}: failed in stage {stage}: {reason}; "
                       f"dataset in failed/{safe_text(final)}", priority=LOG_ERR, failed_stage=stage,
                       reason=reason, **job_fields(record))
        for old in prune_failed(self.d.spool, self.d.cfg.spool.max_failed):
            self.d.log.event("failed-pruned", f"failed/{safe_text(old)} removed: failed/ keeps the newest "
                           f"{self.d.cfg.spool.max_failed} (spool.max_failed)", dataset_file=old)
        if record.get("kind") == "retrain":
            self.d.guarded(lambda: self.d.retrainer.on_failed(record, reason))
        self.d.metrics.job_failed()
        self.d.guarded(self.d.duties.retention)
        self.d.duties.write_metrics()

    def forget(self, job_id: str) -> None:
        self.d.records.pop(job_id, None)
        self.d.retry_at.pop(job_id, None)
        self.d.defer_reason.pop(job_id, None)
