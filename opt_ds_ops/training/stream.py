"""Datasets larger than memory: an ``.npy`` read from disk in chunks, trained on by streaming.

A job whose float32 matrix exceeds its budget (``job.max_matrix_bytes``, by default a quarter of
``job.memory_max``) does not load it. A C-ordered 2-D ``.npy`` of a real dtype becomes an
:class:`NpyRows` instead: rows are read with ``pread`` into buffers of their own, never memory
mapped, so the file's pages stay in the page cache and never count towards the job's RSS or its
``RLIMIT_DATA``. :func:`train_streaming` then trains as :func:`opt_ds_ops.training.fit.train` does, with
the same split, model, optimizer, training step (:mod:`opt_ds_ops.training.step`) and threshold, but:

* column statistics: one pass over the training rows, merging each chunk's float64 mean and sum
  of squared deviations (Chan, Golub and LeVeque, "Algorithms for computing the sample variance",
  1983, the pairwise update);
* shuffling: a block shuffle, as the shuffle buffers of tf.data and WebDataset do: each epoch
  visits the chunks of :data:`opt_ds_ops.dataset.npyrows.CHUNK_BYTES` in a random order, :data:`WINDOW_CHUNKS` at a time,
  and shuffles the rows of each such window (seeded by ``train.seed`` and the epoch, so a run
  repeats exactly); on a GPU each window goes through one pinned host buffer to the device;
* validation: two inference passes over the validation rows (per-feature mean squared error,
  then each row's anomaly score with that scale), then smoothing and threshold as in memory; the
  validation loss of each epoch is one more pass;
* a stop (``should_stop``) is honoured at the end of the current window; the checkpoint resumes
  the run exactly there.

Host memory: one window as read (the file's dtype), its float32 standardised copy and the
shuffled copy, about 3 x ``WINDOW_CHUNKS`` x ``CHUNK_BYTES`` = 192 MiB beside torch itself,
whatever the file's size. The largest dataset tried and the peak RSS it needed are in the README.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ..config.conffile import TrainConfig
from ..dataset.npyrows import NpyRows
from ..fsutil import utc_now
from ..health.device import DevicePlan
from ..model.network import TelemetryAutoencoder, anomaly_scores, feature_errors, smooth
from ..model.scaling import clip_inputs, standardise
from ..model.threshold import pick_threshold
from .common import (
    EpochStats, TrainingError, TrainingInterrupted, TrainResult, batch_bounds, begin_run, checkpoint_dict,
    load_resume, make_optimizer, split_sizes
)
from .step import TrainStep
from .stopping import Stopper

WINDOW_CHUNKS = 4  # chunks shuffled together: the shuffle buffer is CHUNK_BYTES x WINDOW_CHUNKS


def streaming_scaler(source: NpyRows, n_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Return per-column (mean, std) float64 (D,) of rows [0, n_rows) in one pass of chunks.

    Chan et al.'s pairwise merge of each chunk's float64 (count, mean, sum of squared deviations);
    agrees with :func:`opt_ds_ops.model.scaling.fit_scaler` to float64 rounding. A std of 0 becomes 1.
    """
    d = source.shape[1]
    count, mean, m2 = 0, np.zeros(d), np.zeros(d)
    step = source.chunk_rows()
    for start in range(0, n_rows, step):
        block = source.read(start, min(start + step, n_rows)).astype(np.float64)
        nb = block.shape[0]
        mb = block.mean(axis=0)
        block -= mb
        m2b = np.einsum("ij,ij->j", block, block)
        delta = mb - mean
        total = count + nb
        mean = mean + delta * (nb / total)
        m2 = m2 + m2b + delta * delta * (count * nb / total)
        count = total
    std = np.sqrt(m2 / max(count, 1))
    std[std == 0] = 1.0
    return mean, std


def _standardised(source: NpyRows, start: int, stop: int, mean, std, clip: float) -> torch.Tensor:
    """Rows [start, stop) as :func:`opt_ds_ops.model.scaling.standardise` and ``clip_inputs`` make them in memory."""
    return clip_inputs(standardise(source.read(start, stop), mean, std), clip)


def _error_sums(model, source, lo: int, hi: int, mean, std, cfg: TrainConfig, device) -> torch.Tensor:
    """Return each feature's summed squared reconstruction error over rows [lo, hi), (D,) float64
    on ``device``: one inference pass of chunks (the epoch's validation loss and the error scale)."""
    step = source.chunk_rows()
    total = torch.zeros(source.shape[1], dtype=torch.float64, device=device)
    for s in range(lo, hi, step):
        x = _standardised(source, s, min(s + step, hi), mean, std, cfg.input_clip).to(device)
        total += feature_errors(model, x).sum(dim=0, dtype=torch.float64)
    return total


