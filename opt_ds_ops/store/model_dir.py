"""A model's directory in the store, ``MODELS_DIR/<name>/``: its fixed names, its lock, the
complete versions, ``current`` and how it is swapped, each version's ``metadata.json``, and the
operator's last change of ``current`` (``.operator.json``), and the record of every version that
was ``current`` and when (``.current.log``), from which a rollback knows where to go. What :mod:`opt_ds_ops.store.versions` (saving
and loading versions) and :mod:`opt_ds_ops.store.admin` (``ds-ops models``) both build on.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import secrets

from ..fsutil import fsync_dir, utc_now, write_atomic

MODEL_FILE = "model.pt"
METADATA_FILE = "metadata.json"
CURRENT = "current"
OPERATOR_FILE = ".operator.json"  # the operator's last change of current, read by publish_job
CURRENT_LOG = ".current.log"  # JSON lines, oldest first: each change of current (at, version, action, previous)
CURRENT_LOG_MAX = 1000  # lines kept: the newest half once it grows past this
CURRENT_LOG_LINE_BYTES = 160  # about one line's size: the log is read to be cut only past MAX lines of it
HELD = "held by the operator's decision:"  # how a not_current reason of a hold begins (the daemon's model-held)
GATED = "not promoted by the gate:"  # a not_current reason of store.promote (the daemon's model-not-promoted)
_NAME_OK = re.compile(r"[^A-Za-z0-9._+-]")


class StoreError(RuntimeError):
    """The model store could not be written or a stored model could not be read.

    ``errno`` is the OS error number when a file system error caused it, else None.
    """

    errno: int | None = None


def safe_model_name(name: str) -> str:
    """Return name made safe as one directory name: only ``[A-Za-z0-9._+-]``, no leading dot or dash.

    Raises StoreError if nothing usable is left (an empty name).
    """
    cleaned = _NAME_OK.sub("_", name).lstrip(".-")
    if not cleaned:
        raise StoreError(f"model name {name!r} has no usable characters")
    return cleaned[:200]


def name_dir_of(models_dir: str, name: str) -> str:
    """Return ``models_dir/<name>`` for an existing model name. Raises StoreError if it is absent."""
    path = os.path.join(models_dir, safe_model_name(name))
    if not os.path.isdir(path):
        raise StoreError(f"no model named {name!r} under {models_dir}")
    return path


LOCK_FILE = ".lock"  # NAME/.lock: the name lock's file, mode 0600, owned as the model's directory


class NameLock:
    """Exclusive ``flock`` on a model's ``.lock`` file (blocking); released when the fd closes, so
    a killed holder never leaves it held. The file is mode 0600 and owned by the directory's owner
    (root creating it hands it over), so the daemon's user and root share it, and no member of
    group ds-ops, who may read the store, can open it to hold the lock (a shared flock on the
    directory itself, which members can open, blocked every publish of that model)."""

    def __init__(self, name_dir: str):
        self.name_dir = name_dir
        self.fd = -1

    def __enter__(self):
        self.fd = os.open(os.path.join(self.name_dir, LOCK_FILE),
                          os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            st, own = os.fstat(self.fd), os.stat(self.name_dir)
            if (st.st_uid, st.st_gid) != (own.st_uid, own.st_gid) and os.geteuid() == 0:
                os.fchown(self.fd, own.st_uid, own.st_gid)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(self.fd)
            raise
        return self

    def __exit__(self, *exc):
        os.close(self.fd)


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


def current_version(name_dir: str) -> str | None:
    """Return the version ``current`` points at, or None if there is no ``current`` link."""
    try:
        return os.readlink(os.path.join(name_dir, CURRENT))
    except OSError:
        return None


def list_versions(name_dir: str) -> list[str]:
    """Return the complete versions of one model name, oldest first (hidden entries excluded)."""
    try:
        entries = os.listdir(name_dir)
    except FileNotFoundError:
        return []
    return sorted(e for e in entries if not e.startswith(".") and e != CURRENT and os.path.isdir(os.path.join(name_dir, e)))


def publish(name_dir: str, version: str, action: str = "publish") -> None:
    """Point ``name_dir/current`` at version: a new symlink renamed over the old one, then the
    directory fsync'ed; a change is appended to ``.current.log`` first (``action``: ``publish``
    for a job's version, or the operator's ``promote``, ``rollback``, ``rm``). Idempotent, so
    crash recovery replays it. Called under the name lock. Raises OSError."""
    previous = current_version(name_dir)
    link_tmp = os.path.join(name_dir, f".current-{os.getpid()}")
    if os.path.lexists(link_tmp):
        os.unlink(link_tmp)
    os.symlink(version, link_tmp)
    os.replace(link_tmp, os.path.join(name_dir, CURRENT))
    fsync_dir(name_dir)
    if previous != version:  # after the swap: the log never names a version that did not become current
        _log_current(name_dir, {"at": utc_now(), "version": version, "action": action, "previous": previous})


def _log_current(name_dir: str, entry: dict) -> None:
    """Append entry to ``.current.log`` (fsync'ed; mode 0644 as the rest of the store); keep the
    newest half of it past :data:`CURRENT_LOG_MAX` lines. A publish appends one line: the log is
    read (to be cut) only once its size says it may have grown that long."""
    path = os.path.join(name_dir, CURRENT_LOG)
    entry = dict(entry, lineage=model_lineage(name_dir) or secrets.token_hex(8))
    try:
        size = os.lstat(path).st_size
    except FileNotFoundError:
        size = 0
    entries = read_current_log(name_dir) if size >= CURRENT_LOG_MAX * CURRENT_LOG_LINE_BYTES // 2 else []
    if len(entries) >= CURRENT_LOG_MAX:
        keep = entries[-CURRENT_LOG_MAX // 2:] + [entry]
        write_atomic(path, "".join(json.dumps(e, sort_keys=True) + "\n" for e in keep).encode("utf-8"),
                     prefix=".log-")  # not .tmp-: a concurrent save's leftover sweep removes those
        return
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, (json.dumps(entry, sort_keys=True) + "\n").encode("utf-8"))
        os.fsync(fd)
    finally:
        os.close(fd)


def model_lineage(name_dir: str) -> str | None:
    """The token that names this model since its name was first published (``lineage`` of every
    ``.current.log`` entry, drawn at random by the first): ``ds-ops models rm NAME`` removes the
    log, so the name's next owner gets another one, and a scoring series written for the old
    model is known for what it is (:func:`opt_ds_ops.scoring.job.score_job`). None for a model
    without it (one from before it, or none). Reads the log's last line only."""
    try:
        with open(os.path.join(name_dir, CURRENT_LOG), "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 8192))
            tail = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    for line in reversed(tail):
        try:
            e = json.loads(line)
        except ValueError:
            continue
        lineage = e.get("lineage") if isinstance(e, dict) else None
        return lineage if isinstance(lineage, str) and lineage else None
    return None


def read_current_log(name_dir: str) -> list[dict]:
    """The changes of ``current`` recorded in ``.current.log``, oldest first (none where there is
    no log: a model from before it); a line that does not parse (a write cut by a power loss) is
    skipped."""
    try:
        with open(os.path.join(name_dir, CURRENT_LOG), encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if isinstance(e, dict) and isinstance(e.get("version"), str):
            out.append(e)
    return out


def previous_current(name_dir: str, current: str | None) -> str | None:
    """The version that was ``current`` before ``current``, from ``.current.log``: the log read as
    a stack (a change pushes its version, a rollback goes back down to its own), the versions
    since removed left out. None where no version still here was current before it."""
    stack: list[str] = []
    log = read_current_log(name_dir)
    if log and isinstance(log[0].get("previous"), str):  # current before the log began (a model from before it)
        stack.append(log[0]["previous"])
    for e in log:
        v = e["version"]
        if e.get("action") == "rollback" and v in stack:
            while stack[-1] != v:
                stack.pop()
        elif not stack or stack[-1] != v:
            stack.append(v)
    if stack and stack[-1] == current:
        stack.pop()
    existing = set(list_versions(name_dir))
    below = [v for v in stack if v in existing and v != current]
    return below[-1] if below else None


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


def write_operator_action(name_dir: str, entry: dict) -> None:
    """Write entry as ``name_dir/.operator.json`` (mode 0644: the daemon reads what root wrote),
    atomically, under the name lock. Raises OSError."""
    write_atomic(os.path.join(name_dir, OPERATOR_FILE), (json.dumps(entry, sort_keys=True) + "\n").encode("utf-8"))


class CurrentModels:
    """(name, current version's metadata, number of versions) of each model, for a reader that asks
    again and again (the daemon's metrics, after every job): a model's metadata.json is read again
    only when its ``current`` link, the file's identity, size or mtime changed, and its versions
    counted again only when its directory changed. Over a thousand models the store costs a
    readlink and two stats each, not a JSON parse each. Unreadable models are skipped."""

    def __init__(self):
        self._seen: dict[str, tuple] = {}  # name -> (key, metadata, dir mtime_ns, versions)

    def __call__(self, models_dir: str) -> list[tuple[str, dict, int]]:
        out, seen = [], {}
        try:
            names = sorted(e for e in os.listdir(models_dir) if not e.startswith("."))
        except OSError:
            self._seen = {}
            return out
        for name in names:
            name_dir = os.path.join(models_dir, name)
            path = os.path.join(name_dir, CURRENT, METADATA_FILE)
            try:
                st, dir_mtime = os.stat(path), os.stat(name_dir).st_mtime_ns
            except OSError:
                continue
            try:
                link = os.readlink(os.path.join(name_dir, CURRENT))
            except OSError:  # not a link: the file's identity alone says whether it changed
                link = None
            key = (link, st.st_ino, st.st_size, st.st_mtime_ns)
            cached = self._seen.get(name)
            if cached is not None and cached[0] == key:
                md = cached[1]
            else:
                try:
                    with open(path, encoding="utf-8") as f:
                        md = json.load(f)
                except (OSError, ValueError):
                    continue
                if not isinstance(md, dict):
                    continue
                cached = None
            versions = cached[3] if cached is not None and cached[2] == dir_mtime else len(list_versions(name_dir))
            seen[name] = (key, md, dir_mtime, versions)
            out.append((name, md, versions))
        self._seen = seen
        return out


def current_models(models_dir: str) -> list[tuple[str, dict, int]]:
    """Return (name, current version's metadata, number of versions) of each model; unreadable
    ones are skipped (a metric is never worth a failed write). One read: :class:`CurrentModels`
    with nothing cached."""
    return CurrentModels()(models_dir)
    for name in names:
        name_dir = os.path.join(models_dir, name)
        try:
            with open(os.path.join(name_dir, CURRENT, METADATA_FILE), encoding="utf-8") as f:
                md = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(md, dict):
            out.append((name, md, len(list_versions(name_dir))))
    return out


def current_metadata(models_dir: str, name: str) -> dict | None:
    """Return the metadata.json of model name's ``current`` version, or None if there is no such
    model or it cannot be read."""
    try:
        with open(os.path.join(models_dir, safe_model_name(name), CURRENT, METADATA_FILE), encoding="utf-8") as f:
            md = json.load(f)
    except (OSError, ValueError, StoreError):
        return None
    return md if isinstance(md, dict) else None


def dataset_file_of(models_dir: str, name: str) -> str | None:
    """Return the dataset file name the ``current`` version of model name was trained on (its
    metadata's ``dataset.file``), or None if there is no such model or it cannot be read."""
    try:
        return (current_metadata(models_dir, name) or {})["dataset"]["file"]
    except (KeyError, TypeError):
        return None
