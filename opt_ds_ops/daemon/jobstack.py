"""Several queued datasets trained in one job process, as one stacked model (``daemon.stack_max``).

A fleet's first training drops a file per host, all of one shape; one process per file spends
most of its time starting, checking health and launching tiny kernels. When at least
``daemon.stack_min`` files wait in incoming/, the daemon claims up to ``daemon.stack_max`` of them
at once (:meth:`opt_ds_ops.daemon.dispatch.Dispatch.take_stack`) and starts ONE process for them
(:class:`StackProcess`), on one job slot and GPU. In that process (:func:`stack_main`) each job
keeps its own lifecycle, as a job alone has it:

1. its lock, its name (its sidecar), a version already saved (recovered) or a duplicate, each
   reported for that job alone (:func:`opt_ds_ops.daemon.worker.begin_job`);
2. one health gate for all of them (they share the process and its GPU), its verdict sent to each;
3. each dataset read and checked (:func:`opt_ds_ops.training.job.prepare_job`); a bad one fails
   alone;
4. those of the most common :func:`opt_ds_ops.training.stacked.stack_key` train together
   (:func:`opt_ds_ops.training.stacked.train_stacked`: each its own optimizer state, stopping
   rule, best weights and threshold, the same result as alone); a job that cannot join (another
   shape, data that streams, a checkpoint to resume, fewer than two of a shape, fp16 with a
   GradScaler, out of memory beside the others) is handed back with the final message ``alone``
   and trains one job at a time;
5. each model saved under its own name and version (:func:`opt_ds_ops.training.job.store_job`),
   ``saved`` or ``failed`` for each.

Every message carries the job's id (``job``). On the daemon side each job is a
:class:`StackMember` in ``Daemon.jobs``, read by :class:`opt_ds_ops.daemon.dispatch.Dispatch` as
any job: its own record, stage, journal lines, result. A stack keeps no checkpoint: a stop
interrupts every job not yet saved (each trains again from its start on the next start). A death
of the process counts a crash against each job without a final message; a job that has crashed
or been restarted never joins a stack again, so one bad file cannot hold the others back twice.
"""

from __future__ import annotations

import os
import time

from . import worker


class StackProcess:
    """The daemon's handle on one stack's process and its pipe, shared by its :class:`StackMember` s."""

    def __init__(self, spool_root: str, job_ids: list[str], records: dict, cfg, ctx=None, gate=None,
                 gpu: dict | None = None, slot: int = 0):
        ctx = ctx or worker.context()
        self._conn, child_conn = ctx.Pipe(duplex=False)
        self.stop_event = ctx.Event()
        self.proc = ctx.Process(target=stack_main, name=f"ds-ops stack {job_ids[0]}+{len(job_ids) - 1}",
                                args=(child_conn, self.stop_event, spool_root, list(job_ids),
                                      {j: records[j] for j in job_ids}, cfg, gate, gpu))
        self.proc.start()
        child_conn.close()
        self.last_heard = time.monotonic()
        self.members = {j: StackMember(self, j, gpu, slot) for j in job_ids}
        self.eof = False
        self.reading: str | None = None  # the job whose dataset the process reads now (a death then is its own)

    @property
    def conn(self):
        return self._conn

    def pump(self, timeout_s: float) -> None:
        """Hand every message that arrived (waiting up to timeout_s for the first) to its job."""
        try:
            if not self._conn.poll(timeout_s):
                return
            while True:
                kind, fields = self._conn.recv()
                self.last_heard = time.monotonic()
                if kind == "reading":  # the process reads this job's dataset now (None: none)
                    self.reading = fields.get("of")
                elif (member := self.members.get(fields.pop("job", None))) is not None:
                    member.take(kind, fields, self.last_heard)
                if not self._conn.poll(0):  # never wait here for a message that has not come
                    break
        except (EOFError, OSError):
            self.eof = True

    def blamed(self, member: "StackMember") -> bool:
        """True when a death of the process counts against ``member``: it is the job whose dataset
        was being read, or none was (then the stack trained or stored: each job counts it)."""
        return self.reading in (None, member.job_id)

    def kill(self, why: str, crash: bool, by: "StackMember") -> None:
        """SIGKILL the process: every job without a final message ends with it. ``by`` is the job
        the daemon killed it for. A ``crash`` (a stall) counts against the jobs :meth:`blamed`;
        every other job is ``collateral`` (not its fault: the daemon puts it back in the queue)."""
        for m in self.members.values():
            if m.final is None and not m.killed_for:
                m.killed_for = why
                m.crashed = crash and self.blamed(m)
                m.collateral = not m.crashed and (crash or m is not by)
        if self.proc.exitcode is None:
            self.proc.kill()
        self.proc.join(10)

    def closed(self, member: "StackMember") -> None:
        """``member``'s end was handled: once every job's has, reap the process and close the pipe."""
        member.done = True
        if all(m.done for m in self.members.values()):
            self.proc.join(10)
            self._conn.close()


