"""The same bytes dropped again: noticed before training, said once, and not trained twice.

A dataset whose sha256 (hashed by the daemon while it copied the file in) equals the one a
version of the same model was trained from, read with the same dataset options and trained
with the same ``train:`` configuration, would train an identical version. The job process
(:func:`opt_ds_ops.daemon.worker.job_main`) asks :func:`same_bytes_version` before the health gate and,
on a match, ends the job with a ``duplicate`` message instead of training; the daemon ends it
in :mod:`opt_ds_ops.daemon.outcome`: one journal notice (``job-duplicate``) naming the version, and the
job's copy removed (the bytes are the ones that version was trained from, so done/ does not fill
with ``NAME.1``, ``NAME.2``). Changing ``train:`` or the sidecar's options, or removing that
version (``ds-ops models rm``), trains the same bytes again.
"""

from __future__ import annotations

import dataclasses
import json
import os

from ..config.conffile import Config, DatasetConfig, config_to_dict
from ..store.versions import StoreError, list_versions, read_metadata, safe_model_name


def _as_stored(d: dict) -> dict:
    """Return d as metadata.json holds it (JSON: a tuple is a list)."""
    return json.loads(json.dumps(d))


def same_bytes_version(cfg: Config, model_name: str, record: dict, options: DatasetConfig) -> dict | None:
    """Given a daemon job's record (``sha256``, ``uploader_uid``), its model name and dataset options,
    return ``{model_dir, version, sha256, trained_from, trained_at}`` of the newest version of that
    model trained from the same bytes with the same options and ``train:`` configuration, or None.

    A retraining job (``kind: retrain``) is never one (the daemon chose its data); nor is a version
    whose model another uploader owns (the job then goes on, and the owner check refuses it)."""
    sha = record.get("sha256")
    if record.get("kind") == "retrain" or not isinstance(sha, str) or not sha:
        return None
    try:
        name_dir = os.path.join(cfg.models_dir, safe_model_name(model_name))
    except StoreError:
        return None
    train, wanted = _as_stored(config_to_dict(cfg)["train"]), _as_stored(dataclasses.asdict(options))
    try:
        versions = list_versions(name_dir)
    except OSError:  # an unreadable store: the job goes on, and its own store check says why
        return None
    for version in reversed(versions):
        try:
            md = read_metadata(os.path.join(name_dir, version))
        except StoreError:  # a version being removed, or one that is not whole
            continue
        ds, conf = (md.get(k) if isinstance(md.get(k), dict) else {} for k in ("dataset", "config"))
        owner = md.get("uploader_uid")
        if (ds.get("sha256") == sha and ds.get("options") == wanted and conf.get("train") == train
                and (owner is None or owner == record.get("uploader_uid"))):
            return {"model_dir": os.path.join(name_dir, version), "version": version, "sha256": sha,
                    "trained_from": ds.get("file"), "trained_at": md.get("ended_at")}
    return None
