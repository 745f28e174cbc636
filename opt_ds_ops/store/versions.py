"""Model store: ``MODELS_DIR/<name>/<version>/{model.pt,metadata.json}`` and ``<name>/current``.

Writes are atomic (the pattern of Debian's dpkg and of git's object store): everything is written
into a hidden temporary directory in the same file system, each file fsync'ed, the directory
renamed to its version name and the parent fsync'ed; then ``current`` is replaced by renaming a new
symlink over it. A reader, or a SIGKILL at any instant, sees either the previous complete version or
the new complete one, never a partial directory. Hidden ``.tmp-*`` leftovers of a killed writer are
removed by the next save of the same name.

This module saves and loads versions and decides whether a job's new version becomes ``current``
(claim order, the operator's hold, the owner of the name, the promotion gate). A model's directory
itself (names, lock, ``current``, metadata) is :mod:`opt_ds_ops.store.model_dir`; what an operator
changes (``ds-ops models``) is :mod:`opt_ds_ops.store.admin`. Their names are importable from
here too.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
from datetime import datetime, timezone

import numpy as np
import torch

from ..fsutil import fsync_dir, pid_alive
from ..model.network import WINDOW_ERRORS, TelemetryAutoencoder
from ..model.trained import StoredModel
from .admin import (
    DEFAULT_KEEP_VERSIONS, RM_PREFIX, is_pinned, list_models, pin, promote, prune, remove, resolve, rollback,
    version_summary, who
)
from .model_dir import (  # noqa: F401 - some re-exported, as above
    CURRENT, GATED, HELD, METADATA_FILE, MODEL_FILE, OPERATOR_FILE, NameLock, StoreError, current_metadata,
    current_version, dataset_file_of, list_versions,
    name_dir_of, publish, read_metadata, read_operator_action, safe_model_name, write_operator_action,
)

FORMAT_VERSION = 1


def new_version(existing: set[str]) -> str:
    """Return a version name that sorts by time (UTC, microseconds) and is not in existing."""
    base = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
    version, i = base, 1
    while version in existing:
        version, i = f"{base}-{i}", i + 1
    return version


def _write_file(path: str, data: bytes) -> None:
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _clean_leftovers(name_dir: str) -> None:
    """Remove ``.tmp-*`` directories and ``.current-*`` links left by writers that are gone."""
    for entry in os.listdir(name_dir):
        if not (entry.startswith(".tmp-") or entry.startswith(".current-")):
            continue
        pid = entry.rsplit("-", 1)[-1]
        if pid.isdigit() and pid_alive(int(pid)):
            continue
        full = os.path.join(name_dir, entry)
        if os.path.islink(full) or os.path.isfile(full):
            os.unlink(full)
        else:
            shutil.rmtree(full, ignore_errors=True)


def model_payload(result) -> dict:
    """Return the ``model.pt`` dict for a TrainResult: only tensors, numbers, strings (weights_only-safe)."""
    return {
        "format_version": FORMAT_VERSION,
        "model_args": result.model.model_args(),
        "state_dict": {k: v.detach().cpu() for k, v in result.model.state_dict().items()},
        "scaler_mean": torch.from_numpy(np.asarray(result.mean, dtype=np.float64)),
        "scaler_std": torch.from_numpy(np.asarray(result.std, dtype=np.float32)),
        "error_scale": torch.from_numpy(np.asarray(result.error_scale, dtype=np.float32)),
        "threshold": float(result.threshold),
        "threshold_quantile": float(result.threshold_quantile),
        "score_window": int(result.score_window),
        "score_smoothing": str(result.score_smoothing),
        "input_clip": float(result.input_clip),
        "threshold_method": str(result.threshold_method),
        "input_window": int(result.input_window),
        "window_error": str(result.window_error),
        **({"diff_mean": torch.from_numpy(np.asarray(result.diff[0], dtype=np.float32)),
            "diff_std": torch.from_numpy(np.asarray(result.diff[1], dtype=np.float32))}
           if getattr(result, "diff", None) is not None else {}),
    }


def save_model(models_dir: str, name: str, payload: dict, metadata: dict, *, before_publish=None) -> tuple[str, dict]:
    """Atomically write a new version of model name and make it ``current``; return (its
    directory path, the metadata written).

    ``payload`` goes to model.pt (torch.save), ``metadata`` to metadata.json (its ``version`` and
    ``model_dir`` keys are filled in here; a ``job_id`` key lets recovery find the version of a
    job by identity, see :func:`find_job_version`, and orders it by claim: the version becomes
    ``current`` only as :func:`publish_job` allows; the metadata returned, not the file, has
    ``not_current``: None, or why current stayed where it was). ``before_publish(tmp_dir)`` is a test hook
    called after the files are written and before the renames. A failed save removes its
    temporary directory. Raises StoreError if the store cannot be written; its ``errno`` is the
    OS error's (ENOSPC, EROFS, ... say the file system is at fault, not the model).
    """
    name = safe_model_name(name)
    name_dir = os.path.join(models_dir, name)
    tmp = None
    try:
        os.makedirs(name_dir, exist_ok=True)
        _clean_leftovers(name_dir)
        version = new_version(set(os.listdir(name_dir)))
        final = os.path.join(name_dir, version)
        tmp = os.path.join(name_dir, f".tmp-{version}-{os.getpid()}")
        os.mkdir(tmp, 0o755)
        buf = io.BytesIO()
        torch.save(payload, buf)
        _write_file(os.path.join(tmp, MODEL_FILE), buf.getvalue())
        metadata = dict(metadata, name=name, version=version, model_dir=final)
        _write_file(os.path.join(tmp, METADATA_FILE), (json.dumps(metadata, indent=2, sort_keys=True) + "\n").encode())
        fsync_dir(tmp)
        if before_publish is not None:
            before_publish(tmp)
        with NameLock(name_dir):  # the lock ``ds-ops models`` takes: a rollback never interleaves
            os.rename(tmp, final)
            tmp = None
            fsync_dir(name_dir)
            not_current = _publish_in_order(name_dir, version, metadata.get("job_id"))
    except OSError as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        err = StoreError(f"cannot write model under {name_dir}: {e.strerror or e} ({e.filename or name_dir})")
        err.errno = e.errno
        raise err from None
    return final, dict(metadata, not_current=not_current)


def publish_job(name_dir: str, version: str, job_id: str | None) -> str | None:
    """Given a complete version of a model saved by job ``job_id`` (None: ``ds-ops train`` by hand),
    make it ``current`` under the lock ``ds-ops models`` takes, in claim order; return None if
    ``current`` points at it now, else why ``current`` stays where it is. The daemon's recovery
    replays a saved job's publish with it. Raises OSError."""
    with NameLock(name_dir):
        return _publish_in_order(name_dir, version, job_id)


