"""Training: standardise, split, run the mixed-precision loop, pick the reconstruction-error threshold.

The loop follows the nanoGPT / pytorch-examples shape: one code path for every device, autocast
as ``nullcontext()`` or ``torch.autocast(device_type, dtype)``, a GradScaler enabled only for
float16. The whole dataset is one tensor (on the GPU when it fits in free memory, else pinned host
memory copied with ``non_blocking=True``), shuffled with one permutation per epoch and cut into
batches; losses are summed on the device and read once per epoch (no ``.item()`` per batch).

Standardisation (:mod:`opt_ds_ops.model.scaling`) is computed in float64 block by block and only its result is float32: a column of
1e8 + N(0, 1) keeps its signal, a memory-mapped dataset is read in place (the training and
validation splits are views, not copies). With a dataset's float64 ``offset`` (see
:class:`opt_ds_ops.dataset.Dataset`) the stored scaler mean is ``offset`` + the mean of the centred
data, exact in float64. Host memory while training: the dataset, its standardised training split
and the epoch's shuffled copy of it; measured (peak RSS, 750,000 x 32 rows, one CPU epoch) 2.4x the
float32 matrix beyond the dataset itself, 2.8x before the split became a view and the std a pass
over blocks. What the streamed and distributed trainers share with this loop (errors, records,
split, batches, optimizer, checkpoint) is in :mod:`opt_ds_ops.training.common`.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch

from ..config.conffile import TrainConfig
from ..config.sizes import GPU_HEADROOM_BYTES
from ..fsutil import utc_now
from ..health.device import DevicePlan
from ..model.network import (TelemetryAutoencoder, anomaly_scores, difference_scaler, feature_errors, model_inputs,
                             smooth)
from ..model.scaling import clip_inputs, fit_scaler, standardise
from ..model.threshold import pick_threshold
from .common import (
    EpochStats, TrainingError, TrainingInterrupted, TrainResult, batch_bounds, begin_run, checkpoint_dict,
    load_resume, make_optimizer, split_rows
)
from .common import CheckpointMismatch  # noqa: F401 - re-exported: job.py and the tests catch it here
from .step import TrainStep
from .stopping import Stopper, eval_subset
from .stream import train_streaming
from .suspect import column_shift_sd


def threshold_at(scores: torch.Tensor | np.ndarray, quantile: float) -> float:
    """Return the quantile (0..1) of scores, shape (n,) with n >= 1, linearly interpolated as
    torch.quantile does by default.

    Computed by numpy on float64, exactly, for any n: torch.quantile refuses inputs of more than
    2**24 elements, the validation split (10 %) of a dataset of 168 M rows.
    """
    if isinstance(scores, torch.Tensor):
        scores = scores.detach().cpu().double().numpy()
    return float(np.quantile(np.asarray(scores, dtype=np.float64), quantile))


def _place(x: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, str, str]:
    """Put the dataset tensor on the GPU if it fits in free memory, else in pinned host memory;
    return (tensor, placement, note). A CUDA out-of-memory error on the copy (another process took
    the memory after ``mem_get_info``) retries in pinned host memory and ``note`` says so."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        if 2 * x.nbytes + GPU_HEADROOM_BYTES < free:
            try:
                return x.to(device), "gpu", ""
            except torch.OutOfMemoryError as e:
                torch.cuda.empty_cache()
                note = (f"CUDA out of memory placing the dataset ({_mib(x.nbytes)} MiB) on {device} "
                        f"({_first_line(e)}); retried with the dataset in pinned host memory")
                return x.pin_memory(), "pinned-host", note
        return x.pin_memory(), "pinned-host", ""
    if device.type == "cpu":
        return x, "host", ""
    return x.to(device), str(device.type), ""


