"""Retention of ``done/`` and ``failed/``: ``spool.max_failed``, and the age and size
limits of each directory. A finished dataset goes with its JSON and sidecar, the JSON last.
"""

from __future__ import annotations

import os
import time

from ..fsutil import fsync_dir
from .layout import DONE, ERROR_SUFFIX, FAILED, RESULT_SUFFIX, SIDECAR_SUFFIX, Spool, read_json, sidecar_name


def _attachments(names: set[str]) -> set[str]:
    """Return the names among names that belong to another one: its ``.result.json``,
    ``.error.json`` or ``.sidecar.yaml`` (:func:`sidecar_name`), not datasets of their own."""
    return {side for n in names for suffix in (RESULT_SUFFIX, ERROR_SUFFIX, SIDECAR_SUFFIX)
            if (side := sidecar_name(n, suffix)) in names}


def prune_failed(spool: Spool, keep: int) -> list[str]:
    """Keep ``keep`` datasets in failed/ (``spool.max_failed``); remove the others with their error
    JSON and sidecar; return the names removed. A JSON or sidecar is never counted as a dataset of
    its own.

    Nothing a member controls decides whose entries go: each entry's age is when the daemon
    failed it (its error JSON's mtime, written by the daemon; else the dataset's ctime, which no
    one can set), never the dataset's mtime (kept from the member's file, who may have set it to
    2100); and the entries removed are the oldest of the uploader (``uploader_uid`` in the error
    JSON) who has the most, so a member whose drops fail by the hundred ages out their own
    failures, not the others'."""
    entries = []
    with os.scandir(spool.dir(FAILED)) as it:
        found = {e.name: e for e in it if not e.name.startswith(".")}
    for name in set(found) - _attachments(set(found)):
        error = sidecar_name(name, ERROR_SUFFIX)
        try:
            if error in found:
                at = found[error].stat(follow_symlinks=False).st_mtime_ns
            else:
                at = found[name].stat(follow_symlinks=False).st_ctime_ns
        except FileNotFoundError:
            continue
        uploader = (read_json(found[error].path) or {}).get("uploader_uid") if error in found else None
        entries.append((at, name, uploader if isinstance(uploader, int) else None))
    if len(entries) <= keep:
        return []
    by_uploader: dict = {}
    for entry in sorted(entries):
        by_uploader.setdefault(entry[2], []).append(entry)
    removed = []
    for _ in range(len(entries) - keep):
        # the uploader with the most entries, and among equals the one whose oldest entry is oldest
        who = max(by_uploader, key=lambda u: (len(by_uploader[u]), -by_uploader[u][0][0]))
        _, name, _ = by_uploader[who].pop(0)
        if not by_uploader[who]:
            del by_uploader[who]
        for path in (spool.path(FAILED, name), spool.path(FAILED, sidecar_name(name, SIDECAR_SUFFIX)),
                     spool.path(FAILED, sidecar_name(name, ERROR_SUFFIX))):
            try:
                os.unlink(path)
            except (FileNotFoundError, IsADirectoryError):
                pass
        removed.append(name)
    return removed


def _finished_entries(spool: Spool, dest: str) -> list[tuple[float, int, list[str], str]]:
    """Return (mtime of the JSON in seconds, bytes on disk (allocated blocks), [paths: dataset,
    sidecar, JSON], dataset name) per finished dataset of dest (DONE or FAILED), oldest first. The
    JSON (``NAME.result.json``, ``NAME.error.json``) anchors each entry: it is written first by
    :func:`opt_ds_ops.spool.filing.finish` and removed last by :func:`prune_retention`. A member's
    refused file named like a JSON is a dataset (it has a JSON of its own), and what a JSON's text
    says never points at a file its name does not: no member decides which other entries go."""
    suffix = RESULT_SUFFIX if dest == DONE else ERROR_SUFFIX
    entries = []
    with os.scandir(spool.dir(dest)) as it:
        found = list(it)
        names = {e.name for e in found}
        owner = {sidecar_name(e.name, suffix): e.name for e in found}  # a JSON's dataset, by its name alone
        for e in found:
            if e.name.startswith(".") or not e.name.endswith(suffix):
                continue
            if sidecar_name(e.name, suffix) in names:
                continue  # a member's file named like a JSON (refused, with a JSON of its own): a dataset, not an anchor
            doc = read_json(e.path) or {}  # {}: over read_json's 1 MiB or not JSON; its name says whose it is
            name = doc.get("dataset_file") if isinstance(doc.get("dataset_file"), str) else owner.get(e.name)
            if name is not None and sidecar_name(name, suffix) != e.name:
                name = owner.get(e.name)  # the daemon's JSON is always NAME + suffix: the text names no other file
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
                size += st.st_blocks * 512  # the space it takes: a sparse file's holes are not (st_size would be)
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
