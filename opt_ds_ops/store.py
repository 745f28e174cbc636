"""Model store: ``MODELS_DIR/<name>/<version>/{model.pt,metadata.json}`` and ``<name>/current``.

Writes are atomic (the pattern of Debian's dpkg and of git's object store): everything is written
into a hidden temporary directory in the same file system, each file fsync'ed, the directory
renamed to its version name and the parent fsync'ed; then ``current`` is replaced by renaming a new
symlink over it. A reader, or a SIGKILL at any instant, sees either the previous complete version or
the new complete one, never a partial directory. Hidden ``.tmp-*`` leftovers of a killed writer are
removed by the next save of the same name.
"""

from __future__ import annotations

import fcntl
import io
import json
import os
import pickle
import pwd
import re
import shutil
from dataclasses import dataclass
from datetime import datetime, timezone

import numpy as np
import torch

from .fsutil import fsync_dir, pid_alive, utc_now, write_atomic
from .model import WINDOW_ERRORS, TelemetryAutoencoder

MODEL_FILE = "model.pt"
METADATA_FILE = "metadata.json"
CURRENT = "current"
OPERATOR_FILE = ".operator.json"  # the operator's last change of current, read by publish_job
FORMAT_VERSION = 1
_NAME_OK = re.compile(r"[^A-Za-z0-9._+-]")


class StoreError(RuntimeError):
    """The model store could not be written or a stored model could not be read.

    ``errno`` is the OS error number when a file system error caused it, else None.
    """

    errno: int | None = None


@dataclass
class StoredModel:
    """A model loaded back from the store, ready to score.

    ``mean``: (D,) float64 tensor (float32 in models saved before ds-ops kept the exact mean of
    columns far from zero); ``std``, ``error_scale``: (D,) float32 tensors; ``threshold``: anomaly-score threshold
    for scores smoothed over ``score_window`` rows by ``score_smoothing`` (``ema`` or ``mean``) of
    inputs clipped to +-``input_clip`` standard deviations (0: none). Models saved before issue 10
    lack the last two and load with their score then: a trailing mean, no clipping.
    ``input_window``: rows per model input (the model's n_features is D * input_window and
    ``error_scale`` is (D * input_window,)); ``window_error``: ``last`` or ``window``, which of
    the window's rows make the score (:func:`opt_ds_ops.model.fold_window`). Models saved
    before windowed inputs load as 1 and ``last``: one row per input, as they were trained.
    """

    path: str
    model: TelemetryAutoencoder
    mean: torch.Tensor
    std: torch.Tensor
    error_scale: torch.Tensor
    threshold: float
    score_window: int
    metadata: dict
    score_smoothing: str = "mean"
    input_clip: float = 0.0
    input_window: int = 1
    window_error: str = "last"

    @property
    def n_features(self) -> int:
        """D: the columns of one data row (the model's input width over ``input_window``)."""
        return self.model.n_features // self.input_window


def safe_model_name(name: str) -> str:
    """Return name made safe as one directory name: only ``[A-Za-z0-9._+-]``, no leading dot or dash.

    Raises StoreError if nothing usable is left (an empty name).
    """
    cleaned = _NAME_OK.sub("_", name).lstrip(".-")
    if not cleaned:
        raise StoreError(f"model name {name!r} has no usable characters")
    return cleaned[:200]


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
        with _NameLock(name_dir):  # the lock ``ds-ops models`` takes: a rollback never interleaves
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


def publish(name_dir: str, version: str) -> None:
    """Point ``name_dir/current`` at version: a new symlink renamed over the old one, then the
    directory fsync'ed. Idempotent, so crash recovery replays it. Raises OSError."""
    link_tmp = os.path.join(name_dir, f".current-{os.getpid()}")
    if os.path.lexists(link_tmp):
        os.unlink(link_tmp)
    os.symlink(version, link_tmp)
    os.replace(link_tmp, os.path.join(name_dir, CURRENT))
    fsync_dir(name_dir)


def current_metadata(models_dir: str, name: str) -> dict | None:
    """Return the metadata.json of model name's ``current`` version, or None if there is no such
    model or it cannot be read."""
    try:
        with open(os.path.join(models_dir, safe_model_name(name), CURRENT, METADATA_FILE), encoding="utf-8") as f:
            md = json.load(f)
    except (OSError, ValueError, StoreError):
        return None
    return md if isinstance(md, dict) else None


