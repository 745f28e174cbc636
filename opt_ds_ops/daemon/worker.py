"""One job in its own process: health gate -> dataset -> training -> model store.

The daemon never parses or trains in its own process. Each job runs in a child started by
multiprocessing's ``forkserver``: a server process, started once by the daemon, that has imported
torch and ds-ops (``set_forkserver_preload``), so a job starts in milliseconds, inherits none of
the daemon's threads or locks, and gives its memory and GPU context back to the system when it
ends. In the child (:func:`job_main`):

* ``prctl(PR_SET_PDEATHSIG, SIGKILL)``: it dies with the forkserver, which exits when the daemon
  dies, so a SIGKILLed daemon leaves no job training on behind its back;
* ``RLIMIT_DATA`` = ``job.memory_max``: a dataset that needs more fails with an out-of-memory
  error of its own stage instead of growing until the kernel's OOM killer picks a process;
  ``oom_score_adj`` +500 makes the job, never the daemon, the OOM killer's choice;
* ``flock`` on ``processing/JOB/lock`` for its lifetime, so a new daemon never starts a second
  copy of a job whose process still runs;
* ``CUDA_VISIBLE_DEVICES=<UUID>`` when the daemon gave the job a GPU (``daemon.max_jobs``),
  set before anything in the process touches CUDA, so torch sees that GPU alone as ``cuda:0`` and the
  job's health gate judges and smoke-tests it (NVML still lists every GPU; the others have no torch
  index and are never chosen). The forkserver only imports torch and never initialises CUDA, so a
  forked child starts with CUDA uninitialised; a child that finds it initialised refuses to run
  rather than train on a GPU it was not given.

The child reports over a one-way pipe with ``(kind, fields)`` tuples: ``stage`` (health, dataset,
training, store), ``health``, ``resumed``, ``epoch``, ``beat`` (at most every
:data:`BEAT_S` seconds from inside the training loop), and one final message: ``saved``,
``failed``, ``deferred`` or ``interrupted``. A child that ends without a final message died (a
signal: OOM kill, SIGBUS, SIGSEGV, or a sticky CUDA error that aborted it); the daemon counts that
against the job, in the stage the child last reported.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import resource
import signal
import time
import traceback

FINAL = ("saved", "failed", "deferred", "interrupted", "scored", "duplicate", "alone")  # a job's last message
BEAT_S = 2.0  # the job process reports at least this often while training (seconds)
_CONTEXT = None


def context():
    """Return the forkserver multiprocessing context, with torch and ds-ops preloaded in the server."""
    global _CONTEXT
    if _CONTEXT is None:
        ctx = multiprocessing.get_context("forkserver")
        # torch._dynamo: AdamW imports it lazily on first use, 1.5 s a job here when not preloaded
        # opt_ds_ops.daemon.scoreslot/scoring: a scoring job starts with the model code already imported
        ctx.set_forkserver_preload(["opt_ds_ops.daemon.worker", "opt_ds_ops.training.job", "opt_ds_ops.health.policy", "torch._dynamo",
                                    "opt_ds_ops.daemon.scoreslot", "opt_ds_ops.scoring.job"])
        _CONTEXT = ctx
    return _CONTEXT


def _noop() -> None:
    """The target of :func:`warm_up`'s first fork."""


def warm_up() -> None:
    """Start the forkserver and wait until it has imported torch and ds-ops (seconds), by forking
    one process that does nothing, so the first job starts at once."""
    p = context().Process(target=_noop, name="ds-ops forkserver warm-up")
    p.start()
    p.join()


def shut_down() -> None:
    """Stop the forkserver and multiprocessing's resource tracker before the daemon exits, so a
    clean stop leaves no process for systemd to SIGKILL. Uses their ``_stop`` methods (what
    CPython's own tests call); where those are missing, the two exit by themselves once the
    daemon's end of their pipes closes."""
    import gc
    from multiprocessing import forkserver, resource_tracker

    # ended jobs' handles still in a reference cycle (a stack and its members) go first, unlinking their
    # semaphores while the tracker runs: without torch's allocations the daemon's collector seldom runs
    gc.collect()
    for child in multiprocessing.active_children():  # a health check hung in NVML: it holds the server's pipe
        child.kill()
        child.join(10)
    for server in (getattr(forkserver, "_forkserver", None), getattr(resource_tracker, "_resource_tracker", None)):
        try:
            server._stop()
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass


