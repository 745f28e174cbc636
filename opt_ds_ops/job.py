"""One training job: dataset -> device decision -> training -> model store, with its metadata.

Both ``ds-ops train`` and the daemon run a dataset through :func:`run_job`; the stage that fails
is named in :class:`JobError` so a person knows where to look.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch

from . import __version__
from .config import Config, config_to_dict
from .dataset import Dataset, DatasetError, DatasetLimits, dataset_stem, file_sha256, load_dataset
from .device import DeviceError, DevicePlan, plan_device
from .store import StoreError, model_payload, save_model
from .train import EpochStats, TrainingError, TrainResult, train


class JobError(RuntimeError):
    """A job failed; ``stage`` is one of dataset, health, training, store; the message says why.

    ``errno`` is set when an OS error of the file system caused it (ENOSPC on the store, ...).
    """

    def __init__(self, stage: str, message: str, cause: BaseException | None = None):
        super().__init__(message)
        self.stage = stage
        self.cause_type = type(cause).__name__ if cause is not None else "JobError"
        self.errno = getattr(cause, "errno", None) if isinstance(cause, OSError) else None


@dataclass
class JobResult:
    """What a finished job produced: the model directory, the training result, its metadata."""

    model_dir: str
    result: TrainResult
    dataset: Dataset
    metadata: dict


def build_metadata(ds: Dataset, sha256: str, result: TrainResult, cfg: Config, health: dict | None) -> dict:
    """Return metadata.json's content for a trained model (all JSON types, times in UTC)."""
    return {
        "dataset": {
            "file": os.path.basename(ds.path),
            "size_bytes": ds.size_bytes,
            "sha256": sha256,
            "rows": ds.rows,
            "columns": ds.features,
            "header": ds.header,
            "format": ds.format,
        },
        "rows_train": result.rows_train,
        "rows_val": result.rows_val,
        "epochs": len(result.history),
        "history": [h.as_dict() for h in result.history],
        "final_train_loss": result.history[-1].train_loss if result.history else None,
        "final_val_loss": result.history[-1].val_loss if result.history else None,
        "samples_per_s": result.samples_per_s,
        "threshold": result.threshold,
        "threshold_quantile": result.threshold_quantile,
        "score_window": result.score_window,
        "score_smoothing": result.score_smoothing,
        "input_clip": result.input_clip,
        "error_floor": result.error_floor,
        "threshold_method": result.threshold_method,
        "device": str(result.plan.device),
        "amp_dtype": result.plan.amp_name,
        "data_placement": result.data_placement,
        "skipped_steps": result.skipped_steps,
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "ds_ops_version": __version__,
        "started_at": result.started_at,
        "ended_at": result.ended_at,
        "duration_s": result.duration_s,
        "config": config_to_dict(cfg),
        "health": health,
    }


def run_job(
    path: str,
    cfg: Config,
    *,
    name: str | None = None,
    plan: DevicePlan | None = None,
    health: dict | None = None,
    on_epoch: Callable[[EpochStats], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    resume: dict | None = None,
    job_id: str | None = None,
    source_name: str | None = None,
    sha256: str | None = None,
    on_stage: Callable[[str], None] | None = None,
) -> JobResult:
    """Train on the dataset at path and save the model under ``cfg.models_dir``; return a JobResult.

    ``plan`` is the device decision (default: ``cfg.device``/``cfg.amp`` as configured);
    ``health`` is the health report the job ran under, stored in metadata.json. ``on_epoch``,
    ``should_stop`` and ``resume`` are passed to :func:`opt_ds_ops.train.train` (TrainingInterrupted
    propagates unchanged). The daemon passes ``job_id`` (stored in metadata.json, how recovery
    finds the job's version), ``source_name`` (the file name the user dropped; ``path`` is the
    daemon's copy) and ``sha256`` (hashed while copying); ``on_stage(stage)`` is called as each
    stage (dataset, training, store) begins. Raises JobError naming the failed stage; nothing is
    written to the store unless training succeeded.
    """
    stage = on_stage or (lambda _s: None)
    stage("dataset")
    try:
        ds = load_dataset(path, DatasetLimits.from_config(cfg.job))
        sha = sha256 or file_sha256(path)
    except DatasetError as e:
        raise JobError("dataset", str(e), e) from e
    try:
        plan = plan or plan_device(cfg.device, cfg.amp)
    except DeviceError as e:
        raise JobError("health", str(e), e) from e
    stage("training")
    try:
        result = train(ds.data, cfg.train, plan, on_epoch=on_epoch, should_stop=should_stop, resume=resume, offset=ds.offset)
    except TrainingError as e:
        raise JobError("training", f"{path}: {e}", e) from e
    metadata = build_metadata(ds, sha, result, cfg, health)
    metadata["job_id"] = job_id
    if source_name:
        metadata["dataset"]["file"] = source_name
    stage("store")
    try:
        model_dir, metadata = save_model(cfg.models_dir, name or dataset_stem(path), model_payload(result), metadata)
    except StoreError as e:
        err = JobError("store", str(e), e)
        err.errno = e.errno
        raise err from e
    return JobResult(model_dir=model_dir, result=result, dataset=ds, metadata=metadata)