def publish_job(name_dir: str, version: str, job_id: str | None) -> str | None:
    """Given a complete version of a model saved by job ``job_id`` (None: ``ds-ops train`` by hand),
    make it ``current`` under the lock ``ds-ops models`` takes, in claim order; return None if
    ``current`` points at it now, else why ``current`` stays where it is. The daemon's recovery
    replays a saved job's publish with it. Raises OSError."""
    with _NameLock(name_dir):
        return _publish_in_order(name_dir, version, job_id)


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


def _publish_in_order(name_dir: str, version: str, job_id: str | None) -> str | None:
    """:func:`publish_job`'s body, under the name lock: a job's version does not become current
    over a version of a later claim (a job claimed later finished first; recovery replays an old
    job), nor over an operator's promote, rollback or rm that came after the job was claimed, nor
    while the operator's decision holds (:func:`operator_hold`)."""
    current = current_version(name_dir)
    if current == version:
        return None
    if job_id is not None:
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


HELD = "held by the operator's decision:"  # how a not_current reason of a hold begins (the daemon's model-held)


GATED = "not promoted by the gate:"  # a not_current reason of store.promote (the daemon's model-not-promoted)


def _gate_refusal(name_dir: str, version: str) -> str | None:
    """Return the promotion gate's reason when version's metadata says it is not to be promoted
    (``promotion.promote`` false, :mod:`opt_ds_ops.promotion`), else None."""
    try:
        gate = read_metadata(os.path.join(name_dir, version)).get("promotion")
    except StoreError:
        return None
    if isinstance(gate, dict) and gate.get("promote") is False:
        return f"{gate.get('failed') or gate.get('mode')}: {gate.get('reason')}"
    return None


def operator_hold(name_dir: str, current: str | None, op: dict | None) -> str | None:
    """Return why no new version of a job may become current because an operator decided which
    version is current (issue 20): ``current`` is pinned (until ``ds-ops models unpin``), or the
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


def _owner_conflict(name_dir: str, current: str | None, version: str) -> str | None:
    """Return why ``version`` may not become current over ``current`` because the model name
    belongs to another uid (``uploader_uid`` of current's metadata; issue 18), or None. Checked
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


def read_operator_action(name_dir: str) -> dict | None:
    """Return the last change of ``current`` an operator made (``ds-ops models promote``,
    ``rollback``, ``rm``): ``{action, by, at, version, previous}`` from ``name_dir/.operator.json``,
    or None if there is none or it cannot be read."""
    try:
        with open(os.path.join(name_dir, OPERATOR_FILE), encoding="utf-8") as f:
            op = json.load(f)
    except (OSError, ValueError):
        return None
    return op if isinstance(op, dict) else None


def _write_operator_action(name_dir: str, entry: dict) -> None:
    """Write entry as ``name_dir/.operator.json`` (mode 0644: the daemon reads what root wrote),
    atomically, under the name lock. Raises OSError."""
    write_atomic(os.path.join(name_dir, OPERATOR_FILE), (json.dumps(entry, sort_keys=True) + "\n").encode("utf-8"))


def dataset_file_of(models_dir: str, name: str) -> str | None:
    """Return the dataset file name the ``current`` version of model name was trained on (its
    metadata's ``dataset.file``), or None if there is no such model or it cannot be read."""
    try:
        return (current_metadata(models_dir, name) or {})["dataset"]["file"]
    except (KeyError, TypeError):
        return None


def current_version(name_dir: str) -> str | None:
    """Return the version ``current`` points at, or None if there is no ``current`` link."""
    try:
        return os.readlink(os.path.join(name_dir, CURRENT))
    except OSError:
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


def list_versions(name_dir: str) -> list[str]:
    """Return the complete versions of one model name, oldest first (hidden entries excluded)."""
    try:
        entries = os.listdir(name_dir)
    except FileNotFoundError:
        return []
    return sorted(e for e in entries if not e.startswith(".") and e != CURRENT and os.path.isdir(os.path.join(name_dir, e)))


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
    smoothing = payload.get("score_smoothing", "mean")  # "mean": the score of models saved before issue 10
    if smoothing not in ("ema", "mean"):
        raise StoreError(f"{model_file}: unknown score_smoothing {smoothing!r} (this ds-ops knows ema, mean)")
    window, window_error = int(payload.get("input_window", 1)), payload.get("window_error", "last")
    if window_error not in WINDOW_ERRORS or window < 1 or payload["model_args"]["n_features"] % window:
        raise StoreError(f"{model_file}: unknown window_error {window_error!r} or input_window {window} "
                         f"(this ds-ops knows {', '.join(WINDOW_ERRORS)}; the model's input width must be a multiple)")
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
    )


