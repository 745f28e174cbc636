"""Scoring and evaluation: anomaly scores of new rows against a stored model, and how well they find labels.

Metrics follow their standard definitions: ROC-AUC as the Mann-Whitney U statistic with average
ranks for ties (Hanley & McNeil 1982); PR-AUC as average precision, the step-wise area
``sum_k (R_k - R_{k-1}) P_k`` over distinct score thresholds (the definition scikit-learn's
``average_precision_score`` uses); precision, recall and F1 of the flag ``score > threshold``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .model import anomaly_scores, feature_errors, smooth_scores
from .store import StoredModel


class ScoreError(ValueError):
    """Data or labels that do not fit the model (feature count, label count or values)."""


@dataclass
class Evaluation:
    """Detection quality against 0/1 labels. AUCs are None when only one class is present."""

    rows: int
    anomalies: int
    roc_auc: float | None
    pr_auc: float | None
    precision: float
    recall: float
    f1: float
    threshold: float
    flagged: int

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def standardise_rows(stored: StoredModel, rows: np.ndarray, offset: np.ndarray | None = None) -> torch.Tensor:
    """Return rows (n, D) standardised with the model's scaler: (n, D) float32 CPU tensor.

    ``offset``: (D,) float64, the dataset's (``Dataset.offset``; the values are rows + offset), or
    None. Computed in float64 as ``(rows - (mean - offset)) / std`` and then cast, so a column far
    from zero (1e8 + N(0, 1)) keeps its signal. The stored mean may be float32 (models saved
    before the scaler was kept in float64) or float64.
    """
    shift = stored.mean.double().numpy()
    if offset is not None:
        shift = shift - np.asarray(offset, dtype=np.float64)
    x = np.asarray(rows, dtype=np.float64) - shift
    x /= stored.std.double().numpy()
    return torch.from_numpy(x.astype(np.float32))


def score_rows(
    stored: StoredModel, data: np.ndarray, batch_rows: int = 65536, *, offset: np.ndarray | None = None
) -> np.ndarray:
    """Return the anomaly score of each row of data (rows, D): (rows,) float32, higher = more anomalous.

    Rows are standardised with the model's stored scaler (:func:`standardise_rows`; ``offset`` is
    the dataset's ``Dataset.offset`` when data is centred, else None), ``batch_rows`` at a time; the
    score is the model's :func:`~opt_ds_ops.model.anomaly_scores` of the reconstruction error,
    smoothed over the stored ``score_window`` rows (rows are taken in file order, oldest first),
    comparable with ``stored.threshold``. Raises ScoreError if D differs from the model's feature
    count or offset is not of shape (D,).
    """
    want = stored.model.n_features
    if data.ndim != 2 or data.shape[1] != want:
        raise ScoreError(f"data has {data.shape[1] if data.ndim == 2 else '?'} features, model expects {want}")
    if offset is not None and np.shape(offset) != (want,):
        raise ScoreError(f"offset has shape {np.shape(offset)}, model expects ({want},)")
    out = torch.empty(data.shape[0], dtype=torch.float32)
    for start in range(0, data.shape[0], batch_rows):
        x = standardise_rows(stored, data[start : start + batch_rows], offset)
        out[start : start + batch_rows] = anomaly_scores(feature_errors(stored.model, x, batch_rows), stored.error_scale)
    return smooth_scores(out, stored.score_window).numpy()


def load_labels(path: str, rows: int) -> np.ndarray:
    """Return labels (rows,) bool from a text file of one 0/1 per line (SMD's test_label format).

    Raises ScoreError if the file cannot be read, holds a value other than 0/1, or its line count
    differs from rows.
    """
    try:
        labels = np.loadtxt(path, dtype=np.float64, ndmin=1, comments=None)
    except (OSError, ValueError) as e:
        raise ScoreError(f"{path}: cannot read labels: {e}") from None
    if labels.ndim != 1:
        raise ScoreError(f"{path}: labels must be one value per line, got shape {labels.shape}")
    bad = np.flatnonzero((labels != 0) & (labels != 1))
    if bad.size:
        raise ScoreError(f"{path}: line {bad[0] + 1}: label {labels[bad[0]]:g} is not 0 or 1")
    if labels.shape[0] != rows:
        raise ScoreError(f"{path}: {labels.shape[0]} labels for {rows} data rows")
    return labels.astype(bool)


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float | None:
    """Return the ROC-AUC of scores (n,) for bool labels (n,), or None if one class is absent."""
    pos = int(labels.sum())
    neg = labels.size - pos
    if pos == 0 or neg == 0:
        return None
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    ranks = np.empty(scores.size, dtype=np.float64)
    # average rank (1-based) for each run of tied scores
    _, first, counts = np.unique(sorted_scores, return_index=True, return_counts=True)
    avg = first + (counts + 1) / 2.0
    ranks[order] = np.repeat(avg, counts)
    u = ranks[labels].sum() - pos * (pos + 1) / 2.0
    return float(u / (pos * neg))


def average_precision(scores: np.ndarray, labels: np.ndarray) -> float | None:
    """Return average precision (PR-AUC) of scores for bool labels, or None without positives."""
    pos = int(labels.sum())
    if pos == 0:
        return None
    order = np.argsort(-scores, kind="mergesort")
    s, y = scores[order], labels[order]
    tp = np.cumsum(y)
    fp = np.cumsum(~y)
    last = np.r_[np.flatnonzero(np.diff(s)), s.size - 1]  # last index of each distinct score
    tp, fp = tp[last], fp[last]
    precision = tp / (tp + fp)
    recall = tp / pos
    return float(np.sum(np.diff(np.r_[0.0, recall]) * precision))


def evaluate(scores: np.ndarray, labels: np.ndarray, threshold: float) -> Evaluation:
    """Return the :class:`Evaluation` of scores (n,) against bool labels (n,) at threshold."""
    flags = scores > threshold
    tp = int(np.sum(flags & labels))
    fp = int(np.sum(flags & ~labels))
    fn = int(np.sum(~flags & labels))
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / (tp + fn) if tp + fn else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return Evaluation(
        rows=int(labels.size),
        anomalies=int(labels.sum()),
        roc_auc=roc_auc(scores, labels),
        pr_auc=average_precision(scores, labels),
        precision=precision,
        recall=recall,
        f1=f1,
        threshold=float(threshold),
        flagged=int(flags.sum()),
    )


def zscore_baseline(train: np.ndarray, data: np.ndarray) -> np.ndarray:
    """Model-free baseline score: mean squared z-score of each row against train's column statistics.

    The reference the SMD README gives (mean ROC-AUC about 0.77 over its ten machines); a learned
    detector is only worth running where it beats this.
    """
    mean = train.mean(axis=0, dtype=np.float64)
    std = train.std(axis=0, dtype=np.float64)
    std[std == 0] = 1.0
    z = (np.asarray(data, dtype=np.float64) - mean) / std
    return np.mean(z * z, axis=1)


def fmt_metric(value: float | None) -> str:
    """Format a metric for humans: 4 decimals, or 'n/a' for None/NaN."""
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.4f}"
