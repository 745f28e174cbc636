"""One training job: dataset -> device decision -> training -> model store, with its metadata.

Both ``ds-ops train`` and the daemon run a dataset through :func:`run_job`; the stage that fails
is named in :class:`JobError` so a person knows where to look.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import resource
import shutil
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .. import __version__
from ..config.conffile import Config, ConfigError, DatasetConfig, config_to_dict
from ..config.sizes import data_segment_bytes
from ..config.sidecar import SIDECAR_MAX_BYTES, SIDECAR_SUFFIXES, parse_sidecar
from ..dataset import Dataset, DatasetError, DatasetLimits, SpillError, dataset_stem, file_sha256, load_dataset
from ..fsutil import pid_alive, read_small, user_name
from ..health.device import DeviceError, DevicePlan, plan_device
from ..health.gpustats import sampler_for
from ..lifecycle.promotion import promotion_record
from ..lifecycle.retrain_data import exclude_flagged
from ..store.versions import (
    StoreError, current_metadata, dataset_file_of, model_payload, safe_model_name, save_model
)
from .fit import CheckpointMismatch, EpochStats, TrainingError, TrainingInterrupted, TrainResult, train
from .records import columns_note  # noqa: F401 - re-exported: ds-ops train imports it here
from .report import try_write_report, validation_summary
from .suspect import split_warnings


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
    report_warning: str | None = None  # why report.png was not drawn (None: it was)


def _check_store_writable(models_dir: str) -> None:
    """Check with access(2) that models_dir (or, where it does not exist yet, the directory it would
    be made in) is writable by this process, so that a store the user cannot write fails
    the job before training rather than after; nothing is created. Raises JobError (stage store,
    ``errno`` EROFS on a read-only file system, which the daemon treats as the store's fault and
    pauses for, else EACCES) naming the directory and who may write it."""
    path = os.path.abspath(models_dir)
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    if os.access(path, os.W_OK | os.X_OK):
        return
    try:
        read_only = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    code = errno.EROFS if read_only else errno.EACCES
    hint = "" if read_only else " (the service's store: train as root or user ds-ops, or pass --models-dir DIR)"
    err = JobError("store", f"cannot write models under {models_dir}: {os.strerror(code)}{hint}")
    err.errno = code
    raise err


def find_sidecar(dataset_path: str) -> str | None:
    """Return the sidecar beside a dataset (``NAME.yaml`` or ``NAME.yml`` for ``NAME.csv.gz``), or None."""
    base = os.path.join(os.path.dirname(dataset_path), dataset_stem(dataset_path))
    for suffix in SIDECAR_SUFFIXES:
        if os.path.isfile(base + suffix):
            return base + suffix
    return None


def read_sidecar(path: str, base: DatasetConfig, label: str | None = None) -> tuple[DatasetConfig, str | None]:
    """Return (dataset options, model name or None) from the sidecar at path over ``base`` (the
    conffile's ``dataset:``); see :func:`opt_ds_ops.config.sidecar.parse_sidecar`. ``label`` names it in
    messages (default: path). Raises JobError(stage ``dataset``) for an unreadable or invalid
    sidecar; it is read without following a link or blocking on a FIFO, 64 KiB at most."""
    where = label or path
    try:
        text = read_small(path, SIDECAR_MAX_BYTES)
        return parse_sidecar(text, where, base)
    except OSError as e:
        raise JobError("dataset", f"sidecar {where}: cannot read it: {e.strerror or e}", e) from None
    except ConfigError as e:
        raise JobError("dataset", f"sidecar {e}", e) from None


def check_model_name(models_dir: str, name: str, source: str, explicit: bool, uploader_uid: int | None = None) -> None:
    """Raise JobError(stage ``dataset``) if a name made from the file name ``source`` (not
    ``explicit``) would take over a model trained from a different file whose name cleans up to
    the same model name (``gpu nöde 1.csv`` and ``gpu_nüde_1.csv`` both give ``gpu_n_de_1``).

    ``uploader_uid`` (a daemon job: the owner of the dropped file) must also own the model: a
    model name belongs to the uid whose dataset first trained it (metadata.json's
    ``uploader_uid``), so no other member of group ds-ops can publish a new ``current`` for it,
    by file name or by a sidecar's ``name:``. Root and the service's own uid (``ds-ops
    requeue``, an operator) may train any model."""
    if uploader_uid is not None and uploader_uid not in (0, os.geteuid()):
        md = current_metadata(models_dir, name) or {}
        first = md.get("uploader_uid")
        if isinstance(first, int) and first != uploader_uid:
            raise JobError(
                "dataset",
                f"{source}: model {safe_model_name(name)!r} belongs to {user_name(first)}, who first trained it; this "
                f"file was dropped by {user_name(uploader_uid)}. Choose another model name (rename the file, or a sidecar "
                f"{dataset_stem(source)}.yaml with name: ...), or ask an operator (root) to train it",
            )
    if explicit:
        return
    owner = dataset_file_of(models_dir, name)
    if owner is not None and dataset_stem(owner) != dataset_stem(source):
        raise JobError(
            "dataset",
            f"{source}: its model name {safe_model_name(name)!r} is already the model of another dataset, "
            f"{owner!r}; a name made from a file name never takes over another file's model. Rename the file, "
            f"or set the model name in a sidecar {dataset_stem(source)}.yaml (name: ...) or with --name",
        )


def named_metrics(ds: Dataset, options: DatasetConfig) -> list[str] | None:
    """Return the names of ds's features, stored with the model: the file's header names, else
    ``dataset.metric_names`` (the conffile's or a sidecar's), else None. Raises DatasetError if
    ``metric_names`` is used and its count differs from the features'."""
    if ds.header is not None:
        return [str(h) for h in ds.header]
    if not options.metric_names:
        return None
    if len(options.metric_names) != ds.features:
        raise DatasetError(f"{ds.path}: dataset.metric_names gives {len(options.metric_names)} names for "
                           f"{ds.features} feature columns")
    return [str(n).strip() for n in options.metric_names]


def build_metadata(ds: Dataset, sha256: str, result: TrainResult, cfg: Config, health: dict | None,
                   options: DatasetConfig | None = None) -> dict:
    """Return metadata.json's content for a trained model (all JSON types, times in UTC).

    ``dataset.header`` names the feature columns (None without names), ``dataset.time`` is the
    time index's summary (:meth:`opt_ds_ops.dataset.TimeIndex.summary`), ``dataset.left_out`` the
    columns that are not features, ``dataset.options`` the column options the file was read with
    (``ds-ops score`` reads new data the same way). ``history`` holds each epoch's GPU reading
    (``gpu``, None on the CPU); ``tf32`` and ``float32_matmul_precision`` say how fp32 matmuls ran
    on CUDA (None off CUDA); ``data_placement_note`` says why the dataset went to pinned host memory
    after a CUDA out-of-memory error ("" otherwise).
    """
    return {
        "dataset": {
            "file": os.path.basename(ds.path),
            "size_bytes": ds.size_bytes,
            "sha256": sha256,
            "rows": ds.rows,
            "columns": ds.features,
            "header": ds.header,
            "format": ds.format,
            "time": ds.time.summary() if ds.time is not None else None,
            "left_out": ds.left_out,
            "feature_columns": [c + 1 for c in ds.feature_columns] if ds.feature_columns is not None else None,
            "notes": ds.notes,
            "options": dataclasses.asdict(options or cfg.dataset),
        },
        "rows_train": result.rows_train,
        "rows_val": result.rows_val,
        "epochs": len(result.history),
        "stopping": result.stopping,  # the rule, why training stopped and after how many steps
        "warnings": split_warnings(result.split_check, cfg.train.suspect_loss_ratio, cfg.train.suspect_shift_sd,
                                   ds.header, ds.feature_columns),
        "history": [h.as_dict() for h in result.history],
        "final_train_loss": result.history[-1].train_loss if result.history else None,
        # the published model's validation loss (a restored best's, not the last epoch's: that is
        # history[-1].val_loss, and last_epoch_val_loss)
        "final_val_loss": result.val_loss if result.val_loss is not None else (
            result.history[-1].val_loss if result.history else None),
        "last_epoch_val_loss": result.history[-1].val_loss if result.history else None,
        "samples_per_s": result.samples_per_s,
        "threshold": result.threshold,
        "threshold_quantile": result.threshold_quantile,
        "score_window": result.score_window,
        "score_smoothing": result.score_smoothing,
        "input_clip": result.input_clip,
        "input_window": result.input_window,
        "window_error": result.window_error,
        "input_differences": result.diff is not None,
        "error_floor": result.error_floor,
        "threshold_method": result.threshold_method,
        "device": str(result.plan.device),
        "amp_dtype": result.plan.amp_name,
        "data_placement": result.data_placement,
        "data_placement_note": result.placement_note,
        "step_mode": result.step_mode,
        "tf32": result.plan.tf32 if result.plan.device.type == "cuda" else None,
        "float32_matmul_precision": result.plan.matmul_precision if result.plan.device.type == "cuda" else None,
        "skipped_steps": result.skipped_steps,
        "torch_version": str(torch.__version__),  # not a TorchVersion: the daemon, without torch, unpickles it
        "cuda_version": torch.version.cuda,
        "ds_ops_version": __version__,
        "started_at": result.started_at,
        "ended_at": result.ended_at,
        "duration_s": result.duration_s,
        "config": config_to_dict(cfg),
        "health": health,
    }


SCRATCH_PREFIX = ".convert-"  # models_dir/.convert-PID: where `ds-ops train` converts a dataset over its budget


def scratch_dir_for(models_dir: str) -> str:
    """Return ``models_dir/.convert-PID`` for this process (not created: a dataset over the matrix
    budget creates it when its rows spill; :func:`run_job` removes it), after removing those of
    processes that no longer run (a ``ds-ops train`` that was killed while converting). The store
    skips names that start with a dot."""
    try:
        names = os.listdir(models_dir)
    except OSError:
        names = []
    for entry in names:
        pid = entry[len(SCRATCH_PREFIX):]
        if entry.startswith(SCRATCH_PREFIX) and pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            shutil.rmtree(os.path.join(models_dir, entry), ignore_errors=True)
    return os.path.join(models_dir, f"{SCRATCH_PREFIX}{os.getpid()}")


@contextlib.contextmanager
def _scratch(models_dir: str, given: str | None):
    """Yield the directory a dataset over its budget is converted in: ``given``, or this process's
    :func:`scratch_dir_for`, removed on the way out."""
    if given is not None:
        yield given
        return
    own = scratch_dir_for(models_dir)
    try:
        yield own
    finally:
        shutil.rmtree(own, ignore_errors=True)


def checkpoint_fit(ds: Dataset, options: DatasetConfig, sha256: str) -> dict:
    """Return what a checkpoint of training on ds depends on, in plain values (it is saved with
    the checkpoint and loads with ``weights_only``): the file's sha256, the dataset options, the
    rows, the feature columns (names and file positions), and whether the data streams and in
    what chunks (``job.memory_max`` and ``job.max_matrix_bytes`` decide that)."""
    streamed = not isinstance(ds.data, np.ndarray)
    return {
        "sha256": sha256,
        "options": {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(options).items()},
        "rows": ds.rows,
        "features": ds.features,
        "header": list(ds.header) if ds.header is not None else None,
        "feature_columns": list(ds.feature_columns) if ds.feature_columns is not None else None,
        "streamed": streamed,
        "chunk_rows": ds.data.chunk_rows() if hasattr(ds.data, "chunk_rows") else None,
    }


_FIT_WHAT = {"sha256": "the dataset's content", "options": "the dataset options (dataset:, a sidecar)",
             "rows": "the row count", "features": "the feature count", "header": "the feature columns' names",
             "feature_columns": "the feature columns", "streamed": "whether the data streams (job.memory_max, "
             "job.max_matrix_bytes)", "chunk_rows": "the streamed chunk size"}


def _misfit(resume: dict, fit: dict, nproc: int) -> str | None:
    """Return why checkpoint resume does not fit this run (``fit``: :func:`checkpoint_fit`), or None."""
    if nproc > 1:
        return f"the job now trains on {nproc} processes (daemon.distributed_min_bytes), which keep no checkpoint"
    saved = resume.get("fit")
    if not isinstance(saved, dict):  # made before ds-ops recorded it: train() checks the shapes
        return None
    changed = [key for key in fit if saved.get(key) != fit[key]]
    if changed:
        return "the checkpoint does not fit: " + ", ".join(_FIT_WHAT[k] for k in changed) + " changed since it was made"
    return None


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
    options: DatasetConfig | None = None,
    explicit_name: bool = False,
    nproc: int = 1,
    scratch_dir: str | None = None,
    distributed_optional: bool = False,
    uploader_uid: int | None = None,
    on_resume_dropped: Callable[[str], None] | None = None,
    extra_metadata: dict | None = None,
    held_back_path: str | None = None,
    history_path: str | None = None,
) -> JobResult:
    """Train on the dataset at path and save the model under ``cfg.models_dir``; return a JobResult.

    ``plan`` is the device decision (default: ``cfg.device``/``cfg.amp`` as configured);
    ``health`` is the health report the job ran under, stored in metadata.json. ``on_epoch``,
    ``should_stop`` and ``resume`` are passed to :func:`opt_ds_ops.training.fit.train` (TrainingInterrupted
    propagates unchanged). The daemon passes ``job_id`` (stored in metadata.json, how recovery
    finds the job's version), ``source_name`` (the file name the user dropped; ``path`` is the
    daemon's copy) and ``sha256`` (hashed while copying); ``on_stage(stage)`` is called as each
    stage (dataset, training, store) begins. ``options`` say which columns are features (default:
    the conffile's ``dataset:``; a sidecar's, see :func:`read_sidecar`); ``explicit_name``: ``name``
    was set by a person (sidecar or ``--name``), not made from the file name, so it may take over
    another file's model (:func:`check_model_name`). ``nproc`` > 1 trains with that many processes
    under torchrun (:func:`opt_ds_ops.training.distributed.train_distributed`; ``should_stop`` ends the
    ranks and raises TrainingInterrupted without a checkpoint, ``resume`` is not used;
    metadata.json's ``distributed`` says world size and backend). ``distributed_optional`` (the
    daemon's ``daemon.distributed_min_bytes``): where a distributed run cannot take the dataset (it
    streams, ``train.input_window`` > 1 or ``train.input_differences``) it trains in one process and
    the dataset's notes say why, instead of failing; a run that still streams or is distributed reads
    levels alone (:func:`_levels_alone_where_needed`). ``uploader_uid``: the owner of the file a daemon job was dropped as
    (:func:`check_model_name`). A text, Parquet or Arrow
    dataset whose matrix is over the job's budget is converted into a float32 ``.npy`` in
    ``scratch_dir`` (the daemon: the job's own directory; default :func:`scratch_dir_for`, removed
    here at the end) and streamed (:mod:`opt_ds_ops.dataset.core`); a distributed run's copy of the
    matrix for its ranks goes there too; a failure to write it is a
    JobError of stage dataset carrying its errno (ENOSPC: the daemon pauses, the dataset stays).
    A checkpoint (``resume``) records what it depends on (:func:`checkpoint_fit`, added to
    TrainingInterrupted's checkpoint here); one that does not fit the dataset as loaded now (the
    conffile's ``dataset:``, ``job.memory_max`` or ``job.max_matrix_bytes`` changed, or it does not
    load) is dropped: ``on_resume_dropped(why)`` is called and training starts at epoch 1.
    ``extra_metadata`` is merged into metadata.json (a retraining job's ``retrain`` and
    ``excluded``; its ``reads_as`` replaces the keys of ``dataset`` that say how data is read); a sidecar's ``exclude_flagged`` cuts the dataset to the rows the model's current
    version does not flag (:func:`opt_ds_ops.lifecycle.retrain_data.exclude_flagged`, ``excluded``).
    ``held_back_path``: a ``.npy`` of rows the promotion gate judges on instead of the dataset's
    validation split (a retraining job's newest history rows, :func:`opt_ds_ops.daemon.retrainer.job_dataset`);
    ``history_path``: a retraining job's copy of the series' scoring history, from which the gate
    computes the challenger's seeded alarm budget (:func:`opt_ds_ops.lifecycle.promotion.seeded_threshold`).
    When ``health`` names the GPU the gate chose,
    each epoch carries its NVML reading (:mod:`opt_ds_ops.health.gpustats`; a failing NVML never fails the
    job). Raises JobError naming the failed stage;
    nothing is written to the store unless training succeeded.
    """
    stage = on_stage or (lambda _s: None)
    stage("dataset")
    with _scratch(cfg.models_dir, scratch_dir) as scratch_dir:
        prep = prepare_job(path, cfg, name=name, plan=plan, source_name=source_name, sha256=sha256, options=options,
                           explicit_name=explicit_name, scratch_dir=scratch_dir, uploader_uid=uploader_uid,
                           job_id=job_id)
        ds = prep.ds
        if nproc > 1 and distributed_optional and (not isinstance(ds.data, np.ndarray) or cfg.train.input_window > 1
                                                   or cfg.train.input_differences):
            why = ("it streams from disk (over the job's matrix budget)" if not isinstance(ds.data, np.ndarray)
                   else f"train.input_window is {cfg.train.input_window}" if cfg.train.input_window > 1
                   else "train.input_differences is true")
            ds.notes.append(f"trained in one process, not {nproc} (daemon.distributed_min_bytes): {why}")
            nproc = 1
        cfg = _levels_alone_where_needed(cfg, ds, nproc, prep.max_matrix_bytes)
        stage("training")
        fit = checkpoint_fit(ds, prep.options, prep.sha)
        dropped = on_resume_dropped or (lambda _why: None)
        if resume is not None and (why := _misfit(resume, fit, nproc)):
            dropped(why)
            resume = None
        sampler = sampler_for(health)  # per-epoch NVML readings of the GPU the gate chose; None off CUDA
        try:
            if nproc > 1:
                from .distributed import train_distributed  # torch.distributed only where it is used

                result = train_distributed(ds.data, cfg.train, prep.plan, nproc, offset=ds.offset, on_epoch=on_epoch,
                                           should_stop=should_stop, work_dir=scratch_dir)
            else:
                read_gpu = sampler.read if sampler is not None else None
                try:
                    result = train(ds.data, cfg.train, prep.plan, on_epoch=on_epoch, should_stop=should_stop,
                                   resume=resume, offset=ds.offset, read_gpu=read_gpu)
                except CheckpointMismatch as e:  # once, from scratch: a checkpoint never fails a dataset
                    dropped(f"the checkpoint does not fit: {e}")
                    result = train(ds.data, cfg.train, prep.plan, on_epoch=on_epoch, should_stop=should_stop,
                                   offset=ds.offset, read_gpu=read_gpu)
        except TrainingInterrupted as ti:
            if ti.checkpoint is not None:
                ti.checkpoint["fit"] = fit
            raise
        except TrainingError as e:
            raise JobError("training", f"{path}: {e}", e) from e
        finally:
            if sampler is not None:
                sampler.close()
        return store_job(prep, result, cfg, health=health, job_id=job_id, source_name=source_name,
                         explicit_name=explicit_name, uploader_uid=uploader_uid, extra_metadata=extra_metadata,
                         held_back_path=held_back_path, history_path=history_path, distributed=nproc > 1,
                         on_stage=stage)