# ---- model versions an operator controls (ds-ops models) -------------------------------------
# Every change below is one atomic rename (metadata.json rewritten through a temporary file; a
# version removed by renaming it to a hidden ``.rm-<version>-<pid>`` first, then deleting that),
# under an exclusive flock on the model's directory, so two changes never interleave and a SIGKILL
# at any instant leaves every version either complete or hidden (a leftover ``.rm-*`` is deleted
# by the next change of the same name).

RM_PREFIX = ".rm-"
DEFAULT_KEEP_VERSIONS = 10


def name_dir_of(models_dir: str, name: str) -> str:
    """Return ``models_dir/<name>`` for an existing model name. Raises StoreError if it is absent."""
    path = os.path.join(models_dir, safe_model_name(name))
    if not os.path.isdir(path):
        raise StoreError(f"no model named {name!r} under {models_dir}")
    return path


class _NameLock:
    """Exclusive ``flock`` on a model's directory (blocking); released when the fd closes, so a
    killed holder never leaves it held. A directory fd needs only read access, so the daemon's
    user and root share it without a lock file of either's ownership."""

    def __init__(self, name_dir: str):
        self.name_dir = name_dir
        self.fd = -1

    def __enter__(self):
        self.fd = os.open(self.name_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        os.close(self.fd)


def who() -> str:
    """Return who runs this process, for the metadata: the user name, ``root (sudo by alice)``."""
    try:
        user = pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        user = str(os.getuid())
    sudo = os.environ.get("SUDO_USER")
    return f"{user} (sudo by {sudo})" if sudo and sudo != user else user


def read_metadata(version_dir: str) -> dict:
    """Return a version's metadata.json. Raises StoreError if it is missing or not JSON."""
    try:
        with open(os.path.join(version_dir, METADATA_FILE), encoding="utf-8") as f:
            md = json.load(f)
    except FileNotFoundError:
        raise StoreError(f"{version_dir}: not a model version ({METADATA_FILE} missing)") from None
    except (OSError, ValueError) as e:
        raise StoreError(f"{version_dir}: cannot read {METADATA_FILE}: {e}") from None
    if not isinstance(md, dict):
        raise StoreError(f"{version_dir}: {METADATA_FILE} is not a JSON object")
    return md


def _write_metadata(version_dir: str, md: dict) -> None:
    write_atomic(os.path.join(version_dir, METADATA_FILE), (json.dumps(md, indent=2, sort_keys=True) + "\n").encode())


def _record(version_dir: str, action: str, why: str | None, **extra) -> dict:
    """Append ``{action, by, at, why, ...}`` to the version's ``operator_log`` and return the entry."""
    md = read_metadata(version_dir)
    entry = dict(action=action, by=who(), at=utc_now(), why=why or "", **extra)
    md.setdefault("operator_log", []).append(entry)
    if action == "pin":
        md["pinned"] = {"by": entry["by"], "at": entry["at"], "why": entry["why"]}
    elif action == "unpin":
        md.pop("pinned", None)
    _write_metadata(version_dir, md)
    return entry


def is_pinned(version_dir: str) -> bool:
    """Return True if the version's metadata says it is pinned (``ds-ops models pin``)."""
    try:
        return bool(read_metadata(version_dir).get("pinned"))
    except StoreError:
        return False


def _clean_removed(name_dir: str) -> None:
    """Delete ``.rm-*`` directories in name_dir (a model's directory, or models_dir for whole
    models) whose remover is gone (a kill between the rename and the delete). Raises OSError."""
    for entry in os.listdir(name_dir):
        if entry.startswith(RM_PREFIX):
            pid = entry.rsplit("-", 1)[-1]
            if not (pid.isdigit() and pid_alive(int(pid)) and int(pid) != os.getpid()):
                shutil.rmtree(os.path.join(name_dir, entry), ignore_errors=True)


def _remove_version(name_dir: str, version: str, hook=None) -> None:
    """Hide a version by one rename (a reader then no longer finds it), fsync, then delete it."""
    hidden = os.path.join(name_dir, f"{RM_PREFIX}{version}-{os.getpid()}")
    os.rename(os.path.join(name_dir, version), hidden)
    fsync_dir(name_dir)
    if hook is not None:
        hook(version, hidden)
    shutil.rmtree(hidden)


def version_summary(name_dir: str, version: str, current: str | None = None) -> dict:
    """Return one version's row for ``ds-ops models``: dataset, losses, threshold, age (seconds)."""
    vdir = os.path.join(name_dir, version)
    try:
        md = read_metadata(vdir)
    except StoreError as e:
        md = {"error": str(e)}
    ended = md.get("ended_at") or md.get("started_at")
    age_s = None
    if isinstance(ended, str):
        try:
            t = datetime.strptime(ended, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc)
            age_s = round(datetime.now(timezone.utc).timestamp() - t.timestamp(), 1)
        except ValueError:
            pass
    return {
        "name": os.path.basename(name_dir),
        "version": version,
        "path": vdir,
        "current": version == current,
        "pinned": bool(md.get("pinned")),
        "dataset": (md.get("dataset") or {}).get("file"),
        "final_train_loss": md.get("final_train_loss"),
        "final_val_loss": md.get("final_val_loss"),
        "threshold": md.get("threshold"),
        "trained_at": ended,
        "age_s": age_s,
        "error": md.get("error"),
        "promotion": _gate_summary(md.get("promotion")),
    }


def _gate_summary(gate) -> dict | None:
    """The promotion gate's verdict of a version for ``ds-ops models`` (None: no gate ran)."""
    if not isinstance(gate, dict):
        return None
    share = lambda side: (gate.get(side) or {}).get("flagged_share")  # noqa: E731
    return {"mode": gate.get("mode"), "promote": gate.get("promote"), "failed": gate.get("failed"),
            "reason": gate.get("reason"), "flagged_share": share("challenger"), "champion_flagged_share": share("champion")}


def list_models(models_dir: str) -> list[dict]:
    """Return every model name under models_dir with its versions (oldest first) and ``current``.

    Raises StoreError if models_dir cannot be read.
    """
    try:
        names = sorted(e for e in os.listdir(models_dir) if not e.startswith(".")
                       and os.path.isdir(os.path.join(models_dir, e)))
    except FileNotFoundError:
        return []
    except OSError as e:
        raise StoreError(f"cannot read the models directory {models_dir}: {e.strerror}") from None
    out = []
    for name in names:
        name_dir = os.path.join(models_dir, name)
        current = current_version(name_dir)
        out.append({"name": name, "current": current,
                    "versions": [version_summary(name_dir, v, current) for v in list_versions(name_dir)]})
    return out


def resolve(models_dir: str, spec: str) -> tuple[str, str | None]:
    """Given ``NAME`` or ``NAME/VERSION`` (VERSION may be ``current``), return (name_dir, version
    or None). Raises StoreError for an unknown name or version."""
    name, _, version = spec.partition("/")
    name_dir = name_dir_of(models_dir, name)
    if not version:
        return name_dir, None
    if version == CURRENT:
        version = current_version(name_dir)
        if version is None:
            raise StoreError(f"model {name!r} has no current version")
    if version not in list_versions(name_dir):
        raise StoreError(f"model {name!r} has no version {version!r} (see ds-ops models)")
    return name_dir, version


def promote(models_dir: str, name: str, version: str, why: str | None = None, action: str = "promote") -> dict:
    """Make version the ``current`` of model name and record who and why in its metadata.json
    (``operator_log``) and in the model's ``.operator.json`` (so that a job claimed before now
    does not undo it, :func:`publish_job`); return the log entry (with ``previous``). Raises
    StoreError for an unknown name or version or an OSError."""
    name_dir, version = resolve(models_dir, f"{name}/{version}")
    try:
        with _NameLock(name_dir):
            return _set_current(name_dir, version, why, action)
    except OSError as e:
        raise StoreError(f"cannot {action} {name}/{version}: {e.strerror} ({e.filename})") from None


def _set_current(name_dir: str, version: str, why: str | None, action: str) -> dict:
    """Point current at version for an operator, under the name lock; return the log entry. Raises OSError."""
    entry = _record(os.path.join(name_dir, version), action, why, previous=current_version(name_dir))
    _write_operator_action(name_dir, dict(entry, version=version))
    publish(name_dir, version)
    return entry


def rollback(models_dir: str, name: str, why: str | None = None) -> dict:
    """Point ``current`` of model name at the newest version older than the current one and record
    it (``action: rollback``) as :func:`promote` does; return the entry. Raises StoreError if
    there is no older version."""
    name_dir = name_dir_of(models_dir, name)
    try:
        with _NameLock(name_dir):  # chosen and set under one lock: a job's publish cannot come between
            current = current_version(name_dir)
            older = [v for v in list_versions(name_dir) if current is None or v < current]
            if not older:
                raise StoreError(f"model {name!r} has no version older than {current} to roll back to")
            return _set_current(name_dir, older[-1], why, "rollback")
    except OSError as e:
        raise StoreError(f"cannot roll back {name}: {e.strerror} ({e.filename})") from None


def pin(models_dir: str, spec: str, pinned: bool = True, why: str | None = None) -> dict:
    """Pin (or unpin) ``NAME/VERSION`` (default: the current one): pruning never removes a pinned
    version, nor does ``models rm`` until it is unpinned, and while current is pinned no job's new
    version becomes current (:func:`operator_hold`). Unpinning current also lifts the hold of a
    rollback. Return the log entry. Raises StoreError."""
    name_dir, version = resolve(models_dir, spec if "/" in spec else f"{spec}/{CURRENT}")
    try:
        with _NameLock(name_dir):
            entry = _record(os.path.join(name_dir, version), "pin" if pinned else "unpin", why)
            if not pinned and version == current_version(name_dir):  # lifts a rollback's hold too
                last = read_operator_action(name_dir) or {}  # its time still orders jobs claimed before it
                _write_operator_action(name_dir, dict(entry, version=version, at=last.get("at", ""),
                                                      unpinned_at=entry["at"]))
            return entry
    except OSError as e:
        raise StoreError(f"cannot pin {spec}: {e.strerror} ({e.filename})") from None


def remove(models_dir: str, spec: str, why: str | None = None) -> dict:
    """Remove ``NAME/VERSION`` or every version of ``NAME``; ``current`` stays valid: removing the
    current version first points ``current`` at the newest other version (recorded as a
    promote), and a model's last version goes only with ``rm NAME``. A pinned version is refused.
    Return ``{removed: [...], current: ...}``. Raises StoreError."""
    name_dir, version = resolve(models_dir, spec)
    try:
        _clean_removed(models_dir)  # a whole model whose removal was killed midway
        with _NameLock(name_dir):
            _clean_removed(name_dir)
            versions = list_versions(name_dir)
            targets = [version] if version else versions
            pinned = [v for v in targets if is_pinned(os.path.join(name_dir, v))]
            if pinned:
                raise StoreError(f"{os.path.basename(name_dir)}/{pinned[0]} is pinned; "
                                 "ds-ops models unpin it first")
            current = current_version(name_dir)
            if version is None:
                parent = os.path.dirname(name_dir)
                hidden = os.path.join(parent, f"{RM_PREFIX}{os.path.basename(name_dir)}-{os.getpid()}")
                os.rename(name_dir, hidden)
                fsync_dir(parent)
                shutil.rmtree(hidden)
                return {"removed": targets, "current": None}
            new_current = current
            if version == current:
                others = [v for v in versions if v != version]
                if not others:
                    raise StoreError(f"{spec} is the only version; remove the model with ds-ops models rm "
                                     f"{os.path.basename(name_dir)}")
                new_current = others[-1]
                entry = _record(os.path.join(name_dir, new_current), "promote",
                                f"{version} removed: {why or ''}".strip(), previous=version)
                _write_operator_action(name_dir, dict(entry, action="rm", version=new_current))
                publish(name_dir, new_current)
            _remove_version(name_dir, version)
    except OSError as e:
        raise StoreError(f"cannot remove {spec}: {e.strerror} ({e.filename})") from None
    return {"removed": [version], "current": new_current}


def prune(models_dir: str, name: str, keep: int, *, hook=None) -> list[str]:
    """Remove the versions of model name beyond the newest ``keep``, never ``current`` or a pinned
    one; return the versions removed, oldest first. Each goes by a rename to a hidden ``.rm-*``
    first, so a SIGKILL midway leaves every kept version whole (the leftover is deleted next time).
    ``hook(version, hidden_path)`` is a test hook called between that rename and the delete.
    ``keep`` <= 0 keeps everything. Raises StoreError on an OSError."""
    if keep <= 0:
        return []
    try:
        name_dir = os.path.join(models_dir, safe_model_name(name))
        with _NameLock(name_dir):
            _clean_removed(name_dir)
            versions = list_versions(name_dir)
            current = current_version(name_dir)
            keep_set = set(versions[-keep:]) | {current}
            victims = [v for v in versions if v not in keep_set and not is_pinned(os.path.join(name_dir, v))]
            for v in victims:
                _remove_version(name_dir, v, hook)
    except OSError as e:
        raise StoreError(f"cannot prune model {name}: {e.strerror} ({e.filename})") from None
    return victims
