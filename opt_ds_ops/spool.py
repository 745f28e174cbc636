"""The spool: a dataset moves ``incoming/`` -> ``processing/<job id>/`` -> ``done/`` or ``failed/``.

Layout under ``spool.dir`` (default ``/var/spool/ds-ops``)::

    incoming/          group ds-ops drops datasets; '.NAME', NAME.part and NAME.tmp are ignored;
                       STEM.yaml (or .yml) is the sidecar of dataset STEM.<ext>, taken with it
    score/             the same for telemetry to score (issue 19, :mod:`opt_ds_ops.scorer`): the
                       same claim (``drop=SCORE``), a job of kind ``score``; no copy kept in done/
    processing/JOB/    one directory per job, the daemon's own (0750): job.json (the record),
                       dataset.<ext> (the daemon's 0600 copy of the bytes), sidecar.yaml, checkpoint.pt
    done/              NAME, NAME.result.json (model directory, sha256, losses, threshold, ...)
                       and NAME.sidecar.yaml if it had one
    failed/            NAME, NAME.error.json (reason, stage, time, exception type), NAME.sidecar.yaml

**Sidecars.** A sidecar (``STEM.yaml`` beside ``STEM.csv``; keys in
:func:`opt_ds_ops.config.parse_sidecar`) is never a job of its own: it waits in incoming/ until
its dataset is claimed, and is then taken the same way (renamed into the job directory, copied,
64 KiB at most), so drop it first. It applies only to a dataset of the same uploader (owner uid);
another user's file of that name is moved aside, never parsed. It is parsed in the job process only,
never here nor anywhere in the daemon.

**The bytes, not the name.** incoming/ is writable by every member of group ds-ops, so nothing
there is trusted. An entry is looked at with ``lstat``; anything but a regular file (a directory,
FIFO, socket, device node or symlink) is never opened, renamed or read: it is reported once and
left where it is. A regular file is opened ``O_NOFOLLOW | O_NONBLOCK``, checked to be the inode
that was looked at, renamed into its job directory (the claim: one ``rename(2)``, after which the
name is the daemon's) and copied into ``dataset.<ext>``, owned by the daemon and mode 0600, while
its size is held to ``spool.max_dataset_bytes`` and its sha256 computed; then the user's inode is
unlinked. A file that changed while it was copied is put back (never over a newer file of the
same name) and taken again later. Nothing the user can still write is read after the copy, so a
writer that keeps appending, truncates or rewrites can change neither the data trained nor its hash.

**Daemon-owned names.** Job state lives in ``processing/<job id>/`` under fixed names that no
user file name can collide with. done/ and failed/ are written by the daemon only; their JSON
files are read with :func:`opt_ds_ops.fsutil.read_small` (no link followed, no FIFO opened).

Every step is ordered so that a SIGKILL leaves a state that :func:`recover_claim` finishes: the
record (``state: claiming``) is written before the rename, ``claimed`` (with the sha256) after the
copy is fsync'ed, and the user's inode is unlinked last.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone

from .config import SIDECAR_MAX_BYTES, SIDECAR_SUFFIXES
from .dataset import dataset_stem
from .fsutil import (
    fsync_dir, open_regular, pid_alive, read_small, rename_noreplace, try_lock, user_name, utc_now, write_atomic,
)

INCOMING, PROCESSING, DONE, FAILED = "incoming", "processing", "done", "failed"
SCORE = "score"  # issue 19: the scoring drop directory, claimed exactly as incoming/ (jobs of kind "score")
SUBDIRS = (INCOMING, SCORE, PROCESSING, DONE, FAILED)
IGNORED_SUFFIXES = (".part", ".tmp")
RESULT_SUFFIX, ERROR_SUFFIX, SIDECAR_SUFFIX = ".result.json", ".error.json", ".sidecar.yaml"
JOB_FILE, CHECKPOINT_FILE, SOURCE_FILE, LOCK_FILE = "job.json", "checkpoint.pt", "source", "lock"
SIDECAR_FILE, SIDECAR_SOURCE = "sidecar.yaml", "sidecar.source"
DATA_PREFIX = "dataset"
NAME_MAX_BYTES = 255
COPY_CHUNK = 1 << 20
_JOB_ID = re.compile(r"^\d{8}T\d{6}(\.\d{6})?Z-[0-9a-f]{6,32}$")
# errno values that mean the file system (not one dataset) is in trouble: intake pauses, retries
STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO)


class SpoolError(RuntimeError):
    """The spool (or models) directory cannot be used; the message names the path and why."""


def is_storage_error(e: BaseException) -> bool:
    """Return True for an OSError that is the file system's fault (ENOSPC, EDQUOT, EROFS, EIO)."""
    return isinstance(e, OSError) and e.errno in STORAGE_ERRNOS


def is_ignored(name: str) -> bool:
    """Return True for names the daemon never claims on their own in incoming/: '.NAME',
    'NAME.part', 'NAME.tmp' and sidecars ('STEM.yaml', 'STEM.yml': taken with their dataset)."""
    return name.startswith(".") or name.lower().endswith(IGNORED_SUFFIXES + SIDECAR_SUFFIXES)