class StackMember:
    """One job of a stack, as the daemon's :class:`opt_ds_ops.daemon.dispatch.Dispatch` reads a
    :class:`opt_ds_ops.daemon.worker.JobProcess`: its stage, its messages, its final message, its
    end (the stack's process ending, or its final message having come)."""

    nproc = 1
    gpus = None

    def __init__(self, stack: StackProcess, job_id: str, gpu: dict | None, slot: int):
        self.stack, self.job_id, self.gpu, self.slot = stack, job_id, gpu, slot
        self.proc, self.stop_event = stack.proc, stack.stop_event
        self.inbox: list[tuple[str, dict]] = []
        self.stage, self.stage_since = "health", time.monotonic()
        self.final: tuple[str, dict] | None = None
        self.stop_sent = False
        self.killed_for = ""
        self._crashed = True
        self._collateral = False
        self.done = False

    # an end without a final message that the daemon did not cause: a crash of the job it blames,
    # collateral for the others (a daemon's kill sets both for every job, see StackProcess.kill)
    @property
    def crashed(self) -> bool:
        return self._crashed if self.killed_for else self.stack.blamed(self)

    @crashed.setter
    def crashed(self, value: bool) -> None:
        self._crashed = value

    @property
    def collateral(self) -> bool:
        return self._collateral if self.killed_for else not self.stack.blamed(self)

    @collateral.setter
    def collateral(self, value: bool) -> None:
        self._collateral = value

    @property
    def conn(self):
        return self.stack.conn

    @property
    def last_heard(self) -> float:
        return self.stack.last_heard

    def take(self, kind: str, fields: dict, now: float) -> None:
        if kind == "stage":
            self.stage, self.stage_since = fields["stage"], now
        if kind in worker.FINAL:
            self.final = (kind, fields)
        self.inbox.append((kind, fields))

    def receive(self, timeout_s: float) -> list[tuple[str, dict]]:
        self.stack.pump(timeout_s)
        out, self.inbox = self.inbox, []
        return out

    def exitcode(self) -> int | None:
        """0 once its final message came (its end is handled while the others train), else the
        process's exit code (None while it runs)."""
        if self.final is not None:
            return 0
        code = self.proc.exitcode
        if code is None and self.stack.eof:  # the pipe closed: the process is ending
            self.proc.join(1)
            code = self.proc.exitcode
        return code

    def kill(self, why: str, *, crash: bool) -> None:
        if self.final is None:  # a finished job's end never stops the others
            self.stack.kill(why, crash, self)

    def close(self) -> None:
        self.stack.closed(self)