def health_at_start(cfg, need_bytes: int) -> tuple[dict, str]:
    """The daemon's health check at start-up: the health gate without its CUDA smoke test (the
    daemon holds no CUDA context; each job runs it in its process); return (its report, its summary line)."""
    from ..health.policy import gate_job, summary_line

    decision = gate_job(cfg, need_bytes, smoke=False)
    return decision.report, summary_line(decision)


def _health_main(conn, cfg, need_bytes: int) -> None:
    """The process of :func:`health_in_child`: sends ``("ok", (report, line))`` or ``("error", text)``
    (the exception as text: its class may not unpickle, or may import torch, in the daemon)."""
    _die_with_parent()
    try:
        conn.send(("ok", health_at_start(cfg, need_bytes)))
    except Exception as e:  # noqa: BLE001 - raised again in the daemon, which logs it
        conn.send(("error", f"{type(e).__name__}: {e}"))


def health_in_child(cfg, need_bytes: int, ctx=None) -> tuple[dict, str]:
    """:func:`health_at_start` in a process of the forkserver (``ctx``, None: :func:`context`), which has
    torch and the gate's code imported: the daemon's own process never imports torch. Waits for the
    answer as long as the check takes (a hung NVML call: for ever; the caller gives up on its thread);
    raises RuntimeError with what the check raised (its class and message), or if its process died
    without answering."""
    ctx = ctx or context()
    conn, child_conn = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_health_main, args=(child_conn, cfg, need_bytes), name="ds-ops health check")
    proc.start()
    child_conn.close()
    try:
        kind, answer = conn.recv()
    except EOFError:
        proc.join()
        raise RuntimeError(f"the health check's process ended without an answer (exit code {proc.exitcode})") from None
    finally:
        conn.close()
    proc.join()
    if kind == "error":
        raise RuntimeError(answer)
    return answer


class JobProcess:
    """The daemon's handle on one running job process.

    ``stage`` is the last stage the child reported; ``last_heard`` the monotonic time (seconds) of
    its last message; ``final`` the final message once it came. ``main`` is the function the
    child runs (:func:`job_main`; :func:`opt_ds_ops.daemon.scoreslot.score_main` for a scoring job), called
    with the same arguments.
    """

    def __init__(self, spool_root: str, job_id: str, record: dict, cfg, ctx=None, gate=None,
                 gpu: dict | None = None, slot: int = 0, nproc: int = 1, gpus: list[dict] | None = None,
                 main=None, stage: str = "health"):
        ctx = ctx or context()
        self.job_id = job_id
        self.gpu = gpu  # {"index": NVML index, "uuid": "GPU-..."} the job may use, or None (its gate chooses)
        self.slot = slot  # the daemon's number for this running job (0..max_jobs-1), for the metrics
        self.nproc = nproc  # > 1: one dataset on nproc processes (daemon.distributed_min_bytes), alone
        self.gpus = gpus  # the GPUs such a job may use (one rank each), or None (CPU ranks)
        self._conn, child_conn = ctx.Pipe(duplex=False)
        self.stop_event = ctx.Event()
        self.proc = ctx.Process(target=main or job_main, name=f"ds-ops job {job_id}",
                                args=(child_conn, self.stop_event, spool_root, job_id, record, cfg, gate, gpu,
                                      nproc, gpus))
        self.proc.start()
        child_conn.close()
        now = time.monotonic()
        self.started, self.last_heard, self.stage_since = now, now, now
        self.stage = stage
        self.final: tuple[str, dict] | None = None
        self.stop_sent = False
        self.killed_for = ""  # why the daemon killed it ("" if it did not)
        self.crashed = True  # an end without a final message counts as the job's crash unless kill() said not

    @property
    def conn(self):
        """The daemon's end of the job's pipe (for :func:`multiprocessing.connection.wait`)."""
        return self._conn

    def receive(self, timeout_s: float) -> list[tuple[str, dict]]:
        """Return the messages that arrived within timeout_s seconds (waits only for the first)."""
        out = []
        try:
            if not self._conn.poll(timeout_s):
                return out
            while True:
                kind, fields = self._conn.recv()
                self.last_heard = time.monotonic()
                if kind == "stage":
                    self.stage, self.stage_since = fields["stage"], self.last_heard
                if kind in FINAL:
                    self.final = (kind, fields)
                out.append((kind, fields))
                if not self._conn.poll(0):
                    break
        except (EOFError, OSError):
            pass
        return out

    def exitcode(self) -> int | None:
        """Return the exit code (negative: the signal that ended it), or None while it runs."""
        return self.proc.exitcode

    def kill(self, why: str, *, crash: bool) -> None:
        """SIGKILL the job process: a stalled job (``crash=True``: counts against it), a stop
        during a parse or a hung health check (``crash=False``: not the dataset's fault)."""
        self.killed_for, self.crashed = why, crash
        if self.proc.exitcode is None:
            self.proc.kill()
        self.proc.join(10)

    def close(self) -> None:
        """Reap the process and close the pipe."""
        self.proc.join(10)
        self._conn.close()


