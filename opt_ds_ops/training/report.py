"""``report.png`` of a model version: what the model learned, at a glance.

Three panels, drawn by matplotlib's Agg backend (no display needed): the per-epoch training and
validation loss (MSE of standardised values); the distribution of the validation rows' anomaly
scores with the stored threshold; the per-feature error scale (the mean squared validation error
of each metric, the metrics the model reconstructs worst first, by header name when the dataset
had one). Everything comes from the version directory alone (metadata.json, with its
``validation_scores`` histogram, and model.pt), so ``ds-ops report`` redraws it any time.
A report that cannot be drawn is a warning for the job, never a failure (:func:`try_write_report`).
"""

from __future__ import annotations

import io
import json
import os

import numpy as np

from ..fsutil import write_atomic

# matplotlib is imported with this module, not at the first drawing: the daemon's forkserver
# preloads opt_ds_ops.training.job and so this module, and each job process forked from it then draws
# without importing matplotlib and loading its font list again (1.5 s a job here otherwise).
MATPLOTLIB_ERROR = ""  # why matplotlib cannot be used here (empty: it can)
try:
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    def _warm_up() -> None:
        """Draw one small figure with text (0.1 s): loads the font list and the font's glyph
        cache once, in the forkserver, instead of in every job (0.25 s each, measured)."""
        import io

        fig = Figure(figsize=(1, 1), dpi=10)
        fig.subplots().set_title("x")
        fig.savefig(io.BytesIO(), format="png")

    _warm_up()
except Exception as e:  # noqa: BLE001 - missing or broken (a bad MPLBACKEND): reports fail, nothing else
    Figure = MaxNLocator = None
    MATPLOTLIB_ERROR = f"matplotlib cannot be used: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

REPORT_FILE = "report.png"
HIST_BINS = 60
TOP_FEATURES = 20  # the error-scale panel shows this many metrics, worst first


class ReportError(RuntimeError):
    """A report that cannot be drawn or written; the message names the file and why."""


def validation_summary(result, data: np.ndarray, offset, val_fraction: float) -> dict | None:
    """Given a TrainResult and its dataset's (rows, D) matrix (and ``Dataset.offset``), return the
    validation rows' anomaly-score histogram for metadata.json: ``{rows, edges, counts, max}``
    (scores as ``ds-ops score`` computes them; ``HIST_BINS`` bins up to the larger of the highest
    score and 1.2 x the threshold); None without a validation split."""
    from ..model.detection import in_memory_model, score_rows
    from .fit import split_rows

    if not isinstance(data, np.ndarray):  # a streamed dataset (opt_ds_ops.training.stream): its trainer kept the scores
        scores = result.extra.get("validation_scores")
        if scores is None or not result.rows_val:
            return None
        scores = np.asarray(scores, dtype=np.float64)
    else:
        train_idx, val_idx = split_rows(data.shape[0], val_fraction)
        if len(val_idx) == 0:
            return None
        scores = score_rows(in_memory_model(result), data[len(train_idx):], offset=offset).astype(np.float64)
    top = max(float(scores.max()), 1.2 * float(result.threshold), 1e-12)
    counts, edges = np.histogram(scores, bins=HIST_BINS, range=(0.0, top))
    return {"rows": int(len(scores)), "edges": [float(e) for e in edges], "counts": [int(c) for c in counts],
            "max": float(scores.max())}


def _error_scale(version_dir: str) -> np.ndarray | None:
    import torch

    try:
        payload = torch.load(os.path.join(version_dir, "model.pt"), map_location="cpu", weights_only=True)
        return np.asarray(payload["error_scale"], dtype=np.float64)
    except Exception:  # an older or damaged model.pt: the panel says so instead
        return None


