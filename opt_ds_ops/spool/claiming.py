"""Claiming: a dataset dropped in ``incoming/`` (or ``score/``) becomes a job directory that the
daemon owns, ``processing/<job id>/``, holding the daemon's copy of its bytes and its sidecar.

**Sidecars.** A sidecar (``STEM.yaml`` beside ``STEM.csv``; keys in
:func:`opt_ds_ops.config.sidecar.parse_sidecar`) is never a job of its own: it waits in incoming/ until
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

Every step is ordered so that a SIGKILL leaves a state that :func:`recover_claim` finishes: the
record (``state: claiming``) is written before the rename, ``claimed`` (with the sha256) after the
copy is fsync'ed, and the user's inode is unlinked last.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import stat
from dataclasses import dataclass, field

from ..config.sidecar import SIDECAR_MAX_BYTES, SIDECAR_SUFFIXES
from ..dataset import dataset_stem
from ..fsutil import fsync_dir, open_regular, read_small, rename_noreplace, user_name, utc_now, write_atomic
from .layout import (
    COPY_CHUNK, DATA_PREFIX, INCOMING, JOB_FILE, NAME_MAX_BYTES, SCORE, SIDECAR_FILE, SIDECAR_SOURCE, SOURCE_FILE, Spool,
    data_suffix, is_ignored, is_storage_error, kind_of, new_job_id, sidecar_names, write_json,
)


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
    ``progress()`` is called after each chunk of COPY_CHUNK bytes. A chunk of zeros is not written
    but skipped, so the copy of a sparse file (``truncate -s 4G``) has holes where it had them and
    takes the blocks its data takes, not its length: a member cannot make the service hold
    terabytes in failed/ with files that take nothing on disk."""
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
    zeros = bytes(COPY_CHUNK)
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
                if chunk == zeros[:len(chunk)]:  # a hole stays a hole: no blocks of the service's for it
                    os.lseek(out, len(chunk), os.SEEK_CUR)
                else:
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(out, view):]
                if progress is not None:
                    progress()
            os.ftruncate(out, min(copied, max_bytes))  # the length of a file that ends in a hole
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
    moves it aside to failed/ as its own entry; a chunk in score/ whose only sidecar is such a
    file is noted (``sidecar_squatted``): the scoring job fails it with that reason rather than
    score it under its file name, unless that name is a model its uploader may score. The uploader's own sidecar is taken like a dataset: only
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
    if drop == SCORE and "sidecar" not in record and record.get("sidecars_foreign"):
        # a chunk whose sidecar name another member took: its own sidecar's rename was refused (the
        # sticky bit), so it would be scored under its file name, by a model it may not have meant
        f = record["sidecars_foreign"][0]
        # (the scoring job fails it with this reason unless its file name names a model its uploader
        # may score: a chunk that needs no sidecar is not stopped by someone else's)
        record["sidecar_squatted"] = (f"{drop}/{f['name']} belongs to another member (uid {f['uid']}), not to this "
                                      "chunk's uploader: not applied, moved aside; the chunk is not scored under its "
                                      "file name instead. Drop it again with a sidecar of your own, staged where no "
                                      "one else can see it (docs/alerts.md)")
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
    record["sidecar_done"] = True  # recovery takes the sidecar again only where this is missing
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
        if os.path.lexists(os.path.join(jdir, SIDECAR_SOURCE)) or (
                not record.get("sidecar_done") and not os.path.lexists(os.path.join(jdir, SIDECAR_FILE))):
            take_sidecar(spool, job_id, record)  # killed before or while the sidecar was taken
        elif not record.get("sidecar_done"):  # taken and copied; killed before the record said so
            record["sidecar_done"] = True
            write_json(os.path.join(jdir, JOB_FILE), record)
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