def _publish_in_order(name_dir: str, version: str, job_id: str | None) -> str | None:
    """:func:`publish_job`'s body, under the name lock: a job's version does not become current
    over a version of a later claim (a job claimed later finished first; recovery replays an old
    job), nor over an operator's promote, rollback or rm that came after the job was claimed, nor
    while the operator's decision holds (:func:`operator_hold`)."""
    current = current_version(name_dir)
    if current == version:
        return None
    if job_id is not None:
        parent = _retrained_from(name_dir, version)
        if parent is not None and current != parent and parent not in list_versions(name_dir):
            return (f"the version it retrained, {parent}, is no longer in the store (the model was removed or "
                    "rolled back while it retrained); ds-ops models promote makes it current")
        if current is not None and _order_key(name_dir, current) > job_id:
            return f"current is {current}, of a later claim ({_order_key(name_dir, current)}) than job {job_id}"
        op = read_operator_action(name_dir)
        if op is not None and _compact_time(str(op.get("at", ""))) > job_id:
            return (f"current is {current}, set by {op.get('by')}'s {op.get('action')} at {op.get('at')}, "
                    f"after job {job_id} was claimed")
        taken = _owner_conflict(name_dir, current, version)
        if taken:
            return taken
        held = operator_hold(name_dir, current, op)
        if held:
            return f"{HELD} {held}; ds-ops models promote {os.path.basename(name_dir)} {version} makes it current"
        gated = _gate_refusal(name_dir, version)
        if gated and current is not None:
            return f"{GATED} {gated}; ds-ops models promote {os.path.basename(name_dir)} {version} makes it current"
    publish(name_dir, version)
    return None


