"""The spool directory: a dataset moves ``incoming/`` -> ``processing/`` -> ``done/`` or ``failed/``.

Layout under ``spool.dir`` (default ``/var/spool/ds-ops``)::

    incoming/    users drop datasets; names starting with '.' or ending in .part/.tmp are ignored
    processing/  NAME (the claimed dataset), .NAME.job.json (job record), .NAME.checkpoint.pt
    done/        NAME and NAME.result.json (model directory, losses, threshold, duration, device)
    failed/      NAME and NAME.error.json (reason, stage, time, exception type)

Every move is one ``rename(2)`` inside the spool, so a SIGKILL leaves a dataset in exactly one
place. JSON files and checkpoints are written to a hidden temporary name, fsync'ed and renamed.
An entry is looked at with ``lstat`` only until it is known to be a regular file: a FIFO is never
opened, a symlink never followed. Names are used literally as one path component (spaces,
unicode, undecodable bytes, leading dashes) and never reach a shell. Datasets are never deleted;
the hidden files in processing/ are the daemon's own and are removed when their job is over.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
import time

from .fsutil import fsync_dir, pid_alive, write_atomic

INCOMING, PROCESSING, DONE, FAILED = "incoming", "processing", "done", "failed"
SUBDIRS = (INCOMING, PROCESSING, DONE, FAILED)
IGNORED_SUFFIXES = (".part", ".tmp")
RESULT_SUFFIX, ERROR_SUFFIX = ".result.json", ".error.json"
JOB_SUFFIX, CHECKPOINT_SUFFIX = ".job.json", ".checkpoint.pt"
NAME_MAX_BYTES = 255


class SpoolError(RuntimeError):
    """The spool (or models) directory cannot be used; the message names the path and why."""


def is_ignored(name: str) -> bool:
    """Return True for names the daemon leaves alone in incoming/: '.NAME', 'NAME.part', 'NAME.tmp'."""
    return name.startswith(".") or name.lower().endswith(IGNORED_SUFFIXES)


def sidecar_name(name: str, suffix: str, *, hidden: bool = False) -> str:
    """Return the file name beside dataset ``name``: ``NAME.result.json``, ``.NAME.job.json``, ...

    If that would exceed NAME_MAX (255 bytes), the name is cut and a hash of the full name keeps
    it unique: ``<first bytes>~<sha1 prefix><suffix>``.
    """
    prefix = "." if hidden else ""
    full = prefix + name + suffix
    if len(os.fsencode(full)) <= NAME_MAX_BYTES:
        return full
    digest = "~" + hashlib.sha1(os.fsencode(name)).hexdigest()[:12]
    room = NAME_MAX_BYTES - len(os.fsencode(prefix + digest + suffix))
    return prefix + os.fsdecode(os.fsencode(name)[:room]) + digest + suffix


def _numbered(name: str, n: int) -> str:
    """Return ``NAME.n`` cut to fit NAME_MAX (a second dataset of the same name in done/ or failed/)."""
    tail = f".{n}"
    raw = os.fsencode(name)
    return os.fsdecode(raw[: NAME_MAX_BYTES - len(tail)]) + tail


def write_json(path: str, obj: dict) -> None:
    """Atomically write obj as indented JSON (non-ASCII escaped, so any file name round-trips)."""
    write_atomic(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("ascii"))


def read_json(path: str) -> dict | None:
    """Return the JSON object in path, or None if it is missing, unreadable or not an object."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def check_writable_dir(path: str, what: str) -> None:
    """Create directory path if needed and prove it writable by creating and removing a file.

    Raises SpoolError naming ``what`` (e.g. "models directory"), the path and the OS error.
    """
    try:
        os.makedirs(path, 0o755, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        where = e.filename or path
        raise SpoolError(f"{what} {path} is not usable: {e.strerror or e} ({where})") from None


class Spool:
    """The four spool directories under ``root``; every path the daemon touches comes from here."""

    def __init__(self, root: str):
        self.root = os.path.abspath(root)

    def dir(self, which: str) -> str:
        """Return the directory incoming/, processing/, done/ or failed/."""
        return os.path.join(self.root, which)

    def path(self, which: str, name: str) -> str:
        """Return the path of name inside one spool directory.

        Raises SpoolError for a name that is not exactly one path component ('', '.', '..', '/').
        """
        if name in ("", ".", "..") or "/" in name or "\0" in name:
            raise SpoolError(f"refusing spool entry name {name!r}: not a single file name")
        return os.path.join(self.root, which, name)

    def record_path(self, name: str) -> str:
        """processing/.NAME.job.json: the job record (id, state, epoch, model directory)."""
        return self.path(PROCESSING, sidecar_name(name, JOB_SUFFIX, hidden=True))

    def checkpoint_path(self, name: str) -> str:
        """processing/.NAME.checkpoint.pt: the checkpoint written on SIGTERM."""
        return self.path(PROCESSING, sidecar_name(name, CHECKPOINT_SUFFIX, hidden=True))


def open_spool(root: str) -> Spool:
    """Create the spool directories if needed and check they are writable and on one file system.

    Raises SpoolError naming the directory and the reason (claims are renames, which only work
    within one file system).
    """
    spool = Spool(root)
    devices = {}
    for which in SUBDIRS:
        path = spool.dir(which)
        check_writable_dir(path, "spool directory")
        devices[which] = os.stat(path).st_dev
    if len(set(devices.values())) > 1:
        raise SpoolError(
            f"spool directory {spool.root}: incoming/, processing/, done/ and failed/ must be on one "
            f"file system (a claim is a rename); device ids: {devices}"
        )
    return spool


def list_incoming(spool: Spool) -> list[str]:
    """Return the names in incoming/ the daemon will consider, oldest modification first."""
    entries = []
    with os.scandir(spool.dir(INCOMING)) as it:
        for e in it:
            if is_ignored(e.name):
                continue
            try:
                entries.append((e.stat(follow_symlinks=False).st_mtime_ns, e.name))
            except FileNotFoundError:
                continue
    return [name for _, name in sorted(entries)]


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device node"
    if stat.S_ISDIR(mode):
        return "a directory"
    return "not a regular file"


def inspect_entry(path: str, max_bytes: int) -> tuple[os.stat_result | None, str | None]:
    """Look at a spool entry with lstat only; return (stat, None) if it may be taken, else (stat, reason).

    Refused (reason a person can act on): symlinks, FIFOs, sockets, device nodes, directories,
    hard links (link count > 1: the file could change through its other name), and files larger
    than ``max_bytes`` (bytes, from ``spool.max_dataset_bytes``). Returns (None, None) if the
    entry is gone. Nothing is opened.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None, None
    if stat.S_ISLNK(st.st_mode):
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        return st, f"a symbolic link (to {target!r}); only regular files are taken, copy the data in instead"
    if not stat.S_ISREG(st.st_mode):
        return st, f"{_kind(st.st_mode)}; only regular files are taken"
    if st.st_nlink > 1:
        return st, (f"a hard link ({st.st_nlink} names for one file; it could change through another name); "
                    "copy the file in instead of linking it")
    if st.st_size > max_bytes:
        return st, f"{st.st_size} bytes, larger than spool.max_dataset_bytes ({max_bytes} bytes)"
    return st, None


def _identity(st: os.stat_result) -> tuple:
    """What must not change between the first look and the claim (a rename changes only ctime)."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def check_claimed(path: str, expected: os.stat_result, max_bytes: int) -> str | None:
    """Return why the claimed entry at path cannot be used, or None if it is readable and unchanged.

    Guards the moment between the first look and the claim: the entry must still be the same
    regular file (device, inode, size, mtime); then it is opened with O_NOFOLLOW|O_NONBLOCK (never blocks,
    never follows a link) to prove it readable.
    """
    st, reason = inspect_entry(path, max_bytes)
    if st is None:
        return "the file disappeared while being claimed"
    if reason is not None:
        return reason
    if _identity(st) != _identity(expected):
        return "the file was replaced or written to while being claimed; drop it again when it is complete"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as e:
        return (f"unreadable: {e.strerror} (mode {stat.filemode(st.st_mode)}, owner uid {st.st_uid}); "
                "make it readable by the ds-trainer service and drop it again")
    os.close(fd)
    return None


def claim(spool: Spool, name: str, record: dict) -> bool:
    """Claim incoming/NAME for a job: write its job record, then rename it into processing/.

    Returns False (and leaves no record) if the file vanished or processing/ already holds that
    name. The record is written first so that a dataset in processing/ always has one.
    """
    src, dst = spool.path(INCOMING, name), spool.path(PROCESSING, name)
    if os.path.lexists(dst):
        return False
    write_json(spool.record_path(name), record)
    try:
        os.rename(src, dst)
    except FileNotFoundError:
        os.unlink(spool.record_path(name))
        return False
    fsync_dir(spool.dir(PROCESSING))
    fsync_dir(spool.dir(INCOMING))
    return True


def finish(spool: Spool, name: str, source: str, dest: str, doc: dict) -> str:
    """Move source/NAME to dest (DONE or FAILED) with its JSON beside it; return the name it got there.

    ``doc`` goes to ``NAME.result.json`` in done/ or ``NAME.error.json`` in failed/, with
    ``dataset_file`` set to the final name. An existing dataset of the same name is never
    replaced: the newcomer becomes ``NAME.1``, ``NAME.2``, ... A JSON file left by an earlier
    attempt of the same job (same ``job_id``) is reused. Coming from processing/, the job's hidden
    files there are removed afterwards. Raises OSError if the spool cannot be written.
    """
    suffix = RESULT_SUFFIX if dest == DONE else ERROR_SUFFIX
    final, n = name, 0
    while True:
        side = spool.path(dest, sidecar_name(final, suffix))
        if not os.path.lexists(spool.path(dest, final)):
            old = read_json(side) if os.path.lexists(side) else None
            if not os.path.lexists(side) or (old is not None and old.get("job_id") == doc.get("job_id")):
                break
        n += 1
        final = _numbered(name, n)
    write_json(side, dict(doc, dataset_file=final))
    os.rename(spool.path(source, name), spool.path(dest, final))
    fsync_dir(spool.dir(dest))
    fsync_dir(spool.dir(source))
    if source == PROCESSING:
        remove_job_files(spool, name)
    return final


def remove_job_files(spool: Spool, name: str) -> None:
    """Remove processing/.NAME.job.json and .NAME.checkpoint.pt (the daemon's own files) if present."""
    for path in (spool.record_path(name), spool.checkpoint_path(name)):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def processing_datasets(spool: Spool) -> list[str]:
    """Return the datasets in processing/ (every name not starting with '.')."""
    return sorted(n for n in os.listdir(spool.dir(PROCESSING)) if not n.startswith("."))


def remove_orphans(spool: Spool) -> list[str]:
    """Remove hidden files in processing/ that belong to no dataset there; return their names.

    They are job records and checkpoints of jobs that already reached done/ or failed/ (or whose
    claim never happened) and temporary files of a killed writer. Only the daemon writes hidden
    files in processing/ (datasets never start with '.'), so nothing of a user's is touched.
    """
    keep = set()
    for name in processing_datasets(spool):
        keep.add(os.path.basename(spool.record_path(name)))
        keep.add(os.path.basename(spool.checkpoint_path(name)))
    removed = []
    for entry in os.listdir(spool.dir(PROCESSING)):
        if entry.startswith(".") and entry not in keep:
            path = spool.path(PROCESSING, entry)
            if os.path.isfile(path) and not os.path.islink(path):
                os.unlink(path)
                removed.append(entry)
    return removed


def save_checkpoint(spool: Spool, name: str, obj: dict) -> str:
    """Atomically write obj (tensors, numbers, strings) to processing/.NAME.checkpoint.pt; return its path."""
    import io

    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    path = spool.checkpoint_path(name)
    write_atomic(path, buf.getvalue())
    return path


def load_checkpoint(spool: Spool, name: str) -> tuple[dict | None, str]:
    """Return (checkpoint dict, "") for NAME, or (None, why not) if it is absent or unusable.

    Loaded with ``torch.load(weights_only=True)`` on the CPU: no pickled code runs.
    """
    import torch

    path = spool.checkpoint_path(name)
    if not os.path.exists(path):
        return None, "no checkpoint"
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises UnpicklingError, RuntimeError, EOFError, ... on a bad file
        return None, f"checkpoint {path} unreadable ({type(e).__name__}: {e})"
    if not isinstance(obj, dict) or "checkpoint" not in obj:
        return None, f"checkpoint {path} has an unknown layout"
    return obj, ""


def boot_id() -> str:
    """Return this boot's id (/proc/sys/kernel/random/boot_id), or "" where there is none."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


def process_alive(pid: int | None, boot: str | None) -> bool:
    """Return True if pid runs now and the record it came from was written during this boot."""
    if not pid or (boot and boot != boot_id()):
        return False
    return pid_alive(pid)


def _recent_docs(directory: str, suffix: str, last: int) -> tuple[int, list[dict]]:
    """Return (how many suffix files, the newest ``last`` of them as dicts) in directory."""
    found = []
    try:
        with os.scandir(directory) as it:
            for e in it:
                if e.name.endswith(suffix) and not e.name.startswith("."):
                    try:
                        found.append((e.stat(follow_symlinks=False).st_mtime_ns, e.path))
                    except FileNotFoundError:
                        continue
    except FileNotFoundError:
        return 0, []
    found.sort(reverse=True)
    docs = [d for _, p in found[:last] if (d := read_json(p)) is not None and "job_id" in d]
    return len(found), docs


def spool_status(spool: Spool, last: int = 5) -> dict:
    """Return what the spool shows: queue, jobs in processing/, counts and the newest results.

    Read from the files alone (works without talking to the daemon): ``queue`` lists incoming/
    names oldest first; each job in ``processing`` carries its record (state, epoch, losses) and
    ``daemon_alive`` (the pid in the record runs, same boot). Raises FileNotFoundError if the spool
    does not exist.
    """
    if not os.path.isdir(spool.root):
        raise FileNotFoundError(spool.root)
    queue = list_incoming(spool) if os.path.isdir(spool.dir(INCOMING)) else []
    jobs = []
    if os.path.isdir(spool.dir(PROCESSING)):
        for name in processing_datasets(spool):
            record = read_json(spool.record_path(name)) or {}
            jobs.append(dict(record, dataset=name,
                             daemon_alive=process_alive(record.get("pid"), record.get("boot_id")),
                             checkpoint=os.path.exists(spool.checkpoint_path(name))))
    n_done, done = _recent_docs(spool.dir(DONE), RESULT_SUFFIX, last)
    n_failed, failed = _recent_docs(spool.dir(FAILED), ERROR_SUFFIX, last)
    return {
        "spool": spool.root,
        "queue": queue,
        "processing": jobs,
        "done_count": n_done,
        "failed_count": n_failed,
        "recent_done": done,
        "recent_failed": failed,
        "checked_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