def sidecar_names(name: str) -> list[str]:
    """Return the sidecar names dataset ``name`` may have in incoming/: ``STEM.yaml``, ``STEM.yml``."""
    return [dataset_stem(name) + suffix for suffix in SIDECAR_SUFFIXES]


def is_job_id(name: str) -> bool:
    """Return True if name has the shape of a job id (a processing/ directory of this daemon)."""
    return bool(_JOB_ID.match(name))


def new_job_id() -> str:
    """Return a unique job id that sorts by claim time: ``20261130T014242.123456Z-3f9a2c1b``."""
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ-") + uuid.uuid4().hex[:8]


def sidecar_name(name: str, suffix: str) -> str:
    """Return the JSON file name beside dataset ``name`` in done/ or failed/: ``NAME.result.json``.

    If that would exceed NAME_MAX (255 bytes), the name is cut and a hash of the full name keeps
    it unique: ``<first bytes>~<sha1 prefix><suffix>``.
    """
    full = name + suffix
    if len(os.fsencode(full)) <= NAME_MAX_BYTES:
        return full
    digest = "~" + hashlib.sha1(os.fsencode(name)).hexdigest()[:12]
    room = NAME_MAX_BYTES - len(os.fsencode(digest + suffix))
    return os.fsdecode(os.fsencode(name)[:room]) + digest + suffix


def _numbered(name: str, n: int) -> str:
    """Return ``NAME.n`` cut to fit NAME_MAX (a second dataset of the same name in done/ or failed/)."""
    tail = f".{n}"
    raw = os.fsencode(name)
    return os.fsdecode(raw[: NAME_MAX_BYTES - len(tail)]) + tail


def write_json(path: str, obj: dict) -> None:
    """Atomically write obj as indented JSON (non-ASCII escaped, so any file name round-trips)."""
    write_atomic(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("ascii"))


def read_json(path: str) -> dict | None:
    """Return the JSON object in path, or None if it is missing, not a regular file (a FIFO or
    link is never opened in a blocking way or followed), larger than 1 MiB, or not an object."""
    try:
        obj = json.loads(read_small(path))
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


def data_suffix(name: str) -> str:
    """Return the format suffix of a dataset name, lower-cased (``.txt.gz``, ``.npy``, or "")."""
    low = name.lower()
    gz = ".gz" if low.endswith(".gz") else ""
    base = low[: -len(gz)] if gz else low
    ext = os.path.splitext(base)[1]
    return ext + gz if ext and len(ext) <= 8 and ext[1:].isalnum() else ""


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

    def job_dir(self, job_id: str) -> str:
        """processing/JOB: the job's own directory."""
        return self.path(PROCESSING, job_id)

    def job_path(self, job_id: str, name: str) -> str:
        """A fixed-name file in the job's directory: job.json, checkpoint.pt, dataset.<ext>, ..."""
        return os.path.join(self.job_dir(job_id), name)


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


DAEMON_LOCK = ".daemon.lock"


def lock_spool(spool: Spool) -> int:
    """Take the spool's single-daemon lock (``flock`` on ``spool.dir/.daemon.lock``, holding the
    pid); return its fd, to keep open for the daemon's life (the kernel drops the lock when the
    process dies). Raises SpoolError naming the other daemon's pid if one holds it."""
    path = os.path.join(spool.root, DAEMON_LOCK)
    fd = try_lock(path, 0o640)
    if fd is None:
        try:
            other = read_small(path, 64).decode("ascii", "replace").strip() or "?"
        except OSError:
            other = "?"
        raise SpoolError(f"spool directory {spool.root} is served by another ds-trainer (pid {other}); "
                         "one daemon per spool")
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode("ascii"))
    return fd


def daemon_pid(spool: Spool) -> int | None:
    """Return the pid of the daemon serving the spool, or None if no process holds its lock.

    Read from ``/proc/locks`` (the kernel's table of held locks: a FLOCK on the inode of
    ``.daemon.lock``), never by taking the lock, so a status never stands in a daemon's way; where
    /proc/locks cannot be read, the pid written in the lock file, if that process runs.
    """
    path = os.path.join(spool.root, DAEMON_LOCK)
    try:
        ino = os.stat(path).st_ino
    except OSError:
        return None
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 5 and fields[1] == "FLOCK" and fields[5].rsplit(":", 1)[-1] == str(ino):
                    return int(fields[4]) if fields[4].isdigit() else None
        return None
    except OSError:
        pass
    try:
        pid = int(read_small(path, 64).decode("ascii").strip())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return pid if pid_alive(pid) else None


def kind_of(mode: int) -> str:
    """Return what a non-regular file is, in words ("a FIFO (named pipe)", "a directory", ...)."""
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device node"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    return "not a regular file"


def list_incoming(spool: Spool, drop: str = INCOMING) -> list[str]:
    """Return the names in incoming/ (or ``drop``) the daemon will consider, oldest modification first."""
    entries = []
    with os.scandir(spool.dir(drop)) as it:
        for e in it:
            if is_ignored(e.name):
                continue
            try:
                entries.append((e.stat(follow_symlinks=False).st_mtime_ns, e.name))
            except FileNotFoundError:
                continue
    return [name for _, name in sorted(entries)]


