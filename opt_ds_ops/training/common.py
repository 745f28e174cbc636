"""What every trainer shares: its errors, the epoch and result records, the split and batches,
the start of a run, the optimizer and the checkpoint dict.

:func:`opt_ds_ops.training.fit.train` (in memory), :func:`opt_ds_ops.training.stream.train_streaming` (a dataset
larger than memory) and :func:`opt_ds_ops.training.distributed.train_distributed` (one process per GPU)
build on these, so that their models, thresholds and checkpoints agree. Nothing here imports a
trainer: the data flows from the trainers to this module, never back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from ..config.conffile import TrainConfig
from ..fsutil import utc_now
from ..health.device import DevicePlan
from ..model.network import TelemetryAutoencoder
from .records import EpochStats

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


def is_out_of_memory(e: BaseException) -> bool:
    """True for an out-of-memory error: Python's MemoryError, or torch's on the CPU ("can't allocate
    memory", a RuntimeError) or a GPU ("out of memory")."""
    text = str(e)
    return isinstance(e, MemoryError) or "can't allocate memory" in text or "out of memory" in text.lower()


class TrainingInterrupted(Exception):
    """Raised when ``should_stop()`` turned true; ``checkpoint`` resumes the job exactly (see
    :func:`train`), or is None (a distributed run, :func:`opt_ds_ops.training.distributed.train_distributed`,
    keeps none)."""

    def __init__(self, checkpoint: dict | None):
        super().__init__("training interrupted" if checkpoint is None else
                         f"training interrupted at epoch {checkpoint['epoch'] + 1}, batch {checkpoint['batch']}")
        self.checkpoint = checkpoint


@dataclass
class TrainResult:
    """A trained model with what scoring needs: scaler, per-feature error scale and threshold.

    ``mean``/``std``: (D,) float64 column statistics of the training split, in the units of the
    file's values (the dataset's offset included; a zero std is 1).
    ``error_scale``: (D,) float32 mean squared validation error per feature, at least
    ``error_floor`` (score normaliser).
    ``threshold``: set by ``threshold_method`` (:func:`opt_ds_ops.model.threshold.pick_threshold`) from
    the validation rows' anomaly scores, computed exactly as scoring does: inputs clipped to
    +-``input_clip`` (0: not clipped), smoothed over ``score_window`` rows by ``score_smoothing``.
    ``input_window``: rows per model input (:func:`opt_ds_ops.model.network.window_rows`; the model's
    n_features is D * input_window, ``error_scale`` (D * input_window,)); ``window_error``: which
    rows of the window make a row's score (:func:`opt_ds_ops.model.network.fold_window`).
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
    diff: tuple | None = None  # (diff_mean, diff_std) (D,) float64: a model reading differences
    window_error: str = "last"
    # Why and when training stopped (Stopper.summary), the human line, and the split
    # check's figures (opt_ds_ops.training.suspect: eval-mode train/validation loss, per-column mean shift)
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

def begin_run(cfg: TrainConfig, plan: DevicePlan) -> tuple[str, float]:
    """Start a training run: fp32 matmul precision on CUDA (``plan.tf32``), the seed for the
    weights; return (UTC start stamp, ``time.perf_counter()`` at the start, seconds)."""
    if plan.device.type == "cuda":
        torch.set_float32_matmul_precision(plan.matmul_precision)
    torch.manual_seed(cfg.seed)
    return utc_now(), time.perf_counter()


def make_optimizer(model: nn.Module | list[torch.Tensor], cfg: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    """Return AdamW(lr, weight_decay) over model's parameters (or a list of tensors), fused where
    this torch supports it on the device, else foreach.

    On CUDA it is ``capturable`` (step counter and bias corrections on the GPU, no host sync), so
    :class:`opt_ds_ops.training.step.TrainStep` can record its update in a CUDA graph; eager and captured
    runs then use the same kernels."""
    capturable = device.type == "cuda"
    params = list(model.parameters()) if isinstance(model, nn.Module) else list(model)
    try:
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True,
                                 capturable=capturable)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=True,
                                 capturable=capturable)

def checkpoint_dict(model, optimizer, scaler, n, epoch, batch, history, partial: dict) -> dict:
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
