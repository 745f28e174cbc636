"""One dataset on several processes: DistributedDataParallel under torchrun (issue 12).

``ds-ops train DATASET --nproc N`` loads and checks the dataset in its own process, as a
single-process run does, writes the float32 matrix to a private temporary ``.npy`` and runs
``python -m torch.distributed.run --nproc-per-node N ... -m opt_ds_ops.distributed ...``
(:func:`train_distributed`). Each rank (:func:`main`) memory-maps the matrix and trains with
:func:`train_ddp`; rank 0 writes the result, which the launching process turns back into a
:class:`opt_ds_ops.training_common.TrainResult` and stores through the same code as a single-process run.
Backend: nccl on CUDA GPUs (rank r on ``cuda:LOCAL_RANK``), gloo on the CPU.

The numerics follow :func:`opt_ds_ops.train.train` so that the stored model equals what one
process stores, within float tolerance:

* Column statistics: each rank sums its contiguous shard of the training split in float64; the
  sums (then the squared deviations from the global mean) are all-reduced.
* Batches: every rank draws the same permutation per epoch from ``seed`` (as train.py does); each
  global batch of ``batch_size`` rows is cut into N contiguous parts (sizes differ by at most 1)
  and rank r trains on part r. Each rank's loss is weighted by ``N * part rows / batch rows``, so
  DDP's gradient average equals the gradient of the whole batch's mean loss, also for unequal parts.
* BatchNorm1d: on CUDA the layers become ``torch.nn.SyncBatchNorm`` (batch statistics over the
  whole global batch, as one process computes them). SyncBatchNorm is CUDA-only, so on the CPU each
  rank normalises with its own part's statistics and the running statistics are rank 0's
  (broadcast after every epoch): the CPU model differs from a single-process one as much as
  BatchNorm over batch_size / N rows differs from BatchNorm over batch_size rows (README, "One
  dataset on several GPUs", gives the measured effect).
* Validation: each rank scores a contiguous shard of the validation split; the per-feature sums of
  squared errors are all-reduced (``error_scale``), the per-row scores all-gathered in rank order,
  then smoothed and thresholded exactly as train.py does, identically on every rank.

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
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from .config import TrainConfig
from .device import AMP_DTYPES, DevicePlan
from .fsutil import pid_alive, utc_now
from .model import TelemetryAutoencoder, anomaly_scores, feature_errors, smooth
from .threshold import pick_threshold
from .stopping import Stopper
from .scaling import clip_inputs, float64_blocks, standardise
from .training_common import (EpochStats, TrainingError, TrainingInterrupted, TrainResult, batch_bounds, begin_run,
                              make_optimizer, split_sizes)

EPOCH_MARK = "ds-ops-epoch "  # rank 0's stdout line per epoch: the mark, then EpochStats as JSON
RESULT_FILE = "result.pt"
STOP_POLL_S = 0.5  # how often run_ranks asks should_stop() while the ranks run (seconds)


@dataclass(frozen=True)
class ProcessGroupInfo:
    """This process's place in the job: ``rank`` (0..world_size-1), ``local_rank`` (its index on
    this machine: the CUDA device it uses), ``world_size`` (processes in all) and ``backend``
    (``nccl`` or ``gloo``). The default is one process, rank 0."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    backend: str = "gloo"

    @classmethod
    def from_env(cls, backend: str) -> ProcessGroupInfo:
        """Return the group torchrun describes in RANK, LOCAL_RANK and WORLD_SIZE. Raises KeyError
        if they are not set (not started by torchrun)."""
        env = os.environ
        return cls(int(env["RANK"]), int(env["LOCAL_RANK"]), int(env["WORLD_SIZE"]), backend)


def shard(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """Return [start, end) of rank's contiguous part of n rows cut into world_size parts whose
    sizes differ by at most 1 (the first ``n % world_size`` parts have the extra row)."""
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def ddp_batch_bounds(n: int, batch_size: int, world_size: int) -> list[tuple[int, int]]:
    """Return the global batches' [start, end) over n rows, as :func:`opt_ds_ops.training_common.batch_bounds`,
    with a last batch too small to give every rank 2 rows (BatchNorm1d's minimum) joined to the one
    before. Equals batch_bounds for world_size 1. Raises TrainingError if n or batch_size is
    below 2 * world_size."""
    if n < 2 * world_size:
        raise TrainingError(f"{n} training rows cannot give each of {world_size} processes 2 rows "
                            f"(BatchNorm1d's minimum); use a smaller --nproc")
    if batch_size < 2 * world_size:
        raise TrainingError(f"batch_size {batch_size} cannot give each of {world_size} processes 2 rows "
                            f"(BatchNorm1d's minimum); use a smaller --nproc or a larger --batch-size")
    bounds = batch_bounds(n, batch_size)
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] < 2 * world_size:
        bounds[-2] = (bounds[-2][0], n)
        bounds.pop()
    return bounds


