"""Recovery at start-up: every job found in processing/ is run again, or quarantined.

A death of the daemon (SIGKILL, OOM kill, power loss) counts against no dataset: at start-up every
job in processing/ is run again, resumed from its checkpoint if it has one, and an interrupted
claim is finished (:func:`opt_ds_ops.spool.recover_claim`). Only a job the daemon was handling at
two deaths in a row is quarantined to failed/ (:mod:`opt_ds_ops.daemon.breadcrumb`).

**Recovery by identity.** A job's model version records the job id in metadata.json. When a job
(re)starts, its process first asks the store for a version with its job id
(:func:`opt_ds_ops.store.versions.find_job_version`): if there is one, publishing ``current`` is replayed in
claim order (:func:`opt_ds_ops.store.versions.publish_job`) and the job finishes in done/ without training
again, whatever the clocks say.
"""

from __future__ import annotations

from ..observe.journal import safe_text
from ..spool import (
    discard_job, job_ids, migrate_legacy, read_record, recover_claim, remove_stale_temps, save_record
)
from .breadcrumb import QUARANTINE_AFTER
from .dispatch import job_fields
from .pacing import STEP_BUDGET_S


class Recovery:
    """What the daemon (:class:`opt_ds_ops.daemon.service.Daemon`) does with processing/ at start-up,
    its ``recovery``: it fills the queues (``pending``, the scoring slot's) and the daemon's copies of the
    job records; a job to quarantine or refuse ends through the daemon's ``outcome``.
    """

    def __init__(self, daemon):
        self.d = daemon  # its spool, queue, job records, scoring slot, journal

    def recover(self, quarantine: tuple[str, int] = ("", 0)) -> None:
        """Queue every job found in processing/ at start-up; finish interrupted claims. A daemon's
        death counts against no dataset (``restarts`` counts them, for the record), except that a
        job the daemon was handling when it died, twice in a row (``quarantine``: the job id and
        deaths in a row, from :meth:`opt_ds_ops.daemon.breadcrumb.Breadcrumb.deaths`), is quarantined to
        failed/ instead: no dataset can hold the service in a restart loop."""
        remove_stale_temps(self.d.spool)
        for name in migrate_legacy(self.d.spool):
            self.d.log.event("job-claimed", f"{safe_text(name)}: left in processing/ by an older ds-ops; "
                           "back in incoming/", dataset_file=name)
        for job_id in job_ids(self.d.spool):
            self.d.for_job(job_id, self._recover_job, job_id, quarantine, hold=False)

    def _recover_job(self, job_id: str, quarantine: tuple[str, int]) -> None:
        """:meth:`_recover` for one job directory. Only copying an interrupted claim in again
        holds the job (:mod:`opt_ds_ops.daemon.breadcrumb`): the rest reads the daemon's own record, and a
        kill then (a restart loop of the harness or of systemd) must not count against it. A job
        whose model is saved is never quarantined: its process replays the publish and it is done."""
        record = read_record(self.d.spool, job_id)
        if record is None or not record.get("dataset"):
            discard_job(self.d.spool, job_id)  # killed before its record was written: nothing of a user's
            return
        self.d.records[job_id] = record
        if quarantine[0] == job_id and quarantine[1] >= QUARANTINE_AFTER and record.get("state") != "saved":
            stage = record.get("stage") or ("spool" if record.get("state") == "claiming" else "daemon")
            self.d.outcome.fail(record, stage, f"the daemon died {quarantine[1]} times in a row while handling this job "
                       f"(state {record.get('state')}, stage {stage}); quarantined so that it cannot stop the service "
                       "again. ds-ops requeue NAME runs it once more", "Quarantined")
            return
        with self.d.breadcrumb.holding(job_id if record.get("state") == "claiming" else None):
            c = recover_claim(self.d.spool, job_id, record, self.d.cfg.spool.max_dataset_bytes,
                              progress=lambda: self.d.notifier.keepalive(STEP_BUDGET_S))
        if c.outcome in ("gone", "busy"):
            self.d.outcome.forget(job_id)
            return
        if c.outcome == "empty":
            discard_job(self.d.spool, job_id)
            self.d.outcome.forget(job_id)
            return
        if c.outcome == "refused":
            self.d.outcome.fail(record, "spool", c.reason, "SpoolRefused")
            return
        if record.get("sidecars_foreign"):
            self.d.dispatch.refuse_foreign_sidecars(record)
        for stale in ("gpu_index", "gpu_uuid"):  # the GPU of the last run; the next start chooses again
            record.pop(stale, None)
        if record.get("state") in ("running", "claimed", "interrupted", "deferred"):
            if record.get("state") == "running":
                record["restarts"] = record.get("restarts", 0) + 1
            record["state"] = "claimed"
            save_record(self.d.spool, record)
        self.d.log.event("job-claimed", f"{safe_text(record['dataset'])}: job {job_id} found in processing/ at "
                       "start-up; running it again", **job_fields(record))
        (self.d.scorer.pending if record.get("kind") == "score" else self.d.pending).append(job_id)
