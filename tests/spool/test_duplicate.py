"""opt_ds_ops.spool.duplicate: which earlier version makes a dropped dataset a duplicate (real versions in
a real store; the daemon's end of it is in tests/daemon/test_daemon_ops.py)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from opt_ds_ops.config.conffile import Config, DatasetConfig, TrainConfig, config_to_dict
from opt_ds_ops.health.device import plan_device
from opt_ds_ops.spool.duplicate import same_bytes_version
from opt_ds_ops.store.versions import model_payload, save_model
from opt_ds_ops.training.fit import train

SHA = "a41eb69b3416" + "0" * 52


@pytest.fixture(scope="module")
def payload(smd_rows):
    return model_payload(train(smd_rows[:3000], TrainConfig(epochs=1), plan_device("cpu", "off")))


def saved(cfg: Config, payload, *, options: DatasetConfig | None = None, owner: int | None = None) -> str:
    """Save a version of model m as a daemon job does: the file's sha256, its options, the config, its owner."""
    md = {"dataset": {"file": "m.csv", "sha256": SHA, "options": json.loads(json.dumps(
          dataclasses.asdict(options or cfg.dataset)))}, "config": json.loads(json.dumps(config_to_dict(cfg))),
          "uploader_uid": owner, "ended_at": "2026-12-01T00:00:00.000000Z"}
    path, _ = save_model(cfg.models_dir, "m", payload, md)
    return path


def test_the_same_bytes_options_and_train_config_match_the_newest_such_version(tmp_path, payload):
    cfg = Config(models_dir=str(tmp_path))
    saved(cfg, payload)
    newest = saved(cfg, payload)
    got = same_bytes_version(cfg, "m", {"sha256": SHA, "uploader_uid": 1002}, cfg.dataset)
    assert got == {"model_dir": newest, "version": os.path.basename(newest), "sha256": SHA, "trained_from": "m.csv",
                   "trained_at": "2026-12-01T00:00:00.000000Z"}


def test_other_bytes_options_train_config_owner_or_a_retraining_are_no_duplicate(tmp_path, payload):
    cfg = Config(models_dir=str(tmp_path))
    saved(cfg, payload, owner=1001)
    record = {"sha256": SHA, "uploader_uid": 1001}
    assert same_bytes_version(cfg, "m", record, cfg.dataset) is not None  # the owner's own drop
    assert same_bytes_version(cfg, "m", dict(record, sha256="f" * 64), cfg.dataset) is None
    assert same_bytes_version(cfg, "m", record, dataclasses.replace(cfg.dataset, exclude_columns=("b",))) is None
    longer = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_steps=cfg.train.max_steps + 1))
    assert same_bytes_version(longer, "m", record, cfg.dataset) is None
    assert same_bytes_version(cfg, "m", dict(record, uploader_uid=1002), cfg.dataset) is None  # another's model
    assert same_bytes_version(cfg, "m", dict(record, kind="retrain"), cfg.dataset) is None
    assert same_bytes_version(cfg, "other", record, cfg.dataset) is None