def _die_with_parent() -> None:
    """PR_SET_PDEATHSIG(SIGKILL); exit if the parent is already gone."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() == 1:
        os._exit(0)


def _limit_memory(limit_bytes: int) -> None:
    """RLIMIT_DATA = limit_bytes (private writable memory: heap, anonymous mmap); oom_score_adj +500."""
    try:
        _soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
        if hard != resource.RLIM_INFINITY:
            limit_bytes = min(limit_bytes, hard)
        resource.setrlimit(resource.RLIMIT_DATA, (limit_bytes, limit_bytes))
    except (ValueError, OSError):
        pass
    try:
        with open("/proc/self/oom_score_adj", "r+") as f:
            current = int(f.read().strip() or 0)
            f.seek(0)
            f.write(str(min(1000, current + 500)))
    except (OSError, ValueError):
        pass


def name_job(spool, job_id: str, record: dict, cfg):
    """Return (model name, explicit, dataset options) of a daemon job: its sidecar (the job
    directory's copy, ``sidecar.yaml``) parsed over the conffile's ``dataset:``, its ``name:`` or
    else the dataset's stem. Runs in the job process only: the daemon never parses a user's bytes.
    Raises JobError: stage ``dataset`` for a sidecar that could not be taken or is invalid, stage
    ``spool`` for a file name no model name can be made from."""
    from ..dataset import dataset_stem
    from ..training.job import JobError, read_sidecar
    from ..spool import SIDECAR_FILE
    from ..store.versions import StoreError, safe_model_name

    if record.get("kind") == "retrain":  # the daemon named the model, no sidecar
        from .retrainer import job_options

        return safe_model_name(str(record["model"])), True, job_options(cfg, str(record["model"]))
    if record.get("sidecar_error"):
        raise JobError("dataset", f"sidecar {record['sidecar_error']}")
    options, name = cfg.dataset, None
    path = spool.job_path(job_id, SIDECAR_FILE)
    if record.get("sidecar") and os.path.lexists(path):
        options, name = read_sidecar(path, cfg.dataset, record["sidecar"])
    elif record.get("sidecar") and record.get("state") == "saved" and record.get("model_name"):
        # killed inside spool.finish after the sidecar moved to done/: the name the job already
        # reported (the "named" message), so its saved version is found and not trained again
        return str(record["model_name"]), bool(record.get("name_explicit", True)), options
    try:
        return safe_model_name(name or dataset_stem(record["dataset"])), name is not None, options
    except StoreError as e:
        raise JobError("spool", f"no model name can be made from this file name: {e}", e) from None


def enter_job_process(cfg, gpu: dict | None = None, gpus: list[dict] | None = None) -> int:
    """What a job process does first, before it imports anything that may touch CUDA: limit it to
    ``gpu`` (or ``gpus``), die with the daemon, leave ^C to the daemon, cap its memory; return its
    memory limit in bytes (``job.memory_max``)."""
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu["uuid"]
    elif gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(g["uuid"] for g in gpus)
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C goes to the daemon, which decides
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    memory_max = cfg.job.memory_max_bytes()
    _limit_memory(memory_max)
    return memory_max


def begin_job(spool, job_id: str, record: dict, cfg, send) -> tuple | None:
    """A job's first steps in its process, in its dataset stage: name it (its sidecar, sent as
    ``named``), finish it at once when its version is already in the store (a restart after it
    was saved: ``saved``, recovered) or when its bytes were trained before (``duplicate``), after
    the name's own checks. Return (model name, explicit, dataset options), or None when a final
    message was sent. ``send(kind, **fields)`` reports. Raises JobError."""
    from ..spool.duplicate import same_bytes_version
    from ..store.versions import find_job_version, publish_job
    from ..training.job import check_model_name

    model_name, explicit, options = name_job(spool, job_id, record, cfg)
    send("named", model_name=model_name, explicit=explicit)
    done = find_job_version(cfg.models_dir, model_name, job_id)
    if done is not None:  # saved before a restart: publish again (a kill may have come before it), done
        # in claim order, under the store's lock: never over a later job's version or an operator's change
        done["not_current"] = publish_job(os.path.dirname(done["model_dir"]), done["version"], job_id)
        send("saved", metadata=done, recovered=True)
        return None
    # the name's own checks first (another file's model, another uploader's): a duplicate only of
    # a model this file may train (run_job checks again; this is cheap, it reads metadata.json)
    check_model_name(cfg.models_dir, model_name, record["dataset"], explicit, record.get("uploader_uid"))
    if (same := same_bytes_version(cfg, model_name, record, options)) is not None:  # not trained twice
        send("duplicate", **same)
        return None
    return model_name, explicit, options


def gpu_unbound(gpu: dict | None) -> dict | None:
    """The ``failed`` message's fields when CUDA was initialised before the job process could be
    limited to ``gpu`` (``CUDA_VISIBLE_DEVICES`` would be ignored), else None."""
    import torch

    if gpu is None or not torch.cuda.is_initialized():
        return None
    return dict(stage="health", reason=f"CUDA was initialised before the job could be limited to GPU {gpu['index']} "
                f"({gpu['uuid']}); not training on a GPU it was not given", type="JobGpuUnbound", transient=True)


def gate_verdict(decision, send) -> bool:
    """Send the health gate's ``decision`` (``health``) and, when it does not let the job run, the
    job's final message (``deferred`` or ``failed``); return True when the job may run."""
    plan = decision.plan
    send("health", action=decision.action, reason=decision.reason, report=decision.report,
         device=str(plan.device) if plan else None, amp_dtype=plan.amp_name if plan else None,
         describe=plan.describe() if plan else "", plan_reason=plan.reason if plan else "")
    if decision.action == "defer":
        send("deferred", reason=decision.reason or "health gate deferred the job")
        return False
    if decision.action != "run" or plan is None:
        send("failed", stage="health", reason=decision.reason or f"health gate answered {decision.action!r}",
             type="HealthRefused", report=decision.report)
        return False
    return True


