"""Model store: layout, weights_only loading, and atomicity under SIGKILL of a real writer process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from conftest import REPO, SMD_TRAIN
from opt_ds_ops.config.conffile import TrainConfig
from opt_ds_ops.health.device import plan_device
from opt_ds_ops.model.network import model_inputs
from opt_ds_ops.store.versions import (
    CURRENT,
    StoreError,
    list_versions,
    load_model,
    model_payload,
    safe_model_name,
    save_model,
)
from opt_ds_ops.training.fit import train


@pytest.fixture(scope="module")
def result(smd_rows):
    return train(smd_rows[:3000], TrainConfig(epochs=1), plan_device("cpu", "off"))


def test_save_writes_version_dir_and_current_link(tmp_path, result):
    path, md = save_model(str(tmp_path), "machine-1-2", model_payload(result), {"k": 1})
    name_dir = tmp_path / "machine-1-2"
    assert os.readlink(name_dir / CURRENT) == os.path.basename(path)
    assert sorted(os.listdir(path)) == ["metadata.json", "model.pt"]
    on_disk = json.loads((name_dir / CURRENT / "metadata.json").read_text())
    assert dict(on_disk, not_current=None) == md and md["k"] == 1 and md["version"] == os.path.basename(path)
    payload = torch.load(os.path.join(path, "model.pt"), weights_only=True)
    assert set(payload) >= {"state_dict", "model_args", "scaler_mean", "scaler_std", "threshold", "error_scale"}
    path2, _ = save_model(str(tmp_path), "machine-1-2", model_payload(result), {})
    assert list_versions(str(name_dir)) == sorted([os.path.basename(path), os.path.basename(path2)])
    assert os.readlink(name_dir / CURRENT) == os.path.basename(path2)


def test_loaded_model_reconstructs_like_the_trained_one(tmp_path, result, smd_rows):
    path, _ = save_model(str(tmp_path), "m", model_payload(result), {})
    stored = load_model(str(tmp_path / "m"))  # the name directory resolves through current
    assert stored.path == path and stored.threshold == result.threshold
    # As shipped the model reads each metric's change beside its level (train.input_differences):
    # its reading contract comes back from the store, and both models are fed what scoring feeds them.
    assert (stored.input_window, stored.window_error) == (result.input_window, result.window_error) == (2, "window")
    assert stored.diff is not None and stored.input_clip == result.input_clip
    for loaded, trained in zip(stored.diff, result.diff, strict=True):
        np.testing.assert_array_equal(loaded.numpy(), trained)
    z = torch.from_numpy(((smd_rows[:50] - result.mean) / result.std).astype(np.float32))
    z = z.clamp(-result.input_clip, result.input_clip)
    x = model_inputs(z, stored.input_window, diff=stored.diff, clip=stored.input_clip)
    assert x.shape == (50, 2 * 38)
    with torch.no_grad():
        torch.testing.assert_close(stored.model(x), result.model.eval()(x))


def test_names_cannot_escape_the_store():
    assert safe_model_name("../../etc/passwd") == "_.._etc_passwd"
    assert safe_model_name("-rf machine 1") == "rf_machine_1"
    assert safe_model_name("métrique") == "m_trique"
    with pytest.raises(StoreError):
        safe_model_name("...")


def test_load_refuses_a_non_model_directory(tmp_path):
    with pytest.raises(StoreError, match="not a model directory"):
        load_model(str(tmp_path))
    (tmp_path / "model.pt").write_bytes(b"garbage")
    (tmp_path / "metadata.json").write_text("{}")
    with pytest.raises(StoreError, match="cannot read model"):
        load_model(str(tmp_path))


def test_unwritable_store_is_a_store_error(tmp_path, result):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(StoreError, match="cannot write model"):
        save_model(str(blocker), "m", model_payload(result), {})


KILL_AT = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {repo!r})
    import opt_ds_ops.store.versions as store
    from opt_ds_ops.config.conffile import Config, TrainConfig
    from opt_ds_ops.training.job import run_job
    point = sys.argv[1]
    real_rename, real_replace = os.rename, os.replace
    def die(*a):
        os.kill(os.getpid(), signal.SIGKILL)
    if point == "before-rename":
        store.os.rename = die
    elif point == "before-current":
        store.os.replace = die
    cfg = Config(models_dir={models!r}, device="cpu", amp="off", train=TrainConfig(epochs=1))
    run_job({data!r}, cfg, name="m")
    """
)


