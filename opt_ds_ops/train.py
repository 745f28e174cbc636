"""Training: standardise, split, run the mixed-precision loop, pick the reconstruction-error threshold.

The loop follows the nanoGPT / pytorch-examples shape: one code path for every device, autocast
as ``nullcontext()`` or ``torch.autocast(device_type, dtype)``, a GradScaler enabled only for
float16. The whole dataset is one tensor (on the GPU when it fits in free memory, else pinned host
memory copied with ``non_blocking=True``), shuffled with one permutation per epoch and cut into
batches; losses are summed on the device and read once per epoch (no ``.item()`` per batch).

Standardisation is computed in float64 block by block and only its result is float32: a column of
1e8 + N(0, 1) keeps its signal, a memory-mapped dataset is read in place (the training and
validation splits are views, not copies). With a dataset's float64 ``offset`` (see
:class:`opt_ds_ops.dataset.Dataset`) the stored scaler mean is ``offset`` + the mean of the centred
data, exact in float64. Host memory while training: the dataset, its standardised training split
and the epoch's shuffled copy of it; measured (peak RSS, 750,000 x 32 rows, one CPU epoch) 2.4x the
float32 matrix beyond the dataset itself, 2.8x before the split became a view and the std a pass
over blocks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from torch import nn

from .config import TrainConfig
from .device import DevicePlan
from .fsutil import utc_now
from .model import TelemetryAutoencoder, anomaly_scores, feature_errors, smooth, window_rows
from .step import TrainStep
from .stopping import Stopper, eval_subset
from .suspect import column_shift_sd
from .threshold import pick_threshold

# Keep this much GPU memory free beyond the dataset tensors (bytes): activations, optimizer, CUDA context.
GPU_HEADROOM_BYTES = 512 * 1024**2


class TrainingError(RuntimeError):
    """Training could not produce a usable model (non-finite loss, every fp16 step skipped, ...)."""


class CheckpointMismatch(TrainingError):
    """A checkpoint passed as ``resume`` does not fit this dataset and configuration (rows, shapes,
    in memory or streamed, or state_dicts that do not load); the job trains from epoch 1 instead."""


def load_resume(resume: dict, n: int, model, optimizer, scaler, *, streamed: bool) -> None:
    """Given a checkpoint of :func:`_checkpoint`, check it fits ``n`` training rows, the model's
    shape and the streaming decision, and load its state_dicts into model, optimizer and scaler.
    Raises CheckpointMismatch naming what does not fit (nothing is half-loaded that the caller keeps)."""
    if resume.get("rows_train") != n:
        raise CheckpointMismatch(f"the checkpoint has {resume.get('rows_train')} training rows, this run {n}")
    if resume.get("model_args") != model.model_args():
        raise CheckpointMismatch(f"the checkpoint's model is {resume.get('model_args')}, this run's {model.model_args()}")
    if bool(resume.get("streamed")) != streamed:
        raise CheckpointMismatch("the checkpoint was made " + ("in memory" if streamed else "streaming")
                                 + ", this run " + ("streams" if streamed else "holds the data in memory"))
    try:
        model.load_state_dict(resume["model"])
        optimizer.load_state_dict(resume["optimizer"])
        scaler.load_state_dict(resume["grad_scaler"])
    except (KeyError, ValueError, RuntimeError, TypeError) as e:
        raise CheckpointMismatch(f"the checkpoint's state does not load ({type(e).__name__}: "
                                 f"{str(e).splitlines()[0][:200] if str(e) else ''})") from None


class TrainingInterrupted(Exception):
    """Raised when ``should_stop()`` turned true; ``checkpoint`` resumes the job exactly (see
    :func:`train`), or is None (a distributed run, :func:`opt_ds_ops.distributed.train_distributed`,
    keeps none)."""

    def __init__(self, checkpoint: dict | None):
        super().__init__("training interrupted" if checkpoint is None else
                         f"training interrupted at epoch {checkpoint['epoch'] + 1}, batch {checkpoint['batch']}")
        self.checkpoint = checkpoint


@dataclass
class EpochStats:
    """One epoch: mean train and validation MSE (standardised units), throughput (samples/s).

    ``gpu``: the job's GPU read through NVML at the epoch's end (:meth:`opt_ds_ops.gpustats.GpuSampler.read`:
    °C, W, MHz, MiB, %, throttle reasons), None on the CPU."""

    epoch: int
    train_loss: float
    val_loss: float | None
    samples_per_s: float
    seconds: float
    skipped_steps: int = 0
    gpu: dict | None = None

    def as_dict(self) -> dict:
        return dict(self.__dict__)

    def line(self, epochs: int) -> str:
        """One human line: ``epoch 2/5 loss=0.843029 val_loss=1.013831 1,312,349 samples/s``."""
        val = f" val_loss={self.val_loss:.6f}" if self.val_loss is not None else ""
        skipped = f" skipped_steps={self.skipped_steps}" if self.skipped_steps else ""
        return f"epoch {self.epoch}/{epochs} loss={self.train_loss:.6f}{val} {self.samples_per_s:,.0f} samples/s{skipped}"


@dataclass
class TrainResult:
    """A trained model with what scoring needs: scaler, per-feature error scale and threshold.

    ``mean``/``std``: (D,) float64 column statistics of the training split, in the units of the
    file's values (the dataset's offset included; a zero std is 1).
    ``error_scale``: (D,) float32 mean squared validation error per feature, at least
    ``error_floor`` (score normaliser).
    ``threshold``: set by ``threshold_method`` (:func:`opt_ds_ops.threshold.pick_threshold`) from
    the validation rows' anomaly scores, computed exactly as scoring does: inputs clipped to
    +-``input_clip`` (0: not clipped), smoothed over ``score_window`` rows by ``score_smoothing``.
    ``input_window``: rows per model input (:func:`opt_ds_ops.model.window_rows`; the model's
    n_features is D * input_window, ``error_scale`` (D * input_window,)); ``window_error``: which
    rows of the window make a row's score (:func:`opt_ds_ops.model.fold_window`).
    """

    model: TelemetryAutoencoder
    mean: np.ndarray
    std: np.ndarray
    error_scale: np.ndarray
    threshold: float
    threshold_quantile: float
    score_window: int
    history: list[EpochStats]
    plan: DevicePlan
    rows_train: int
    rows_val: int
    skipped_steps: int
    started_at: str
    ended_at: str
    duration_s: float
    data_placement: str = ""
    placement_note: str = ""
    step_mode: str = "eager"
    extra: dict = field(default_factory=dict)
    score_smoothing: str = "ema"
    input_clip: float = 0.0
    error_floor: float = 1e-6
    threshold_method: str = "quantile"
    input_window: int = 1
    window_error: str = "last"
    # issue 21: why and when training stopped (Stopper.summary), the human line, and the split
    # check's figures (opt_ds_ops.suspect: eval-mode train/validation loss, per-column mean shift)
    stopping: dict = field(default_factory=dict)
    stopping_line: str = ""
    split_check: dict = field(default_factory=dict)
    # the published model's validation loss (None: no validation split, or not computed here);
    # history[-1].val_loss is the last epoch's, whose weights a restored best replaced
    val_loss: float | None = None

    @property
    def samples_per_s(self) -> float:
        """Training throughput over all epochs (samples/s, validation excluded)."""
        secs = sum(h.seconds for h in self.history)
        return sum(h.samples_per_s * h.seconds for h in self.history) / secs if secs else 0.0


def split_sizes(n: int, val_fraction: float) -> tuple[int, int]:
    """Return (training rows, validation rows) of n rows: :func:`split_rows`'s sizes, without its
    index arrays (a streamed dataset of 16 M rows would spend 128 MiB on them)."""
    n_val = max(1, round(n * val_fraction)) if val_fraction > 0 else 0
    if n - n_val < 2:
        n_val = 0
    return n - n_val, n_val


def split_rows(n: int, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Return (train_idx, val_idx) int64 arrays: the last round(n * val_fraction) rows validate.

    Telemetry rows are a time series, so the validation split is the most recent stretch (a
    time-ordered holdout, as in forecasting practice) rather than random rows: its scores are
    contiguous, which the trailing-mean threshold needs, and it measures drift honestly. At least
    1 row validates when val_fraction > 0, none if that would leave fewer than 2 training rows
    (BatchNorm1d needs 2).
    """
    n_train, _n_val = split_sizes(n, val_fraction)
    return np.arange(n_train, dtype=np.int64), np.arange(n_train, n, dtype=np.int64)