def all_reduce_sum(values: np.ndarray, device: torch.device) -> np.ndarray:
    """Return the float64 sum over ranks of values (any shape), computed with one all_reduce."""
    t = torch.as_tensor(np.asarray(values, dtype=np.float64)).to(device)
    dist.all_reduce(t)
    return t.cpu().numpy()


def fit_scaler_sharded(rows: np.ndarray, group: ProcessGroupInfo, device: torch.device) -> tuple[np.ndarray, np.ndarray]:
    """Return the (mean, std) float64 (D,) of all of rows (N, D), as :func:`opt_ds_ops.scaling.fit_scaler`
    computes them, each rank reading only its contiguous shard: float64 block sums all-reduced,
    then the squared deviations from the global mean all-reduced. A zero std becomes 1."""
    lo, hi = shard(rows.shape[0], group.rank, group.world_size)
    mine = rows[lo:hi]
    total = np.zeros(rows.shape[1], dtype=np.float64)
    for _, block in float64_blocks(mine):
        total += block.sum(axis=0)
    mean = all_reduce_sum(total, device) / rows.shape[0]
    squares = np.zeros_like(mean)
    for _, block in float64_blocks(mine):
        block -= mean
        squares += np.einsum("ij,ij->j", block, block)
    std = np.sqrt(all_reduce_sum(squares, device) / rows.shape[0])
    std[std == 0] = 1.0
    return mean, std


