"""One rank of a distributed run: its shard of the rows, its part of each global batch,
the statistics all-reduced over the ranks, BatchNorm over ranks, and :func:`train_ddp`, the loop
each rank runs inside an initialised process group. Started by :mod:`opt_ds_ops.training.distributed`.

The numerics follow :func:`opt_ds_ops.training.fit.train` so that the stored model equals what one
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
* The plateau rule: as one process runs it, every ``eval_every_steps`` steps on the same evenly
  strided validation rows (each rank scores its shard of them, the mean is all-reduced, so every
  rank stops at the same step, mid-epoch too), and offered each epoch's validation loss.
* Validation: each rank scores a contiguous shard of the validation split; the per-feature sums of
  squared errors are all-reduced (``error_scale``), the per-row scores all-gathered in rank order,
  then smoothed and thresholded exactly as train.py does, identically on every rank.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..config.conffile import TrainConfig
from ..fsutil import utc_now
from ..health.device import DevicePlan
from ..model.network import TelemetryAutoencoder, anomaly_scores, feature_errors, smooth
from ..model.scaling import clip_inputs, float64_blocks, standardise
from ..model.threshold import pick_threshold
from .common import EpochStats, TrainingError, TrainResult, batch_bounds, begin_run, make_optimizer, split_sizes
from .stopping import Stopper, eval_stride


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
    """Return the global batches' [start, end) over n rows, as :func:`opt_ds_ops.training.common.batch_bounds`,
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
    """Return the (mean, std) float64 (D,) of all of rows (N, D), as :func:`opt_ds_ops.model.scaling.fit_scaler`
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


def _eval_shard(val_rows: np.ndarray, mean, std, cfg: TrainConfig, group: ProcessGroupInfo,
                device: torch.device) -> tuple[torch.Tensor, int]:
    """Return (this rank's contiguous shard of the plateau rule's evaluation rows, standardised and
    clipped; how many evaluation rows all ranks hold): the rows :func:`opt_ds_ops.training.stopping.eval_subset`
    takes from the whole validation split (all of it up to EVAL_ROWS rows, else evenly strided)."""
    stride = eval_stride(len(val_rows))
    picked = np.arange(0, len(val_rows), stride)
    lo, hi = shard(len(picked), group.rank, group.world_size)
    rows = val_rows[picked[lo:hi]] if stride > 1 else val_rows[lo:hi]
    return clip_inputs(standardise(rows, mean, std), cfg.input_clip).to(device), len(picked)


def train_ddp(data: np.ndarray, cfg: TrainConfig, plan: DevicePlan, group: ProcessGroupInfo, *,
              on_epoch: Callable[[EpochStats], None] | None = None) -> TrainResult:
    """Train a TelemetryAutoencoder on data (rows, D) float32 as rank ``group.rank`` of an
    initialised process group; return the same :class:`TrainResult` on every rank (model on the CPU).

    Numerics as :func:`opt_ds_ops.training.fit.train` (module docstring: what is reduced, how batches are
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
    # The plateau rule as one process runs it (fit.py): evaluated every eval_every_steps steps on the
    # same evenly strided rows of the validation split (each rank scores its shard of them; the mean
    # is all-reduced, so every rank decides alike), and offered each epoch's validation loss
    stopper = Stopper(cfg)
    x_eval, n_eval = _eval_shard(val_rows, mean, std, cfg, group, device) if n_val else (None, 0)

    def evaluate() -> bool:
        stop = stopper.update(_mean_error(model, x_eval, n_eval, device) if n_val else None, model)
        net.train()
        return stop

    for epoch in range(cfg.epochs):
        net.train()
        t0 = time.perf_counter()
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch)
        perm = torch.randperm(n, generator=gen)[positions].to(x_train.device)
        mine = torch.index_select(x_train, 0, perm)
        batch_loss.zero_()
        step_skipped.zero_()
        done = len(bounds)  # batches of this epoch run (fewer when the stopping rule ends it)
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
            stopper.step()
            if stopper.due() and evaluate():  # due at max_steps too
                done = b + 1
                break
        dist.all_reduce(batch_loss)  # each batch's mean loss over all its rows
        seconds = time.perf_counter() - t0
        finite = torch.isfinite(batch_loss[:done])
        n_nonfinite, n_skipped = int((~finite).sum()), int(step_skipped[:done].sum())
        if n_nonfinite and not scaler.is_enabled():
            raise TrainingError(f"non-finite loss in epoch {epoch + 1} ({n_nonfinite} of {len(bounds)} batches)")
        if scaler.is_enabled() and n_skipped == len(bounds):  # as fit.py: a whole epoch's steps skipped
            raise TrainingError(
                f"fp16 loss-scale collapse in epoch {epoch + 1}: all {len(bounds)} steps skipped by GradScaler")
        if not all(torch.isfinite(p).all() for p in model.parameters()):
            raise TrainingError(f"non-finite weights after epoch {epoch + 1}")
        _broadcast_buffers(model)
        val_loss = _mean_error(model, x_ref, len(ref_rows), device) if n_val else None
        if n_val and n_eval == n_val:  # the rule's rows: the printed loss may be the best one
            stopper.consider(val_loss, model)
        rows_counted = float(batch_sizes[:done][finite].sum())
        train_loss = float(torch.where(finite, batch_loss[:done] * batch_sizes[:done], 0.0).sum()) / max(rows_counted, 1.0)
        rows_run = bounds[done - 1][1] if done < len(bounds) else n  # a stopped epoch ran its first rows
        stats = EpochStats(epoch + 1, train_loss, val_loss, rows_run / seconds, seconds, n_skipped,
                           steps=stopper.steps)
        skipped_total += n_skipped
        history.append(stats)
        if on_epoch is not None:
            on_epoch(stats)
        if stopper.reason is not None:
            break

    if stopper.pending():  # the epochs cap between two evaluations: the last weights may be the best
        evaluate()
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