# ---- claiming ----------------------------------------------------------------------------------

@dataclass
class Claim:
    """What :func:`claim` did with one incoming/ entry.

    ``outcome``: ``claimed`` (a job directory with a complete copy; ``record`` is its job.json),
    ``refused`` (in a job directory, to be moved to failed/ with ``reason``), ``empty`` (a
    zero-byte file: removed, nothing to keep), ``ignored`` (not a regular file: left in place,
    ``reason`` says what it is), ``busy`` (changed while being copied: put back, try later) or
    ``gone`` (vanished first).
    """

    outcome: str
    job_id: str | None = None
    record: dict = field(default_factory=dict)
    reason: str = ""


def _identity(st: os.stat_result) -> tuple:
    return st.st_dev, st.st_ino


def _content_sig(st: os.stat_result) -> tuple:
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns


def claim(spool: Spool, name: str, max_bytes: int, *, on_job=None, progress=None, drop: str = INCOMING,
          kind: str | None = None) -> Claim:
    """Claim incoming/NAME (or ``drop``/NAME: the scoring spool's score/, with ``kind`` "score" in the
    record): rename it into a new job directory and copy its bytes (see the module
    docstring). ``max_bytes`` is ``spool.max_dataset_bytes``: a larger file is refused.
    ``on_job(job_id)`` is called once the job directory and its record exist (the daemon notes
    which job it is handling); ``progress()`` after each copied chunk (the daemon's watchdog ping).

    Never opens anything but a regular file, never blocks, never renames a directory. Raises
    OSError only for errors of the spool itself (ENOSPC, EIO, ...), never for what a user dropped.
    The record keeps ``uploader_uid``, the owner of the dropped inode (sidecars and model names
    are bound to it, see :func:`take_sidecar`).
    """
    src = spool.path(drop, name)
    try:
        st = os.lstat(src)
    except FileNotFoundError:
        return Claim("gone")
    if not stat.S_ISREG(st.st_mode):
        return Claim("ignored", reason=f"{kind_of(st.st_mode)}; only regular files are taken")
    try:
        fd, fst = open_regular(src)
    except FileNotFoundError:
        return Claim("gone")
    except OSError as e:
        if is_storage_error(e):
            raise
        if e.errno != errno.EACCES:  # replaced (ELOOP, ENXIO, ...), a lease held on it (EAGAIN): later
            return Claim("busy", reason=f"cannot be opened now: {e.strerror or e}")
        fd, fst = None, st  # unreadable: claimed (so it leaves incoming/) and refused
    try:
        if _identity(fst) != _identity(st):
            return Claim("busy", reason="replaced while being looked at")
        job_id = new_job_id()
        jdir = spool.job_dir(job_id)
        os.mkdir(jdir, 0o750)
        record = {"job_id": job_id, "dataset": name, "state": "claiming", "claimed_at": utc_now(),
                  "size_bytes": fst.st_size, "uploader_uid": fst.st_uid,
                  "source": {"dev": fst.st_dev, "ino": fst.st_ino}}
        if drop != INCOMING:
            record.update(drop=drop, kind=kind or drop)
        write_json(os.path.join(jdir, JOB_FILE), record)
        if on_job is not None:
            on_job(job_id)
        source = os.path.join(jdir, SOURCE_FILE)
        try:
            os.rename(src, source)  # the claim: from here on the name is the daemon's
        except OSError as e:
            shutil.rmtree(jdir, ignore_errors=True)
            if e.errno == errno.ENOENT:
                return Claim("gone")
            if is_storage_error(e):
                raise
            return Claim("busy", reason=f"could not be claimed: {e.strerror}")
        fsync_dir(spool.dir(drop))
        fsync_dir(jdir)
        moved = os.lstat(source)
        if _identity(moved) != _identity(fst):  # swapped between open and rename: not what we opened
            _give_back(spool, jdir, name, drop)
            return Claim("busy", reason="replaced while being claimed")
        return _copy_in(spool, job_id, record, fd, max_bytes, progress)
    finally:
        if fd is not None:
            os.close(fd)


def _put_back(spool: Spool, jdir: str, name: str, drop: str = INCOMING) -> str | None:
    """Return the user's file from jdir/source to incoming/ (or ``drop``; never over a newer file of that
    name: then NAME.returned-N, and last NAME.returned-JOB, a name no one can have taken before);
    return the name it got, or None if there was nothing to return. Raises OSError if even that
    fails (the job directory then stays, ``claiming``: recovery takes the file from there)."""
    source = os.path.join(jdir, SOURCE_FILE)
    if not os.path.lexists(source):
        return None
    targets = [name] + [f"{name}.returned-{n}" for n in range(1, 100)] + [f"{name}.returned-{os.path.basename(jdir)}"]
    for target in targets:
        try:
            rename_noreplace(source, spool.path(drop, target))
            fsync_dir(spool.dir(drop))
            return target
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free name to put the file back under", source)


def _give_back(spool: Spool, jdir: str, name: str, drop: str = INCOMING) -> str | None:
    """:func:`_put_back`, then remove the job directory; where the file cannot be put back, the
    directory stays (``claiming``) and the next start's recovery takes the file from it: a user's
    file is never removed with it. Return the name it got in incoming/, or None."""
    try:
        back = _put_back(spool, jdir, name, drop)
    except OSError:
        return None
    shutil.rmtree(jdir, ignore_errors=True)
    return back


