"""One order per model for ``current``: jobs publish in claim order, the daemon's
recovery never moves ``current`` backward nor undoes an operator, and the daemon's publish takes
the lock ``ds-ops models`` takes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from conftest import REPO
from daemon_kit import done_names, run_until, write_config
from opt_ds_ops.config.conffile import TrainConfig
from opt_ds_ops.health.device import plan_device
from opt_ds_ops.spool import new_job_id
from opt_ds_ops.store.versions import current_version, model_payload, publish_job, rollback, save_model
from opt_ds_ops.training.fit import train
from daemon_kit import job_in_processing, save_version


@pytest.fixture(scope="module")
def payload(smd_rows):
    return model_payload(train(smd_rows[:3000], TrainConfig(epochs=1), plan_device("cpu", "off")))


def job_version(models_dir, name: str, job_id: str | None, payload) -> tuple[str, dict]:
    """Save a version of model name as job job_id's process does; return (its version, the metadata returned)."""
    path, md = save_model(str(models_dir), name, payload, {"dataset": {"file": f"{name}.csv"}, "job_id": job_id})
    return os.path.basename(path), md


def test_a_job_claimed_earlier_that_finishes_later_does_not_take_current(tmp_path, payload):
    early, late = new_job_id(), new_job_id()
    v_late, md_late = job_version(tmp_path, "m", late, payload)
    v_early, md_early = job_version(tmp_path, "m", early, payload)
    assert v_early > v_late  # saved later: the version name alone would have made it current
    assert current_version(str(tmp_path / "m")) == v_late
    assert md_late["not_current"] is None
    assert f"of a later claim ({late})" in md_early["not_current"]
    v_third, md_third = job_version(tmp_path, "m", new_job_id(), payload)  # claimed after both: current
    assert current_version(str(tmp_path / "m")) == v_third and md_third["not_current"] is None


def test_a_job_claimed_before_an_operators_rollback_does_not_undo_it(tmp_path, payload):
    v1, _ = job_version(tmp_path, "m", new_job_id(), payload)
    job_version(tmp_path, "m", new_job_id(), payload)
    running = new_job_id()  # claimed, still training while the operator rolls back
    rollback(str(tmp_path), "m", why="v2 alarms all night")
    v3, md = job_version(tmp_path, "m", running, payload)
    assert current_version(str(tmp_path / "m")) == v1
    assert "rollback" in md["not_current"] and "after job" in md["not_current"]
    v4, md4 = job_version(tmp_path, "m", new_job_id(), payload)  # claimed after: the rollback holds
    assert current_version(str(tmp_path / "m")) == v1 and "rolled back to" in md4["not_current"]


def test_train_by_hand_publishes_whatever_the_order(tmp_path, payload):
    job_version(tmp_path, "m", new_job_id(), payload)
    rollback_target, _ = job_version(tmp_path, "m", new_job_id(), payload)
    v, md = job_version(tmp_path, "m", None, payload)  # ds-ops train: no job id
    assert current_version(str(tmp_path / "m")) == v and md["not_current"] is None
    assert rollback_target < v


@pytest.mark.parametrize("after", ["rollback", "newer version"])
def test_recovery_replay_never_moves_current_backward_nor_undoes_the_operator(tmp_path, after):
    """A job killed after its version was saved is replayed at the next start: its version becomes
    current only if nothing of a later claim, and no operator since its claim, moved current."""
    conf = write_config(tmp_path)
    name_dir = tmp_path / "models" / "machine-1-2"
    first = os.path.basename(save_version(tmp_path, "machine-1-2", new_job_id(), publish=True))
    job_id = new_job_id()
    job_in_processing(tmp_path, "machine-1-2.txt.gz", job_id)
    killed = os.path.basename(save_version(tmp_path, "machine-1-2", job_id, publish=after == "rollback"))
    if after == "rollback":
        rollback(str(tmp_path / "models"), "machine-1-2", why="bad model")
        expect = first
    else:
        expect = os.path.basename(save_version(tmp_path, "machine-1-2", new_job_id(), publish=True))
    assert current_version(str(name_dir)) == expect
    d = run_until(conf, lambda: done_names(tmp_path) == {"machine-1-2.txt.gz"}, "the job to be recovered")
    assert "not training again" in d.log() and "not made current" in d.log()
    assert current_version(str(name_dir)) == expect != killed


def test_the_daemons_publish_waits_for_the_lock_the_models_commands_take(tmp_path, payload):
    v1, _ = job_version(tmp_path, "m", new_job_id(), payload)
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from opt_ds_ops.store.model_dir import NameLock
            with NameLock({str(tmp_path / "m")!r}):
                print("held", flush=True)
                sys.stdin.readline()
        """)], cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        saved = {}
        t = threading.Thread(target=lambda: saved.update(v=job_version(tmp_path, "m", new_job_id(), payload)[0]))
        t.start()
        time.sleep(1.0)
        assert t.is_alive() and current_version(str(tmp_path / "m")) == v1  # waiting on the lock
        holder.stdin.write("\n")
        holder.stdin.flush()
        t.join(30)
        assert not t.is_alive() and current_version(str(tmp_path / "m")) == saved["v"]
        assert publish_job(str(tmp_path / "m"), v1, None) is None and current_version(str(tmp_path / "m")) == v1
    finally:
        holder.kill()
        holder.wait()


def test_two_first_datasets_of_a_new_name_cannot_both_take_it(tmp_path, payload):
    """Both jobs passed the owner check at their start (no model yet); the later
    claim's publish moved current to the other uploader's data. The check is repeated under the lock."""
    alice, bob = 12345, 12346
    first, second = new_job_id(), new_job_id()  # Bob's claim is the later one
    v_a, md_a = save_model(str(tmp_path), "new", payload, {"dataset": {"file": "new.csv"}, "job_id": first,
                                                          "uploader_uid": alice, "uploaded_by_uid": alice})
    v_b, md_b = save_model(str(tmp_path), "new", payload, {"dataset": {"file": "x.csv"}, "job_id": second,
                                                          "uploader_uid": alice, "uploaded_by_uid": bob})
    assert current_version(str(tmp_path / "new")) == os.path.basename(v_a) and md_a["not_current"] is None
    assert f"belongs to uid {alice}" in md_b["not_current"] and f"dropped by uid {bob}" in md_b["not_current"]
    v_c, md_c = save_model(str(tmp_path), "new", payload, {"dataset": {"file": "new.csv"}, "job_id": new_job_id(),
                                                          "uploader_uid": alice, "uploaded_by_uid": alice})
    assert current_version(str(tmp_path / "new")) == os.path.basename(v_c)  # hers go on as before
