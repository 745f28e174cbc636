"""``ds-ops score`` as a real process on the bundled real SMD machine."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import SHARED_SMD, SMD_LABELS, SMD_TEST, SMD_TRAIN, run_cli


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    models = tmp_path_factory.mktemp("models")
    p = run_cli("train", str(SMD_TRAIN), "--models-dir", str(models), "--json")
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)["model_dir"]


def test_score_with_labels_prints_metrics_and_writes_rows(tmp_path, model_dir):
    out = tmp_path / "scores.csv"
    p = run_cli("score", model_dir, str(SMD_TEST), "--labels", str(SMD_LABELS), "--output", str(out))
    assert p.returncode == 0, p.stderr
    assert "ROC-AUC" in p.stdout and "PR-AUC" in p.stdout and "F1" in p.stdout
    rows = np.loadtxt(out, delimiter=",", skiprows=1, usecols=(0, 1, 2, 3))
    assert out.read_text().splitlines()[0] == "row,score,anomaly,label,top_metrics"
    assert rows.shape == (23694, 4) and set(np.unique(rows[:, 2])) <= {0, 1}


def test_score_json_evaluation(model_dir):
    p = run_cli("score", model_dir, str(SMD_TEST), "--labels", str(SMD_LABELS), "--json")
    assert p.returncode == 0, p.stderr
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
        assert p.returncode == 0, p.stderr
        aucs[name] = json.loads(p.stdout)["evaluation"]["roc_auc"]
    assert len(aucs) == 10
    assert all(0.5 < a <= 1 for a in aucs.values()), aucs