def _copy_in(spool: Spool, job_id: str, record: dict, fd: int | None, max_bytes: int, progress=None) -> Claim:
    """Copy the claimed source into the job's dataset file, then unlink the source (see claim);
    ``progress()`` is called after each chunk of COPY_CHUNK bytes."""
    jdir = spool.job_dir(job_id)
    name = record["dataset"]
    drop = record.get("drop", INCOMING)
    source = os.path.join(jdir, SOURCE_FILE)
    if fd is None:
        st = os.lstat(source)
        return _refuse(record, f"unreadable: permission denied (mode {stat.filemode(st.st_mode)}, owner uid "
                       f"{st.st_uid}); make it readable by group ds-ops and drop it again")
    before = os.fstat(fd)
    if before.st_nlink > 1:  # a hard link to an inode another member owns: who dropped it cannot be told
        return _refuse(record, f"it has {before.st_nlink} hard links (owner {user_name(before.st_uid)}): who dropped it "
                       "cannot be told, so it is not trained; drop a copy of its own (cp, or mv of a file "
                       "that has no other name)")
    if before.st_size == 0:
        os.unlink(source)
        return Claim("empty", job_id, record, "an empty file (0 bytes); removed, nothing to train")
    if before.st_size > max_bytes:
        return _refuse(record, f"{before.st_size} bytes, larger than spool.max_dataset_bytes ({max_bytes} bytes)")
    data_name = DATA_PREFIX + data_suffix(name)
    dest = os.path.join(jdir, data_name)
    h = hashlib.sha256()
    copied = 0
    try:
        out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            os.lseek(fd, 0, os.SEEK_SET)
            while True:
                chunk = os.read(fd, COPY_CHUNK)
                if not chunk:
                    break
                copied += len(chunk)
                if copied > max_bytes:
                    break
                h.update(chunk)
                view = memoryview(chunk)
                while view:
                    view = view[os.write(out, view):]
                if progress is not None:
                    progress()
            os.fsync(out)
        finally:
            os.close(out)
    except OSError:
        # the spool's file system failed (ENOSPC, EIO): the user's file goes back where it was
        try:
            os.unlink(dest)
            if _put_back(spool, jdir, name, drop) is not None:
                shutil.rmtree(jdir, ignore_errors=True)
        except OSError:
            pass  # still "claiming": recover_claim copies again from jdir/source
        raise
    after = os.fstat(fd)
    if _content_sig(after) != _content_sig(before) or copied != before.st_size:
        os.unlink(dest)
        back = _give_back(spool, jdir, name, drop)
        return Claim("busy", reason="it changed while being copied (still being written?)"
                     + (f"; put back as {drop}/{back}" if back and back != name else ""))
    record.update(state="claimed", data_file=data_name, sha256=h.hexdigest(), size_bytes=copied, copied_at=utc_now())
    record.pop("source", None)
    write_json(os.path.join(jdir, JOB_FILE), record)
    os.unlink(source)  # the user's inode: any writer still holding it now writes into nothing we read
    fsync_dir(jdir)
    take_sidecar(spool, job_id, record)
    return Claim("claimed", job_id, record)


def take_sidecar(spool: Spool, job_id: str, record: dict) -> None:
    """Take the dataset's sidecar from incoming/ into the job directory (``sidecar.yaml``) and note
    it in the record (``sidecar``: its name; ``sidecar_error``: why it could not be taken;
    ``sidecars_foreign``: the files of those names other users dropped, not taken).

    A sidecar applies only to a dataset of the same uploader: one whose owner is not the
    dataset's ``uploader_uid`` (a squatted name: Bob's ``alice.yaml`` before Alice drops
    ``alice.csv``) is never taken or parsed; it is named in ``sidecars_foreign`` and the daemon
    moves it aside to failed/ as its own entry. The uploader's own sidecar is taken like a dataset: only
    a regular file, renamed in, then copied (64 KiB at most); anything else of that name of
    theirs (a directory, FIFO, link) is left alone and named in ``sidecar_error``, so the job
    fails rather than silently training without the options it was meant to have. Its bytes are
    never parsed here, nor anywhere in the daemon: the job process parses ``sidecar.yaml``.
    Idempotent: the record names the sidecar before it is renamed in, so a SIGKILL between the
    steps leaves ``sidecar.source`` and a record that still says whose it is.
    """
    jdir = spool.job_dir(job_id)
    taken = os.path.join(jdir, SIDECAR_SOURCE)
    owner = record.get("uploader_uid")
    drop = record.get("drop", INCOMING)
    if not os.path.lexists(taken):
        for cand in sidecar_names(record["dataset"]):
            if len(os.fsencode(cand)) > NAME_MAX_BYTES:
                continue  # a dataset name near NAME_MAX has no room for a sidecar's suffix
            src = spool.path(drop, cand)
            try:
                st = os.lstat(src)
            except FileNotFoundError:
                continue
            if owner is not None and (st.st_uid != owner or st.st_nlink > 1):  # a hard link: anyone's
                record.setdefault("sidecars_foreign", []).append(
                    {"name": cand, "uid": st.st_uid, "ino": st.st_ino,
                     "kind": "a regular file" if stat.S_ISREG(st.st_mode) else kind_of(st.st_mode),
                     **({"drop": drop} if drop != INCOMING else {})})
                continue
            record["sidecar"] = cand
            if not stat.S_ISREG(st.st_mode):
                record["sidecar_error"] = f"{drop}/{cand} is {kind_of(st.st_mode)}, not a regular file"
                break
            write_json(os.path.join(jdir, JOB_FILE), record)  # before the rename: recovery knows its name
            try:
                os.rename(src, taken)
            except FileNotFoundError:
                record.pop("sidecar")
                continue
            fsync_dir(spool.dir(drop))
            break
    if os.path.lexists(taken):
        record.setdefault("sidecar", dataset_stem(record["dataset"]) + SIDECAR_SUFFIXES[0])
        try:
            data = read_small(taken, SIDECAR_MAX_BYTES)
            write_atomic(os.path.join(jdir, SIDECAR_FILE), data)
        except OSError as e:
            if is_storage_error(e):
                raise
            record["sidecar_error"] = f"{drop}/{record.get('sidecar')}: cannot be read: {e.strerror or e}"
        os.unlink(taken)
        fsync_dir(jdir)
    if "sidecar" in record or "sidecars_foreign" in record:
        write_json(os.path.join(jdir, JOB_FILE), record)


