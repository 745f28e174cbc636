"""Model versions an operator controls: promote, rollback, pin, rm, keep_versions pruning (also
under SIGKILL of a real pruning process), and ``ds-ops models`` as a real process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO, run_cli
from opt_ds_ops.config.conffile import TrainConfig
from opt_ds_ops.health.device import plan_device
from opt_ds_ops.store.versions import (
    CURRENT, StoreError, current_version, list_versions, load_model, model_payload, pin, promote, prune,
    read_metadata, remove, rollback, save_model,
)
from opt_ds_ops.training.fit import train


@pytest.fixture(scope="module")
def payload(smd_rows):
    return model_payload(train(smd_rows[:3000], TrainConfig(epochs=1), plan_device("cpu", "off")))


def make_versions(models_dir, name: str, n: int, payload) -> list[str]:
    """Save n real versions of model name; return their version names, oldest first."""
    out = []
    for i in range(n):
        path, _ = save_model(str(models_dir), name, payload, {"dataset": {"file": f"{name}.csv"}, "i": i})
        out.append(os.path.basename(path))
    return out


def test_rollback_then_promote_move_current_and_record_who_and_why(tmp_path, payload):
    v = make_versions(tmp_path, "m", 3, payload)
    name_dir = tmp_path / "m"
    entry = rollback(str(tmp_path), "m", why="v3 alarms all night")
    assert current_version(str(name_dir)) == v[1] and entry["previous"] == v[2]
    assert load_model(str(name_dir)).path == str(name_dir / v[1])
    promote(str(tmp_path), "m", v[2], why="retrained data fixed")
    assert current_version(str(name_dir)) == v[2]
    back = read_metadata(str(name_dir / v[1]))["operator_log"][-1]
    fwd = read_metadata(str(name_dir / v[2]))["operator_log"][-1]
    assert (back["action"], back["why"], back["previous"]) == ("rollback", "v3 alarms all night", v[2])
    assert (fwd["action"], fwd["why"], fwd["previous"]) == ("promote", "retrained data fixed", v[1])
    assert back["by"] and fwd["by"] and fwd["at"] >= back["at"]
    rollback(str(tmp_path), "m")
    rollback(str(tmp_path), "m")
    with pytest.raises(StoreError, match="no version still in the store was current before"):
        rollback(str(tmp_path), "m")
    with pytest.raises(StoreError, match="has no version 'nope'"):
        promote(str(tmp_path), "m", "nope")


def test_rollback_goes_to_the_version_that_was_current_before_never_to_one_that_never_was(tmp_path, payload):
    """v1 current; v2 and v3 saved by jobs while v1 is pinned (held, never current); the operator
    promotes v3: a rollback goes back to v1, the version current before, not to v2, the newest
    older one by name (as it did). Removing the current version does the same; and a model with
    no earlier current version refuses both instead of choosing one that never was."""
    from opt_ds_ops.spool import new_job_id

    (v1,) = make_versions(tmp_path, "m", 1, payload)
    pin(str(tmp_path), f"m/{v1}", why="hold while we look at the new data")
    held = []
    for _ in range(2):
        path, md = save_model(str(tmp_path), "m", payload, {"dataset": {"file": "m.csv"}, "job_id": new_job_id()})
        assert md["not_current"], md
        held.append(os.path.basename(path))
    v2, v3 = held
    name_dir = str(tmp_path / "m")
    pin(str(tmp_path), f"m/{v1}", pinned=False)
    promote(str(tmp_path), "m", v3, why="the retrained one")
    entry = rollback(str(tmp_path), "m", why="v3 alarms")
    print(f"\nrollback from {v3}: current {current_version(name_dir)} (v1 {v1}, never current v2 {v2})")
    assert current_version(name_dir) == v1 and entry["previous"] == v3
    promote(str(tmp_path), "m", v3)
    remove(str(tmp_path), f"m/{v3}")
    assert current_version(name_dir) == v1
    with pytest.raises(StoreError, match="no version still in the store was current before"):
        rollback(str(tmp_path), "m")  # v2 is older, but it was never current
    with pytest.raises(StoreError, match="no other version still in the store was current before"):
        remove(str(tmp_path), f"m/{v1}")
    assert current_version(name_dir) == v1


def test_prune_keeps_current_pinned_and_the_newest_n(tmp_path, payload):
    v = make_versions(tmp_path, "m", 7, payload)
    name_dir = str(tmp_path / "m")
    pin(str(tmp_path), f"m/{v[0]}", why="baseline")
    promote(str(tmp_path), "m", v[2])
    removed = prune(str(tmp_path), "m", 2)
    assert removed == [v[1], v[3], v[4]]
    assert list_versions(name_dir) == [v[0], v[2], v[5], v[6]]
    assert current_version(name_dir) == v[2]
    assert sorted(e for e in os.listdir(name_dir) if e.startswith(".")) == [".current.log", ".lock", ".operator.json"]
    assert prune(str(tmp_path), "m", 2) == []


KILLED_PRUNE = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, sys.argv[3])
    from opt_ds_ops.store.versions import prune

    def hook(version, hidden):
        print(version, hidden, flush=True)
        time.sleep(60)  # the parent SIGKILLs us here: renamed away, not yet deleted

    prune(sys.argv[1], sys.argv[2], 2, hook=hook)
""")


