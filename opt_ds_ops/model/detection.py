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

from .network import feature_errors, fold_window, model_inputs, smooth
from .threshold import SECONDS_PER_DAY, segments
from .trained import StoredModel


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


def in_memory_model(result) -> StoredModel:
    """Return the :class:`StoredModel` of a TrainResult without a round trip through the store
    (the same tensors and scoring parameters :func:`opt_ds_ops.store.versions.model_payload` saves)."""
    return StoredModel(
        path="", model=result.model, mean=torch.from_numpy(np.asarray(result.mean, dtype=np.float64)),
        std=torch.from_numpy(np.asarray(result.std, dtype=np.float32)),
        error_scale=torch.from_numpy(np.asarray(result.error_scale, dtype=np.float32)),
        threshold=float(result.threshold), score_window=int(result.score_window), metadata={},
        score_smoothing=result.score_smoothing, input_clip=float(result.input_clip),
        input_window=int(result.input_window), window_error=result.window_error,
        diff=(None if getattr(result, "diff", None) is None else
              tuple(torch.from_numpy(np.asarray(v, dtype=np.float32)) for v in result.diff)),
    )


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


def _check_shape(stored: StoredModel, data: np.ndarray, offset: np.ndarray | None) -> None:
    want = stored.n_features
    if data.ndim != 2 or data.shape[1] != want:
        raise ScoreError(f"data has {data.shape[1] if data.ndim == 2 else '?'} features, model expects {want}")
    if offset is not None and np.shape(offset) != (want,):
        raise ScoreError(f"offset has shape {np.shape(offset)}, model expects ({want},)")


def _cell_batches(stored: StoredModel, data: np.ndarray, batch_rows: int, offset: np.ndarray | None):
    """Yield (start row, (n, D) float32 normalised errors) for batches of batch_rows rows.

    With windowed inputs each batch is read with the input_window - 1 rows before it as context,
    so batches give the same windows as the whole file at once (:func:`window_rows`)."""
    _check_shape(stored, data, offset)
    w = stored.input_window
    for start in range(0, data.shape[0], batch_rows):
        k = min(start, w - 1)  # context rows read again from the previous batch
        x = standardise_rows(stored, data[start - k : start + batch_rows], offset)
        if stored.input_clip > 0:
            x.clamp_(-stored.input_clip, stored.input_clip)
        x = model_inputs(x[k:], w, context=x[:k], diff=stored.diff, clip=stored.input_clip)
        cells = feature_errors(stored.model, x) / stored.error_scale
        yield start, fold_window(cells, w, stored.window_error).numpy()


def normalised_errors(
    stored: StoredModel, data: np.ndarray, batch_rows: int = 65536, *, offset: np.ndarray | None = None
) -> np.ndarray:
    """Return each cell's squared reconstruction error over its feature's stored error scale:
    (rows, D) float32, before smoothing; its row mean is the unsmoothed anomaly score.

    Rows are standardised with the model's stored scaler (:func:`standardise_rows`; ``offset`` is
    the dataset's ``Dataset.offset`` when data is centred, else None), clipped to
    +-``stored.input_clip`` and, for a model with ``input_window`` w > 1, windowed (row t's input
    is rows t-w+1..t, rows before row 0 repeat row 0: :func:`opt_ds_ops.model.network.window_rows`; its
    cells are the window's last row's, or the mean over the window's rows, by
    ``stored.window_error``), ``batch_rows`` at a time. Causal: row t's cells depend on rows <= t.
    Raises ScoreError if D differs from the model's feature count or offset is not of shape (D,).
    """
    out = np.empty(data.shape, dtype=np.float32)
    for start, cells in _cell_batches(stored, data, batch_rows, offset):
        out[start : start + cells.shape[0]] = cells
    return out