_BLOCK_BYTES = 8 * 1024**2  # float64 temporaries of fit_scaler and standardise (bytes)


def _blocks(rows: np.ndarray):
    """Yield (start row, a float64 copy of the block) over rows (N, D), blocks of about _BLOCK_BYTES."""
    step = max(1, _BLOCK_BYTES // (8 * max(rows.shape[1], 1)))
    for start in range(0, rows.shape[0], step):
        yield start, np.array(rows[start : start + step], dtype=np.float64)  # a copy: callers modify it


def fit_scaler(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Return per-column (mean, std) of rows (N >= 1, D), any real dtype, as float64 (D,).

    Two passes over float64 blocks (the mean, then the squared deviations from it): no temporary
    the size of rows, and a memmap is read in place. A std of 0 (a constant column) becomes 1, so
    the column passes through centred, not divided by 0.
    """
    total = np.zeros(rows.shape[1], dtype=np.float64)
    for _, block in _blocks(rows):
        total += block.sum(axis=0)
    mean = total / rows.shape[0]
    squares = np.zeros_like(mean)
    for _, block in _blocks(rows):
        block -= mean
        squares += np.einsum("ij,ij->j", block, block)
    std = np.sqrt(squares / rows.shape[0])
    std[std == 0] = 1.0
    return mean, std


def standardise(rows: np.ndarray, mean: np.ndarray, std: np.ndarray) -> torch.Tensor:
    """Return (rows - mean) / std as a new (N, D) float32 CPU tensor (the one copy of rows).

    rows: (N, D) any real dtype (a memmap is read in place); mean, std: (D,). Computed in float64
    block by block, then cast.
    """
    mean, std = np.asarray(mean, dtype=np.float64), np.asarray(std, dtype=np.float64)
    out = np.empty(rows.shape, dtype=np.float32)
    for start, block in _blocks(rows):
        block -= mean
        block /= std
        out[start : start + len(block)] = block
    return torch.from_numpy(out)


def clip_inputs(x: torch.Tensor, clip: float) -> torch.Tensor:
    """Return standardised rows x (N, D) clipped in place to [-clip, clip] (clip 0: unchanged).

    Robust clipping: one value of 1e6 standard deviations neither dominates a training batch nor a
    row's score. ds-ops's default 20 was chosen on five SMD machines (README, detection quality).
    """
    return x.clamp_(-clip, clip) if clip > 0 else x


def threshold_at(scores: torch.Tensor | np.ndarray, quantile: float) -> float:
    """Return the quantile (0..1) of scores, shape (n,) with n >= 1, linearly interpolated as
    torch.quantile does by default.

    Computed by numpy on float64, exactly, for any n: torch.quantile refuses inputs of more than
    2**24 elements, the validation split (10 %) of a dataset of 168 M rows.
    """
    if isinstance(scores, torch.Tensor):
        scores = scores.detach().cpu().double().numpy()
    return float(np.quantile(np.asarray(scores, dtype=np.float64), quantile))


def batch_bounds(n: int, batch_size: int) -> list[tuple[int, int]]:
    """Return [start, end) pairs covering n rows; a last batch of 1 row joins the one before.

    BatchNorm1d raises in training mode on a batch of one row ("Expected more than 1 value per
    channel"), so n = k * batch_size + 1 gives k batches, the last one batch_size + 1 rows.
    """
    bounds = [(s, min(s + batch_size, n)) for s in range(0, n, batch_size)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] == 1:
        bounds[-2] = (bounds[-2][0], n)
        bounds.pop()
    return bounds


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


def begin_run(cfg: TrainConfig, plan: DevicePlan) -> tuple[str, float]:
    """Start a training run: fp32 matmul precision on CUDA (``plan.tf32``), the seed for the
    weights; return (UTC start stamp, ``time.perf_counter()`` at the start, seconds)."""
    if plan.device.type == "cuda":
        torch.set_float32_matmul_precision(plan.matmul_precision)
    torch.manual_seed(cfg.seed)
    return utc_now(), time.perf_counter()


def make_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    """Return AdamW(lr, weight_decay), fused where this torch supports it on the device, else foreach.

    On CUDA it is ``capturable`` (step counter and bias corrections on the GPU, no host sync), so
    :class:`opt_ds_ops.step.TrainStep` can record its update in a CUDA graph; eager and captured
    runs then use the same kernels."""
    capturable = device.type == "cuda"
    try:
        return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True,
                                 capturable=capturable)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=True,
                                 capturable=capturable)


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

    ``data`` may also be an :class:`opt_ds_ops.stream.NpyRows` (a dataset larger than the job's
    memory): it is trained on by :func:`opt_ds_ops.stream.train_streaming`, chunk by chunk.

    ``offset``: (D,) float64 to add to data's values (``Dataset.offset``: data is the file's values
    centred by it); it moves only the stored scaler mean. None: data holds the values as they are.

    ``on_epoch`` is called after every epoch. ``should_stop`` is polled after every batch; when it
    returns True the loop raises :class:`TrainingInterrupted` whose ``checkpoint`` (model,
    optimizer and GradScaler state_dicts, epoch, batch, partial sums) passed back as ``resume``
    continues the same run: the split is fixed and every epoch's permutation derives from ``cfg.seed``.

    ``read_gpu()`` (:meth:`opt_ds_ops.gpustats.GpuSampler.read`) is called at each epoch's end;
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
    if hasattr(data, "read") and not isinstance(data, np.ndarray):  # opt_ds_ops.stream.NpyRows
        from .stream import train_streaming

        if cfg.input_window > 1:
            raise TrainingError(f"train.input_window is {cfg.input_window}: windowed inputs need the dataset in memory, "
                                f"and this one ({data.nbytes:,} bytes as float32) is over the job's budget and streams; "
                                "use input_window: 1 or a larger job.max_matrix_bytes")
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
    w = cfg.input_window  # windowed inputs (issue 10): each split windowed from its own row 0
    x_train, placement, placement_note = _place(
        window_rows(clip_inputs(standardise(train_rows, mean, std), cfg.input_clip), w), device)
    val_bytes = len(val_idx) * data.shape[1] * w * 4
    placed.update(placement=placement, need_bytes=GPU_HEADROOM_BYTES + val_bytes + 2 * min(cfg.batch_size, len(train_idx))
                  * data.shape[1] * w * 4 + (2 * x_train.nbytes if placement == "gpu" else 0))
    x_val = window_rows(clip_inputs(standardise(val_rows, mean, std), cfg.input_clip), w).to(device) if len(val_idx) else None
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
                raise TrainingInterrupted(dict(_checkpoint(model, optimizer, scaler, n, epoch, b + 1, history, partial),
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
        train_loss = sums["loss_sum"] / max(sums["rows_counted"], 1)
        rows_run = bounds[done - 1][1] if done < len(bounds) else n  # a stopped epoch ran its first rows
        stats = EpochStats(epoch + 1, train_loss, val_loss, rows_run / seconds, seconds, n_skipped,
                           gpu=read_gpu() if read_gpu is not None else None)
        skipped_total += n_skipped
        history.append(stats)
        if on_epoch is not None:
            on_epoch(stats)
        if stopper.reason is not None:
            break

    if stopper.pending():  # the epochs cap between two evaluations: the last weights may be the best
        _evaluate(stopper, model, x_eval)
    restored = stopper.finish(model, device)  # the best evaluated weights, the last ones included
    ref = x_val if x_val is not None else x_train
    cell = feature_errors(model, ref)
    error_scale = cell.mean(dim=0).clamp_min(cfg.error_floor)
    scores = smooth(anomaly_scores(cell, error_scale, w, cfg.window_error).cpu().numpy(), cfg.score_window,
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
        rows_train=n,
        rows_val=len(val_idx),
        skipped_steps=skipped_total,
        started_at=started,
        ended_at=utc_now(),
        duration_s=time.perf_counter() - t_start,
        data_placement=placement,
        placement_note=placement_note,
        step_mode=step.mode,
        score_smoothing=cfg.score_smoothing,
        input_clip=cfg.input_clip,
        error_floor=cfg.error_floor,
        threshold_method=cfg.threshold_method,
        input_window=w,
        window_error=cfg.window_error,
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
    """Return the figures :func:`opt_ds_ops.suspect.split_warnings` judges: the final model's
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


def _checkpoint(model, optimizer, scaler, n, epoch, batch, history, partial: dict) -> dict:
    """Return a checkpoint dict of plain tensors and numbers (loads with weights_only=True)."""
    return {
        "model": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "grad_scaler": scaler.state_dict(),
        "model_args": model.model_args(),
        "rows_train": n,
        "epoch": epoch,
        "batch": batch,
        "history": [h.as_dict() for h in history],
        "partial": partial,
    }
