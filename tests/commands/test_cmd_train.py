"""``ds-ops train`` as a real process: output, exit codes, and that bad input leaves nothing behind."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from conftest import run_cli


def test_train_prints_epochs_and_the_model_dir(tmp_path, small_smd_csv):
    models = tmp_path / "models"
    p = run_cli("train", str(small_smd_csv), "--models-dir", str(models), "--epochs", "3")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert [line.split()[1] for line in lines if line.startswith("epoch ")] == ["1/3", "2/3", "3/3"]
    assert "samples/s" in lines[1] and "val_loss=" in lines[1]
    model_dir = lines[-1].removeprefix("model: ")
    assert os.path.realpath(models / "machine-small" / "current") == model_dir
    md = json.loads((models / "machine-small" / "current" / "metadata.json").read_text())
    for key in ("dataset", "rows_train", "epochs", "history", "samples_per_s", "device", "amp_dtype",
                "torch_version", "cuda_version", "started_at", "ended_at", "duration_s", "threshold"):
        assert key in md, key
    assert md["dataset"]["file"] == "machine-small.csv" and len(md["dataset"]["sha256"]) == 64
    assert md["dataset"]["rows"] == 3000 and md["dataset"]["columns"] == 38
    assert md["epochs"] == 3 and len(md["history"]) == 3 and md["device"] == "cpu"
    assert md["started_at"].endswith("Z") and md["config"]["train"]["epochs"] == 3


def test_train_json_prints_one_summary(tmp_path, small_smd_csv):
    p = run_cli("train", str(small_smd_csv), "--models-dir", str(tmp_path), "--epochs", "1", "--json", "--name", "x y")
    assert p.returncode == 0, p.stderr
    summary = json.loads(p.stdout)
    assert summary["name"] == "x_y" and summary["epochs"] == 1 and summary["features"] == 38
    assert os.path.isdir(summary["model_dir"])


def test_config_file_and_overrides(tmp_path, small_smd_csv):
    conf = tmp_path / "trainer.yaml"
    conf.write_text(f"models_dir: {tmp_path / 'from-conf'}\ntrain:\n  epochs: 2\n  hidden: 16\n")
    p = run_cli("train", str(small_smd_csv), "--config", str(conf), "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["epochs"] == 2 and (tmp_path / "from-conf" / "machine-small").is_dir()
    conf.write_text("train:\n  epochs: 0\n")
    p = run_cli("train", str(small_smd_csv), "--config", str(conf))
    assert p.returncode == 1
    assert p.stderr.strip() == f"ds-ops: error: {conf}: line 2, column 3: key 'train.epochs' must be an integer >= 1, got 0"


BAD = {
    "empty.csv": ("", "empty file"),
    "one-row.csv": ("1,2,3\n", "1 row(s); at least 2 are needed"),
    "cell.csv": ("1,2,3\n4,5,6\n7,x,9\n", "line 3, column 2: 'x' is not a number"),
    "ragged.csv": ("1,2,3\n4,5,6\n7,8\n", "line 3: ragged rows"),
    "nan.csv": ("1,2,3\n4,NaN,6\n", "line 2, column 2: a missing value (empty, NA or NaN)"),
    "inf.tsv": ("1\t2\n3\tinf\n", "line 2, column 2: value inf is not finite"),
    "data.xlsx": ("PK", "unknown dataset format"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_input_exits_1_with_a_message_and_writes_nothing(tmp_path, name):
    content, expected = BAD[name]
    path = tmp_path / name
    path.write_text(content)
    models = tmp_path / "models"
    p = run_cli("train", str(path), "--models-dir", str(models))
    assert p.returncode == 1
    assert p.stderr.startswith(f"ds-ops: error: {path}: ") and expected in p.stderr
    assert "Traceback" not in p.stderr
    assert not models.exists() or not any(models.rglob("*"))


def test_a_dataset_past_the_configs_matrix_budget_trains_from_a_converted_copy_and_says_so(tmp_path, small_smd_csv):
    """3,000 rows of 38 (456,000 bytes as float32) under a 152,000-byte budget are no
    longer refused: they are converted into MODELS_DIR/.convert-PID while read, streamed, and the
    copy is gone afterwards; scoring, which does not stream, still refuses the file."""
    models = tmp_path / "models"
    conf = tmp_path / "trainer.yaml"
    conf.write_text(f"models_dir: {models}\njob:\n  max_matrix_bytes: 152000\n")  # 1000 rows of 38
    p = run_cli("train", str(small_smd_csv), "--config", str(conf))
    assert p.returncode == 0, p.stderr
    assert "note: the float32 matrix (456,000 bytes) exceeds the job's budget: streamed from disk" in p.stdout
    assert (f"3,000 rows x 38 features (456,000 bytes as float32) are over job.max_matrix_bytes (152,000): "
            f"converted while read into {models}/.convert-") in p.stdout
    assert sorted(os.listdir(models)) == ["machine-small"]
    model_dir = str(models / "machine-small" / "current")
    p = run_cli("score", model_dir, str(small_smd_csv), "--config", str(conf))
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert p.stderr.strip() == (f"ds-ops: error: {small_smd_csv}: more than 1000 rows of 38 columns; the float32 "
                                "matrix would pass job.max_matrix_bytes (152000 bytes, 152 bytes a row)")


def test_bad_arrays_exit_1_and_write_nothing(tmp_path):
    models = tmp_path / "models"
    np.save(tmp_path / "rank3.npy", np.zeros((2, 2, 2)))
    np.save(tmp_path / "obj.npy", np.array([[None, 1]], dtype=object), allow_pickle=True)
    np.save(tmp_path / "str.npy", np.array([["a", "b"], ["c", "d"]]))
    for name, expected in [("rank3.npy", "rank 3"), ("obj.npy", "not a plain numeric"), ("str.npy", "dtype <U1")]:
        p = run_cli("train", str(tmp_path / name), "--models-dir", str(models))
        assert p.returncode == 1 and expected in p.stderr, p.stderr
    assert not models.exists() or not any(models.rglob("*"))


def test_usage_errors_exit_2_and_missing_gpu_exits_1(tmp_path, small_smd_csv):
    assert run_cli("train").returncode == 2
    assert run_cli("frobnicate").returncode == 2
    assert run_cli("train", str(small_smd_csv), "--amp", "fp8").returncode == 2
    p = run_cli("train", str(small_smd_csv), "--device", "cuda", "--models-dir", str(tmp_path))
    assert p.returncode == 1 and "no CUDA GPU" in p.stderr and "Traceback" not in p.stderr


def test_a_closed_stdout_pipe_ends_quietly(tmp_path, small_smd_csv):
    """``ds-ops train ... | head -1``: no BrokenPipeError traceback."""
    import subprocess
    import sys

    from conftest import REPO

    cmd = (f"{sys.executable} -m opt_ds_ops.cli train {small_smd_csv} --models-dir {tmp_path} "
           f"--epochs 3 --device cpu 2>{tmp_path / 'err'} | head -c 10 >/dev/null")
    subprocess.run(["bash", "-c", cmd], env={**os.environ, "PYTHONPATH": str(REPO)}, check=True, timeout=300)
    assert "Traceback" not in (tmp_path / "err").read_text()


def test_a_config_named_like_the_dataset_is_read_as_its_sidecar_and_the_error_says_so(tmp_path, small_smd_csv):
    data = tmp_path / "fleet.csv"
    data.write_bytes(small_smd_csv.read_bytes())
    conf = tmp_path / "fleet.yaml"
    conf.write_text("job:\n  memory_max: 2G\n")
    p = run_cli("train", str(data), "--config", str(conf), "--models-dir", str(tmp_path / "models"))
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert "unknown key 'job'" in p.stderr
    assert f"your --config file {conf} was read as the sidecar of fleet.csv" in p.stderr
    assert "--sidecar FILE" in p.stderr


def test_a_streamed_training_says_so_in_its_output_and_json(tmp_path):
    rng = np.random.default_rng(0)
    np.save(tmp_path / "big.npy", rng.standard_normal((20_000, 8)).astype(np.float32))
    conf = tmp_path / "trainer.yaml"
    conf.write_text("job:\n  max_matrix_bytes: 100000\ntrain:\n  epochs: 1\n")
    p = run_cli("train", str(tmp_path / "big.npy"), "--config", str(conf), "--models-dir", str(tmp_path / "m"))
    assert p.returncode == 0, p.stderr
    assert "note: the float32 matrix (640,000 bytes) exceeds the job's budget: streamed from disk" in p.stdout
    p = run_cli("train", str(tmp_path / "big.npy"), "--config", str(conf), "--models-dir", str(tmp_path / "m"), "--json")
    out = json.loads(p.stdout)
    assert out["data_placement"] == "streamed" and out["peak_rss_bytes"] > 0 and out["step_mode"] == "eager"