def _refuse(record: dict, reason: str) -> Claim:
    record["data_file"] = SOURCE_FILE
    return Claim("refused", record["job_id"], record, reason)


def recover_claim(spool: Spool, job_id: str, record: dict, max_bytes: int, progress=None) -> Claim:
    """Finish a claim a SIGKILL interrupted: copy again from the source if it was renamed in,
    drop the job directory if it was not; unlink a leftover source of a completed copy."""
    jdir = spool.job_dir(job_id)
    source = os.path.join(jdir, SOURCE_FILE)
    if record.get("state") != "claiming":
        if os.path.lexists(source) and record.get("data_file") != SOURCE_FILE:
            os.unlink(source)
        if os.path.lexists(os.path.join(jdir, SIDECAR_SOURCE)):
            take_sidecar(spool, job_id, record)
        return Claim("claimed", job_id, record)
    if not os.path.lexists(source):
        shutil.rmtree(jdir, ignore_errors=True)
        return Claim("gone")
    for leftover in os.listdir(jdir):
        if leftover.startswith(DATA_PREFIX):
            os.unlink(os.path.join(jdir, leftover))
    try:
        fd, _ = open_regular(source)
    except OSError as e:
        if e.errno != errno.EACCES:
            _give_back(spool, jdir, record.get("dataset", "recovered"), record.get("drop", INCOMING))
            return Claim("gone")
        fd = None
    try:
        return _copy_in(spool, job_id, record, fd, max_bytes, progress)
    finally:
        if fd is not None:
            os.close(fd)


# ---- jobs in processing/ -----------------------------------------------------------------------

def job_ids(spool: Spool) -> list[str]:
    """Return the job directories in processing/, oldest claim first."""
    try:
        names = os.listdir(spool.dir(PROCESSING))
    except FileNotFoundError:
        return []
    return sorted(n for n in names if is_job_id(n) and os.path.isdir(spool.job_dir(n))
                  and not os.path.islink(spool.job_dir(n)))


def read_record(spool: Spool, job_id: str) -> dict | None:
    """Return processing/JOB/job.json, or None if it is missing or unreadable."""
    return read_json(spool.job_path(job_id, JOB_FILE))


def save_record(spool: Spool, record: dict) -> None:
    """Atomically write the job's record to processing/JOB/job.json."""
    write_json(spool.job_path(record["job_id"], JOB_FILE), record)


def lock_job(spool: Spool, job_id: str) -> int | None:
    """Take the job's lock (``flock`` on processing/JOB/lock); return its fd, or None if a live
    process (the job's own process, or one of a daemon that was killed) still holds it. The job
    process holds it for its lifetime; the kernel drops it when the holder dies."""
    return try_lock(spool.job_path(job_id, LOCK_FILE))


