"""What the spool shows (``ds-ops status``): the queues, the jobs in processing/ and whether their
processes run, the entries left alone in incoming/, and the newest results and failures. Read from
the files alone, without the daemon.
"""

from __future__ import annotations

import os
import stat
import time
from datetime import datetime, timezone

from .claiming import list_incoming
from .layout import (
    CHECKPOINT_FILE, DONE, ERROR_SUFFIX, FAILED, IGNORED_SUFFIXES, INCOMING, RESULT_SUFFIX, SCORE, Spool, daemon_pid,
    kind_of, read_json,
)
from .processing import job_ids, process_alive, read_record


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
    """Return the failed docs that no later success of the same dataset name and uploader superseded (a fixed
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
    done_at: dict[tuple, str] = {}  # (dataset name, uploader uid) -> its newest success
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
                    at, key = doc.get("finished_at"), (doc.get("dataset"), doc.get("uploader_uid"))
                    if isinstance(at, str) and isinstance(key[0], str) and at > oldest and at > done_at.get(key, ""):
                        done_at[key] = at
    except FileNotFoundError:
        return failed
    # a success of the same name by another uploader (a member's file of that name) clears nothing
    return [d for d in failed if not (isinstance(d.get("failed_at"), str)
                                      and done_at.get((d.get("dataset"), d.get("uploader_uid")), "") > d["failed_at"])]


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
        "score_queue": list_incoming(spool, SCORE) if os.path.isdir(spool.dir(SCORE)) else [],  # the scoring spool
        "ignored": ignored,
        "processing": jobs,
        "done_count": n_done,
        "failed_count": n_failed,
        "recent_done": done,
        "recent_failed": failed,
        "checked_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