# Training reads a matrix of differences beside the levels: measured on 500,000 x 38 rows, one epoch,
# the job's peak grew by 4.4 times the matrix with them and 1.6 times with levels alone. A dataset
# over this share of the job's matrix budget (job.max_matrix_bytes) reads levels alone, so the
# budget's quarter of job.memory_max still holds training's peak.
DIFFERENCES_MATRIX_SHARE = 0.5


def _levels_alone_where_needed(cfg: Config, ds: Dataset, nproc: int, max_matrix_bytes: int = 0) -> Config:
    """Return cfg, or cfg with ``train.input_differences`` false where this training cannot read
    differences (a dataset that streams from disk, over the job's matrix budget, or a distributed
    run: both read single rows; or a matrix over :data:`DIFFERENCES_MATRIX_SHARE` of the budget
    ``max_matrix_bytes``, whose differences would not fit beside it), with a dataset note saying
    why. The version's reading contract then says levels alone (metadata.json's
    ``input_differences``), and it scores as one trained so."""
    if not cfg.train.input_differences:
        return cfg
    in_memory = isinstance(ds.data, np.ndarray)
    too_big = in_memory and max_matrix_bytes > 0 and ds.data.nbytes > DIFFERENCES_MATRIX_SHARE * max_matrix_bytes
    if nproc <= 1 and in_memory and not too_big:
        return cfg
    why = (f"a distributed run ({nproc} processes) trains on single rows" if nproc > 1
           else "it streams from disk (over the job's matrix budget), and differences need the rows in memory"
           if not in_memory
           else f"its matrix ({ds.data.nbytes:,} bytes) is over half of the job's matrix budget "
                f"(job.max_matrix_bytes, {max_matrix_bytes:,} bytes), and differences need about twice the memory to train")
    ds.notes.append(f"reads each metric's level alone, not its change beside it (train.input_differences): {why}")
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, input_differences=False))