def _assert_store_consistent(models):
    name_dir = os.path.join(models, "m")
    for version in list_versions(name_dir):
        load_model(os.path.join(name_dir, version))  # every visible version is complete
    if os.path.lexists(os.path.join(name_dir, CURRENT)):
        return load_model(os.path.join(name_dir, CURRENT))
    return None


@pytest.mark.recovery
@pytest.mark.parametrize("point", ["before-rename", "before-current"])
def test_sigkill_while_the_model_is_written_leaves_current_complete(tmp_path, small_smd_csv, point):
    models = str(tmp_path / "models")
    script = KILL_AT.format(repo=str(REPO), models=models, data=str(small_smd_csv))
    ok = subprocess.run([sys.executable, "-c", script, "none"], timeout=300)
    assert ok.returncode == 0
    first = _assert_store_consistent(models)
    killed = subprocess.run([sys.executable, "-c", script, point], timeout=300)
    assert killed.returncode == -signal.SIGKILL
    after = _assert_store_consistent(models)
    assert after is not None and after.path == first.path  # current still the earlier complete version
    entries = os.listdir(os.path.join(models, "m"))
    if point == "before-rename":
        assert any(e.startswith(".tmp-") for e in entries)  # the half-written one stays hidden
        assert len(list_versions(os.path.join(models, "m"))) == 1
    subprocess.run([sys.executable, "-c", script, "none"], timeout=300, check=True)
    assert not any(e.startswith(".tmp-") for e in os.listdir(os.path.join(models, "m")))  # cleaned up


@pytest.mark.recovery
def test_sigkill_at_random_moments_of_real_cli_runs_never_exposes_a_partial_model(tmp_path, small_smd_csv):
    """Real ``ds-ops train`` processes killed at spread-out instants; the store is checked after each."""
    models = str(tmp_path / "models")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "opt_ds_ops.cli", "train", str(small_smd_csv), "--name", "m",
           "--models-dir", models, "--epochs", "2", "--device", "cpu"]
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=300)
    full = time.perf_counter() - t0
    for i in range(8):
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(full * (0.55 + 0.06 * i))  # spread over the end of the run, where the model is written
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert _assert_store_consistent(models) is not None
    assert np.all([os.path.isdir(os.path.join(models, "m", v)) for v in list_versions(os.path.join(models, "m"))])


def test_smd_fixture_file_is_bundled():
    assert SMD_TRAIN.exists()


def test_the_cached_reader_of_current_models_reads_a_metadata_again_only_when_it_changed(tmp_path, result, monkeypatch):
    """The daemon's metrics read the store after every job: CurrentModels gives what current_models
    gives, through new versions, a promotion, a rewritten metadata.json and a removal, and parses
    a model's metadata.json again only when its current link or the file changed."""
    import shutil

    from opt_ds_ops.store import model_dir
    from opt_ds_ops.store.model_dir import CurrentModels, current_models, publish

    root = str(tmp_path)
    first = {n: save_model(root, n, model_payload(result), {"k": n})[0] for n in ("a", "b", "c")}
    parsed = []
    real_load = model_dir.json.load
    monkeypatch.setattr(model_dir.json, "load", lambda f: parsed.append(f.name) or real_load(f))
    reader = CurrentModels()
    assert reader(root) == current_models(root) and len(parsed) == 2 * 3
    parsed.clear()
    assert reader(root) == current_models(root) and len(parsed) == 3  # current_models' own reads only
    parsed.clear()
    save_model(root, "b", model_payload(result), {"k": "b2"})  # a new version of b, made current
    md_path = os.path.join(first["c"], "metadata.json")
    with open(md_path + ".tmp", "w") as f:
        json.dump({"k": "c rewritten"}, f)
    os.replace(md_path + ".tmp", md_path)
    shutil.rmtree(tmp_path / "a")
    got = reader(root)
    assert got == current_models(root) and [(n, md["k"], v) for n, md, v in got] == [("b", "b2", 2), ("c", "c rewritten", 1)]
    assert sorted(p.split(os.sep)[-3] for p in parsed[:2]) == ["b", "c"]  # only what changed, before current_models' own
    publish(str(tmp_path / "b"), os.path.basename(first["b"]), "rollback")  # current back to b's first version
    assert [(n, md["k"]) for n, md, _ in reader(root)] == [("b", "b"), ("c", "c rewritten")]