def _mib(nbytes: int) -> int:
    return -(-int(nbytes) // 1024**2)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def out_of_memory_reason(device: torch.device, placement: str, need_bytes: int, e: BaseException) -> str:
    """Return the reason a job failed with CUDA out of memory: free and needed MiB on ``device``
    (``torch.cuda.mem_get_info`` now) and torch's own words. ``need_bytes`` is ds-ops's estimate
    for the placement it ran with: GPU_HEADROOM_BYTES (model, optimizer, activations, CUDA context)
    + the float32 validation split + two batches, + twice the training split (it and the epoch's
    shuffled copy) when the dataset is on the GPU."""
    try:
        free = f"{torch.cuda.mem_get_info(device)[0] // 1024**2} MiB free"
    except Exception:  # noqa: BLE001 - the reason must be given even when CUDA no longer answers
        free = "free memory unknown"
    where = ("even with the dataset in pinned host memory" if placement == "pinned-host"
             else "with the dataset on the GPU")
    return (f"CUDA out of memory on {device} {where}: {free}, the job needs about {_mib(need_bytes)} MiB "
            f"({_first_line(e)}); another process may hold the GPU's memory (nvidia-smi lists them)")


def train(
    data: np.ndarray,
    cfg: TrainConfig,
    plan: DevicePlan,
    *,
    on_epoch: Callable[[EpochStats], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    resume: dict | None = None,
    offset: np.ndarray | None = None,
    read_gpu: Callable[[], dict] | None = None,
) -> TrainResult:
    """Train a TelemetryAutoencoder on data (rows, D), any real dtype; return a :class:`TrainResult`.

    ``data`` may also be an :class:`opt_ds_ops.dataset.npyrows.NpyRows` (a dataset larger than the job's
    memory): it is trained on by :func:`opt_ds_ops.training.stream.train_streaming`, chunk by chunk.

    ``offset``: (D,) float64 to add to data's values (``Dataset.offset``: data is the file's values
    centred by it); it moves only the stored scaler mean. None: data holds the values as they are.

    ``on_epoch`` is called after every epoch. ``should_stop`` is polled after every batch; when it
    returns True the loop raises :class:`TrainingInterrupted` whose ``checkpoint`` (model,
    optimizer and GradScaler state_dicts, epoch, batch, partial sums) passed back as ``resume``
    continues the same run: the split is fixed and every epoch's permutation derives from ``cfg.seed``.

    ``read_gpu()`` (:meth:`opt_ds_ops.health.gpustats.GpuSampler.read`) is called at each epoch's end;
    its reading is the epoch's ``gpu``. On CUDA, fp32 matmuls follow ``plan.tf32``
    (``torch.set_float32_matmul_precision``). The dataset goes to the GPU when it fits, else to
    pinned host memory (``data_placement``; a CUDA out-of-memory error on that copy retries in
    pinned host memory, ``placement_note`` says so).

    Raises TrainingError on a non-finite loss or weights (naming the epoch), when every step
    of an epoch was skipped by the fp16 GradScaler (loss-scale collapse), or on CUDA out of
    memory that the pinned-host placement did not cure (naming free and needed MiB); ValueError
    if offset is not of shape (D,).
    """
    if offset is not None and np.shape(offset) != (data.shape[1],):
        raise ValueError(f"offset has shape {np.shape(offset)}, data has {data.shape[1]} columns")
    if cfg.input_differences and cfg.input_window != 1:
        raise TrainingError(f"train.input_differences reads each row beside the one before it; it needs "
                            f"train.input_window 1, not {cfg.input_window}")
    if hasattr(data, "read") and not isinstance(data, np.ndarray):  # opt_ds_ops.dataset.npyrows.NpyRows
        if cfg.input_window > 1 or cfg.input_differences:
            what = (f"train.input_window is {cfg.input_window}: windowed inputs" if cfg.input_window > 1
                    else "train.input_differences is true: inputs of differences")
            raise TrainingError(f"{what} need the dataset in memory, "
                                f"and this one ({data.nbytes:,} bytes as float32) is over the job's budget and streams; "
                                "use input_window: 1 and input_differences: false, or a larger job.max_matrix_bytes")
        return train_streaming(data, cfg, plan, on_epoch=on_epoch, should_stop=should_stop, resume=resume,
                               read_gpu=read_gpu, offset=offset)
    placed = {"placement": "", "need_bytes": 0}
    try:
        return _train(data, cfg, plan, on_epoch, should_stop, resume, offset, read_gpu, placed)
    except torch.OutOfMemoryError as e:
        raise TrainingError(out_of_memory_reason(plan.device, placed["placement"], placed["need_bytes"], e)) from None


def _train(data, cfg, plan, on_epoch, should_stop, resume, offset, read_gpu, placed: dict) -> TrainResult:
    """:func:`train`'s body; ``placed`` receives the placement and the GPU bytes it needs (for the OOM reason)."""
    started, t_start = begin_run(cfg, plan)
    device = plan.device
    train_idx, val_idx = split_rows(data.shape[0], cfg.val_fraction)
    train_rows, val_rows = data[: len(train_idx)], data[len(train_idx) :]  # contiguous: views, no copies
    mean, std = fit_scaler(train_rows)
    w, _ = input_form(cfg)  # windowed inputs: each split windowed from its own row 0
    z_train = clip_inputs(standardise(train_rows, mean, std), cfg.input_clip)
    diff = difference_inputs(z_train, cfg)
    x_train, placement, placement_note = _place(model_inputs(z_train, w, diff=diff, clip=cfg.input_clip), device)
    del z_train
    val_bytes = len(val_idx) * data.shape[1] * w * 4
    placed.update(placement=placement, need_bytes=GPU_HEADROOM_BYTES + val_bytes + 2 * min(cfg.batch_size, len(train_idx))
                  * data.shape[1] * w * 4 + (2 * x_train.nbytes if placement == "gpu" else 0))
    x_val = (model_inputs(clip_inputs(standardise(val_rows, mean, std), cfg.input_clip), w, diff=diff,
                          clip=cfg.input_clip).to(device) if len(val_idx) else None)
    n = x_train.shape[0]

    model = TelemetryAutoencoder(data.shape[1] * w, cfg.hidden, cfg.latent).to(device)
    optimizer = make_optimizer(model, cfg, device)
    scaler = torch.amp.GradScaler(device.type, enabled=plan.use_grad_scaler)
    bounds = batch_bounds(n, cfg.batch_size)
    history: list[EpochStats] = []
    start_epoch, start_batch = 0, 0
    carried = _NOTHING_CARRIED
    if resume is not None:
        load_resume(resume, n, model, optimizer, scaler, streamed=False)
        history = [EpochStats(**h) for h in resume["history"]]
        start_epoch, start_batch = resume["epoch"], resume["batch"]
        carried = resume["partial"]
    # the epoch's shuffled copy; pinned like x_train when that stays on the host, so that the
    # per-batch non_blocking copies to the GPU are asynchronous (empty_like would not pin it)
    buf = torch.empty(x_train.shape, dtype=x_train.dtype, device=x_train.device, pin_memory=placement == "pinned-host")
    sizes = torch.tensor([e - s for s, e in bounds], dtype=torch.float32, device=device)
    batch_loss = torch.zeros(len(bounds), device=device)  # each batch's mean loss, read once an epoch
    step_skipped = torch.zeros(len(bounds), dtype=torch.bool, device=device)
    skipped_total = sum(h.skipped_steps for h in history)
    step = TrainStep(model, optimizer, scaler, plan.amp_dtype, device, cfg.batch_size, capture=cfg.cuda_graphs)
    stopper, x_eval = Stopper(cfg), eval_subset(x_val)
    if resume is not None:
        stopper.load_state_dict(resume.get("stopping") or {"steps": start_epoch * len(bounds) + start_batch})

    for epoch in range(start_epoch, cfg.epochs):
        model.train()
        t0 = time.perf_counter()
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch)
        perm = torch.randperm(n, generator=gen).to(x_train.device)
        torch.index_select(x_train, 0, perm, out=buf)
        batch_loss.zero_()
        step_skipped.zero_()
        done = len(bounds)  # batches of this epoch run (fewer when the stopping rule ends it)
        for b in range(start_batch, len(bounds)):
            s, e = bounds[b]
            loss, skipped = step(buf[s:e].to(device, non_blocking=True))
            if skipped is not None:
                step_skipped[b] = skipped
            batch_loss[b] = loss
            stopper.step()
            if stopper.due() and _evaluate(stopper, model, x_eval):  # due at max_steps too
                done = b + 1
                break
            if should_stop is not None and b + 1 < len(bounds) and should_stop():
                partial = _sums(batch_loss, step_skipped, sizes, start_batch, b + 1, carried,
                                carried["seconds"] + time.perf_counter() - t0)
                raise TrainingInterrupted(dict(checkpoint_dict(model, optimizer, scaler, n, epoch, b + 1, history, partial),
                                               stopping=stopper.state_dict()))
        sums = _sums(batch_loss, step_skipped, sizes, start_batch, done, carried,
                     carried["seconds"] + time.perf_counter() - t0)
        start_batch, carried = 0, _NOTHING_CARRIED
        seconds, n_nonfinite, n_skipped = sums["seconds"], sums["nonfinite"], sums["skipped"]
        if n_nonfinite and not scaler.is_enabled():
            raise TrainingError(f"non-finite loss in epoch {epoch + 1} ({n_nonfinite} of {len(bounds)} batches)")
        if scaler.is_enabled() and n_skipped == len(bounds):
            raise TrainingError(
                f"fp16 loss-scale collapse in epoch {epoch + 1}: all {len(bounds)} steps skipped by GradScaler"
            )
        if not all(torch.isfinite(p).all() for p in model.parameters()):
            raise TrainingError(f"non-finite weights after epoch {epoch + 1}")
        val_loss = float(feature_errors(model, x_val).mean()) if x_val is not None else None
        if x_eval is x_val:  # the same rows as the rule's evaluations: the printed loss may be the best one
            stopper.consider(val_loss, model)
        train_loss = sums["loss_sum"] / max(sums["rows_counted"], 1)
        rows_run = bounds[done - 1][1] if done < len(bounds) else n  # a stopped epoch ran its first rows
        stats = EpochStats(epoch + 1, train_loss, val_loss, rows_run / seconds, seconds, n_skipped,
                           gpu=read_gpu() if read_gpu is not None else None, steps=stopper.steps)
        skipped_total += n_skipped
        history.append(stats)
        if on_epoch is not None:
            on_epoch(stats)
        if stopper.reason is not None:
            break

    if stopper.pending():  # the epochs cap between two evaluations: the last weights may be the best
        _evaluate(stopper, model, x_eval)
    restored = stopper.finish(model, device)  # the best evaluated weights, the last ones included
    return finish_result(model, cfg, plan, stopper, restored, x_train, x_val, val_rows, mean, std, offset,
                         history=history, skipped_total=skipped_total, started=started, t_start=t_start,
                         placement=placement, placement_note=placement_note, step_mode=step.mode, diff=diff)


def input_form(cfg: TrainConfig) -> tuple[int, str]:
    """Return (rows per model input, how a window's terms make a row's score) of the model cfg trains:
    ``(input_window, window_error)``, or for one reading differences (its input is the change and
    the level of each metric, :func:`opt_ds_ops.model.network.with_differences`) ``(2, "window")``,
    a row's term per metric the mean of the two, or ``(2, "max")``, the larger, by
    ``difference_term``."""
    if cfg.input_differences:
        return 2, ("max" if cfg.difference_term == "max" else "window")
    return cfg.input_window, cfg.window_error


def difference_inputs(z_train: torch.Tensor, cfg: TrainConfig):
    """Return a model's ``(diff_mean, diff_std)`` (D,) float32 tensors, the scaler of its difference
    inputs fit on the standardised, clipped training rows z_train, or None when cfg reads levels alone."""
    if not cfg.input_differences:
        return None
    mean, std = difference_scaler(z_train, cfg.input_clip)
    return (torch.from_numpy(mean.astype(np.float32)), torch.from_numpy(std.astype(np.float32)))


def finish_result(model, cfg: TrainConfig, plan: DevicePlan, stopper: Stopper, restored: bool, x_train, x_val,
                  val_rows, mean, std, offset, *, history: list[EpochStats], skipped_total: int, started: str,
                  t_start: float, placement: str, placement_note: str, step_mode: str, diff=None) -> TrainResult:
    """Return the :class:`TrainResult` of a finished run whose best weights are in ``model`` (on
    ``plan.device``): the per-feature error scale and the threshold from the validation rows (the
    training rows without a validation split), scored exactly as scoring does. Shared by the
    in-memory loop and :mod:`opt_ds_ops.training.stacked`, so that a model trained in a stack is
    published as one trained alone. ``diff``: the difference inputs' scaler (:func:`difference_inputs`)."""
    w, how = input_form(cfg)
    ref = x_val if x_val is not None else x_train
    cell = feature_errors(model, ref)
    error_scale = cell.mean(dim=0).clamp_min(cfg.error_floor)
    scores = smooth(anomaly_scores(cell, error_scale, w, how).cpu().numpy(), cfg.score_window,
                    cfg.score_smoothing)
    threshold = pick_threshold(scores.astype(np.float32), cfg)
    model = model.cpu().eval()
    return TrainResult(
        model=model,
        mean=mean + offset if offset is not None else mean,
        std=std,
        error_scale=error_scale.cpu().numpy(),
        threshold=threshold,
        threshold_quantile=cfg.threshold_quantile,
        score_window=cfg.score_window,
        history=history,
        plan=plan,
        rows_train=x_train.shape[0],
        rows_val=len(val_rows),
        skipped_steps=skipped_total,
        started_at=started,
        ended_at=utc_now(),
        duration_s=time.perf_counter() - t_start,
        data_placement=placement,
        placement_note=placement_note,
        step_mode=step_mode,
        score_smoothing=cfg.score_smoothing,
        input_clip=cfg.input_clip,
        error_floor=cfg.error_floor,
        threshold_method=cfg.threshold_method,
        input_window=w,
        window_error=how,
        diff=None if diff is None else tuple(t.numpy() for t in diff),
        stopping=stopper.summary(restored),
        stopping_line=stopper.line(),
        val_loss=float(cell.mean()) if x_val is not None else None,
        split_check=split_check(model, x_train, cell, mean, std, val_rows),
    )


def _evaluate(stopper: Stopper, model, x_eval) -> bool:
    """Evaluate the plateau rule on x_eval (None: no validation split); back to train mode; True: stop."""
    stop = stopper.update(float(feature_errors(model, x_eval).mean()) if x_eval is not None else None, model)
    model.train()
    return stop


def split_check(model, x_train: torch.Tensor, val_cell: torch.Tensor, mean, std, val_rows) -> dict:
    """Return the figures :func:`opt_ds_ops.training.suspect.split_warnings` judges: the final model's
    eval-mode loss on (at most EVAL_ROWS of) the training rows and on the validation rows, and each
    column's validation-mean shift in training standard deviations ({} without a validation split)."""
    if len(val_rows) == 0:
        return {}
    return {"train_loss": float(feature_errors(model, eval_subset(x_train).to(val_cell.device)).mean()),
            "val_loss": float(val_cell.mean()),
            "shift_sd": column_shift_sd(mean, std, val_rows).tolist()}


_NOTHING_CARRIED = {"loss_sum": 0.0, "rows_counted": 0, "nonfinite": 0, "skipped": 0, "seconds": 0.0}


def _sums(batch_loss, step_skipped, sizes, lo: int, hi: int, carried: dict, seconds: float) -> dict:
    """Return an epoch's sums over batches lo..hi-1 plus what a resumed run carried in (one sync).

    ``loss_sum``: sum over rows of the per-row loss in batches with a finite loss; ``rows_counted``:
    their rows; ``nonfinite``: batches with a non-finite loss; ``skipped``: steps GradScaler skipped.
    """
    losses, rows = batch_loss[lo:hi], sizes[lo:hi]
    finite = torch.isfinite(losses)
    return {
        "loss_sum": carried["loss_sum"] + float(torch.where(finite, losses * rows, 0.0).sum()),
        "rows_counted": carried["rows_counted"] + int(rows[finite].sum()),
        "nonfinite": carried["nonfinite"] + int((~finite).sum()),
        "skipped": carried["skipped"] + int(step_skipped[lo:hi].sum()),
        "seconds": seconds,
    }
