"""A checkpoint that does not fit the job any more is dropped and training restarts at epoch 1
(docs/checkpoints.md): the conffile's ``dataset:`` or ``job.max_matrix_bytes`` changed between the
stop that wrote the checkpoint and the restart."""

from __future__ import annotations

import json
import signal

import numpy as np
import pytest

from daemon_kit import (
    START_TIMEOUT_S, Daemon, copy_smd, done_names, failed_names, job_dir, job_record, read_json, run_until, spool_dir,
    write_config,
)
from opt_ds_ops.config.conffile import Config, TrainConfig
from opt_ds_ops.health.device import plan_device
from opt_ds_ops.training.job import run_job
from opt_ds_ops.training.fit import TrainingInterrupted

LONG_TRAINING = {"epochs": 60, "batch_size": 128}  # as test_daemon's: a stop lands mid-run
CHANGES = {
    "dataset.columns": ["dataset:", "  columns: [1, 2, 3, 4, 5, 6, 7, 8]"],
    "job.max_matrix_bytes": ["job:", "  max_matrix_bytes: 1048576"],  # SMD's 3.5 MB matrix now streams
}


@pytest.mark.recovery
@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_checkpoint_that_no_longer_fits_is_dropped_and_the_job_trains_from_epoch_1(tmp_path, change):
    conf = write_config(tmp_path, **LONG_TRAINING)
    d = Daemon(conf)
    try:
        d.wait_until(lambda: "ds-trainer ready" in d.log(), "the daemon to be ready", timeout_s=START_TIMEOUT_S)
        copy_smd(spool_dir(tmp_path, "incoming") / "machine-1-2.txt.gz")
        d.wait_until(lambda: (job_record(tmp_path, "machine-1-2.txt.gz") or {}).get("epoch", 0) >= 2, "epoch 2")
        rc, _ = d.stop(signal.SIGTERM)
    finally:
        d.kill()
    assert rc == 0 and (job_dir(tmp_path, "machine-1-2.txt.gz") / "checkpoint.pt").is_file()
    conf = write_config(tmp_path, extra=CHANGES[change], **LONG_TRAINING)

    d2 = run_until(conf, lambda: done_names(tmp_path) | failed_names(tmp_path), "the job to end")
    assert done_names(tmp_path) == {"machine-1-2.txt.gz"}, d2.log()
    assert "the checkpoint does not fit: " in d2.log() and "; starting at epoch 1" in d2.log()
    result = read_json(spool_dir(tmp_path, "done") / "machine-1-2.txt.gz.result.json")
    assert result["resumed_from_epoch"] is None and [h["epoch"] for h in result["history"]] == list(range(1, 61))
    md = json.loads((tmp_path / "models" / "machine-1-2" / "current" / "metadata.json").read_text())
    if change == "dataset.columns":
        assert md["dataset"]["columns"] == 8
    else:
        assert md["data_placement"] == "streamed"


def test_a_checkpoint_whose_state_does_not_load_is_retried_from_scratch_once(tmp_path, smd_rows):
    """A checkpoint made before ds-ops recorded what it fits (no ``fit``) of another column count:
    train() refuses it (CheckpointMismatch) and the job trains from epoch 1 instead of failing."""
    cfg = Config(models_dir=str(tmp_path / "models"), device="cpu", amp="off",
                 train=TrainConfig(epochs=3, batch_size=256))
    narrow = tmp_path / "narrow.npy"
    np.save(narrow, smd_rows[:2000, :8])
    with pytest.raises(TrainingInterrupted) as ti:
        run_job(str(narrow), cfg, plan=plan_device("cpu", "off"), should_stop=lambda: True)
    old = {k: v for k, v in ti.value.checkpoint.items() if k != "fit"}
    wide = tmp_path / "wide.npy"
    np.save(wide, smd_rows[:2000])
    dropped = []
    job = run_job(str(wide), cfg, plan=plan_device("cpu", "off"), resume=old, on_resume_dropped=dropped.append)
    assert len(dropped) == 1 and "the checkpoint does not fit: the checkpoint's model is" in dropped[0]
    assert [h.epoch for h in job.result.history] == [1, 2, 3] and job.dataset.features == smd_rows.shape[1]