@pytest.mark.recovery
def test_a_prune_killed_midway_loses_nothing_that_should_stay(tmp_path, payload):
    v = make_versions(tmp_path, "m", 6, payload)
    name_dir = str(tmp_path / "m")
    pin(str(tmp_path), f"m/{v[1]}")
    promote(str(tmp_path), "m", v[3])
    proc = subprocess.Popen([sys.executable, "-c", KILLED_PRUNE, str(tmp_path), "m", str(REPO)],
                            stdout=subprocess.PIPE, text=True)
    victim, hidden = proc.stdout.readline().split()
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stdout.close()
    assert victim == v[0] and os.path.isdir(hidden)  # killed between the rename and the delete
    should_stay = [v[1], v[3], v[4], v[5]]  # pinned, current, newest 2
    assert set(should_stay) <= set(list_versions(name_dir))
    for version in should_stay:
        assert load_model(os.path.join(name_dir, version)).threshold > 0
    assert current_version(name_dir) == v[3] and load_model(name_dir).path == os.path.join(name_dir, v[3])
    assert prune(str(tmp_path), "m", 2) == [v[2]]  # the next prune finishes the job and the leftover
    assert list_versions(name_dir) == should_stay
    assert not os.path.exists(hidden)


def test_rm_of_the_current_version_moves_current_and_a_pinned_one_is_refused(tmp_path, payload):
    v = make_versions(tmp_path, "m", 3, payload)
    name_dir = str(tmp_path / "m")
    out = remove(str(tmp_path), f"m/{v[2]}", why="bad data")
    assert out == {"removed": [v[2]], "current": v[1]}
    assert os.readlink(os.path.join(name_dir, CURRENT)) == v[1] and load_model(name_dir).path.endswith(v[1])
    pin(str(tmp_path), f"m/{v[0]}")
    with pytest.raises(StoreError, match="is pinned"):
        remove(str(tmp_path), f"m/{v[0]}")
    with pytest.raises(StoreError, match="is pinned"):
        remove(str(tmp_path), "m")
    pin(str(tmp_path), f"m/{v[0]}", pinned=False)
    remove(str(tmp_path), f"m/{v[0]}")
    with pytest.raises(StoreError, match="only version"):
        remove(str(tmp_path), f"m/{v[1]}")
    assert remove(str(tmp_path), "m")["removed"] == [v[1]]
    assert os.listdir(tmp_path) == []
    # a whole-model removal killed between its rename and its delete is finished by the next rm
    make_versions(tmp_path, "n", 1, payload)
    os.mkdir(tmp_path / ".rm-gone-999999999")  # no such pid: its remover is gone
    remove(str(tmp_path), "n")
    assert os.listdir(tmp_path) == []