@dataclass
class PreparedJob:
    """A job's dataset read and checked, before training (:func:`prepare_job`): what
    :func:`store_job` needs besides the training result."""

    path: str  # the file read (the daemon's copy)
    model_name: str
    options: DatasetConfig
    ds: Dataset
    sha: str
    names: list[str] | None  # the features' names (:func:`named_metrics`)
    excluded: dict | None  # a sidecar's exclude_flagged: what was cut
    held_rows: object  # the rows the promotion gate judges on instead of the validation split, or None
    plan: DevicePlan
    max_matrix_bytes: int = 0  # the job's matrix budget the dataset was loaded under (0: not known)


def prepare_job(path: str, cfg: Config, *, name: str | None = None, plan: DevicePlan | None = None,
                source_name: str | None = None, sha256: str | None = None, options: DatasetConfig | None = None,
                explicit_name: bool = False, scratch_dir: str, uploader_uid: int | None = None,
                job_id: str | None = None) -> PreparedJob:
    """:func:`run_job`'s dataset stage: the model name's checks, the store's, the dataset read (a
    matrix over the budget converted into ``scratch_dir``), its sidecar's incidents and
    ``exclude_flagged``, and the device plan. Raises JobError (stage dataset, store or health)."""
    options = options or cfg.dataset
    model_name = name or dataset_stem(source_name or path)
    try:
        check_model_name(cfg.models_dir, safe_model_name(model_name), source_name or os.path.basename(path),
                         explicit_name, uploader_uid)
    except StoreError as e:
        raise JobError("dataset", f"{source_name or path}: {e}", e) from e
    _check_store_writable(cfg.models_dir)  # before spending the training, not after
    try:
        limits = DatasetLimits.from_config(cfg.job, cfg.spool.max_dataset_bytes, stream_large_npy=True,
                                           spill_dir=scratch_dir, base_bytes=data_segment_bytes(),
                                           refuse_constant=True)
        ds = load_dataset(path, limits, options)
        past = [r for r in options.incidents if r[1] > ds.rows]  # checked before training, not at the gate
        if past:
            raise DatasetError(f"{source_name or path}: the sidecar's incidents {list(past[0])} are past the dataset's "
                               f"{ds.rows} data rows (rows are 1-based, in the order the dataset holds them)")
        excluded, held_rows = (exclude_flagged(ds, cfg.models_dir, model_name, cfg.retrain.exclude_margin,
                                               cfg.retrain.exclude_max_rows, hold_back=job_id is not None)
                               if options.exclude_flagged else (None, None))  # the gate runs for daemon jobs only
        names = named_metrics(ds, options)
        sha = sha256 or file_sha256(path)
    except (DatasetError, SpillError, ValueError) as e:
        raise JobError("dataset", str(e), e) from e
    try:
        plan = plan or plan_device(cfg.device, cfg.amp, tf32=cfg.tf32)
    except DeviceError as e:
        raise JobError("health", str(e), e) from e
    return PreparedJob(path=path, model_name=model_name, options=options, ds=ds, sha=sha, names=names,
                       excluded=excluded, held_rows=held_rows, plan=plan, max_matrix_bytes=limits.max_matrix_bytes)


