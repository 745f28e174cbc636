"""``ds-ops score`` as a real process on the bundled real SMD machine."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, SHARED_SMD, SMD_LABELS, SMD_TEST, SMD_TRAIN, run_cli


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    models = tmp_path_factory.mktemp("models")
    p = run_cli("train", str(SMD_TRAIN), "--models-dir", str(models), "--json")
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)["model_dir"]


def test_score_with_labels_prints_metrics_and_writes_rows(tmp_path, model_dir):
    out = tmp_path / "scores.csv"
    p = run_cli("score", model_dir, str(SMD_TEST), "--labels", str(SMD_LABELS), "--output", str(out))
    assert p.returncode == 3, p.stderr  # rows are flagged
    assert "ROC-AUC" in p.stdout and "PR-AUC" in p.stdout and "F1" in p.stdout
    rows = np.loadtxt(out, delimiter=",", skiprows=1, usecols=(0, 1, 2, 3))
    assert out.read_text().splitlines()[0] == "row,score,anomaly,label,top_metrics"
    assert rows.shape == (23694, 4) and set(np.unique(rows[:, 2])) <= {0, 1}


def test_score_json_evaluation(model_dir):
    p = run_cli("score", model_dir, str(SMD_TEST), "--labels", str(SMD_LABELS), "--json")
    assert p.returncode == 3, p.stderr
    ev = json.loads(p.stdout)["evaluation"]
    assert ev["rows"] == 23694 and ev["anomalies"] == 542
    assert 0.9 < ev["roc_auc"] <= 1.0 and 0 < ev["f1"] <= 1


def test_score_errors_exit_1(tmp_path, model_dir):
    p = run_cli("score", str(tmp_path), str(SMD_TEST))
    assert p.returncode == 1 and "not a model directory" in p.stderr
    short = tmp_path / "labels.txt"
    short.write_text("0\n1\n")
    p = run_cli("score", model_dir, str(SMD_TEST), "--labels", str(short))
    assert p.returncode == 1 and "2 labels for 23694 data rows" in p.stderr
    narrow = tmp_path / "narrow.csv"
    narrow.write_text("1,2\n3,4\n")
    p = run_cli("score", model_dir, str(narrow))
    assert p.returncode == 1 and "data has 2 features, model expects 38" in p.stderr


def test_score_reads_the_dataset_within_the_configs_job_budgets(tmp_path, model_dir):
    conf = tmp_path / "trainer.yaml"
    conf.write_text("job:\n  max_columns: 10\n")
    p = run_cli("score", model_dir, str(SMD_TEST), "--config", str(conf))
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert p.stderr.strip() == f"ds-ops: error: {SMD_TEST}: line 1 has 38 fields; job.max_columns is 10"


@pytest.mark.slow
@pytest.mark.skipif(not (SHARED_SMD / "train").is_dir(), reason="../shared/data/smd not present")
def test_every_shared_smd_machine_trains_and_scores(tmp_path):
    """Acceptance: train on every file in ../shared/data/smd/train and score its test period."""
    aucs = {}
    for train_file in sorted((SHARED_SMD / "train").glob("*.txt.gz")):
        name = train_file.name.removesuffix(".txt.gz")
        p = run_cli("train", str(train_file), "--models-dir", str(tmp_path), "--json")
        assert p.returncode == 0, p.stderr
        p = run_cli("score", json.loads(p.stdout)["model_dir"], str(SHARED_SMD / "test" / train_file.name),
                    "--labels", str(SHARED_SMD / "test_label" / f"{name}.txt"), "--json")
        assert p.returncode == (3 if json.loads(p.stdout)["flagged"] else 0), p.stderr
        aucs[name] = json.loads(p.stdout)["evaluation"]["roc_auc"]
    assert len(aucs) == 10
    assert all(0.5 < a <= 1 for a in aucs.values()), aucs


def run_stdin(data: bytes, *args: str) -> subprocess.CompletedProcess:
    """Run ``ds-ops ARGS`` as a real process with data on its standard input (text out)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("DS_OPS_CONFIG", None)
    p = subprocess.run([sys.executable, "-m", "opt_ds_ops.cli", *args], input=data, capture_output=True, env=env,
                       timeout=300, cwd=REPO)
    return subprocess.CompletedProcess(p.args, p.returncode, p.stdout.decode(), p.stderr.decode())


def _flat_rows(tmp_path, smd_rows):
    """50 copies of the training file's column means: nothing to flag."""
    path = tmp_path / "flat.csv"
    np.savetxt(path, np.tile(smd_rows.mean(axis=0), (50, 1)), delimiter=",", fmt="%.6f")
    return path


def test_score_exits_3_when_rows_are_flagged_and_0_when_none_are(tmp_path, model_dir, smd_rows):
    """Scripts read the verdict from the exit status (documented in the man page)."""
    flat = run_cli("score", model_dir, str(_flat_rows(tmp_path, smd_rows)), "--json")
    assert flat.returncode == 0, flat.stderr
    assert json.loads(flat.stdout)["flagged"] == 0 and json.loads(flat.stdout)["exit_status"] == 0
    test = run_cli("score", model_dir, str(SMD_TEST), "--json")
    assert test.returncode == 3 and json.loads(test.stdout)["flagged"] > 0


def test_score_reads_standard_input_as_it_reads_the_file(tmp_path, model_dir):
    """``-`` reads standard input: plain text and gzip (told by its magic bytes) give the file's
    scores and segments; it is bounded by spool.max_dataset_bytes."""
    from_file = run_cli("score", model_dir, str(SMD_TEST), "--json", "--output", str(tmp_path / "a.csv"))
    gz = SMD_TEST.read_bytes()
    for label, data, extra in (("gzip", gz, ()), ("text", gzip.decompress(gz), ()), ("text", gzip.decompress(gz), ("--format", "csv"))):
        p = run_stdin(data, "score", model_dir, "-", "--json", "--output", str(tmp_path / "b.csv"), *extra)
        assert p.returncode == 3, (label, p.stderr)
        got, want = json.loads(p.stdout), json.loads(from_file.stdout)
        assert got["segments"] == want["segments"] and got["flagged"] == want["flagged"], label
        assert (tmp_path / "b.csv").read_text() == (tmp_path / "a.csv").read_text()
    conf = tmp_path / "small.yaml"
    conf.write_text("spool:\n  max_dataset_bytes: 1000\n")
    p = run_stdin(gz, "score", model_dir, "-", "--config", str(conf))
    assert p.returncode == 1 and p.stderr.strip() == (
        "ds-ops: error: standard input: more than spool.max_dataset_bytes (1,000 bytes)")
    p = run_stdin(b"1,2\n3,x\n", "score", model_dir, "-")
    assert p.returncode == 1 and "standard input: line 2" in p.stderr and "/tmp" not in p.stderr


def test_score_names_headerless_metrics_by_the_names_stored_with_the_model(tmp_path, small_smd_csv):
    names = [f"gpu_{j}" for j in range(38)]
    conf = tmp_path / "names.yaml"
    conf.write_text("dataset:\n  metric_names: [" + ", ".join(names) + "]\n")
    p = run_cli("train", str(small_smd_csv), "--models-dir", str(tmp_path / "models"), "--epochs", "1", "--json",
                "--config", str(conf))
    assert p.returncode == 0, p.stderr
    p = run_cli("score", json.loads(p.stdout)["model_dir"], str(SMD_TEST))
    assert p.returncode == 3, p.stderr
    shown = [line for line in p.stdout.splitlines() if line.startswith("  rows ")]
    assert shown and all("gpu_" in line and "column " not in line for line in shown)