def test_models_command_lists_shows_rolls_back_and_promotes_as_a_real_process(tmp_path, payload):
    v = make_versions(tmp_path, "machine-1-2", 2, payload)
    d = ["--models-dir", str(tmp_path)]
    p = run_cli("models", *d, "--json")
    assert p.returncode == 0, p.stderr
    listed = json.loads(p.stdout)["models"]
    assert [m["name"] for m in listed] == ["machine-1-2"] and listed[0]["current"] == v[1]
    assert [x["version"] for x in listed[0]["versions"]] == v
    assert listed[0]["versions"][0]["dataset"] == "machine-1-2.csv"
    p = run_cli("models", "rollback", "machine-1-2", "--why", "test", *d, "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["current"] == v[0]
    p = run_cli("models", "promote", "machine-1-2", v[1], *d)
    assert p.returncode == 0 and f"current {v[0]} -> {v[1]}" in p.stdout
    p = run_cli("models", "show", f"machine-1-2/{v[0]}", *d, "--json")
    assert json.loads(p.stdout)["metadata"]["operator_log"][0]["why"] == "test"
    p = run_cli("models", "list", *d)
    assert p.returncode == 0 and v[1] in p.stdout and "(* current, P pinned)" in p.stdout
    p = run_cli("models", "show", "nope", *d)
    assert p.returncode == 1 and p.stderr.strip() == f"ds-ops: error: no model named 'nope' under {tmp_path}"


def test_score_takes_a_model_name_under_models_dir(tmp_path, payload, smd_rows):
    import numpy as np

    make_versions(tmp_path / "models", "machine-1-2", 1, payload)
    conf = tmp_path / "trainer.yaml"
    conf.write_text(f"models_dir: {tmp_path / 'models'}\n")
    data = tmp_path / "new.csv"
    np.savetxt(data, smd_rows[:500], delimiter=",", fmt="%.6f")
    p = run_cli("score", "machine-1-2", str(data), "--config", str(conf), "--json")
    assert p.returncode == (3 if json.loads(p.stdout)["flagged"] else 0), p.stderr
    assert json.loads(p.stdout)["rows"] == 500
    p = run_cli("score", "machine-9-9", str(data), "--config", str(conf))
    assert p.returncode == 1 and "machine-9-9: not a model directory" in p.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to stand in for a member of group ds-ops")
def test_a_user_who_may_not_write_the_store_is_told_in_one_line_who_may(tmp_path, payload):
    from daemon_kit import as_service_user  # root without DAC override: a member who does not own the store

    v = make_versions(tmp_path, "m", 2, payload)
    for root, dirs, files in os.walk(tmp_path):
        for entry in [root, *(os.path.join(root, n) for n in dirs + files)]:
            os.lchown(entry, 12345, 0)  # the store is another user's (ds-ops's), readable by our group
    os.chmod(tmp_path, 0o2750)  # as /var/models
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("DS_OPS_CONFIG", None)
    for action in (["rollback", "m"], ["promote", "m", v[0]], ["pin", "m"], ["rm", f"m/{v[0]}"]):
        p = subprocess.run([sys.executable, "-m", "opt_ds_ops.cli", "models", *action, "--models-dir", str(tmp_path)],
                           capture_output=True, text=True, timeout=120, preexec_fn=as_service_user, cwd=REPO, env=env)
        assert p.returncode == 1, p.stderr
        assert p.stderr.splitlines() == [
            f"ds-ops: error: cannot {action[0]} {action[1]}: Permission denied; only root and the service user ds-ops "
            f"may change {tmp_path} (members of group ds-ops may read it): sudo ds-ops models {action[0]} ..."]
    assert current_version(str(tmp_path / "m")) == v[1] and list_versions(str(tmp_path / "m")) == v


def test_rollback_after_an_upgrade_goes_back_to_the_version_current_before_the_record_began(tmp_path, payload):
    """A model from before .current.log: v1..v3, v3 current; the first publish after the upgrade
    (v4) starts the record. A rollback goes to v3 (the log's first entry names it as previous);
    pruning keeps v3 too, however many newer versions come."""
    from opt_ds_ops.store.model_dir import CURRENT_LOG

    v = make_versions(tmp_path, "m", 3, payload)
    name_dir = tmp_path / "m"
    (name_dir / CURRENT_LOG).unlink()  # as an older ds-ops left it
    assert rollback_target_of(name_dir) == v[1]  # the old rule, for a model without the record
    (v4,) = make_versions(tmp_path, "m", 1, payload)
    assert rollback_target_of(name_dir) == v[2]
    promote(str(tmp_path), "m", v4)
    assert prune(str(tmp_path), "m", 1) == [v[0], v[1]]  # v3: what a rollback goes back to
    rollback(str(tmp_path), "m")
    assert current_version(str(name_dir)) == v[2]


def rollback_target_of(name_dir) -> str | None:
    from opt_ds_ops.store.admin import rollback_target

    return rollback_target(str(name_dir), current_version(str(name_dir)))


def test_the_current_log_is_cut_to_its_newest_half_and_a_short_log_is_not_read_to_append(tmp_path, monkeypatch):
    """``.current.log`` is a record, bounded: past CURRENT_LOG_MAX lines its newest half is kept.
    A publish appends a line without reading the log while it is far shorter than that."""
    from opt_ds_ops.store import model_dir

    reads = []
    real = model_dir.read_current_log
    monkeypatch.setattr(model_dir, "read_current_log", lambda d: reads.append(d) or real(d))
    for i in range(model_dir.CURRENT_LOG_MAX + 5):
        model_dir._log_current(str(tmp_path), {"at": f"t{i}", "version": f"v{i:05d}", "action": "publish",
                                               "previous": f"v{i - 1:05d}", "why": "x" * 20})
        if i == 100:
            assert reads == []  # 101 lines of about 130 bytes: nothing read
    entries = real(str(tmp_path))
    assert model_dir.CURRENT_LOG_MAX // 2 < len(entries) <= model_dir.CURRENT_LOG_MAX
    assert entries[-1]["version"] == f"v{model_dir.CURRENT_LOG_MAX + 4:05d}"
    assert [e["version"] for e in entries] == sorted(e["version"] for e in entries)


def test_a_member_who_may_read_the_store_cannot_hold_a_models_lock(tmp_path):
    """Before, the name lock was a flock on the model's directory, which any member of group ds-ops
    may open: a shared flock held there blocked every publish and ``ds-ops models`` change of it."""
    import fcntl

    from opt_ds_ops.store.model_dir import LOCK_FILE, NameLock

    name_dir = tmp_path / "m"
    name_dir.mkdir(mode=0o2750)
    member = os.open(name_dir, os.O_RDONLY | os.O_DIRECTORY)  # what a member can open
    fcntl.flock(member, fcntl.LOCK_SH)
    try:
        with NameLock(str(name_dir)):  # not blocked
            pass
    finally:
        os.close(member)
    st = os.stat(name_dir / LOCK_FILE)
    assert st.st_mode & 0o777 == 0o600 and (st.st_uid, st.st_gid) == (os.stat(name_dir).st_uid, os.stat(name_dir).st_gid)