def _scores(model, source, lo: int, hi: int, mean, std, cfg: TrainConfig, device, error_scale) -> np.ndarray:
    """Return the anomaly scores of rows [lo, hi), (hi - lo,) float32, before smoothing."""
    step = source.chunk_rows()
    scores = np.empty(hi - lo, dtype=np.float32)
    for s in range(lo, hi, step):
        e = min(s + step, hi)
        x = _standardised(source, s, e, mean, std, cfg.input_clip).to(device)
        scores[s - lo : e - lo] = anomaly_scores(feature_errors(model, x), error_scale).cpu().numpy()
    return scores


def train_streaming(source: NpyRows, cfg: TrainConfig, plan: DevicePlan, *, on_epoch=None, should_stop=None,
                    resume: dict | None = None, read_gpu=None, offset: np.ndarray | None = None):
    """Train on ``source`` (rows, D) without holding it in memory; return a TrainResult.

    The same contract as :func:`opt_ds_ops.training.fit.train` (``on_epoch``, ``should_stop``/``resume``
    at window granularity, ``read_gpu``, ``offset``: (D,) float64 the rows were centred by, a
    converted text or Parquet file's; it moves only the stored scaler mean); ``result.data_placement`` is ``"streamed"`` and
    ``result.extra["validation_scores"]`` holds the validation rows' scores, (rows_val,) float32.
    Raises TrainingError as train() does; OSError if the file shrinks while it is read.
    """
    started, t_start = begin_run(cfg, plan)
    device = plan.device
    n_all, d = source.shape
    n, n_val = split_sizes(n_all, cfg.val_fraction)
    mean, std = streaming_scaler(source, n)

    model = TelemetryAutoencoder(d, cfg.hidden, cfg.latent).to(device)
    optimizer = make_optimizer(model, cfg, device)
    scaler = torch.amp.GradScaler(device.type, enabled=plan.use_grad_scaler)
    history: list[EpochStats] = []
    start_epoch, start_window = 0, 0
    carried = {"loss_sum": 0.0, "rows": 0, "nonfinite": 0, "skipped": 0, "batches": 0, "seconds": 0.0}
    if resume is not None:
        load_resume(resume, n, model, optimizer, scaler, streamed=True)
        history = [EpochStats(**h) for h in resume["history"]]
        start_epoch, start_window, carried = resume["epoch"], resume["batch"], dict(resume["partial"])
    chunk = source.chunk_rows()
    chunks = [(s, min(s + chunk, n)) for s in range(0, n, chunk)]
    window_rows = chunk * WINDOW_CHUNKS
    pinned = device.type == "cuda"
    shuffled = torch.empty((window_rows, d), dtype=torch.float32, pin_memory=pinned)
    step = TrainStep(model, optimizer, scaler, plan.amp_dtype, device, cfg.batch_size, capture=cfg.cuda_graphs)
    skipped_total = sum(h.skipped_steps for h in history)
    val_sums = None
    # The plateau rule on each epoch's validation loss (a pass over the rows on disk), max_steps per window
    stopper = Stopper(cfg, evaluated="epoch")
    if resume is not None and resume.get("stopping"):
        stopper.load_state_dict(resume["stopping"])

    for epoch in range(start_epoch, cfg.epochs):
        model.train()
        t0 = time.perf_counter()
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch)
        order = torch.randperm(len(chunks), generator=gen).tolist()
        windows = [order[i : i + WINDOW_CHUNKS] for i in range(0, len(order), WINDOW_CHUNKS)]
        # each window's row permutation, drawn in order so that a resumed epoch draws the same ones
        perms = [torch.randperm(sum(chunks[c][1] - chunks[c][0] for c in w), generator=gen) for w in windows]
        sums = dict(carried)
        for w in range(start_window, len(windows)):
            x = torch.cat([_standardised(source, *chunks[c], mean, std, cfg.input_clip) for c in windows[w]])
            m = x.shape[0]
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the last window's non_blocking copies have read `shuffled`
            torch.index_select(x, 0, perms[w], out=shuffled[:m])
            del x
            bounds = batch_bounds(m, cfg.batch_size)
            losses = torch.zeros(len(bounds), device=device)
            skipped = torch.zeros(len(bounds), dtype=torch.bool, device=device)
            for b, (s, e) in enumerate(bounds):
                loss, skip = step(shuffled[s:e].to(device, non_blocking=True))
                losses[b] = loss
                if skip is not None:
                    skipped[b] = skip
            sizes = torch.tensor([e - s for s, e in bounds], dtype=torch.float32, device=device)
            finite = torch.isfinite(losses)
            sums["loss_sum"] += float(torch.where(finite, losses * sizes, 0.0).sum())
            sums["rows"] += int(sizes[finite].sum())
            sums["nonfinite"] += int((~finite).sum())
            sums["skipped"] += int(skipped.sum())
            sums["batches"] += len(bounds)
            stopper.steps += len(bounds)
            if stopper.at_max_steps():
                break
            if should_stop is not None and w + 1 < len(windows) and should_stop():
                partial = dict(sums, seconds=sums["seconds"] + time.perf_counter() - t0)
                raise TrainingInterrupted(dict(checkpoint_dict(model, optimizer, scaler, n, epoch, w + 1, history, partial),
                                               streamed=True, stopping=stopper.state_dict()))
        seconds = sums["seconds"] + time.perf_counter() - t0
        start_window, carried = 0, {k: 0.0 if k in ("loss_sum", "seconds") else 0 for k in carried}
        if sums["nonfinite"] and not scaler.is_enabled():
            raise TrainingError(f"non-finite loss in epoch {epoch + 1} ({sums['nonfinite']} of {sums['batches']} batches)")
        if scaler.is_enabled() and sums["skipped"] == sums["batches"]:
            raise TrainingError(f"fp16 loss-scale collapse in epoch {epoch + 1}: all {sums['batches']} steps skipped by GradScaler")
        if not all(torch.isfinite(p).all() for p in model.parameters()):
            raise TrainingError(f"non-finite weights after epoch {epoch + 1}")
        val_sums = _error_sums(model, source, n, n_all, mean, std, cfg, device) if n_val else None
        val_loss = float(val_sums.sum()) / (n_val * d) if n_val else None
        stats = EpochStats(epoch + 1, sums["loss_sum"] / max(sums["rows"], 1), val_loss, n / seconds, seconds,
                           sums["skipped"], gpu=read_gpu() if read_gpu is not None else None, steps=stopper.steps)
        skipped_total += sums["skipped"]
        history.append(stats)
        if on_epoch is not None:
            on_epoch(stats)
        if stopper.update(val_loss, model) or stopper.reason is not None:
            break

    if stopper.finish(model, device):  # the best epoch's weights: their validation sums, not the last epoch's
        restored, val_sums = True, None
    else:
        restored = False
    # the error scale: the last epoch's validation sums (the model has not changed since), or one
    # pass over the training rows without a validation split
    lo, hi = (n, n_all) if n_val else (0, n)
    sums = val_sums if val_sums is not None else _error_sums(model, source, lo, hi, mean, std, cfg, device)
    error_scale = (sums / max(hi - lo, 1)).float().clamp_min(cfg.error_floor)
    raw = _scores(model, source, lo, hi, mean, std, cfg, device, error_scale)
    scores = smooth(raw, cfg.score_window, cfg.score_smoothing)
    threshold = pick_threshold(scores.astype(np.float32), cfg)
    return TrainResult(
        model=model.cpu().eval(), mean=mean if offset is None else mean + offset, std=std, error_scale=error_scale.cpu().numpy(), threshold=threshold,
        threshold_quantile=cfg.threshold_quantile, score_window=cfg.score_window, history=history, plan=plan,
        rows_train=n, rows_val=n_val, skipped_steps=skipped_total, started_at=started, ended_at=utc_now(),
        duration_s=time.perf_counter() - t_start, data_placement="streamed",
        placement_note=(f"the float32 matrix ({source.nbytes:,} bytes) exceeds the job's budget: streamed from disk "
                        + (f"in chunks of {chunk:,} rows, shuffled {WINDOW_CHUNKS} chunks at a time" if len(chunks) > 1
                           else f"in one chunk of {n:,} rows, shuffled whole")),
        step_mode=step.mode, extra={"validation_scores": scores}, score_smoothing=cfg.score_smoothing,
        input_clip=cfg.input_clip, error_floor=cfg.error_floor, threshold_method=cfg.threshold_method,
        stopping=dict(stopper.summary(restored), split_check="not run on a streamed dataset (it reads the validation "
                      "split once more from disk; in-memory datasets only)"),
        stopping_line=stopper.line(),
        val_loss=float(sums.sum()) / ((hi - lo) * d) if n_val else None,  # the published model's
    )
