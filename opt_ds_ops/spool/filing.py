"""Finishing a job: its dataset moves to ``done/`` or ``failed/`` with its result or error JSON
beside it (:func:`finish`), and an operator's way back from failed/ to the queue (:func:`requeue`).
What stays in done/ and failed/, and for how long, is :mod:`opt_ds_ops.spool.retention`'s.
"""

from __future__ import annotations

import os
import shutil

from ..config.sidecar import SIDECAR_SUFFIXES
from ..dataset import dataset_stem
from ..fsutil import fsync_dir, rename_noreplace
from .layout import (
    DONE, ERROR_SUFFIX, FAILED, INCOMING, NAME_MAX_BYTES, PROCESSING, RESULT_SUFFIX, SCORE, SIDECAR_FILE, SIDECAR_SUFFIX,
    SOURCE_FILE, Spool, SpoolError, read_json, sidecar_name, write_json,
)


def _numbered(name: str, n: int) -> str:
    """Return ``NAME.n`` cut to fit NAME_MAX (a second dataset of the same name in done/ or failed/)."""
    tail = f".{n}"
    raw = os.fsencode(name)
    return os.fsdecode(raw[: NAME_MAX_BYTES - len(tail)]) + tail


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
    if os.path.lexists(data):
        rename_noreplace(data, spool.path(dest, final))
        if record.get("data_file") not in (None, SOURCE_FILE):
            os.chmod(spool.path(dest, final), 0o640)  # the daemon's copy; a refused user's inode keeps its mode
    # the sidecar after the dataset: while the data is in the job directory its sidecar is too, so a
    # job run again after a kill here still reads the options and the name it was dropped with
    sidecar = os.path.join(jdir, SIDECAR_FILE)
    if os.path.lexists(sidecar):
        os.replace(sidecar, spool.path(dest, sidecar_name(final, SIDECAR_SUFFIX)))
    fsync_dir(spool.dir(dest))
    shutil.rmtree(jdir)
    fsync_dir(spool.dir(PROCESSING))
    return final


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
    if isinstance(uploader, int) and not isinstance(uploader, bool) and os.geteuid() not in (0, uploader):
        # only root can give the daemon's copies back to their uploader; offered again as the service's
        # files they would train any model, whoever dropped them (the hostile review of 2560ed3)
        raise SpoolError(f"failed/{name} was dropped by uid {uploader}: only root can requeue it and keep "
                         "its uploader (the model name stays theirs): sudo ds-ops requeue NAME")
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