def finish(spool: Spool, job_id: str, record: dict, dest: str, doc: dict) -> str:
    """Move the job's dataset file to dest (DONE or FAILED) with its JSON beside it, remove the
    job directory; return the name the dataset got there.

    ``doc`` goes to ``NAME.result.json`` in done/ or ``NAME.error.json`` in failed/, with
    ``dataset_file`` set to the final name. An existing dataset of the same name is never
    replaced: the newcomer becomes ``NAME.1``, ``NAME.2``, ... A JSON file left by an earlier
    attempt of the same job (same ``job_id``) is reused. Raises OSError if the spool cannot be written.
    """
    suffix = RESULT_SUFFIX if dest == DONE else ERROR_SUFFIX
    name = record.get("dataset") or job_id
    jdir = spool.job_dir(job_id)
    data = os.path.join(jdir, record.get("data_file") or SOURCE_FILE)
    final, n = name, 0
    while True:
        side = spool.path(dest, sidecar_name(final, suffix))
        taken = os.path.lexists(spool.path(dest, final))
        old = read_json(side) if os.path.lexists(side) else None
        if old is not None and old.get("job_id") == doc.get("job_id") and not (taken and os.path.lexists(data)):
            break  # this job already got here: killed after writing its JSON, or after the move too
        if not taken and not os.path.lexists(side):
            break
        n += 1
        final = _numbered(name, n)
    write_json(side, dict(doc, dataset_file=final))
    sidecar = os.path.join(jdir, SIDECAR_FILE)
    if os.path.lexists(sidecar):
        os.replace(sidecar, spool.path(dest, sidecar_name(final, SIDECAR_SUFFIX)))
    if os.path.lexists(data):
        rename_noreplace(data, spool.path(dest, final))
        if record.get("data_file") not in (None, SOURCE_FILE):
            os.chmod(spool.path(dest, final), 0o640)  # the daemon's copy; a refused user's inode keeps its mode
    fsync_dir(spool.dir(dest))
    shutil.rmtree(jdir)
    fsync_dir(spool.dir(PROCESSING))
    return final


def remove_stale_temps(spool: Spool) -> list[str]:
    """Remove the hidden ``.tmp-*`` files :func:`write_json` leaves in done/, failed/ and
    processing/ when killed between writing and renaming (only the daemon writes there; call at
    start-up, before any write). Returns the paths removed."""
    removed = []
    for which in (DONE, FAILED, PROCESSING):
        try:
            names = os.listdir(spool.dir(which))
        except FileNotFoundError:
            continue
        for name in names:
            path = spool.path(which, name)
            if name.startswith(".tmp-") and not os.path.isdir(path):
                os.unlink(path)
                removed.append(path)
    return removed


def discard_job(spool: Spool, job_id: str) -> None:
    """Remove a job directory that holds nothing of a user's (an empty or vanished claim)."""
    shutil.rmtree(spool.job_dir(job_id), ignore_errors=True)


def _attachments(names: set[str]) -> set[str]:
    """Return the names among names that belong to another one: its ``.result.json``,
    ``.error.json`` or ``.sidecar.yaml`` (:func:`sidecar_name`), not datasets of their own."""
    return {side for n in names for suffix in (RESULT_SUFFIX, ERROR_SUFFIX, SIDECAR_SUFFIX)
            if (side := sidecar_name(n, suffix)) in names}


def prune_failed(spool: Spool, keep: int) -> list[str]:
    """Keep the newest ``keep`` datasets in failed/ (``spool.max_failed``); remove the older ones
    with their error JSON and sidecar; return the names removed. A JSON or sidecar is never
    counted as a dataset of its own."""
    entries = []
    with os.scandir(spool.dir(FAILED)) as it:
        found = {e.name: e for e in it if not e.name.startswith(".")}
    for name in set(found) - _attachments(set(found)):
        try:
            entries.append((found[name].stat(follow_symlinks=False).st_mtime_ns, name))
        except FileNotFoundError:
            continue
    if len(entries) <= keep:
        return []
    entries.sort()
    removed = []
    for _, name in entries[: len(entries) - keep]:
        for path in (spool.path(FAILED, name), spool.path(FAILED, sidecar_name(name, SIDECAR_SUFFIX)),
                     spool.path(FAILED, sidecar_name(name, ERROR_SUFFIX))):
            try:
                os.unlink(path)
            except (FileNotFoundError, IsADirectoryError):
                pass
        removed.append(name)
    return removed


def migrate_legacy(spool: Spool) -> list[str]:
    """Requeue datasets an older ds-ops left in processing/ (processing/NAME with hidden
    .NAME.job.json): each goes back to incoming/ (never over a file there) and the hidden files are
    removed. Returns the names requeued."""
    moved = []
    for entry in sorted(os.listdir(spool.dir(PROCESSING))):
        path = spool.path(PROCESSING, entry)
        if entry.startswith("."):
            if not is_job_id(entry) and os.path.isfile(path) and not os.path.islink(path):
                os.unlink(path)
            continue
        if is_job_id(entry):
            continue
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode):
            for n in range(100):
                target = entry if n == 0 else f"{entry}.{n}"
                try:
                    rename_noreplace(path, spool.path(INCOMING, target))
                    moved.append(target)
                    break
                except FileExistsError:
                    continue
    if moved:
        fsync_dir(spool.dir(INCOMING))
    return moved


def save_checkpoint(spool: Spool, job_id: str, obj: dict) -> str:
    """Atomically write obj (tensors, numbers, strings) to processing/JOB/checkpoint.pt; return its path."""
    import io

    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    path = spool.job_path(job_id, CHECKPOINT_FILE)
    write_atomic(path, buf.getvalue())
    return path


def load_checkpoint(spool: Spool, job_id: str) -> tuple[dict | None, str]:
    """Return (checkpoint dict, "") for the job, or (None, why not) if it is absent or unusable.

    Loaded with ``torch.load(weights_only=True)`` on the CPU: no pickled code runs.
    """
    import torch

    path = spool.job_path(job_id, CHECKPOINT_FILE)
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


