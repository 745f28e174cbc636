"""A job's life in the daemon, from its claim to its last message: claim, start, watch.

The daemon side of one dataset's way (its end, done/ or failed/, is :mod:`opt_ds_ops.daemon.outcome`; a
job found in processing/ at start-up, :mod:`opt_ds_ops.daemon.recovery`):

1. **Claim** (:meth:`Dispatch.take`): incoming/NAME is copied into the job's own directory
   (:func:`opt_ds_ops.spool.claim`), or refused to failed/, or reported and left. Sidecars of the
   dataset's name that other users dropped are refused and moved aside (docs/trust.md).
2. **Start** (:meth:`Dispatch.start`): a process of its own (:class:`opt_ds_ops.daemon.worker.JobProcess`),
   on the slot and GPU :class:`opt_ds_ops.daemon.slots.Slots` gave it, with its memory budget; or alone on
   several ranks when it is large (``daemon.distributed_min_bytes``).
3. **Watch** (:meth:`Dispatch._watch_job`): its messages (stage, the sidecar's model name, the
   health gate's verdict, a resume, each epoch) update its record, the journal, STATUS= and the
   metrics; a stall, a hung health check or a SIGTERM is acted on here; once its process has ended,
   its final message (or its crash) goes to :mod:`opt_ds_ops.daemon.outcome`.

The daemon never parses a user's bytes (docs/trust.md): the sidecar, the dataset and torch are read in
the job process only; what it says comes back over the pipe as plain fields.
"""

from __future__ import annotations

import multiprocessing.connection
import os
import stat
import time
import traceback

from ..config.sidecar import SIDECAR_MAX_BYTES
from ..dataset import dataset_stem
from ..fsutil import user_name, utc_now
from ..health import gpustats
from ..observe.journal import LOG_ERR, LOG_WARNING, safe_text
from ..spool import (
    INCOMING, SpoolError, boot_id, claim, discard_job, is_storage_error, lock_job, process_start_ticks,
    read_record, save_record
)
from ..training.records import EpochStats, step_cap
from . import worker
from .budget import job_config
from .pacing import STEP_BUDGET_S, STOP_EXTEND_S, TICK_S


def job_fields(record: dict, gpu_index: int | None = None) -> dict:
    """The journal fields of a job's events: DS_JOB_ID, DS_DATASET, DS_DATASET_FILE, and
    DS_GPU_INDEX, DS_GPU_UUID while the job holds a GPU (absent on the CPU).
    ``gpu_index``: the NVML index of a reading from the job's GPU, for a job without a GPU slot."""
    name = record.get("dataset") or ""
    return {"job_id": record.get("job_id"), "dataset": dataset_stem(name), "dataset_file": name,
            "gpu_index": record.get("gpu_index") if gpu_index is None else gpu_index,
            "gpu_uuid": record.get("gpu_uuid")}