def stack_main(conn, stop_event, spool_root: str, job_ids: list[str], records: dict, cfg, gate=None,
               gpu: dict | None = None) -> None:
    """The stack's process: see the module docstring. Every message is ``(kind, fields)`` with the
    job's id in ``fields["job"]``; each job gets exactly one final message unless the process dies."""
    memory_max = worker.enter_job_process(cfg, gpu)

    import numpy as np

    from ..health.policy import gate_job
    from ..spool import Spool, load_checkpoint, lock_job
    from ..training.common import is_out_of_memory
    from ..training.fit import GPU_HEADROOM_BYTES, TrainingError, TrainingInterrupted
    from ..training.job import JobError, prepare_job, store_job
    from ..training.stacked import stack_key, train_stacked
    from ..training.stopping import throttled

    spool = Spool(spool_root)
    state = {"beat": time.monotonic()}
    stages: dict[str, str] = {}
    open_jobs: dict[str, dict] = {}  # job id -> what it needs, while it has no final message
    locks: dict[str, int] = {}  # job id -> its lock, held until its final message

    def send(job_id: str | None, kind: str, **fields) -> None:
        if kind in worker.FINAL:
            open_jobs.pop(job_id, None)
            if job_id in locks:  # before the message: a job handed back starts alone at once
                os.close(locks.pop(job_id))
        try:
            conn.send((kind, dict(fields, job=job_id)))
        except OSError:  # EPIPE: the daemon is gone; its successor runs these jobs again
            os._exit(1)
        if kind == "stage":
            stages[job_id] = fields["stage"]

    def reading(job_id: str | None) -> None:
        """Tell the daemon whose dataset (or sidecar) the process reads now: a death then is that job's."""
        send(None, "reading", of=job_id)

    def fail(job_id: str, e: BaseException) -> None:
        job = open_jobs.get(job_id) or {}
        name = records[job_id]["dataset"]
        send(job_id, "failed", **worker.failure(e, stages.get(job_id, "dataset"), job.get("path", name), name, cfg,
                                                memory_max))

    def each(step, ids) -> None:
        """step(job_id) for each job still open; an exception is that job's failure alone."""
        for job_id in [j for j in ids if j in open_jobs]:
            try:
                step(job_id)
            except BaseException as e:  # noqa: BLE001 - reported; the daemon decides
                fail(job_id, e)

    try:
        for job_id in job_ids:
            record = records[job_id]
            open_jobs[job_id] = {"path": spool.job_path(job_id, record["data_file"])}
            send(job_id, "stage", stage="dataset")  # naming the job reads the user's sidecar: the dataset's stage
            lock = lock_job(spool, job_id)
            if lock is None:
                send(job_id, "failed", stage="recovery", reason="another process of this job still runs",
                     type="JobLocked", transient=True)
                continue
            locks[job_id] = lock

        seen: dict[str, str] = {}  # model name -> the job begun with it: a second one trains alone

        def begin(job_id: str) -> None:
            reading(job_id)
            begun = worker.begin_job(spool, job_id, records[job_id], cfg, lambda kind, **f: send(job_id, kind, **f))
            if begun is None:
                return
            open_jobs[job_id].update(zip(("model_name", "explicit", "options"), begun))
            if begun[0] in seen:  # alone, so that the name's owner check and the duplicate rule see the other's
                send(job_id, "alone", reason=f"{records[seen[begun[0]]]['dataset']} of the same stack has the same model name")
                return
            seen[begun[0]] = job_id

        each(begin, job_ids)
        reading(None)
        if not open_jobs:
            return
        for job_id in open_jobs:
            send(job_id, "stage", stage="health")
        if (unbound := worker.gpu_unbound(gpu)) is not None:
            for job_id in list(open_jobs):
                send(job_id, "failed", **unbound)
            return
        decision = (gate or gate_job)(cfg, GPU_HEADROOM_BYTES)
        plan = decision.plan
        for job_id in list(open_jobs):
            if not worker.gate_verdict(decision, lambda kind, **f: send(job_id, kind, **f)):
                continue
            if plan.use_grad_scaler:  # so for every stack on this device: the daemon claims no more
                send(job_id, "alone", reason="fp16 with a GradScaler cannot be stacked", device_cannot_stack=True)
            elif load_checkpoint(spool, job_id)[0] is not None:
                send(job_id, "alone", reason="it has a checkpoint to resume")
            else:  # the gate has answered: each waits to be read (the daemon's health timeout is over)
                send(job_id, "stage", stage="dataset")

        def prepare(job_id: str) -> None:
            job, record = open_jobs[job_id], records[job_id]
            send(job_id, "stage", stage="dataset")
            job["prep"] = prepare_job(job["path"], cfg, name=job["model_name"], plan=plan, source_name=record["dataset"],
                                      sha256=record.get("sha256"), options=job["options"],
                                      explicit_name=job["explicit"], scratch_dir=spool.job_dir(job_id),
                                      uploader_uid=record.get("uploader_uid"), job_id=job_id)
            job["key"] = stack_key(job["prep"].ds.data, cfg.train)

        def prepare_or_hand_back(job_id: str) -> None:
            reading(job_id)
            try:
                prepare(job_id)
            except BaseException as e:  # noqa: BLE001 - out of memory beside the others: alone it may fit
                if not is_out_of_memory(e):
                    raise
                send(job_id, "alone", reason="out of memory beside the other datasets of its stack")

        each(prepare_or_hand_back, list(open_jobs))
        reading(None)
        keys = [j["key"] for j in open_jobs.values() if j["key"] is not None]
        key = max(set(keys), key=keys.count) if keys else None
        together = [j for j, job in open_jobs.items() if key is not None and job["key"] == key]
        if len(together) < 2:
            together = []
        for job_id in [j for j in open_jobs if j not in together]:
            why = ("its data cannot be stacked (it streams from disk, or train.input_window > 1)"
                   if open_jobs[job_id]["key"] is None else
                   f"no other dataset of its shape ({open_jobs[job_id]['key'][0]} rows x {open_jobs[job_id]['key'][1]} "
                   "columns) came with it")
            send(job_id, "alone", reason=why)
        if not together:
            return
        for job_id in together:
            send(job_id, "stage", stage="training")

        def should_stop() -> bool:
            now = time.monotonic()
            if now - state["beat"] >= worker.BEAT_S:
                state["beat"] = now
                for job_id in together:
                    send(job_id, "beat")
            return stop_event.is_set()

        reporters = [throttled(lambda s, j=j: send(j, "epoch", **s.as_dict()), cfg.train) for j in together]
        try:
            results = train_stacked([np.asarray(open_jobs[j]["prep"].ds.data) for j in together], cfg.train, plan,
                                    offsets=[open_jobs[j]["prep"].ds.offset for j in together],
                                    on_epoch=lambda k, s: reporters[k](s), should_stop=should_stop)
        except TrainingInterrupted:
            for job_id in together:
                send(job_id, "interrupted", epoch=1, batch=None, checkpoint=False)
            return
        except Exception as e:  # noqa: BLE001 - the stack as a whole (out of memory, ...): each alone may
            for job_id in together:  # fit and train, or fail with its own reason
                send(job_id, "alone", reason=f"the stack could not train: {type(e).__name__}: {str(e)[:300]}")
            return

        def store(job_id: str) -> None:
            job, record = open_jobs[job_id], records[job_id]
            k = together.index(job_id)
            result, results[k] = results[k], None  # each model and dataset let go once stored
            if isinstance(result, TrainingError):
                raise JobError("training", f"{record['dataset']}: {result}", result)
            try:
                saved = store_job(job["prep"], result, cfg, health=decision.report, job_id=job_id,
                                  source_name=record["dataset"], explicit_name=job["explicit"],
                                  uploader_uid=record.get("uploader_uid"),
                                  on_stage=lambda stage: send(job_id, "stage", stage=stage))
            except BaseException as e:  # noqa: BLE001 - out of memory beside the others: alone it may fit
                if not is_out_of_memory(e):
                    raise
                send(job_id, "alone", reason="out of memory beside the other datasets of its stack")
                return
            send(job_id, "saved", metadata=saved.metadata)

        each(store, together)
    except BaseException as e:  # noqa: BLE001 - the stack's own failure is each open job's
        for job_id in list(open_jobs):
            fail(job_id, e)
    finally:
        for lock in locks.values():
            os.close(lock)
        conn.close()