def process_start_ticks(pid: int) -> int | None:
    """Return when process pid started (``/proc/PID/stat`` field 22, clock ticks since boot), or
    None if it does not exist or /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat_line = f.read()
        return int(stat_line.rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def process_alive(pid: int | None, boot: str | None, start_ticks: int | None = None) -> bool:
    """Return True if the process pid of a record runs now. With ``start_ticks`` (the record's
    :func:`process_start_ticks` of pid) the same pid must have started then: that tells a reused pid
    apart without the boot id, which differs between a sandboxed unit and a shell in a container
    (ProtectKernelTunables= hides nspawn's boot id). Without it: pid runs and the boot id matches."""
    if not pid:
        return False
    if start_ticks is not None:
        return process_start_ticks(pid) == start_ticks
    if boot and boot != boot_id():
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


def ignored_entries(spool: Spool) -> list[dict]:
    """Return the entries of incoming/ that are not regular files (left alone): name and kind;
    sidecar names too (a FIFO or directory squatting a sidecar's name is never taken), not hidden
    or ``.part``/``.tmp`` ones (being written)."""
    out = []
    try:
        with os.scandir(spool.dir(INCOMING)) as it:
            for e in it:
                try:
                    mode = e.stat(follow_symlinks=False).st_mode
                except FileNotFoundError:
                    continue
                if not stat.S_ISREG(mode) and not (e.name.startswith(".") or e.name.lower().endswith(IGNORED_SUFFIXES)):
                    out.append({"name": e.name, "kind": kind_of(mode)})
    except FileNotFoundError:
        pass
    return sorted(out, key=lambda d: d["name"])


def _not_superseded(spool: Spool, failed: list[dict]) -> list[dict]:
    """Return the failed docs that no later success of the same dataset name superseded (a fixed
    file dropped again, or requeued, that then trained): ``latest failed`` shows what still needs
    an operator. Only done/ results newer than the oldest of these failures are read."""
    times = [t for d in failed if (t := d.get("failed_at"))]
    if not times:
        return failed
    oldest = min(times)
    try:
        since = datetime.strptime(oldest, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc).timestamp()
    except (TypeError, ValueError):
        since = 0.0
    done_at: dict[str, str] = {}
    try:
        with os.scandir(spool.dir(DONE)) as it:
            for e in it:
                if e.name.endswith(RESULT_SUFFIX) and not e.name.startswith("."):
                    try:
                        if e.stat(follow_symlinks=False).st_mtime < since - 1:
                            continue  # written before the oldest failure shown: cannot supersede it
                    except FileNotFoundError:
                        continue
                    doc = read_json(e.path) or {}
                    at, name = doc.get("finished_at"), doc.get("dataset")
                    if isinstance(at, str) and isinstance(name, str) and at > oldest and at > done_at.get(name, ""):
                        done_at[name] = at
    except FileNotFoundError:
        return failed
    return [d for d in failed if not (isinstance(d.get("failed_at"), str) and done_at.get(d.get("dataset"), "") > d["failed_at"])]


def spool_status(spool: Spool, last: int = 5) -> dict:
    """Return what the spool shows: queue, jobs in processing/, counts and the newest results.

    Read from the files alone (works without talking to the daemon), never opening anything but a
    regular file: ``queue`` lists incoming/ names oldest first, ``ignored`` the entries there that
    are not regular files; each job in ``processing`` carries its record (state, epoch, losses)
    and ``daemon_alive`` (the pid in the record runs, same boot). Raises FileNotFoundError if the
    spool does not exist.
    """
    if not os.path.isdir(spool.root):
        raise FileNotFoundError(spool.root)
    queue = list_incoming(spool) if os.path.isdir(spool.dir(INCOMING)) else []
    ignored = ignored_entries(spool)
    skip = {d["name"] for d in ignored}
    jobs = []
    daemon = daemon_pid(spool)
    for job_id in job_ids(spool):
        record = read_record(spool, job_id) or {"job_id": job_id}
        if record.get("pid"):
            alive = process_alive(record.get("pid"), record.get("boot_id"), record.get("pid_start"))
        else:  # claiming (being copied in) or claimed (waiting its turn): the spool's daemon has it
            alive = daemon is not None and record.get("state") in ("claiming", "claimed")
        jobs.append(dict(record, daemon_alive=alive,
                         checkpoint=os.path.exists(spool.job_path(job_id, CHECKPOINT_FILE))))
    n_done, done = _recent_docs(spool.dir(DONE), RESULT_SUFFIX, last)
    n_failed, failed = _recent_docs(spool.dir(FAILED), ERROR_SUFFIX, last)
    failed = _not_superseded(spool, failed)
    return {
        "spool": spool.root,
        "daemon_pid": daemon,
        "queue": [n for n in queue if n not in skip],
        "score_queue": list_incoming(spool, SCORE) if os.path.isdir(spool.dir(SCORE)) else [],  # issue 19
        "ignored": ignored,
        "processing": jobs,
        "done_count": n_done,
        "failed_count": n_failed,
        "recent_done": done,
        "recent_failed": failed,
        "checked_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


# ---- retention of done/ and failed/, requeue (issue 11) -----------------------------------------

def _finished_entries(spool: Spool, dest: str) -> list[tuple[float, int, list[str], str]]:
    """Return (mtime of the JSON in seconds, bytes, [paths: dataset, sidecar, JSON], dataset name)
    per finished dataset of dest (DONE or FAILED), oldest first. The JSON (``NAME.result.json``,
    ``NAME.error.json``) anchors each entry: it is written first by :func:`finish` and removed
    last by :func:`prune_retention`."""
    suffix = RESULT_SUFFIX if dest == DONE else ERROR_SUFFIX
    entries = []
    with os.scandir(spool.dir(dest)) as it:
        found = list(it)
        owner = {sidecar_name(e.name, suffix): e.name for e in found}  # a JSON's dataset, by its name alone
        for e in found:
            if e.name.startswith(".") or not e.name.endswith(suffix):
                continue
            doc = read_json(e.path) or {}  # {}: over read_json's 1 MiB or not JSON; its name says whose it is
            name = doc.get("dataset_file") if isinstance(doc.get("dataset_file"), str) else owner.get(e.name)
            paths = []
            if name and "/" not in name and name not in (".", ".."):
                paths = [spool.path(dest, name), spool.path(dest, sidecar_name(name, SIDECAR_SUFFIX))]
            paths.append(e.path)
            size, mtime = 0, 0.0
            for p in paths:
                try:
                    st = os.lstat(p)
                except FileNotFoundError:
                    continue
                size += st.st_size
                if p == e.path:
                    mtime = st.st_mtime
            entries.append((mtime, size, paths, name or e.name))
    entries.sort()
    return entries


def prune_retention(spool: Spool, dest: str, max_age_days: float, max_bytes: int, now: float | None = None) -> list[str]:
    """Remove finished datasets of dest (DONE or FAILED) with their JSON and sidecar: those older
    than ``max_age_days`` (days, by the JSON's mtime: when the job finished), then the oldest until
    the directory's datasets total at most ``max_bytes``; 0 turns either rule off. Return the
    dataset names removed, oldest first. The JSON goes last, so a kill midway leaves an entry the
    next call finds again. Raises OSError if the directory cannot be read or a file removed."""
    if max_age_days <= 0 and max_bytes <= 0:
        return []
    entries = _finished_entries(spool, dest)
    now = time.time() if now is None else now
    total = sum(size for _, size, _, _ in entries)
    removed = []
    for mtime, size, paths, name in entries:
        too_old = max_age_days > 0 and now - mtime > max_age_days * 86400
        too_big = max_bytes > 0 and total > max_bytes
        if not (too_old or too_big):
            break  # oldest first: nothing newer is older, and the total already fits
        for p in paths:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
        total -= size
        removed.append(name)
    if removed:
        fsync_dir(spool.dir(dest))
    return removed


def requeue(spool: Spool, name: str) -> dict:
    """Move failed/NAME back to incoming/NAME (score/NAME for a file that was to be scored) for the
    daemon to take again: its sidecar first (as
    ``incoming/STEM.yaml``, taken with the dataset), then the dataset (a rename that never replaces
    a file of the same name in incoming/), then its ``.error.json`` is removed. Return
    ``{dataset, sidecar, error}`` (the error document, for the record). Raises SpoolError for a name
    not in failed/ or already in incoming/, OSError if the spool cannot be written (root or the
    service user ds-ops may write failed/; a group member may not)."""
    if "/" in name or name in ("", ".", "..") or name.startswith("."):
        raise SpoolError(f"{name!r} is not a dataset name in failed/")
    src = spool.path(FAILED, name)
    if not os.path.isfile(src) or os.path.islink(src):
        raise SpoolError(f"failed/{name} does not exist (ds-ops status lists the latest failures)")
    err_path = spool.path(FAILED, sidecar_name(name, ERROR_SUFFIX))
    doc = read_json(err_path) if os.path.lexists(err_path) else None
    original = (doc or {}).get("dataset") or name
    if not isinstance(original, str) or "/" in original or original.startswith("."):
        original = name
    back = SCORE if (doc or {}).get("drop") == SCORE else INCOMING  # a file to score goes back to score/
    if os.path.lexists(spool.path(back, original)):
        raise SpoolError(f"{back}/{original} exists already; remove or rename it first")
    side_src = spool.path(FAILED, sidecar_name(name, SIDECAR_SUFFIX))
    uploader = (doc or {}).get("uploader_uid")
    if isinstance(uploader, int) and not isinstance(uploader, bool) and os.geteuid() == 0:
        # the daemon's copies belong to the service: give them back to their uploader before they
        # are offered again, so the model name and the sidecar stay theirs (a requeue by the ds-ops
        # user cannot chown: the files stay the service's, which may train any model)
        for path in (src, side_src):
            if os.path.lexists(path):
                os.lchown(path, uploader, -1)
    side_dst = None
    if os.path.lexists(side_src):
        side_dst = dataset_stem(original) + SIDECAR_SUFFIXES[0]
        rename_noreplace(side_src, spool.path(back, side_dst))
    rename_noreplace(src, spool.path(back, original))
    fsync_dir(spool.dir(back))
    try:
        os.unlink(err_path)
    except FileNotFoundError:
        pass
    fsync_dir(spool.dir(FAILED))
    return {"dataset": original, "sidecar": side_dst, "error": doc}