def store_job(prep: PreparedJob, result: TrainResult, cfg: Config, *, health: dict | None = None,
              job_id: str | None = None, source_name: str | None = None, explicit_name: bool = False,
              uploader_uid: int | None = None, extra_metadata: dict | None = None, held_back_path: str | None = None,
              history_path: str | None = None, distributed: bool = False,
              on_stage: Callable[[str], None] | None = None) -> JobResult:
    """:func:`run_job`'s end: metadata.json (with the promotion gate's verdict for a daemon job),
    then the model saved under ``cfg.models_dir`` (stage store); return the JobResult.
    ``distributed``: ``result`` came from several processes (metadata.json's ``distributed``)."""
    ds, model_name = prep.ds, prep.model_name
    metadata = build_metadata(ds, prep.sha, result, cfg, health, prep.options)
    metadata["job_id"] = job_id
    extra = dict(extra_metadata or {})
    reads_as = extra.pop("reads_as", None)
    metadata.update(extra, excluded=extra.get("excluded", prep.excluded))
    if reads_as:  # a retraining reads and scores the model's data as the version it retrains does
        metadata["dataset"].update(reads_as)
    metadata["metric_names"] = prep.names  # alerts, results and score name the metrics
    # the job process's peak resident memory so far (bytes; getrusage's ru_maxrss is in KiB on Linux)
    metadata["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    metadata["name_explicit"] = explicit_name
    # the model name's owner (check_model_name): the first uploader's uid, kept by every later version
    first = (current_metadata(cfg.models_dir, model_name) or {}).get("uploader_uid")
    exempt = uploader_uid in (None, 0, os.geteuid())  # root, the service (requeue), by hand: owns nothing
    metadata["uploader_uid"] = first if isinstance(first, int) else (None if exempt else uploader_uid)
    metadata["uploaded_by_uid"] = uploader_uid  # who dropped this version's file (None: ds-ops train)
    metadata["distributed"] = result.extra if distributed else None
    if source_name:
        metadata["dataset"]["file"] = source_name
    # The validation scores' histogram for report.png (warning-only, like the report)
    try:
        metadata["validation_scores"] = validation_summary(result, ds.data, ds.offset, cfg.train.val_fraction)
    except Exception as e:  # noqa: BLE001 - a picture's data never fails a trained job
        metadata["validation_scores"] = None
        metadata["validation_scores_error"] = f"{type(e).__name__}: {e}"
    if job_id is not None:  # a daemon job's version becomes current only past the gate
        metadata["promotion"] = promotion_record(cfg, result, metadata, model_name, ds, prep.path, prep.held_rows,
                                                 held_back_path, prep.options.incidents, history_path)
    (on_stage or (lambda _s: None))("store")
    # report.png is drawn into the version's hidden temporary directory, so it is
    # published with the version by the same rename (a kill leaves no partial picture behind); a
    # failure is a warning, never the job's
    report_warnings: list[str | None] = []
    try:
        model_dir, metadata = save_model(cfg.models_dir, model_name, model_payload(result), metadata,
                                         before_publish=lambda tmp: report_warnings.append(try_write_report(tmp)))
    except StoreError as e:
        err = JobError("store", str(e), e)
        err.errno = e.errno
        raise err from e
    report_warning = report_warnings[0] if report_warnings else None
    metadata = dict(metadata, report_warning=report_warning)  # the caller's copy only, not metadata.json
    return JobResult(model_dir=model_dir, result=result, dataset=ds, metadata=metadata,
                     report_warning=report_warning)