def failure(e: BaseException, stage: str, path: str, name: str, cfg, memory_max: int) -> dict:
    """The fields of the ``failed`` message for exception ``e`` raised in ``stage`` of a job whose
    dataset ``name`` the job process reads at ``path`` (the path is never shown: the name is):
    a JobError's own stage and words, an out-of-memory error's limit, else the exception and its
    traceback."""
    from ..dataset import dataset_stem
    from ..training.common import is_out_of_memory
    from ..training.job import JobError

    if isinstance(e, JobError):
        reason = str(e).replace(path, name).replace(f" {dataset_stem(path)}.yaml ", f" {dataset_stem(name)}.yaml ")
        return dict(stage=e.stage, reason=reason, type=e.cause_type, errno=e.errno)
    if is_out_of_memory(e):
        reason = (f"out of memory in stage {stage} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                  f"the job may use job.memory_max = {cfg.job.memory_max} ({memory_max} bytes)")
    else:
        reason = f"unexpected {type(e).__name__}: {str(e).replace(path, name)}"
    return dict(stage=stage, reason=reason, type=type(e).__name__, errno=getattr(e, "errno", None),
                traceback=traceback.format_exc())


def job_main(conn, stop_event, spool_root: str, job_id: str, record: dict, cfg, gate=None,
             gpu: dict | None = None, nproc: int = 1, gpus: list[dict] | None = None) -> None:
    """The job process: gate, load, train, store; report to the daemon over conn (see the module docstring).

    ``gate(cfg, need_bytes) -> GateDecision`` replaces :func:`opt_ds_ops.health.policy.gate_job` (tests
    only; a module-level function, pickled by name). ``gpu`` (``{"index", "uuid"}``) is the GPU
    the daemon gave the job: ``CUDA_VISIBLE_DEVICES`` is set to its UUID before CUDA initialises.
    ``nproc`` > 1: the dataset trains on that many processes under torchrun
    (:func:`opt_ds_ops.training.job.run_job`'s ``nproc``, one process where the data streams), on ``gpus``
    (``CUDA_VISIBLE_DEVICES`` = their UUIDs, rank r on the r-th) or, None, on the CPU; a stop
    ends the ranks and keeps no checkpoint (the next start trains from epoch 1).
    """
    memory_max = enter_job_process(cfg, gpu, gpus)

    from ..config.conffile import config_to_dict
    from ..health.policy import gate_job
    from ..training.job import JobError, run_job
    from ..fsutil import utc_now
    from ..spool import Spool, load_checkpoint, lock_job, save_checkpoint
    from ..training.stopping import throttled
    from ..training.fit import GPU_HEADROOM_BYTES, TrainingInterrupted

    spool = Spool(spool_root)
    name = record["dataset"]
    path = spool.job_path(job_id, record["data_file"])
    state = {"stage": "health", "beat": time.monotonic()}

    def send(kind: str, **fields) -> None:
        try:
            conn.send((kind, fields))
        except OSError:  # EPIPE: the daemon is gone; its successor runs this job again
            os._exit(1)

    def on_stage(stage: str) -> None:
        state["stage"] = stage
        send("stage", stage=stage)

    lock_fd = lock_job(spool, job_id)
    if lock_fd is None:
        send("failed", stage="recovery", reason="another process of this job still runs", type="JobLocked",
             transient=True)
        return
    try:
        state["stage"] = "dataset"  # naming the job reads the user's sidecar: the dataset's stage
        begun = begin_job(spool, job_id, record, cfg, send)
        if begun is None:
            return
        model_name, explicit, options = begun
        on_stage("health")
        if (unbound := gpu_unbound(gpu)) is not None:
            send("failed", **unbound)
            return
        decision = (gate or gate_job)(cfg, GPU_HEADROOM_BYTES)
        plan = decision.plan
        if not gate_verdict(decision, send):
            return
        resume = None
        obj, why = load_checkpoint(spool, job_id)
        train_cfg = config_to_dict(cfg)["train"]
        if obj is not None:
            if obj.get("job_id") != job_id:
                why = "the checkpoint belongs to another job"
            elif obj.get("train_config") != train_cfg:
                why = "the training configuration changed since the checkpoint"
            elif obj.get("amp_dtype") != plan.amp_name:
                why = f"the checkpoint was made with amp {obj.get('amp_dtype')}, this run uses {plan.amp_name}"
            else:
                resume = obj["checkpoint"]
                send("resumed", epoch=len(resume.get("history", [])) + 1, batch=resume.get("batch"))
        if resume is None and why != "no checkpoint":
            send("resumed", epoch=1, why=why)

        def should_stop() -> bool:
            now = time.monotonic()
            if now - state["beat"] >= BEAT_S:
                state["beat"] = now
                send("beat")
            return stop_event.is_set()

        extra = held = history = None
        if record.get("kind") == "retrain":  # the history copy cut to its normal rows
            from .retrainer import DATA_FILE, job_dataset

            history = spool.job_path(job_id, DATA_FILE)  # the gate seeds the challenger's alarm budget from it
            try:
                path, extra, name, held = job_dataset(spool, job_id, record, cfg)
            except ValueError as e:
                raise JobError("dataset", str(e)) from None
        try:
            job = run_job(path, cfg, name=model_name, plan=plan, health=decision.report,
                          on_epoch=throttled(lambda s: send("epoch", **s.as_dict()), cfg.train),
                          should_stop=should_stop,
                          resume=resume, job_id=job_id, source_name=name, sha256=record.get("sha256"),
                          on_stage=on_stage, options=options, explicit_name=explicit,
                          scratch_dir=spool.job_dir(job_id), nproc=nproc, distributed_optional=True,
                          uploader_uid=record.get("uploader_uid"),
                          on_resume_dropped=lambda why: send("resumed", epoch=1, why=why), extra_metadata=extra,
                          held_back_path=held, history_path=history)
        except TrainingInterrupted as ti:
            ckpt = ti.checkpoint
            if ckpt is None:  # a distributed run keeps none: it trains again from epoch 1
                send("interrupted", epoch=1, batch=None, checkpoint=False)
                return
            save_checkpoint(spool, job_id, {"job_id": job_id, "train_config": train_cfg, "amp_dtype": plan.amp_name,
                                            "saved_at": utc_now(), "checkpoint": ckpt})
            send("interrupted", epoch=len(ckpt.get("history", [])) + 1, batch=ckpt.get("batch"))
            return
        send("saved", metadata=job.metadata)
    except BaseException as e:  # noqa: BLE001 - everything is reported; the daemon decides
        send("failed", **failure(e, state["stage"], path, name, cfg, memory_max))
    finally:
        os.close(lock_fd)
        conn.close()