def _retrained_from(name_dir: str, version: str) -> str | None:
    """The version a retraining's version was retrained from (``dataset.inherited_from``), or None."""
    try:
        parent = (read_metadata(os.path.join(name_dir, version)).get("dataset") or {}).get("inherited_from")
    except StoreError:
        return None
    return parent if isinstance(parent, str) and parent else None


def _order_key(name_dir: str, version: str) -> str:
    """Return what orders a version among its model's: the job id that saved it (ids sort by claim
    time, :func:`opt_ds_ops.spool.new_job_id`), else its version name (its save time, same format)."""
    try:
        job_id = read_metadata(os.path.join(name_dir, version)).get("job_id")
    except StoreError:
        job_id = None
    return job_id if isinstance(job_id, str) and job_id else version


def _compact_time(iso: str) -> str:
    """``2026-11-30T01:42:42.123456Z`` -> ``20261130T014242.123456Z``, the job ids' time format."""
    return iso.replace("-", "").replace(":", "")


def _owner_conflict(name_dir: str, current: str | None, version: str) -> str | None:
    """Return why ``version`` may not become current over ``current`` because the model name
    belongs to another uid (``uploader_uid`` of current's metadata; docs/trust.md), or None. Checked
    under the name lock, so two first datasets of a new name cannot both take it: the first to
    publish owns it. A version dropped by root or the service user (``uploaded_by_uid``) may."""
    if current is None:
        return None
    try:
        owner = read_metadata(os.path.join(name_dir, current)).get("uploader_uid")
        by = read_metadata(os.path.join(name_dir, version)).get("uploaded_by_uid")
    except StoreError:
        return None
    if not isinstance(owner, int) or not isinstance(by, int) or by in (0, os.geteuid(), owner):
        return None
    return f"the model belongs to uid {owner} (current is {current}); this version's file was dropped by uid {by}"


def operator_hold(name_dir: str, current: str | None, op: dict | None) -> str | None:
    """Return why no new version of a job may become current because an operator decided which
    version is current (docs/retraining.md): ``current`` is pinned (until ``ds-ops models unpin``), or the
    operator's last change was a rollback (until a ``promote`` or ``unpin``); else None."""
    if current is None:
        return None
    try:
        pinned = read_metadata(os.path.join(name_dir, current)).get("pinned")
    except StoreError:
        pinned = None
    if isinstance(pinned, dict):
        return f"current {current} is pinned (by {pinned.get('by')} at {pinned.get('at')}: {pinned.get('why') or '-'})"
    if op is not None and op.get("action") == "rollback":
        return f"current was rolled back to {op.get('version')} (by {op.get('by')} at {op.get('at')}: {op.get('why') or '-'})"
    return None


def _gate_refusal(name_dir: str, version: str) -> str | None:
    """Return the promotion gate's reason when version's metadata says it is not to be promoted
    (``promotion.promote`` false, :mod:`opt_ds_ops.lifecycle.promotion`), else None."""
    try:
        gate = read_metadata(os.path.join(name_dir, version)).get("promotion")
    except StoreError:
        return None
    if isinstance(gate, dict) and gate.get("promote") is False:
        return f"{gate.get('failed') or gate.get('mode')}: {gate.get('reason')}"
    return None


