"""One dataset on several processes: DistributedDataParallel under torchrun.

``ds-ops train DATASET --nproc N`` loads and checks the dataset in its own process, as a
single-process run does, writes the float32 matrix to a private temporary ``.npy`` and runs
``python -m torch.distributed.run --nproc-per-node N ... -m opt_ds_ops.training.distributed ...``
(:func:`train_distributed`). Each rank (:func:`main`) memory-maps the matrix and trains with
:func:`train_ddp`; rank 0 writes the result, which the launching process turns back into a
:class:`opt_ds_ops.training.common.TrainResult` and stores through the same code as a single-process run.
Backend: nccl on CUDA GPUs (rank r on ``cuda:LOCAL_RANK``), gloo on the CPU.

What each rank computes, and how its numerics follow :func:`opt_ds_ops.training.fit.train`, is
:mod:`opt_ds_ops.training.ddp_rank`; this module is the launcher (the ``ds-ops train`` process) and one
rank's process (its entry point, its error file, its result).

Every rank holds the standardised training split (a permutation picks rows from all of it); the
page cache holds the memory-mapped matrix once. A failing rank writes a one-line error file;
torchrun stops the others, and the launcher raises TrainingError naming the first rank that failed.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import queue
import re
import tempfile
import threading
import time
import uuid
from typing import Callable, NoReturn

import numpy as np
import torch
import torch.distributed as dist

from ..config.conffile import TrainConfig
from ..fsutil import pid_alive
from ..health.device import AMP_DTYPES, DevicePlan
from ..model.network import TelemetryAutoencoder
from .common import EpochStats, TrainingError, TrainingInterrupted, TrainResult, split_sizes
from .ddp_rank import (  # noqa: F401 - shard, ddp_batch_bounds, GlooSyncBatchNorm: re-exported for the tests' ranks
    GlooSyncBatchNorm, ProcessGroupInfo, ddp_batch_bounds, shard, train_ddp,
)

EPOCH_MARK = "ds-ops-epoch "  # rank 0's stdout line per epoch: the mark, then EpochStats as JSON
RESULT_FILE = "result.pt"
STOP_POLL_S = 0.5  # how often run_ranks asks should_stop() while the ranks run (seconds)


def train_distributed(data: np.ndarray, cfg: TrainConfig, plan: DevicePlan, nproc: int, *,
                      offset: np.ndarray | None = None,
                      on_epoch: Callable[[EpochStats], None] | None = None,
                      should_stop: Callable[[], bool] | None = None,
                      work_dir: str | None = None) -> TrainResult:
    """Train on data (rows, D) with ``nproc`` processes under torchrun on this machine; return rank
    0's :class:`TrainResult` (``mean`` with ``offset`` added, as :func:`opt_ds_ops.training.fit.train`).

    ``plan``: its device type (cpu: gloo; cuda: nccl, rank r on ``cuda:r`` of the visible GPUs) and
    AMP dtype apply to every rank. ``on_epoch`` gets rank 0's epochs as they end. The matrix goes
    to a private temporary directory (removed afterwards) that the ranks memory-map.
    ``work_dir``: the directory that private directory is made in (created if missing; default the
    system's temporary directory): a job's own directory, so that a kill of everything (SIGKILL,
    power loss) leaves the matrix copy where the job's cleanup removes it.
    ``should_stop`` is polled about every 0.5 s while the ranks run; once it returns True the ranks
    are stopped and TrainingInterrupted is raised with no checkpoint (a distributed run keeps none).

    Raises TrainingError naming the first rank that failed and its message (torchrun stops the
    others), or, before any process starts, for an ``nproc`` this machine or dataset cannot take:
    < 2, more than the CPUs (on the CPU) or the visible CUDA GPUs, MPS, fewer than 2 training rows
    per process.
    """
    if nproc < 2:
        raise TrainingError(f"--nproc {nproc}: a distributed run needs at least 2 processes")
    if plan.device.type == "cuda" and nproc > torch.cuda.device_count():
        raise TrainingError(f"--nproc {nproc}: only {torch.cuda.device_count()} CUDA GPU(s) are visible")
    if plan.device.type == "cpu" and nproc > (os.cpu_count() or 1):
        raise TrainingError(f"--nproc {nproc}: more processes than this machine's {os.cpu_count()} CPUs")
    if plan.device.type not in ("cpu", "cuda"):
        raise TrainingError(f"--nproc {nproc}: distributed training runs on cpu or cuda, not {plan.device.type}")
    if not isinstance(data, np.ndarray):  # opt_ds_ops.dataset.npyrows.NpyRows
        raise TrainingError(f"--nproc {nproc}: this dataset is over the job's memory budget and streams, which a "
                            "distributed run does not do yet (every rank holds the training split); train it with one process")
    if cfg.input_window > 1 or cfg.input_differences:
        raise TrainingError(f"--nproc {nproc}: " + (f"train.input_window is {cfg.input_window}" if cfg.input_window > 1
                                                    else "train.input_differences is true")
                            + "; a distributed run trains on single rows (input_window: 1, input_differences: false)")
    ddp_batch_bounds(split_sizes(data.shape[0], cfg.val_fraction)[0], cfg.batch_size, nproc)
    if work_dir is not None:
        os.makedirs(work_dir, mode=0o700, exist_ok=True)
    remove_stale_work_dirs(work_dir)
    tmp = tempfile.mkdtemp(prefix=f"{WORK_PREFIX}{os.getpid()}-", dir=work_dir)
    try:
        np.save(os.path.join(tmp, "data.npy"), np.ascontiguousarray(data, dtype=np.float32))
        with open(os.path.join(tmp, "train.json"), "w", encoding="utf-8") as f:
            json.dump(dataclasses.asdict(cfg), f)
        run_ranks(nproc, ["--dir", tmp, "--device", plan.device.type, "--amp", plan.amp_name,
                           "--tf32", "1" if plan.tf32 else "0"], tmp, on_epoch, should_stop=should_stop)
        return _read_result(os.path.join(tmp, RESULT_FILE), plan, offset)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


WORK_PREFIX = "ds-ops-ddp-"  # + the launcher's pid + "-" + random: the private directory of one run


def remove_stale_work_dirs(work_dir: str | None) -> list[str]:
    """Remove the private directories of runs whose launcher is gone (SIGKILLed with its job) from
    work_dir (None: the system's temporary directory): ``ds-ops-ddp-PID-*`` of a dead PID; in a
    job's own work_dir, also those named before the PID was in the name. Return the paths removed."""
    where = work_dir if work_dir is not None else tempfile.gettempdir()
    removed = []
    with contextlib.suppress(OSError), os.scandir(where) as it:
        for e in it:
            if not e.name.startswith(WORK_PREFIX) or not e.is_dir(follow_symlinks=False):
                continue
            pid = e.name[len(WORK_PREFIX):].split("-", 1)[0]
            if pid.isdigit() and "-" in e.name[len(WORK_PREFIX):]:
                if pid_alive(int(pid)) and int(pid) != os.getpid():
                    continue
            elif work_dir is None:
                continue  # an older ds-ops's name in a shared /tmp: whose it is cannot be told
            shutil.rmtree(e.path, ignore_errors=True)
            removed.append(e.path)
    return removed


# torchrun under a parent-death signal: SIGKILL when the job process that started it dies (its ranks
# die with it by theirs, _die_with_torchrun); argv[1] is the parent's pid, to catch a death before
# prctl, argv[2] the module (torch.distributed.run, also for ps and pgrep to see)


_TORCHRUN_WITH_PARENT = (
    "import ctypes, os, runpy, signal, sys\n"
    "ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)\n"
    "if os.getppid() != int(sys.argv.pop(1)):\n"
    "    os._exit(1)\n"
    "os.environ['DS_OPS_TORCHRUN_PID'] = str(os.getpid())\n"
    "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)\n"
)


def torchrun_command(nproc: int, module_args: list[str], module: str = "opt_ds_ops.training.distributed") -> list[str]:
    """Return the single-machine torchrun command line that runs ``python -m module module_args``
    in nproc processes (``torch.distributed.run`` through this interpreter: no ``torchrun`` on PATH
    needed), with PR_SET_PDEATHSIG(SIGKILL) set first: torchrun never outlives the calling process.

    ``--standalone`` without its names: its store on ``localhost:0`` and the ranks'
    master address, this host's FQDN, need name resolution, and the FQDN a route; in the unit's
    PrivateNetwork= (loopback only) the FQDN is not reachable, and without /etc/hosts not even
    localhost resolves. 127.0.0.1 is what :func:`opt_ds_ops.daemon.sandbox.loopback_problem` checks.
    """
    return [sys.executable, "-c", _TORCHRUN_WITH_PARENT, str(os.getpid()), "torch.distributed.run", "--nnodes=1",
            f"--nproc-per-node={nproc}", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0",
            f"--rdzv-id={uuid.uuid4()}", "--local-addr=127.0.0.1", "-m", module, *module_args]


def run_ranks(nproc: int, module_args: list[str], out_dir: str, on_epoch: Callable[[EpochStats], None] | None,
              module: str = "opt_ds_ops.training.distributed", should_stop: Callable[[], bool] | None = None) -> None:
    """Run ``python -m module module_args`` in nproc ranks under torchrun, pass rank 0's epoch lines
    (``EPOCH_MARK``) to on_epoch, wait. The ranks report errors with :func:`run_rank` into out_dir,
    where torchrun's own output goes too (``torchrun.log``). Raises TrainingError naming the first
    rank that failed, if torchrun fails. The ranks import the same
    opt_ds_ops as this process (PYTHONPATH); each gets ``OMP_NUM_THREADS`` = CPUs / nproc unless set,
    and ``TMPDIR`` = out_dir.
    Interrupted (KeyboardInterrupt, any error here), torchrun's process group is stopped; so it is
    once ``should_stop()`` (polled every :data:`STOP_POLL_S`, on the calling thread, as on_epoch
    is) turns true, and then TrainingInterrupted(None) is raised."""
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    env["TMPDIR"] = out_dir  # torchrun's log directories and torch's caches go where the launcher removes them
    log_path = os.path.join(out_dir, "torchrun.log")
    with open(log_path, "wb") as log, _sigterm_raises():
        proc = subprocess.Popen(torchrun_command(nproc, module_args, module), stdout=subprocess.PIPE, stderr=log,
                                env=env, start_new_session=True, text=True)
        # torchrun's stdout is read on a thread; on_epoch and should_stop run here, on this thread only
        # (the daemon's job sends both over one pipe, which takes one writer at a time)
        lines: queue.Queue = queue.Queue()

        def pump() -> None:
            for ln in proc.stdout:
                lines.put(ln)
            lines.put(None)  # torchrun closed its stdout

        reader = threading.Thread(target=pump, name="ds-ops torchrun stdout", daemon=True)
        reader.start()
        stopped = False
        try:
            while True:
                try:
                    line = lines.get(timeout=STOP_POLL_S)
                except queue.Empty:
                    line = ""
                if line is None:
                    break
                if line.startswith(EPOCH_MARK) and on_epoch is not None:
                    on_epoch(EpochStats(**json.loads(line[len(EPOCH_MARK):])))
                if should_stop is not None and not stopped and should_stop():
                    stopped = True
                    _stop(proc)
            rc = proc.wait()
        except BaseException:
            _stop(proc)
            raise
    if stopped:
        raise TrainingInterrupted(None)
    if rc != 0:
        raise TrainingError(_failure(out_dir, log_path, rc))


@contextlib.contextmanager
def _sigterm_raises():
    """While the ranks run, SIGTERM raises TrainingError in the main thread (so the ranks are
    stopped and the temporary directory removed); elsewhere, or outside, SIGTERM is as it was."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise TrainingError("stopped by SIGTERM")

    before = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def _stop(proc: subprocess.Popen) -> None:
    """Stop torchrun and its ranks (its own session: the process group it leads), SIGKILL after 10 s."""
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _failure(out_dir: str, log_path: str, rc: int) -> str:
    """Return why the ranks failed: a rank killed without an error file of its own (a signal, torchrun's
    root cause: the others' errors are then only its consequence), else the first error a rank wrote
    (``rank 1: ...``), else what torchrun's log says (:func:`_torchrun_cause`)."""
    errors = {}
    for path in glob.glob(os.path.join(out_dir, "error-rank*.json")):
        with contextlib.suppress(OSError, ValueError), open(path, encoding="utf-8") as f:
            e = json.load(f)
            errors[e["rank"]] = e
    with open(log_path, encoding="utf-8", errors="replace") as f:
        lines = [ln.strip() for ln in f if ln.strip()]
    root = _root_cause(lines)
    # a rank killed by a signal without an error file is the cause, unless it aborted (SIGABRT) after
    # another rank's error: a peer leaving mid-collective aborts the others (gloo::IoException)
    killed = (root is not None and root[1].startswith("-") and root[0] not in errors
              and not (errors and root[2] == "SIGABRT"))
    if errors and not killed:
        first = min(errors.values(), key=lambda e: (e["time"], e["rank"]))
        return f"distributed training failed on rank {first['rank']} of {first['world_size']}: {first['message']}"
    return f"distributed training failed (torchrun exit code {rc}): {_torchrun_cause(lines, root)}"


_ROOT_FIELD = re.compile(r"^(rank|exitcode)\s*:\s*(\S+)(.*)$")
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt)\b:?")
# what a rank's process says as it aborts: C++'s std::terminate (gloo's and c10d's exceptions
# thrown on their own threads) and CPython's fatal errors
_ABORT_LINE = re.compile(r"^(terminate called\b|what\(\):|Fatal Python error:)")
_ROOT_HEADING = "Root Cause (first observed failure):"


def _root_cause(lines: list[str]) -> tuple[int, str, str] | None:
    """Return (rank, exit code, signal name or "") of the root cause in torchrun's failure summary,
    None without one."""
    if _ROOT_HEADING not in lines:
        return None
    fields = {}
    for ln in lines[lines.index(_ROOT_HEADING) + 1:]:
        m = _ROOT_FIELD.match(ln)
        if m and m[1] not in fields:
            fields[m[1]] = (m[2], m[3])
    if "rank" not in fields or "exitcode" not in fields or not fields["rank"][0].isdigit():
        return None
    signame = re.search(r"\((SIG\w+)\)", fields["exitcode"][1])
    return int(fields["rank"][0]), fields["exitcode"][0], signame[1] if signame else ""


def _abort_words(lines: list[str]) -> list[str]:
    """Return what the first rank to abort said: its first ``terminate called after throwing ...``
    (or ``Fatal Python error: ...``) line, with the ``what(): ...`` line right after it; the
    generic lines (``terminate called recursively``, ``Fatal Python error: Aborted``, which the
    fault handler adds) only where nothing else was said. Later aborts are mostly the others'
    consequences (a peer's connection closed)."""
    found = [i for i, ln in enumerate(lines) if _ABORT_LINE.match(ln)]
    generic = ("terminate called recursively", "Fatal Python error: Aborted")
    said = [i for i in found if not lines[i].startswith("what():") and not lines[i].startswith(generic)]
    if said:
        i = said[0]
        return [lines[i]] + ([lines[i + 1]] if i + 1 < len(lines) and lines[i + 1].startswith("what():") else [])
    what = [i for i in found if lines[i].startswith("what():")]
    return [lines[(what or found)[0]]] if found else []


def _torchrun_cause(lines: list[str], root: tuple[int, str, str] | None) -> str:
    """Return the root cause's rank and exit code, and what the first rank to abort said
    (:func:`_abort_words`), else the last exception line a rank printed before torchrun's summary;
    else the log's last line."""
    summary = next((i for i, ln in enumerate(lines) if ln.startswith("=====")), len(lines))
    raised = [ln for ln in lines[:summary] if _EXCEPTION_LINE.match(ln) and "ChildFailedError" not in ln]
    parts = [f"rank {root[0]} ended with exit code {root[1]}" + (f" ({root[2]})" if root[2] else "")] if root else []
    parts += _abort_words(lines[:summary]) or raised[-1:]
    return "; ".join(parts) or (lines[-1] if lines else "no message")


def _read_result(path: str, plan: DevicePlan, offset: np.ndarray | None) -> TrainResult:
    """Return the TrainResult rank 0 saved at path (weights_only), its plan the launcher's."""
    saved = torch.load(path, map_location="cpu", weights_only=True)
    model = TelemetryAutoencoder(**saved["model_args"])
    model.load_state_dict(saved["state_dict"])
    fields = dict(saved["fields"], history=[EpochStats(**h) for h in saved["fields"]["history"]])
    mean = saved["mean"].numpy()
    return TrainResult(model=model.eval(), mean=mean + offset if offset is not None else mean,
                       std=saved["std"].numpy(), error_scale=saved["error_scale"].numpy(), plan=plan, **fields)


# ---- one rank (``python -m opt_ds_ops.training.distributed`` under torchrun) ---------------------------


def write_error(out_dir: str, group: ProcessGroupInfo, e: BaseException) -> None:
    """Write rank's one-line error (``error-rankR.json``: rank, world_size, message, time) for the launcher."""
    text = (str(e).strip().splitlines() or [""])[0]
    message = text if isinstance(e, TrainingError) else f"{type(e).__name__}: {text}".rstrip(": ")
    path = os.path.join(out_dir, f"error-rank{group.rank}.json")
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump({"rank": group.rank, "world_size": group.world_size, "message": message, "time": time.time()}, f)
    os.replace(path + ".tmp", path)


def _die_with_torchrun() -> None:
    """PR_SET_PDEATHSIG(SIGKILL): a rank dies with torchrun, also when torchrun is SIGKILLed (its
    workers run in sessions of their own, out of reach of a signal to its process group); a rank
    whose torchrun (``DS_OPS_TORCHRUN_PID``, set by :func:`torchrun_command`'s) is already gone exits."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)
    launcher = os.environ.get("DS_OPS_TORCHRUN_PID", "")
    if launcher.isdigit() and os.getppid() != int(launcher):  # torchrun died before the prctl
        os._exit(1)


def exit_rank(code: int) -> NoReturn:
    """End a rank's process with code once its output is flushed, without the interpreter's
    finalisation: its group is destroyed and its result written (atomically), so nothing is left
    to finalise, and finalising with gloo's and OpenMP's threads still in the process is where a
    rank can abort (SIGABRT) after its work is done (a thread that still holds a tensor takes the
    GIL of an interpreter being torn down, the case pytorch/pytorch#179291 discusses). A rank's
    own exit code is all torchrun reads."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def run_rank(out_dir: str, backend: str, body: Callable[[ProcessGroupInfo], None]) -> int:
    """Join the process group torchrun describes (``backend``), run ``body(group)``, wait for
    every rank to finish it (a barrier), leave; return the exit code. An exception in body is written with :func:`write_error` and gives 1. The rank
    dies with its torchrun (PR_SET_PDEATHSIG)."""
    _die_with_torchrun()
    group = ProcessGroupInfo.from_env(backend)
    try:
        if backend == "nccl":
            torch.cuda.set_device(group.local_rank)
        dist.init_process_group(backend)
        body(group)
        # every rank done (rank 0's result written) before any tears its connections down: a peer
        # closing while this rank's gloo connections are live is the known abort (gloo::IoException)
        dist.barrier()
        return 0
    except Exception as e:  # noqa: BLE001 - the boundary of one rank: reported to the launcher
        write_error(out_dir, group, e)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _save_result(r: TrainResult, path: str) -> None:
    """Write r (weights_only-safe: tensors, numbers, strings) to path atomically."""
    fields = {k: getattr(r, k) for k in ("threshold", "threshold_quantile", "score_window", "rows_train", "rows_val",
                                         "skipped_steps", "started_at", "ended_at", "duration_s", "data_placement",
                                         "score_smoothing", "input_clip", "error_floor", "threshold_method", "extra",
                                         "stopping", "stopping_line", "val_loss")}
    fields["history"] = [h.as_dict() for h in r.history]
    torch.save({"model_args": r.model.model_args(), "state_dict": r.model.state_dict(),
                "mean": torch.from_numpy(np.asarray(r.mean, dtype=np.float64)),
                "std": torch.from_numpy(np.asarray(r.std, dtype=np.float64)),
                "error_scale": torch.from_numpy(np.asarray(r.error_scale, dtype=np.float32)), "fields": fields},
               path + ".tmp")
    os.replace(path + ".tmp", path)


def main(argv: list[str] | None = None) -> int:
    """One rank: ``python -m opt_ds_ops.training.distributed --dir DIR --device cpu|cuda --amp off|bf16|fp16
    --tf32 0|1`` under torchrun. Reads DIR/data.npy (memory-mapped) and DIR/train.json (a
    TrainConfig); rank 0 prints each epoch as an ``EPOCH_MARK`` line and writes DIR/result.pt."""
    p = argparse.ArgumentParser(prog="python -m opt_ds_ops.training.distributed")
    p.add_argument("--dir", required=True)
    p.add_argument("--device", choices=["cpu", "cuda"], required=True)
    p.add_argument("--amp", choices=sorted(AMP_DTYPES), default="off")
    p.add_argument("--tf32", choices=["0", "1"], default="0")
    args = p.parse_args(argv)

    def body(group: ProcessGroupInfo) -> None:
        with open(os.path.join(args.dir, "train.json"), encoding="utf-8") as f:
            cfg = TrainConfig(**json.load(f))
        device = torch.device("cuda", group.local_rank) if args.device == "cuda" else torch.device("cpu")
        plan = DevicePlan(device=device, amp_dtype=AMP_DTYPES[args.amp], tf32=args.tf32 == "1")
        data = np.load(os.path.join(args.dir, "data.npy"), mmap_mode="r")

        def on_epoch(s: EpochStats) -> None:
            if group.rank == 0:
                print(EPOCH_MARK + json.dumps(s.as_dict()), flush=True)

        result = train_ddp(data, cfg, plan, group, on_epoch=on_epoch)
        if group.rank == 0:
            _save_result(result, os.path.join(args.dir, RESULT_FILE))

    return run_rank(args.dir, "nccl" if args.device == "cuda" else "gloo", body)


if __name__ == "__main__":
    exit_rank(main())