def gather_rows(local: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Return the concatenation in rank order of every rank's local (sizes[rank],) tensor, on every
    rank (all_gather of tensors padded to the largest size, then trimmed)."""
    width = max(sizes)
    padded = torch.zeros(width, dtype=local.dtype, device=local.device)
    padded[: local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded)
    return torch.cat([p[:k] for p, k in zip(parts, sizes)])


class _SumOverRanks(torch.autograd.Function):
    """all_reduce(SUM) with a gradient: the gradient of a sum over ranks is the sum of the ranks' gradients."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class GlooSyncBatchNorm(nn.BatchNorm1d):
    """BatchNorm1d whose training-mode batch statistics are those of all ranks' rows together, for
    the CPU (gloo), where ``torch.nn.SyncBatchNorm`` raises: per-channel sum and sum of squares
    (float64) are all-reduced with a gradient, so forward, backward and the running statistics equal
    one BatchNorm1d over the global batch (within float rounding). Input (rows, C) float32; outside
    training mode, or with one process, it is BatchNorm1d. Same parameters and buffers (state_dict).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and dist.is_initialized() and dist.get_world_size() > 1):
            return super().forward(x)
        x64 = x.double()
        count = torch.tensor([float(x.shape[0])], dtype=torch.float64, device=x.device)
        dist.all_reduce(count)
        n = count[0]
        stats = _SumOverRanks.apply(torch.cat([x64.sum(dim=0), (x64 * x64).sum(dim=0)]))
        mean = stats[: x.shape[1]] / n
        var = (stats[x.shape[1]:] / n - mean * mean).clamp_min(0.0)  # biased, as BatchNorm normalises
        with torch.no_grad():
            self.num_batches_tracked.add_(1)
            m = self.momentum
            self.running_mean.mul_(1 - m).add_(mean.to(self.running_mean.dtype), alpha=m)
            self.running_var.mul_(1 - m).add_((var * n / (n - 1)).to(self.running_var.dtype), alpha=m)
        y = (x64 - mean) / torch.sqrt(var + self.eps)
        return (y.to(x.dtype) * self.weight + self.bias) if self.affine else y.to(x.dtype)


def sync_batchnorm(model: nn.Module, device: torch.device) -> nn.Module:
    """Return model with every BatchNorm1d synchronised over the ranks: torch.nn.SyncBatchNorm on
    CUDA, :class:`GlooSyncBatchNorm` elsewhere (state_dicts unchanged)."""
    if device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.BatchNorm1d:
                synced = GlooSyncBatchNorm(child.num_features, child.eps, child.momentum, child.affine,
                                           child.track_running_stats)
                synced.load_state_dict(child.state_dict())
                setattr(parent, name, synced)
    return model


def _local_batches(bounds, group: ProcessGroupInfo) -> tuple[torch.Tensor, list[tuple[int, int]], list[float]]:
    """Return (positions in the epoch's permutation that this rank trains on, int64; its local
    [start, end) per batch; each batch's part rows / batch rows)."""
    positions, local, fractions, at = [], [], [], 0
    for s, e in bounds:
        lo, hi = shard(e - s, group.rank, group.world_size)
        positions.append(torch.arange(s + lo, s + hi))
        local.append((at, at + hi - lo))
        fractions.append((hi - lo) / (e - s))
        at += hi - lo
    return torch.cat(positions), local, fractions


def _broadcast_buffers(model: nn.Module) -> None:
    """Make every rank's buffers (BatchNorm running statistics) rank 0's."""
    for buf in model.buffers():
        dist.broadcast(buf, 0)


def _mean_error(model: nn.Module, x: torch.Tensor, n_rows: int, device: torch.device) -> float:
    """Return the mean squared error over all ranks' rows of x (n_rows rows in all)."""
    local = float(feature_errors(model, x).double().sum()) if x.shape[0] else 0.0
    return float(all_reduce_sum(np.array([local]), device)[0]) / (n_rows * x.shape[1])


def train_ddp(data: np.ndarray, cfg: TrainConfig, plan: DevicePlan, group: ProcessGroupInfo, *,
              on_epoch: Callable[[EpochStats], None] | None = None) -> TrainResult:
    """Train a TelemetryAutoencoder on data (rows, D) float32 as rank ``group.rank`` of an
    initialised process group; return the same :class:`TrainResult` on every rank (model on the CPU).

    Numerics as :func:`opt_ds_ops.train.train` (module docstring: what is reduced, how batches are
    split); the dataset's offset is not applied here (the caller adds it to ``mean``). No
    checkpoint or resume: a distributed run is one command. Raises TrainingError on a non-finite
    loss or weights, an fp16 loss-scale collapse, or too few rows for the ranks.
    """
    started, t_start = begin_run(cfg, plan)
    device = plan.device
    n, n_val = split_sizes(data.shape[0], cfg.val_fraction)
    bounds = ddp_batch_bounds(n, cfg.batch_size, group.world_size)
    train_rows, val_rows = data[:n], data[n:]
    mean, std = fit_scaler_sharded(train_rows, group, device)
    x_train = clip_inputs(standardise(train_rows, mean, std), cfg.input_clip).to(device)
    ref_rows = val_rows if n_val else train_rows  # as train.py: no validation split -> the training rows
    sizes = [hi - lo for lo, hi in (shard(len(ref_rows), r, group.world_size) for r in range(group.world_size))]
    lo, hi = shard(len(ref_rows), group.rank, group.world_size)
    x_ref = clip_inputs(standardise(ref_rows[lo:hi], mean, std), cfg.input_clip).to(device)

    model = sync_batchnorm(TelemetryAutoencoder(data.shape[1], cfg.hidden, cfg.latent), device).to(device)
    net = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = make_optimizer(model, cfg, device)
    scaler = torch.amp.GradScaler(device.type, enabled=plan.use_grad_scaler)
    autocast = (torch.autocast(device.type, dtype=plan.amp_dtype) if plan.amp_dtype is not None
                else contextlib.nullcontext())
    loss_fn = nn.MSELoss()
    positions, local_bounds, fractions = _local_batches(bounds, group)
    batch_sizes = torch.tensor([e - s for s, e in bounds], dtype=torch.float64, device=device)
    batch_loss = torch.zeros(len(bounds), dtype=torch.float64, device=device)
    step_skipped = torch.zeros(len(bounds), dtype=torch.bool, device=device)
    history: list[EpochStats] = []
    skipped_total = 0
    # issue 21: the plateau rule on each epoch's validation loss (all-reduced: every rank decides alike)
    stopper = Stopper(cfg, evaluated="epoch")

    for epoch in range(cfg.epochs):
        net.train()
        t0 = time.perf_counter()
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch)
        perm = torch.randperm(n, generator=gen)[positions].to(x_train.device)
        mine = torch.index_select(x_train, 0, perm)
        batch_loss.zero_()
        step_skipped.zero_()
        for b, (s, e) in enumerate(local_bounds):
            xb = mine[s:e]
            with autocast:
                recon = net(xb)
            loss = loss_fn(recon.float(), xb)
            optimizer.zero_grad(set_to_none=True)
            if scaler.is_enabled():
                scale_before = scaler._scale.clone()
            scaler.scale(loss * (group.world_size * fractions[b])).backward()  # DDP averages: = the batch's mean
            scaler.step(optimizer)
            scaler.update()
            if scaler.is_enabled():
                step_skipped[b] = scaler._scale < scale_before
            batch_loss[b] = loss.detach().double() * fractions[b]
        dist.all_reduce(batch_loss)  # each batch's mean loss over all its rows
        seconds = time.perf_counter() - t0
        finite = torch.isfinite(batch_loss)
        n_nonfinite, n_skipped = int((~finite).sum()), int(step_skipped.sum())
        if n_nonfinite and not scaler.is_enabled():
            raise TrainingError(f"non-finite loss in epoch {epoch + 1} ({n_nonfinite} of {len(bounds)} batches)")
        if scaler.is_enabled() and n_skipped == len(bounds):
            raise TrainingError(
                f"fp16 loss-scale collapse in epoch {epoch + 1}: all {len(bounds)} steps skipped by GradScaler")
        if not all(torch.isfinite(p).all() for p in model.parameters()):
            raise TrainingError(f"non-finite weights after epoch {epoch + 1}")
        _broadcast_buffers(model)
        val_loss = _mean_error(model, x_ref, len(ref_rows), device) if n_val else None
        rows_counted = float(batch_sizes[finite].sum())
        train_loss = float(torch.where(finite, batch_loss * batch_sizes, 0.0).sum()) / max(rows_counted, 1.0)
        stats = EpochStats(epoch + 1, train_loss, val_loss, n / seconds, seconds, n_skipped)
        skipped_total += n_skipped
        history.append(stats)
        if on_epoch is not None:
            on_epoch(stats)
        stopper.steps += len(bounds)
        if stopper.update(val_loss if n_val else None, model):
            break

    restored = stopper.finish(model, device)
    cell = feature_errors(model, x_ref)
    sums = torch.from_numpy(all_reduce_sum(cell.double().sum(dim=0).cpu().numpy(), device))
    error_scale = (sums / len(ref_rows)).float().clamp_min(cfg.error_floor)
    local_scores = anomaly_scores(cell, error_scale.to(device))
    scores = smooth(gather_rows(local_scores, sizes).cpu().numpy(), cfg.score_window, cfg.score_smoothing)
    threshold = pick_threshold(scores.astype(np.float32), cfg)
    return TrainResult(
        model=_plain_batchnorm(model).eval(), mean=mean, std=std, error_scale=error_scale.numpy(), threshold=threshold,
        threshold_quantile=cfg.threshold_quantile, score_window=cfg.score_window, history=history, plan=plan,
        rows_train=n, rows_val=n_val, skipped_steps=skipped_total, started_at=started, ended_at=utc_now(),
        duration_s=time.perf_counter() - t_start, data_placement="gpu" if device.type == "cuda" else "host",
        score_smoothing=cfg.score_smoothing, input_clip=cfg.input_clip, error_floor=cfg.error_floor,
        threshold_method=cfg.threshold_method, stopping=stopper.summary(restored), stopping_line=stopper.line(),
        val_loss=float(sums.sum()) / (len(ref_rows) * sums.numel()) if n_val else None,
        extra={"world_size": group.world_size, "backend": group.backend})


def _plain_batchnorm(model: nn.Module) -> TelemetryAutoencoder:
    """Return a CPU TelemetryAutoencoder with model's state_dict (synchronised BatchNorm's keys are BatchNorm1d's)."""
    plain = TelemetryAutoencoder(model.n_features, model.hidden, model.latent)
    plain.load_state_dict({k: v.detach().cpu() for k, v in model.state_dict().items()})
    return plain


# ---- the launcher (the ``ds-ops train`` process) ----------------------------------------------


def train_distributed(data: np.ndarray, cfg: TrainConfig, plan: DevicePlan, nproc: int, *,
                      offset: np.ndarray | None = None,
                      on_epoch: Callable[[EpochStats], None] | None = None,
                      should_stop: Callable[[], bool] | None = None,
                      work_dir: str | None = None) -> TrainResult:
    """Train on data (rows, D) with ``nproc`` processes under torchrun on this machine; return rank
    0's :class:`TrainResult` (``mean`` with ``offset`` added, as :func:`opt_ds_ops.train.train`).

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
    if not isinstance(data, np.ndarray):  # opt_ds_ops.stream.NpyRows
        raise TrainingError(f"--nproc {nproc}: this dataset is over the job's memory budget and streams, which a "
                            "distributed run does not do yet (every rank holds the training split); train it with one process")
    if cfg.input_window > 1:
        raise TrainingError(f"--nproc {nproc}: train.input_window is {cfg.input_window}; a distributed run trains "
                            "on single rows (input_window: 1)")
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


def torchrun_command(nproc: int, module_args: list[str], module: str = "opt_ds_ops.distributed") -> list[str]:
    """Return the single-machine torchrun command line that runs ``python -m module module_args``
    in nproc processes (``torch.distributed.run`` through this interpreter: no ``torchrun`` on PATH
    needed), with PR_SET_PDEATHSIG(SIGKILL) set first: torchrun never outlives the calling process.

    ``--standalone`` without its names (issue 18): its store on ``localhost:0`` and the ranks'
    master address, this host's FQDN, need name resolution, and the FQDN a route; in the unit's
    PrivateNetwork= (loopback only) the FQDN is not reachable, and without /etc/hosts not even
    localhost resolves. 127.0.0.1 is what :func:`opt_ds_ops.sandbox.loopback_problem` checks.
    """
    return [sys.executable, "-c", _TORCHRUN_WITH_PARENT, str(os.getpid()), "torch.distributed.run", "--nnodes=1",
            f"--nproc-per-node={nproc}", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0",
            f"--rdzv-id={uuid.uuid4()}", "--local-addr=127.0.0.1", "-m", module, *module_args]


def run_ranks(nproc: int, module_args: list[str], out_dir: str, on_epoch: Callable[[EpochStats], None] | None,
              module: str = "opt_ds_ops.distributed", should_stop: Callable[[], bool] | None = None) -> None:
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
    """Return why the ranks failed: the first error a rank wrote (``rank 1: ...``), else torchrun's
    last log line."""
    errors = []
    for path in glob.glob(os.path.join(out_dir, "error-rank*.json")):
        with contextlib.suppress(OSError, ValueError), open(path, encoding="utf-8") as f:
            errors.append(json.load(f))
    if errors:
        first = min(errors, key=lambda e: (e["time"], e["rank"]))
        return f"distributed training failed on rank {first['rank']} of {first['world_size']}: {first['message']}"
    with open(log_path, encoding="utf-8", errors="replace") as f:
        lines = [ln.strip() for ln in f if ln.strip()]
    return f"distributed training failed (torchrun exit code {rc}): {lines[-1] if lines else 'no message'}"


def _read_result(path: str, plan: DevicePlan, offset: np.ndarray | None) -> TrainResult:
    """Return the TrainResult rank 0 saved at path (weights_only), its plan the launcher's."""
    saved = torch.load(path, map_location="cpu", weights_only=True)
    model = TelemetryAutoencoder(**saved["model_args"])
    model.load_state_dict(saved["state_dict"])
    fields = dict(saved["fields"], history=[EpochStats(**h) for h in saved["fields"]["history"]])
    mean = saved["mean"].numpy()
    return TrainResult(model=model.eval(), mean=mean + offset if offset is not None else mean,
                       std=saved["std"].numpy(), error_scale=saved["error_scale"].numpy(), plan=plan, **fields)


# ---- one rank (``python -m opt_ds_ops.distributed`` under torchrun) ---------------------------


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


def run_rank(out_dir: str, backend: str, body: Callable[[ProcessGroupInfo], None]) -> int:
    """Join the process group torchrun describes (``backend``), run ``body(group)``, leave; return
    the exit code. An exception in body is written with :func:`write_error` and gives 1. The rank
    dies with its torchrun (PR_SET_PDEATHSIG)."""
    _die_with_torchrun()
    group = ProcessGroupInfo.from_env(backend)
    try:
        if backend == "nccl":
            torch.cuda.set_device(group.local_rank)
        dist.init_process_group(backend)
        body(group)
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
    """One rank: ``python -m opt_ds_ops.distributed --dir DIR --device cpu|cuda --amp off|bf16|fp16
    --tf32 0|1`` under torchrun. Reads DIR/data.npy (memory-mapped) and DIR/train.json (a
    TrainConfig); rank 0 prints each epoch as an ``EPOCH_MARK`` line and writes DIR/result.pt."""
    p = argparse.ArgumentParser(prog="python -m opt_ds_ops.distributed")
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
    sys.exit(main())