def score_rows(
    stored: StoredModel, data: np.ndarray, batch_rows: int = 65536, *, offset: np.ndarray | None = None
) -> np.ndarray:
    """Return the anomaly score of each row of data (rows, D): (rows,) float32, higher = more anomalous.

    The mean over features of :func:`normalised_errors`, smoothed over the stored ``score_window``
    rows by the stored ``score_smoothing`` (rows in file order, oldest first; causal: appending
    rows never changes earlier scores), comparable with ``stored.threshold``. Holds one batch of
    cells at a time. Raises ScoreError if D differs from the model's feature count or offset is
    not of shape (D,).
    """
    raw = np.empty(data.shape[0], dtype=np.float32)
    for start, cells in _cell_batches(stored, data, batch_rows, offset):
        raw[start : start + cells.shape[0]] = cells.mean(axis=1)
    return smooth(raw, stored.score_window, stored.score_smoothing).astype(np.float32)


def score_with_cells(
    stored: StoredModel, data: np.ndarray, batch_rows: int = 65536, *, offset: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Return (:func:`score_rows`' scores (rows,) float32, equal to its to the bit, and
    :func:`normalised_errors`' (rows, D) float32, which costs the memory of data again).
    Raises ScoreError as :func:`score_rows` does."""
    cells = normalised_errors(stored, data, batch_rows, offset=offset)
    raw = np.empty(data.shape[0], dtype=np.float32)
    for start in range(0, data.shape[0], batch_rows):
        raw[start : start + batch_rows] = cells[start : start + batch_rows].mean(axis=1)
    return smooth(raw, stored.score_window, stored.score_smoothing).astype(np.float32), cells


def contributions(stored: StoredModel, cells: np.ndarray) -> np.ndarray:
    """Return each feature's share of the smoothed score: (rows, D) float64 from
    :func:`normalised_errors`' (rows, D), smoothed like the score. Both smoothings are linear, so
    a row's mean over features is its score (to float rounding)."""
    return smooth(cells, stored.score_window, stored.score_smoothing)


def metric_names(header: list[str] | None, features: int, columns: list[int] | None = None) -> list[str]:
    """Return the metrics' names: the dataset's header names, else 1-based column numbers as text
    (of the file, when ``columns``, the features' 0-based file columns, are given)."""
    if header is not None and len(header) == features:
        return [str(h) for h in header]
    return [str(c + 1) for c in (columns if columns is not None else range(features))]


def rank_metrics(contrib: np.ndarray, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
    """Return (column indices best first, their shares) of rows start..end-1 of contrib (rows, D).

    A metric's share is its summed contribution over the rows divided by the sum over all metrics
    (shares are >= 0 and add up to 1; all 0 where the rows' score is 0).
    """
    total = contrib[start:end].sum(axis=0)
    order = np.argsort(-total, kind="stable")
    denom = total.sum()
    return order, (total[order] / denom if denom > 0 else np.zeros_like(total))


def flagged_segments(
    scores: np.ndarray, threshold: float, cells: np.ndarray, names: list[str], top: int = 3
) -> list[dict]:
    """Return one dict per run of rows with ``scores > threshold``: ``start`` and ``end`` (first and
    last row, 0-based, inclusive), ``peak_score``, ``peak_row`` and ``top_metrics``: the ``top``
    metrics with the largest share of the segment's score, as ``{"metric": name, "share": s}``.

    scores: (rows,); cells: (rows, D), :func:`normalised_errors` (the unsmoothed score's terms:
    a segment's own rows, not the smoothing's memory of rows before it; on the five SMD machines
    used to pick defaults this ranked the labelled metrics better, HitRate@150% 0.717 against
    0.663 for the smoothed terms); names: D metric names.
    """
    starts, ends = segments(scores > threshold)
    out = []
    for a, b in zip(starts.tolist(), ends.tolist()):
        order, shares = rank_metrics(cells, a, b)
        peak = a + int(np.argmax(scores[a:b]))
        out.append({
            "start": a, "end": b - 1, "peak_row": peak, "peak_score": float(scores[peak]),
            "top_metrics": [{"metric": names[j], "share": float(sh)} for j, sh in zip(order[:top], shares[:top])],
        })
    return out


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


def best_f1(scores: np.ndarray, labels: np.ndarray) -> float | None:
    """Return the highest point-wise F1 of ``scores >= t`` over every distinct score t, or None
    without positives. An upper bound no threshold set in advance reaches (it looks at labels)."""
    pos = int(labels.sum())
    if pos == 0:
        return None
    order = np.argsort(-scores, kind="mergesort")
    s, y = scores[order], labels[order]
    last = np.r_[np.flatnonzero(np.diff(s)), s.size - 1]
    tp = np.cumsum(y)[last]
    flagged = last + 1
    f1 = 2 * tp / (flagged + pos)
    return float(f1.max())


def false_alarms_per_day(flags: np.ndarray, labels: np.ndarray, sample_period_s: float) -> float:
    """Return alarms per day of normal data: runs of flagged rows (flags (n,) bool) that touch no
    labelled row, divided by the days the normal rows cover (``sample_period_s`` seconds each).
    0.0 when there are no normal rows."""
    starts, ends = segments(flags)
    lab = np.r_[0, np.cumsum(labels, dtype=np.int64)]
    false = int(np.sum(lab[ends] - lab[starts] == 0))
    days = int((~labels).sum()) * sample_period_s / SECONDS_PER_DAY
    return false / days if days else 0.0


def segments_flagged(flags: np.ndarray, labels: np.ndarray) -> float | None:
    """Return the share of labelled segments (runs of labelled rows) with at least one flagged row
    (flags, labels: (n,) bool); None when nothing is labelled. With :func:`false_alarms_per_day` it
    is what an operator lives with: the incidents the alarm caught at all, and the alarms for nothing."""
    starts, ends = segments(labels)
    if len(starts) == 0:
        return None
    hit = np.r_[0, np.cumsum(flags, dtype=np.int64)]
    return float(np.mean(hit[ends] - hit[starts] > 0))


EMA_BASELINE_WINDOW = 10  # alpha = 2 / (10 + 1): the model-free z-score + EMA baseline (docs/detection.md)


def zscore_cells(train: np.ndarray, data: np.ndarray) -> np.ndarray:
    """Return each cell's squared z-score against train's column mean and std (a zero std is 1):
    (rows, D) float64 from train (N, D) and data (rows, D), any real dtype."""
    mean = train.mean(axis=0, dtype=np.float64)
    std = train.std(axis=0, dtype=np.float64)
    std[std == 0] = 1.0
    z = (np.asarray(data, dtype=np.float64) - mean) / std
    return z * z


PCA_VARIANCE = 0.95  # the PCA baseline keeps the components of this share of the training variance


def pca_cells(train: np.ndarray, data: np.ndarray, variance: float = PCA_VARIANCE) -> tuple[np.ndarray, int]:
    """Return (each cell's squared PCA reconstruction error, components kept): (rows, D) float64
    from train (N, D) and data (rows, D), any real dtype.

    Both are standardised by train's column mean and std (a zero std is 1, as :func:`zscore_cells`);
    the principal axes are the eigenvectors of train's covariance (float64, ``numpy.linalg.eigh``),
    the fewest whose eigenvalues hold at least ``variance`` (0..1] of its trace; a row's
    reconstruction is its projection on them (the linear reference of docs/detection-protocol.md,
    after Sarfraz et al., ICML 2024)."""
    mean = train.mean(axis=0, dtype=np.float64)
    std = train.std(axis=0, dtype=np.float64)
    std[std == 0] = 1.0
    z_train = (np.asarray(train, dtype=np.float64) - mean) / std
    eigvals, eigvecs = np.linalg.eigh(z_train.T @ z_train / z_train.shape[0])
    eigvals, eigvecs = eigvals[::-1].clip(min=0.0), eigvecs[:, ::-1]
    total = eigvals.sum()
    k = int(np.searchsorted(np.cumsum(eigvals) / total, variance - 1e-12) + 1) if total > 0 else 0
    axes = eigvecs[:, :min(k, eigvecs.shape[1])]
    z = (np.asarray(data, dtype=np.float64) - mean) / std
    residual = z - (z @ axes) @ axes.T
    return residual * residual, axes.shape[1]


def pca_ema_baseline(train: np.ndarray, data: np.ndarray, variance: float = PCA_VARIANCE) -> np.ndarray:
    """The PCA baseline of ``ds-ops evaluate``: the row's mean squared reconstruction error
    (:func:`pca_cells`), then the z-score baseline's causal EMA (alpha = 2/11); (rows,) float64."""
    return smooth(pca_cells(train, data, variance)[0].mean(axis=1), EMA_BASELINE_WINDOW, "ema")


def zscore_ema_baseline(train: np.ndarray, data: np.ndarray) -> np.ndarray:
    """The model-free baseline (docs/detection.md): the row's mean squared z-score (:func:`zscore_cells`),
    then a causal EMA with alpha = 2/11; (rows,) float64."""
    return smooth(zscore_cells(train, data).mean(axis=1), EMA_BASELINE_WINDOW, "ema")


def hit_rate(contrib: np.ndarray, truth: list[tuple[int, int, list[int]]], pct: float) -> float | None:
    """Return OmniAnomaly's HitRate@pct% of per-row metric rankings, or None without truth rows.

    contrib: (rows, D), larger = more to blame; truth: ``(start, end, columns)`` with rows
    start..end-1 (0-based) and the 0-based columns the anomaly touched. For each such row t,
    ``HitRate = |top k of t's ranking & columns| / |columns|`` with ``k = floor(pct / 100 *
    |columns|)`` (the interpretation metric of OmniAnomaly, Su et al., KDD 2019, which reports
    about 0.89 at 150 % on SMD); the result is the mean over every row of every segment, whether
    the score flagged the row or not.
    """
    hits, n = 0.0, 0
    for start, end, cols in truth:
        if not cols or end <= start:
            continue
        k = int(pct / 100 * len(cols))
        rows = contrib[start:end]
        top = np.argsort(-rows, axis=1, kind="stable")[:, :k]
        hits += float(np.isin(top, cols).sum()) / len(cols)
        n += rows.shape[0]
    return hits / n if n else None


def segment_hit_rate(cells: np.ndarray, truth: list[tuple[int, int, list[int]]], pct: float) -> float | None:
    """Return HitRate@pct% of the ranking ``ds-ops score`` gives a segment, or None without truth.

    For each truth segment ``(start, end, columns)`` the metrics are ranked by their share of the
    segment's unsmoothed score (:func:`rank_metrics` over cells (rows, D), rows start..end-1);
    ``|top k & columns| / |columns|`` with ``k = floor(pct / 100 * |columns|)``, averaged over
    segments (each anomaly counts once, however long).
    """
    rates = []
    for start, end, cols in truth:
        if not cols or end <= start:
            continue
        order, _ = rank_metrics(cells, start, end)
        rates.append(float(np.isin(order[: int(pct / 100 * len(cols))], cols).sum()) / len(cols))
    return float(np.mean(rates)) if rates else None


def load_interpretation(path: str, rows: int, features: int) -> list[tuple[int, int, list[int]]]:
    """Return SMD's interpretation_label ``start-end:c1,c2,...`` lines (rows start..end-1, 0-based;
    columns 1-based in the file) as ``(start, end, [0-based columns])``.

    Raises ScoreError naming the file and line for a line of another form, rows outside 0..rows
    or a column outside 1..features.
    """
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ScoreError(f"{path}: cannot read interpretation labels: {e.strerror}") from None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            span, cols_text = line.split(":")
            a, b = (int(v) for v in span.split("-"))
            cols = [int(c) for c in cols_text.split(",") if c.strip()]
        except ValueError:
            raise ScoreError(f"{path}: line {i}: expected 'start-end:col,col,...', got {line.strip()[:60]!r}") from None
        if not 0 <= a < b <= rows or not all(1 <= c <= features for c in cols):
            raise ScoreError(f"{path}: line {i}: rows {a}-{b} or columns outside {rows} rows x {features} columns")
        out.append((a, b, [c - 1 for c in cols]))
    return out
