"""The model versions an operator controls (``ds-ops models``): list, promote, roll back, pin,
remove, and the daemon's pruning of old versions (``models.keep_versions``).

Every change here is one atomic rename (metadata.json rewritten through a temporary file; a
version removed by renaming it to a hidden ``.rm-<version>-<pid>`` first, then deleting that),
under an exclusive flock on the model's directory (:class:`opt_ds_ops.store.model_dir.NameLock`), so two
changes never interleave and a SIGKILL at any instant leaves every version either complete or
hidden (a leftover ``.rm-*`` is deleted by the next change of the same name). A change of
``current`` is also written to the model's ``.operator.json``, which orders it against the jobs'
versions (:func:`opt_ds_ops.store.versions.publish_job`).
"""

from __future__ import annotations

import errno
import json
import os
import pwd
import shutil
from datetime import datetime, timezone

from ..fsutil import fsync_dir, pid_alive, utc_now, write_atomic
from .model_dir import (
    CURRENT, METADATA_FILE, NameLock, StoreError, current_version, list_versions, name_dir_of, previous_current,
    publish, read_current_log, read_metadata, read_operator_action, safe_model_name, write_operator_action,
)

RM_PREFIX = ".rm-"
DEFAULT_KEEP_VERSIONS = 10


def who() -> str:
    """Return who runs this process, for the metadata: the user name, ``root (sudo by alice)``."""
    try:
        user = pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        user = str(os.getuid())
    sudo = os.environ.get("SUDO_USER")
    return f"{user} (sudo by {sudo})" if sudo and sudo != user else user


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
    does not undo it, :func:`opt_ds_ops.store.versions.publish_job`); return the log entry (with ``previous``). Raises
    StoreError for an unknown name or version or an OSError."""
    name_dir, version = resolve(models_dir, f"{name}/{version}")
    try:
        with NameLock(name_dir):
            return _set_current(name_dir, version, why, action)
    except OSError as e:
        raise StoreError(f"cannot {action} {name}/{version}: {e.strerror} ({e.filename})") from None


def _set_current(name_dir: str, version: str, why: str | None, action: str) -> dict:
    """Point current at version for an operator, under the name lock; return the log entry. Raises OSError."""
    entry = _record(os.path.join(name_dir, version), action, why, previous=current_version(name_dir))
    write_operator_action(name_dir, dict(entry, version=version))
    publish(name_dir, version, action)
    return entry


def rollback_target(name_dir: str, current: str | None) -> str | None:
    """The version a rollback from ``current`` goes to: the one that was current before it, from
    the store's record (:func:`opt_ds_ops.store.model_dir.previous_current`); for a model from
    before that record, the newest older version that the promotion gate did not refuse. Never
    a version that was never current (a challenger the gate refused, one held by the operator)."""
    if read_current_log(name_dir):
        return previous_current(name_dir, current)
    older = []
    for v in list_versions(name_dir):
        if current is not None and v >= current:
            continue
        try:
            gate = read_metadata(os.path.join(name_dir, v)).get("promotion")
        except StoreError:
            continue
        if not (isinstance(gate, dict) and gate.get("promote") is False):
            older.append(v)
    return older[-1] if older else None


def rollback(models_dir: str, name: str, why: str | None = None) -> dict:
    """Point ``current`` of model name at the version that was current before it
    (:func:`rollback_target`) and record it (``action: rollback``) as :func:`promote` does; return
    the entry. Raises StoreError if no version still here was current before it."""
    name_dir = name_dir_of(models_dir, name)
    try:
        with NameLock(name_dir):  # chosen and set under one lock: a job's publish cannot come between
            current = current_version(name_dir)
            target = rollback_target(name_dir, current)
            if target is None:
                raise StoreError(f"model {name!r}: no version still in the store was current before {current}; "
                                 "nothing to roll back to (ds-ops models promote NAME VERSION chooses one)")
            return _set_current(name_dir, target, why, "rollback")
    except OSError as e:
        raise StoreError(f"cannot roll back {name}: {e.strerror} ({e.filename})") from None


def pin(models_dir: str, spec: str, pinned: bool = True, why: str | None = None) -> dict:
    """Pin (or unpin) ``NAME/VERSION`` (default: the current one): pruning never removes a pinned
    version, nor does ``models rm`` until it is unpinned, and while current is pinned no job's new
    version becomes current (:func:`opt_ds_ops.store.versions.operator_hold`). Unpinning current also lifts the hold of a
    rollback. Return the log entry. Raises StoreError."""
    name_dir, version = resolve(models_dir, spec if "/" in spec else f"{spec}/{CURRENT}")
    try:
        with NameLock(name_dir):
            if not pinned and not is_pinned(os.path.join(name_dir, version)):
                held = [v for v in list_versions(name_dir) if is_pinned(os.path.join(name_dir, v))]
                name = os.path.basename(name_dir)
                raise StoreError(f"{name}/{version} is not pinned" + (
                    f"; pinned: {', '.join(held)} (ds-ops models unpin {name}/{held[-1]})" if held else ""))
            entry = _record(os.path.join(name_dir, version), "pin" if pinned else "unpin", why)
            if not pinned and version == current_version(name_dir):  # lifts a rollback's hold too
                last = read_operator_action(name_dir) or {}  # its time still orders jobs claimed before it
                write_operator_action(name_dir, dict(entry, version=version, at=last.get("at", ""),
                                                      unpinned_at=entry["at"]))
            return entry
    except OSError as e:
        raise StoreError(f"cannot pin {spec}: {e.strerror} ({e.filename})") from None


def remove(models_dir: str, spec: str, why: str | None = None) -> dict:
    """Remove ``NAME/VERSION`` or every version of ``NAME``; ``current`` stays valid: removing the
    current version first points ``current`` back at the version that was current before it
    (:func:`rollback_target`, recorded as a promote), and a model's last version goes only with
    ``rm NAME``. A pinned version is refused.
    Return ``{removed: [...], current: ...}``. Raises StoreError."""
    name_dir, version = resolve(models_dir, spec)
    try:
        _clean_removed(models_dir)  # a whole model whose removal was killed midway
        if not os.access(name_dir, os.W_OK):  # who may not change it hears that first, not "is pinned"
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), name_dir)
        with NameLock(name_dir):
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
                new_current = rollback_target(name_dir, current)
                if new_current is None:
                    raise StoreError(f"{spec} is current and no other version still in the store was current before "
                                     f"it; ds-ops models promote {os.path.basename(name_dir)} VERSION first")
                entry = _record(os.path.join(name_dir, new_current), "promote",
                                f"{version} removed: {why or ''}".strip(), previous=version)
                write_operator_action(name_dir, dict(entry, action="rm", version=new_current))
                publish(name_dir, new_current, "rollback")
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
        with NameLock(name_dir):
            _clean_removed(name_dir)
            versions = list_versions(name_dir)
            current = current_version(name_dir)
            # never the version a rollback would go back to either (refused challengers are newer)
            keep_set = set(versions[-keep:]) | {current, rollback_target(name_dir, current)}
            victims = [v for v in versions if v not in keep_set and not is_pinned(os.path.join(name_dir, v))]
            for v in victims:
                _remove_version(name_dir, v, hook)
    except OSError as e:
        raise StoreError(f"cannot prune model {name}: {e.strerror} ({e.filename})") from None
    return victims