class Dispatch:
    """A job's claim, start and messages: the daemon's ``dispatch``.

    Given the daemon (:class:`opt_ds_ops.daemon.service.Daemon`), it reads and writes its queue
    (``pending``, ``retry_at``), its copies of the job records (``records``) and its running jobs
    (``jobs``); job slots are asked of ``slots``; a job's end is handed to ``outcome``
    (:class:`opt_ds_ops.daemon.outcome.Outcome`).
    """

    def __init__(self, daemon):
        self.d = daemon  # its queue, job records, running jobs, slots, watcher, journal
        self.claimed: list[str] = []  # job ids claimed by take(start=False), for take_stack
        self.no_stacks = ""  # why this daemon claims no more stacks (its device cannot stack), or ""

    def take(self, name: str, gpu: dict | None = None, start: bool = True) -> bool:
        """Claim incoming/NAME and start its job (on ``gpu``, see :meth:`opt_ds_ops.daemon.slots.Slots.free_slot`),
        refuse it to failed/, or report it and leave it; return True if something was done. The copy
        pings the watchdog as it goes (a file near spool.max_dataset_bytes takes minutes); an
        exception is that file's failure (``Daemon.job_exception``), never the daemon's."""
        box: dict = {}

        def on_job(job_id: str) -> None:
            box["job_id"] = job_id
            self.d.breadcrumb.mark(job_id)

        try:
            try:
                c = claim(self.d.spool, name, self.d.cfg.spool.max_dataset_bytes, on_job=on_job,
                          progress=lambda: self.d.notifier.keepalive(STEP_BUDGET_S))
                return self._claimed(name, c, gpu, start)
            finally:
                self.d.breadcrumb.mark(None)
        except Exception as e:  # noqa: BLE001 - one file's exception is that file's failure
            if is_storage_error(e) or isinstance(e, SpoolError):
                raise
            self.d.job_exception(box.get("job_id"), name, e)
            return True

    def _claimed(self, name: str, c, gpu: dict | None, start: bool = True) -> bool:
        """What :meth:`take` does with a claim's outcome."""
        if c.outcome == "gone":
            self.d.watcher.forget(name)
            return False
        if c.outcome == "ignored":
            self.d.watcher.ignore(name)
            self.d.log.event("entry-ignored", f"incoming/{safe_text(name)} is {c.reason}; left where it is "
                           "(remove it, or drop the data as a regular file)", priority=LOG_WARNING,
                           dataset_file=name)
            return True
        if c.outcome == "busy":
            self.d.watcher.retry_later(name, max(1.0, 2 * self.d.cfg.spool.settle_s))
            self.d.log.event("entry-busy", f"incoming/{safe_text(name)}: not taken yet: {c.reason}",
                           dataset_file=name)
            return True
        self.d.watcher.forget(name)
        record = c.record
        self.d.records[c.job_id] = record
        if c.outcome == "empty":
            discard_job(self.d.spool, c.job_id)
            self.d.log.event("entry-removed", f"incoming/{safe_text(name)}: {c.reason}", priority=LOG_WARNING,
                           **job_fields(record))
            return True
        if c.outcome == "refused":
            self.d.outcome.fail(record, "spool", c.reason, "SpoolRefused")
            return True
        self.d.log.event("job-claimed", f"{safe_text(name)}: claimed as job {record['job_id']} "
                       f"({record['size_bytes']} bytes, sha256 {record['sha256'][:12]})", **job_fields(record))
        if record.get("sidecars_foreign"):
            self.refuse_foreign_sidecars(record)
        if start:
            self.start(c.job_id, gpu)
        else:
            self.claimed.append(c.job_id)
        return True

    # ---- several datasets in one stacked job (daemon.stack_max) --------------------------------
    def stack_candidates(self, names: list[str]) -> list[str]:
        """Return the files of ``names`` (ready in incoming/) to claim as one stack: those of at most
        ``daemon.stack_max_bytes`` (lstat; a large file is never claimed early), none when fewer than
        ``daemon.stack_min``, when the oldest is not one of them, or after a stack answered that this
        host's device cannot stack (fp16 with a GradScaler: ``no_stacks``)."""
        cfg = self.d.cfg.daemon
        if cfg.stack_max < 2 or len(names) < cfg.stack_min or self.no_stacks:
            return []
        small = []
        for name in names:
            try:
                st = os.lstat(self.d.spool.path(INCOMING, name))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and st.st_size <= cfg.stack_max_bytes:
                small.append(name)
        if not small or small[0] != names[0]:  # the oldest ready file first: a large one is never passed over
            return []
        return small if len(small) >= cfg.stack_min else []

    def stackable(self, record: dict) -> bool:
        """True when a claimed job may join a stack: a plain training drop of at most
        ``daemon.stack_max_bytes``, not distributed, that never crashed and was never restarted."""
        return (record.get("kind") in (None, "train") and not record.get("crashes") and not record.get("restarts")
                and record.get("size_bytes", 0) <= self.d.cfg.daemon.stack_max_bytes
                and not self.d.slots.distributed(record))

    def take_stack(self, names: list[str], gpu: dict | None = None) -> bool:
        """Claim up to ``daemon.stack_max`` of ``names`` and start the stackable ones as one stack
        (:mod:`opt_ds_ops.daemon.jobstack`); the others, or all when fewer than two can stack, go to the
        queue and start one at a time. Return True if something was done."""
        self.claimed = []
        did = False
        try:
            for name in names:
                if len(self.claimed) >= self.d.cfg.daemon.stack_max or self.d.stop_requested:
                    break
                did = self.take(name, gpu, start=False) or did
        finally:  # each claimed job is queued first: a storage error or a failed start loses none
            claimed = [j for j in self.claimed if self.d.records.get(j, {}).get("state") == "claimed"]
            self.d.pending.extend(claimed)
        together = [j for j in claimed if self.stackable(self.d.records[j])]
        if len(together) < 2 or self.d.stop_requested:
            return did
        try:
            self.start_stack(together, gpu)
        except Exception as e:  # noqa: BLE001 - not one job's fault: they stay queued and start one at a time
            if is_storage_error(e) or isinstance(e, SpoolError):
                raise
            self.d.log.event("internal-error", f"starting a stack of {len(together)} jobs: {type(e).__name__}: {e}; "
                             f"those not started train one at a time\n{traceback.format_exc()}", priority=LOG_ERR)
        return True

    def start_stack(self, job_ids: list[str], gpu: dict | None = None) -> None:
        """Start one process for the claimed jobs ``job_ids`` (:class:`opt_ds_ops.daemon.jobstack.StackProcess`),
        each a job of its own in ``Daemon.jobs`` and in ``ds-ops status``."""
        from .jobstack import StackProcess

        stack = StackProcess(self.d.spool.root, job_ids, self.d.records, job_config(self.d.cfg, self.d.slots.memory_budget()),
                             self.d.mp_context, self.d.gate, gpu=gpu, slot=self._free_slot_number())
        self.d.jobs.update(stack.members)  # watched from here on, whatever happens below
        self.d.pending = [j for j in self.d.pending if j not in job_ids]
        for job_id in job_ids:
            self._running(self.d.records[job_id], stack.proc.pid, gpu, stacked=len(job_ids))
        first = self.d.records[job_ids[0]]
        self.d.log.event("job-stacked", f"{len(job_ids)} datasets claimed together into one job process; those of one "
                       "shape train as one stacked model, the others alone (daemon.stack_max): "
                       f"{', '.join(safe_text(self.d.records[j]['dataset']) for j in job_ids[:8])}"
                       f"{', ...' if len(job_ids) > 8 else ''}", stacked=len(job_ids), **job_fields(first))
        self.d.notifier.status(self.d.duties.busy_status())
        self.d.duties.write_metrics()

    def refuse_foreign_sidecars(self, record: dict) -> None:
        """Sidecars of the dataset's name that other users dropped (squatted names, see
        :func:`opt_ds_ops.spool.take_sidecar`) were not applied: say so, and move each aside to
        failed/ as its own entry (its owner can look at it there; the uploader could not remove
        it). Whatever happens to a foreign file is its own matter, never the uploader's job's.
        They stay in the record until all are moved (each ``said`` once it is said): a daemon
        killed in between says nothing twice, and its recovery moves them again (a move finds a
        moved one gone, :meth:`_move_foreign_sidecar`)."""
        for f in record.get("sidecars_foreign") or []:
            side = f["name"]
            why = (f"{f.get('drop', INCOMING)}/{side} belongs to {user_name(f['uid'])}, {f['kind']}; {record['dataset']} was dropped "
                   f"by {user_name(record.get('uploader_uid'))}: a sidecar applies only to a dataset of the same uploader")
            if not f.get("said"):
                self.d.log.event("sidecar-refused", f"{safe_text(record['dataset'])}: {safe_text(why)}; it trains without "
                               "it", priority=LOG_WARNING, **job_fields(record))
                f["said"] = True
                save_record(self.d.spool, record)
            self.d.for_job(None, self._move_foreign_sidecar, f, why, name=side)
        record.pop("sidecars_foreign", None)
        save_record(self.d.spool, record)

    def _move_foreign_sidecar(self, f: dict, why: str) -> None:
        """Move one foreign sidecar (``{"name", "uid", "ino"}`` as seen) to failed/, if that same
        file is still there; report it and leave it if it is not a regular file."""
        drop = f.get("drop", INCOMING)  # score/ for a file to score
        try:
            st = os.lstat(self.d.spool.path(drop, f["name"]))
        except FileNotFoundError:
            return
        if (st.st_uid, st.st_ino) != (f["uid"], f["ino"]):
            return  # replaced since it was seen: not the file this is about
        c = claim(self.d.spool, f["name"], SIDECAR_MAX_BYTES, drop=drop)
        if c.outcome in ("claimed", "refused"):
            self.d.outcome.fail(c.record, "spool", f"{why}; not applied, moved aside", "SidecarForeign")
        elif c.outcome == "empty":
            discard_job(self.d.spool, c.job_id)
        elif c.outcome == "ignored":  # not a regular file: left where it is, listed by ds-ops status
            self.d.log.event("entry-ignored", f"{drop}/{safe_text(f['name'])} is {c.reason}; left where it is "
                           "(its owner can remove it)", priority=LOG_WARNING, dataset_file=f["name"])

    # ---- starting and watching a job -----------------------------------------------------------
    def start(self, job_id: str, gpu: dict | None = None) -> None:
        """Start the job's process (limited to ``gpu`` if given), or finish it at once if its model
        is already in the store."""
        record = self.d.records.get(job_id) or read_record(self.d.spool, job_id)
        if record is None:
            return
        self.d.records[job_id] = record
        for stale in ("gpu_index", "gpu_uuid"):  # from an earlier attempt (before a restart or a defer)
            record.pop(stale, None)
        lock = lock_job(self.d.spool, job_id)
        if lock is None:  # the job process of a killed daemon still runs (it dies with its forkserver)
            self.d.pending.append(job_id)
            self.d.retry_at[job_id] = time.monotonic() + 1.0
            return
        os.close(lock)
        for stale in ("epoch", "loss", "val_loss", "samples_per_s", "updated_at", "nproc", "stacked"):
            record.pop(stale, None)
        nproc, gpus = 1, None
        if self.d.slots.distributed(record):
            if self.d.jobs:  # it runs alone: back to the head of the queue until the others have ended
                self.d.pending.insert(0, job_id)
                return
            nproc, gpus = self.d.slots.ranks()
            if nproc > 1:
                gpu = None
                on = (f"GPUs {', '.join(str(g['index']) for g in gpus)} (nccl)" if gpus
                      else f"{nproc} CPU processes (gloo)")
                self.d.log.event("job-claimed", f"{safe_text(record['dataset'])}: {record.get('size_bytes', 0):,} bytes "
                               f">= daemon.distributed_min_bytes: trains alone with {nproc} processes under "
                               f"torchrun, on {on} (in one process if its data streams, being over "
                               "job.max_matrix_bytes, or train.input_window > 1, or train.input_differences)", **job_fields(record))
        job = worker.JobProcess(self.d.spool.root, job_id, record, job_config(self.d.cfg, self.d.slots.memory_budget(nproc)),
                                self.d.mp_context, self.d.gate,
                                gpu=gpu, slot=self._free_slot_number(), nproc=nproc, gpus=gpus)
        self.d.jobs[job_id] = job
        extra = {}
        if nproc > 1:
            extra["nproc"] = nproc
            if gpus:
                extra.update(gpu_index=",".join(str(g["index"]) for g in gpus), gpu_uuid=",".join(g["uuid"] for g in gpus))
        self._running(record, job.proc.pid, gpu, **extra)
        self.d.notifier.status(self.d.duties.busy_status())
        self.d.duties.write_metrics()

    def _free_slot_number(self) -> int:
        """The lowest slot number (the metrics' ``slot`` label) no running job holds."""
        return min(set(range(len(self.d.jobs) + 1)) - {j.slot for j in self.d.jobs.values()})

    def _running(self, record: dict, job_pid: int, gpu: dict | None, **extra) -> None:
        """Record that the job runs in process ``job_pid`` (on ``gpu``), for ``ds-ops status`` and a
        restarted daemon; ``extra``: more fields of the record (a distributed job's ranks and GPUs)."""
        if gpu is not None:
            record.update(gpu_index=gpu["index"], gpu_uuid=gpu["uuid"])
        record.update(state="running", pid=os.getpid(), pid_start=process_start_ticks(os.getpid()), job_pid=job_pid,
                      boot_id=boot_id(), started_at=utc_now(), epochs=self.d.cfg.train.epochs, stage="health", **extra)
        save_record(self.d.spool, record)


    def watch_jobs(self) -> bool:
        """Wait up to a tick for a message from any running job, then look after each of them;
        return True if one of them ended."""
        try:
            conns = {id(c): c for c in [j.conn for j in self.d.jobs.values()] + self.d.scorer.conns()}  # a stack's once
            multiprocessing.connection.wait(list(conns.values()), TICK_S)
        except OSError:
            pass
        before = len(self.d.jobs)
        for job in list(self.d.jobs.values()):
            self.d.for_job(job.job_id, self._watch_job, job, hold=False)  # _watch_job holds it for the end
        return len(self.d.jobs) < before

    def _watch_job(self, job) -> None:
        """Handle one running job's messages, its end, a stall, a hung health check or a stop."""
        record = self.d.records[job.job_id]
        for kind, fields in job.receive(0):
            self._on_message(record, kind, fields)
        now = time.monotonic()
        code = job.exitcode()
        if code is None:
            if self.d.stop_requested and not job.stop_sent:
                job.stop_sent = True
                self.d.stopping()
                if job.stage in ("health", "dataset"):
                    job.kill(f"stopping during the {job.stage} stage", crash=False)
                    record.update(state="interrupted", stage=job.stage)
                    save_record(self.d.spool, record)
                    self.d.log.event("job-interrupted", f"{safe_text(record['dataset'])}: stopped in the {job.stage} "
                                   "stage; it runs again on the next start", **job_fields(record))
                else:
                    self.d.notifier.extend_timeout(STOP_EXTEND_S)
                    self.d.notifier.status(f"stopping: {safe_text(record['dataset'])} writes its checkpoint; "
                                         f"{len(self.d.jobs)} job{'' if len(self.d.jobs) == 1 else 's'} running")
                    job.stop_event.set()
                    return
            elif job.stage == "health" and now - job.stage_since > self.d.cfg.job.health_timeout_s:
                job.kill(f"the health check did not answer within {self.d.cfg.job.health_timeout_s:.0f} s "
                         "(a hung NVML call?)", crash=False)
                self.d.outcome.defer(record, job.killed_for)
            elif now - job.last_heard > self._stall_budget(record, job):
                job.kill(f"no word from the job for {now - job.last_heard:.0f} s in stage {job.stage}", crash=True)
            else:
                return
        with self.d.breadcrumb.holding(job.job_id):  # a job's end (moving files, the store) is in hand, not its progress
            for kind, fields in job.receive(0):
                self._on_message(record, kind, fields)
            if job.final is not None and job.final[0] == "alone":
                self._alone(record, job.final[1])
            elif job.final is not None:
                self.d.outcome.on_final(record, *job.final)
            elif job.crashed:
                self.d.outcome.on_crash(record, job)
            elif getattr(job, "collateral", False):
                self._collateral(record, job.killed_for)
            job.close()
            self.d.jobs.pop(job.job_id, None)

    def _alone(self, record: dict, f: dict) -> None:
        """A stack handed the job back (:mod:`opt_ds_ops.daemon.jobstack`): it trains one job at a time,
        at the head of the queue."""
        record.update(state="claimed", stage=None)
        record.pop("stacked", None)
        if f.get("device_cannot_stack"):  # so for every stack on this device
            self.no_stacks = f["reason"]
        save_record(self.d.spool, record)
        self.d.log.event("job-stacked", f"{safe_text(record['dataset'])}: not trained in the stack: {safe_text(f.get('reason', ''))}; "
                       "it trains alone", **job_fields(record))
        self.d.pending.insert(0, record["job_id"])

    def _collateral(self, record: dict, why: str) -> None:
        """The job's stack was killed for another job of it (a hung health check, a stop in the dataset
        stage, the daemon failing one job): not this job's fault. Interrupted when the daemon stops,
        else back at the head of the queue, to train alone."""
        if self.d.stop_requested:
            record.update(state="interrupted")
            save_record(self.d.spool, record)
            self.d.log.event("job-interrupted", f"{safe_text(record['dataset'])}: stopped with its stack ({safe_text(why)}); it "
                           "runs again on the next start", **job_fields(record))
            return
        self._alone(record, {"reason": f"its stack's process was stopped for another of its jobs ({why})"})

    def _stall_budget(self, record: dict, job) -> float:
        """Seconds the job may stay silent: job.stall_timeout_s, more while parsing a large file
        (a pessimistic 5 MB/s for text, 4x that for gzip's inflation)."""
        budget = self.d.cfg.job.stall_timeout_s
        if job.stage == "dataset":
            budget += 4 * record.get("size_bytes", 0) / 5e6
        return budget

    def _on_message(self, record: dict, kind: str, f: dict) -> None:
        fields = job_fields(record)
        name = safe_text(record["dataset"])
        if kind == "stage":
            record["stage"] = f["stage"]
            save_record(self.d.spool, record)
            self.d.notifier.status(self.d.duties.busy_status())
        elif kind == "named":  # the job process read its sidecar (the daemon never does)
            record.update(model_name=f["model_name"], name_explicit=f["explicit"])
            save_record(self.d.spool, record)
        elif kind == "health":
            where = f" on {f['describe']}" if f.get("describe") else ""
            if record.get("gpu_uuid"):  # the job sees only this GPU (as cuda:0)
                where += f" (GPU {record.get('gpu_index')} {record['gpu_uuid']})"
            why = f": {f['reason']}" if f.get("reason") and f.get("reason") != f.get("plan_reason") else ""
            self.d.log.event("job-health", f"{name}: health gate says {f['action']}{where}{why}", device=f.get("device"),
                           amp_dtype=f.get("amp_dtype"), verdict=(f.get("report") or {}).get("verdict"), **fields)
            record.update(device=f.get("device"), amp_dtype=f.get("amp_dtype"))
            self.d.metrics.health(f.get("report"))
            self.d.slots.judge_job_gpu(record, f)
        elif kind == "resumed":
            if f.get("why"):
                record.pop("resumed_from_epoch", None)  # a checkpoint taken at first and then dropped
                self.d.log.event("job-resumed", f"{name}: {f['why']}; starting at epoch 1", priority=LOG_WARNING, **fields)
            else:
                record["resumed_from_epoch"] = f["epoch"]
                self.d.log.event("job-resumed", f"{name}: resuming from the checkpoint in epoch {f['epoch']} "
                               f"(batch {f.get('batch')})", epoch=f["epoch"], **fields)
        elif kind == "epoch":
            s = EpochStats(**f)
            total = self.d.cfg.train.epochs
            max_steps = step_cap(self.d.cfg.train)
            g = s.gpu or {}
            self.d.log.event("job-epoch", f"{name}: {s.line(total, max_steps)}", epoch=s.epoch, epochs=total,
                           steps=s.steps, max_steps=max_steps, loss=s.train_loss,
                           val_loss=s.val_loss, samples_per_s=s.samples_per_s, device=record.get("device"),
                           amp_dtype=record.get("amp_dtype"), gpu_temp_c=gpustats.field(g, "temperature_c"),
                           gpu_power_w=gpustats.field(g, "power_draw_w"), gpu_sm_clock_mhz=gpustats.field(g, "sm_clock_mhz"),
                           gpu_mem_used_mib=gpustats.field(g, "memory_used_mib"),
                           gpu_proc_mem_mib=gpustats.field(g, "process_memory_mib"),
                           gpu_util_pct=gpustats.field(g, "utilization_gpu_pct"),
                           gpu_throttle=gpustats.field(g, "clocks_event_reasons"), **fields)
            if g.get("throttle_started"):  # a thermal/power slowdown that began during this job
                self.d.log.event("job-gpu-throttle", f"{name}: GPU {g.get('index')} started throttling in epoch "
                               f"{s.epoch}: {gpustats.throttle_words(g['throttle_started'])}", priority=LOG_WARNING,
                               epoch=s.epoch, gpu_throttle_started=",".join(g["throttle_started"]),
                               gpu_temp_c=gpustats.field(g, "temperature_c"), gpu_power_w=gpustats.field(g, "power_draw_w"),
                               **job_fields(record, gpu_index=g.get("index")))
            record.update(epoch=s.epoch, steps=s.steps, max_steps=max_steps, loss=s.train_loss, val_loss=s.val_loss,
                          samples_per_s=s.samples_per_s, updated_at=utc_now())
            save_record(self.d.spool, record)
            self.d.notifier.status(self.d.duties.busy_status())
            self.d.duties.write_metrics()