def write_report(version_dir: str, out: str | None = None) -> str:
    """Draw the report of the model version in version_dir to out (default
    ``version_dir/report.png``), atomically (a hidden temporary file renamed over it); return its
    path. Raises ReportError if metadata.json cannot be read, matplotlib is missing or the PNG
    cannot be written."""
    if Figure is None:
        raise ReportError(f"report.png not drawn: {MATPLOTLIB_ERROR} (ds-ops needs matplotlib==3.11.2)")
    try:
        with open(os.path.join(version_dir, "metadata.json"), encoding="utf-8") as f:
            md = json.load(f)
    except (OSError, ValueError) as e:
        raise ReportError(f"{version_dir}: cannot read metadata.json: {getattr(e, 'strerror', None) or e}") from None
    out = out or os.path.join(version_dir, REPORT_FILE)
    threshold = md.get("threshold")
    # Figure without pyplot: no global figure registry, no GUI backend, and 0.26 s less to import;
    # savefig renders a PNG with Agg
    fig = Figure(figsize=(16, 4.6))
    axes = fig.subplots(1, 3)
    title = (f"{md.get('name', '?')} / {md.get('version', '?')}  -  {(md.get('dataset') or {}).get('file', '?')}, "
             f"{(md.get('dataset') or {}).get('rows', '?')} rows x {(md.get('dataset') or {}).get('columns', '?')} "
             f"metrics, {md.get('device', '?')}")
    fig.suptitle(title, fontsize=11)
    ax = axes[0]
    hist = md.get("history") or []
    epochs = [h.get("epoch") for h in hist]
    ax.plot(epochs, [h.get("train_loss") for h in hist], "o-", label="train loss")
    if any(h.get("val_loss") is not None for h in hist):
        ax.plot(epochs, [h.get("val_loss") for h in hist], "s-", label="validation loss")
    stop = md.get("stopping") or {}
    ax.set(title="loss per epoch" + (f" (stopped: {stop['reason']}, {stop['steps']:,} steps)" if stop.get("reason") else ""),
           xlabel="epoch", ylabel="MSE (standardised units)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend()
    ax.grid(alpha=0.3)
    ax = axes[1]
    vs = md.get("validation_scores")
    if vs:
        edges = np.asarray(vs["edges"])
        ax.bar(edges[:-1], vs["counts"], width=np.diff(edges), align="edge", color="tab:blue", alpha=0.7,
               label=f"{vs['rows']} validation rows")
        ax.set_yscale("log")
    else:
        ax.text(0.5, 0.5, "no validation scores stored\n(model from before ds-ops stored them,\nor no validation split)",
                ha="center", va="center", transform=ax.transAxes)
    if isinstance(threshold, (int, float)):
        ax.axvline(threshold, color="tab:red", lw=1.5, label=f"threshold {threshold:.4g} "
                   f"({md.get('threshold_method', 'quantile')})")
    ax.set(title="validation anomaly scores", xlabel="anomaly score", ylabel="rows")
    ax.legend(fontsize=8)
    ax = axes[2]
    scale = _error_scale(version_dir)
    if scale is not None and scale.size:
        header = (md.get("dataset") or {}).get("header")
        columns = (md.get("dataset") or {}).get("feature_columns")  # 1-based, as the file numbers them
        if not columns or len(columns) != scale.size:
            columns = range(1, scale.size + 1)
        names = list(header) if header and len(header) == scale.size else [f"column {c}" for c in columns]
        order = np.argsort(-scale)[:TOP_FEATURES][::-1]
        ax.barh([str(names[i])[:28] for i in order], scale[order], color="tab:orange")
        ax.set(title=f"error scale per metric (worst {len(order)} of {scale.size})",
               xlabel="mean squared validation error (standardised)")
        ax.tick_params(axis="y", labelsize=7)
    else:
        ax.text(0.5, 0.5, "model.pt unreadable", ha="center", va="center", transform=ax.transAxes)
    # A suspect model says so under the plots, one red line per warning
    warnings = [str(w) for w in md.get("warnings") or []][:3]
    for i, w in enumerate(warnings):
        fig.text(0.01, 0.015 + 0.05 * (len(warnings) - 1 - i), "WARNING: " + (w if len(w) <= 190 else w[:187] + "..."),
                 color="tab:red", fontsize=9)
    fig.subplots_adjust(left=0.05, right=0.99, bottom=0.13 + 0.05 * len(warnings), top=0.86,
                        wspace=0.28)  # not tight_layout: 0.35 s
    try:
        write_atomic(out, _png(fig))
    except OSError as e:
        raise ReportError(f"cannot write {out}: {e.strerror or e}") from None
    return out


def _png(fig) -> bytes:
    """Render a matplotlib Figure as PNG bytes (90 dpi), for :func:`opt_ds_ops.fsutil.write_atomic`."""
    buf = io.BytesIO()
    fig.savefig(buf, dpi=90, format="png")
    return buf.getvalue()


def try_write_report(version_dir: str) -> str | None:
    """Draw ``version_dir/report.png``; return None on success, else one line saying why not (a
    warning for the job: a plot never fails a job, whatever goes wrong in matplotlib)."""
    try:
        write_report(version_dir)
    except ReportError as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - matplotlib's errors are many; none may fail a trained job
        return f"report.png not drawn: {type(e).__name__}: {e}"
    return None


def write_score_plot(scores: np.ndarray, threshold: float, path: str, *, labels: np.ndarray | None = None,
                     title: str = "") -> str:
    """Draw ``ds-ops score --plot``: the anomaly score per row (log scale), the threshold, flagged
    rows and, with labels (0/1 per row), the labelled segments shaded; write a PNG to path
    atomically and return it. Raises ReportError if matplotlib is missing or path cannot be written."""
    if Figure is None:
        raise ReportError(f"--plot: {MATPLOTLIB_ERROR} (ds-ops needs matplotlib==3.11.2)")
    from ..model.threshold import segments

    s = np.asarray(scores, dtype=np.float64)
    fig = Figure(figsize=(14, 3.6))
    ax = fig.subplots()
    ax.plot(s, lw=0.6, color="tab:blue", label="anomaly score")
    ax.axhline(threshold, color="tab:red", lw=0.9, ls="--", label=f"threshold {threshold:.4g}")
    flagged = np.flatnonzero(s > threshold)
    if flagged.size:
        ax.plot(flagged, s[flagged], ".", ms=2, color="tab:red", label=f"{flagged.size} rows flagged")
    if labels is not None:
        for i, (a, b) in enumerate(zip(*segments(np.asarray(labels).astype(bool)))):
            ax.axvspan(a, b, color="tab:orange", alpha=0.3, lw=0, label="labelled anomaly" if i == 0 else None)
    if np.all(s > 0):
        ax.set_yscale("log")
    ax.set(title=title, xlabel="row", ylabel="anomaly score", xlim=(0, max(s.size, 1)))
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    try:
        write_atomic(path, _png(fig))
    except OSError as e:
        raise ReportError(f"{path}: cannot write plot: {e.strerror or e}") from None
    return path
