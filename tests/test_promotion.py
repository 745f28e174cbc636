"""Issue 20: an operator's decision holds (after ``ds-ops models rollback`` or ``pin`` no new
version of that model becomes current until the operator promotes or unpins), and the promotion
gate (``store.promote``) lets a challenger become current only if it is not worse."""

from __future__ import annotations

import os

import numpy as np
import pytest

from conftest import run_cli
from daemon_kit import Daemon, spool_dir, versions, write_config
from opt_ds_ops.config import TrainConfig
from opt_ds_ops.device import plan_device
from opt_ds_ops.spool import new_job_id
from opt_ds_ops.store import HELD, current_version, model_payload, pin, promote, rollback, save_model
from opt_ds_ops.train import train


@pytest.fixture(scope="module")
def payload(smd_rows):
    return model_payload(train(smd_rows[:3000], TrainConfig(epochs=1), plan_device("cpu", "off")))


def job_version(models_dir, name: str, payload) -> tuple[str, dict]:
    """Save a version of model name as a daemon job claimed now does; return (version, metadata returned)."""
    path, md = save_model(str(models_dir), name, payload, {"dataset": {"file": f"{name}.csv"}, "job_id": new_job_id()})
    return os.path.basename(path), md


def test_after_a_rollback_no_new_jobs_version_becomes_current_until_a_promote(tmp_path, payload):
    v1, _ = job_version(tmp_path, "m", payload)
    job_version(tmp_path, "m", payload)
    rollback(str(tmp_path), "m", why="v2 alarms all night")
    v3, md3 = job_version(tmp_path, "m", payload)  # claimed after the rollback
    v4, md4 = job_version(tmp_path, "m", payload)
    assert current_version(str(tmp_path / "m")) == v1
    for md, v in ((md3, v3), (md4, v4)):
        assert md["not_current"].startswith(HELD) and "rolled back to" in md["not_current"]
        assert f"ds-ops models promote m {v}" in md["not_current"]
    promote(str(tmp_path), "m", v4, why="checked it")
    v5, md5 = job_version(tmp_path, "m", payload)  # the promote ended the hold
    assert current_version(str(tmp_path / "m")) == v5 and md5["not_current"] is None


def test_while_current_is_pinned_no_new_jobs_version_becomes_current_until_unpin(tmp_path, payload):
    v1, _ = job_version(tmp_path, "m", payload)
    pin(str(tmp_path), "m", why="known good")
    _, md2 = job_version(tmp_path, "m", payload)
    assert current_version(str(tmp_path / "m")) == v1
    assert md2["not_current"].startswith(HELD) and "is pinned" in md2["not_current"] and "known good" in md2["not_current"]
    pin(str(tmp_path), "m", pinned=False)
    v3, md3 = job_version(tmp_path, "m", payload)
    assert current_version(str(tmp_path / "m")) == v3 and md3["not_current"] is None


def test_unpinning_a_rolled_back_current_lifts_the_rollbacks_hold_too(tmp_path, payload):
    v1, _ = job_version(tmp_path, "m", payload)
    job_version(tmp_path, "m", payload)
    rollback(str(tmp_path), "m")
    pin(str(tmp_path), "m")
    assert job_version(tmp_path, "m", payload)[1]["not_current"].startswith(HELD)
    pin(str(tmp_path), "m", pinned=False)
    v4, md4 = job_version(tmp_path, "m", payload)
    assert current_version(str(tmp_path / "m")) == v4 and md4["not_current"] is None


def test_a_redrop_of_the_same_file_after_a_rollback_is_kept_not_current_and_the_journal_says_so(
        tmp_path, smd_rows):
    """As a new operator would: drop a file twice, roll back, drop it again, to a real daemon."""
    data = tmp_path / "m.csv"
    np.savetxt(data, smd_rows[:2000], delimiter=",", fmt="%.6f")
    conf = write_config(tmp_path, scan_interval_s=0.5)
    models = str(tmp_path / "models")

    def drop_and_wait(n: int) -> None:
        (spool_dir(tmp_path, "incoming") / "m.csv").write_bytes(data.read_bytes())
        d.wait_until(lambda: len(versions(tmp_path, "m")) == n and not any(
            spool_dir(tmp_path, "processing").iterdir()), f"version {n} of m")

    d = Daemon(conf)
    try:
        d.wait_until(lambda: "ds-trainer ready" in d.log(), "the daemon to be ready", timeout_s=120)
        drop_and_wait(1)
        drop_and_wait(2)
        v1, v2 = versions(tmp_path, "m")
        assert current_version(os.path.join(models, "m")) == v2
        r = run_cli("models", "--models-dir", models, "rollback", "m", "--why", "v2 is noisy")
        assert r.returncode == 0, r.stderr
        drop_and_wait(3)
        v3 = versions(tmp_path, "m")[-1]
        assert current_version(os.path.join(models, "m")) == v1
        d.wait_until(lambda: "held by the operator" in d.log(), "the model-held entry")
        log = d.log()
        assert "rolled back to " + v1 in log and "v2 is noisy" in log and f"ds-ops models promote m {v3}" in log
        rc, _ = d.stop()
        assert rc == 0, d.log()
    finally:
        d.kill()
    listed = run_cli("models", "--models-dir", models)
    assert v3 in listed.stdout and f"current {v1}" in listed.stdout
