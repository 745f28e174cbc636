"""Scoring and evaluation metrics, checked against their definitions computed the slow way."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from opt_ds_ops.config import TrainConfig
from opt_ds_ops.device import plan_device
from opt_ds_ops.score import (
    ScoreError,
    average_precision,
    evaluate,
    load_labels,
    roc_auc,
    score_rows,
    zscore_baseline,
)
from opt_ds_ops.store import load_model, model_payload, save_model
from opt_ds_ops.train import train


def brute_roc_auc(scores, labels):
    """P(score of a positive > score of a negative) + 0.5 P(tie), over all pairs."""
    pos, neg = scores[labels], scores[~labels]
    wins = sum((p > n) + 0.5 * (p == n) for p, n in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


def brute_average_precision(scores, labels):
    """sum over distinct thresholds t (descending) of (R(t) - R(prev)) * P(t)."""
    ap, prev_recall = 0.0, 0.0
    for t in sorted(set(scores.tolist()), reverse=True):
        flagged = scores >= t
        tp = np.sum(flagged & labels)
        precision, recall = tp / flagged.sum(), tp / labels.sum()
        ap += (recall - prev_recall) * precision
        prev_recall = recall
    return ap


@pytest.mark.parametrize("seed", range(5))
def test_metrics_match_their_definitions_with_ties(seed):
    rng = np.random.default_rng(seed)
    scores = rng.integers(0, 8, size=60).astype(np.float64)  # many ties
    labels = rng.random(60) < 0.3
    assert roc_auc(scores, labels) == pytest.approx(brute_roc_auc(scores, labels))
    assert average_precision(scores, labels) == pytest.approx(brute_average_precision(scores, labels))


def test_metric_edge_cases():
    labels = np.array([False, False, True, True])
    assert roc_auc(np.array([0.1, 0.2, 0.8, 0.9]), labels) == 1.0
    assert roc_auc(np.array([0.9, 0.8, 0.2, 0.1]), labels) == 0.0
    assert roc_auc(np.ones(4), labels) == 0.5
    assert roc_auc(np.ones(4), np.zeros(4, bool)) is None
    assert average_precision(np.ones(4), np.zeros(4, bool)) is None
    assert average_precision(np.array([0.1, 0.2, 0.8, 0.9]), labels) == 1.0


def test_evaluate_counts_at_the_threshold():
    scores = np.array([0.1, 0.6, 0.7, 0.2, 0.9])
    labels = np.array([False, True, False, False, True])
    ev = evaluate(scores, labels, threshold=0.5)
    assert (ev.flagged, ev.anomalies, ev.rows) == (3, 2, 5)
    assert ev.precision == pytest.approx(2 / 3) and ev.recall == 1.0 and ev.f1 == pytest.approx(0.8)


def test_labels_file_is_validated(tmp_path):
    good = tmp_path / "l.txt"
    good.write_text("0\n1\n0\n")
    assert load_labels(str(good), 3).tolist() == [False, True, False]
    with pytest.raises(ScoreError, match="3 labels for 4 data rows"):
        load_labels(str(good), 4)
    bad = tmp_path / "b.txt"
    bad.write_text("0\n2\n")
    with pytest.raises(ScoreError, match="line 2: label 2 is not 0 or 1"):
        load_labels(str(bad), 2)


def test_scores_of_a_stored_model_on_real_smd_find_the_labelled_anomalies(tmp_path, smd_rows):
    from conftest import SMD_LABELS, SMD_TEST
    from opt_ds_ops.dataset import load_dataset

    result = train(smd_rows, TrainConfig(), plan_device("cpu", "off"))
    save_model(str(tmp_path), "machine-1-2", model_payload(result), {})
    stored = load_model(str(tmp_path / "machine-1-2" / "current"))
    test = load_dataset(str(SMD_TEST)).data
    labels = load_labels(str(SMD_LABELS), test.shape[0])
    scores = score_rows(stored, test)
    assert scores.shape == (test.shape[0],) and scores.dtype == np.float32
    model_auc = roc_auc(scores, labels)
    baseline_auc = roc_auc(zscore_baseline(smd_rows, test), labels)
    assert model_auc > baseline_auc  # measured 0.935 against 0.868 for the per-row z-score
    with pytest.raises(ScoreError, match="data has 5 features, model expects 38"):
        score_rows(stored, np.zeros((3, 5), np.float32))