def find_job_version(models_dir: str, name: str, job_id: str) -> dict | None:
    """Return the metadata of the complete version that job ``job_id`` saved for model name, or
    None. Matched by the job id recorded in metadata.json, never by times (a clock step must not
    make a job look unsaved)."""
    try:
        name_dir = os.path.join(models_dir, safe_model_name(name))
    except StoreError:
        return None
    for version in reversed(list_versions(name_dir)):
        try:
            with open(os.path.join(name_dir, version, METADATA_FILE), encoding="utf-8") as f:
                md = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(md, dict) and md.get("job_id") == job_id:
            return md
    return None


def model_path(spec: str, models_dir: str) -> str:
    """Return spec as a model path: spec itself if it exists, else ``models_dir/NAME[/VERSION]``
    when spec is a model name (``ds-ops score machine-1-2 FILE``) that exists there; otherwise
    spec unchanged (load_model then says what is missing)."""
    if os.path.exists(spec) or spec.startswith(("/", ".")):
        return spec
    candidate = os.path.join(models_dir, spec)
    return candidate if os.path.isdir(candidate) else spec


def load_model(path: str) -> StoredModel:
    """Load a model directory (a version dir, a ``current`` link or a ``<name>`` dir) for scoring.

    model.pt is read with ``torch.load(weights_only=True)``: no pickled code runs. Raises
    StoreError if the directory or its files are missing, unreadable or of another format.
    """
    if os.path.isdir(os.path.join(path, CURRENT)):
        path = os.path.join(path, CURRENT)
    model_file = os.path.join(path, MODEL_FILE)
    try:
        payload = torch.load(model_file, map_location="cpu", weights_only=True)
        with open(os.path.join(path, METADATA_FILE), encoding="utf-8") as f:
            metadata = json.load(f)
    except FileNotFoundError as e:
        raise StoreError(f"{path}: not a model directory ({os.path.basename(e.filename)} missing)") from None
    except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as e:
        raise StoreError(f"{path}: cannot read model: {str(e).splitlines()[0]}") from None
    if not isinstance(payload, dict) or payload.get("format_version") != FORMAT_VERSION:
        raise StoreError(f"{model_file}: unknown model format (want format_version {FORMAT_VERSION})")
    smoothing = payload.get("score_smoothing", "mean")  # "mean": models saved before ds-ops stored it
    if smoothing not in ("ema", "mean"):
        raise StoreError(f"{model_file}: unknown score_smoothing {smoothing!r} (this ds-ops knows ema, mean)")
    window, window_error = int(payload.get("input_window", 1)), payload.get("window_error", "last")
    if window_error not in WINDOW_ERRORS or window < 1 or payload["model_args"]["n_features"] % window:
        raise StoreError(f"{model_file}: unknown window_error {window_error!r} or input_window {window} "
                         f"(this ds-ops knows {', '.join(WINDOW_ERRORS)}; the model's input width must be a multiple)")
    diff = None
    if window_error == "max" and "diff_mean" not in payload:
        raise StoreError(f"{model_file}: window_error max is for a model reading differences (no diff_mean, diff_std)")
    if "diff_mean" in payload or "diff_std" in payload:  # a model reading differences beside levels
        d = payload["model_args"]["n_features"] // 2
        diff = (payload.get("diff_mean"), payload.get("diff_std"))
        if (window != 2 or window_error not in ("window", "max") or not all(isinstance(t, torch.Tensor) and tuple(t.shape) == (d,)
                                                                for t in diff)):
            raise StoreError(f"{model_file}: a model reading differences needs input_window 2, window_error "
                             f"window or max and diff_mean, diff_std of its {d} metrics")
    model = TelemetryAutoencoder(**payload["model_args"])
    model.load_state_dict(payload["state_dict"])
    model.eval()
    return StoredModel(
        path=os.path.realpath(path),
        model=model,
        mean=payload["scaler_mean"],
        std=payload["scaler_std"],
        error_scale=payload["error_scale"],
        threshold=float(payload["threshold"]),
        score_window=int(payload["score_window"]),
        metadata=metadata,
        score_smoothing=smoothing,
        input_clip=float(payload.get("input_clip", 0.0)),
        input_window=window,
        window_error=window_error,
        diff=diff,
    )
