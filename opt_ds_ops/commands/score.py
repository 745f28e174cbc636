"""``ds-ops score MODEL_DIR DATASET``: per-row anomaly scores and flags; detection metrics with --labels."""

from __future__ import annotations

import csv
import json
import os

import numpy as np

from ..config import DEFAULT_CONFIG_PATH
from ..dataset import DatasetLimits, load_dataset
from ..score import evaluate, flagged_segments, fmt_metric, load_labels, metric_names, score_with_cells
from ..scoring import stored_options
from ..store import load_model, model_path
from . import CliError, load_cfg


def add_parser(sub) -> None:
    s = sub.add_parser("score", help="score a dataset with a trained model (per-row reconstruction error)")
    s.add_argument("model_dir", metavar="MODEL_DIR", help="a model version directory, its 'current' link, the model name's directory or a model name under models_dir")
    s.add_argument("dataset", metavar="DATASET")
    s.add_argument("--labels", help="file of one 0/1 per row: also print ROC-AUC, PR-AUC, precision, recall, F1")
    s.add_argument("--output", help="write per-row CSV: row,score,anomaly[,label],top_metrics")
    s.add_argument("--top", type=int, default=3, metavar="N",
                   help="metrics named per flagged segment, largest share of the score first (default 3)")
    s.add_argument("--config", help=f"configuration file, for the job.* dataset budgets (default: {DEFAULT_CONFIG_PATH} if present)")
    s.add_argument("--plot", metavar="FILE", help="draw the score over the rows with the threshold (and the labels) to a PNG")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=run)


def align_columns(stored, ds) -> None:
    """Put ds's feature columns in the order of the model's, by header name, where both have names;
    raise CliError naming the columns the model needs and the file lacks."""
    names = (stored.metadata.get("dataset") or {}).get("header")
    if not names or not ds.header or list(names) == list(ds.header):
        return
    missing = [n for n in names if n not in ds.header]
    if missing:
        shown = ", ".join(repr(n) for n in missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise CliError(f"{ds.path}: the model was trained on columns this file lacks: {shown}")
    order = [ds.header.index(n) for n in names]
    ds.data = np.ascontiguousarray(np.asarray(ds.data)[:, order])
    ds.offset = ds.offset[order] if ds.offset is not None else None
    ds.header = list(names)


def run(args) -> int:
    """``ds-ops score MODEL_DIR DATASET``: per-row anomaly scores and flags; metrics with --labels."""
    cfg = load_cfg(args, {})
    stored = load_model(model_path(args.model_dir, cfg.models_dir))  # issue 11: a bare model name too
    ds = load_dataset(args.dataset, DatasetLimits.from_config(cfg.job, cfg.spool.max_dataset_bytes),
                      stored_options(stored, cfg))
    align_columns(stored, ds)
    if args.top < 1:
        raise CliError(f"--top {args.top}: must be >= 1")
    scores, cells = score_with_cells(stored, ds.data, offset=ds.offset)
    flags = scores > stored.threshold
    labels = load_labels(args.labels, ds.rows) if args.labels else None
    order = ds.time.order if ds.time is not None else None
    if labels is not None and order is not None:
        labels = labels[order]  # the labels follow the file's rows; the rows were sorted by time
    names = metric_names(ds.header, ds.features, ds.feature_columns)
    segs = flagged_segments(scores, stored.threshold, cells, names, args.top)
    del cells
    if args.output:
        write_rows(args.output, scores, flags, labels, segs, ds)
    if args.plot:  # issue 11
        from ..report import ReportError, write_score_plot

        try:
            write_score_plot(scores, stored.threshold, args.plot, labels=labels,
                             title=f"{os.path.basename(args.dataset)} scored with {stored.path}")
        except ReportError as e:
            raise CliError(str(e)) from None
    summary = {
        "model_dir": stored.path,
        "dataset": args.dataset,
        "rows": ds.rows,
        "threshold": stored.threshold,
        "score_window": stored.score_window,
        "score_smoothing": stored.score_smoothing,
        "input_window": stored.input_window,
        "window_error": stored.window_error,
        "threshold_method": stored.metadata.get("threshold_method", "quantile"),
        "flagged": int(flags.sum()),
        "output": args.output,
        "plot": args.plot,
        "segments": segs,
        "notes": ds.notes,
    }
    if labels is not None:
        summary["evaluation"] = evaluate(scores, labels, stored.threshold).as_dict()
    if args.json:
        print(json.dumps(summary, sort_keys=True))
        return 0
    print(f"scored {ds.rows} rows with {stored.path}")
    for note in ds.notes:
        print(f"note: {note}{'; row numbers below count rows in time order' if 'sorted' in note else ''}")
    print(f"threshold {stored.threshold:.4f}: {summary['flagged']} rows flagged ({100 * summary['flagged'] / ds.rows:.2f} %)")
    if labels is not None:
        ev = summary["evaluation"]
        print(f"labels: {ev['anomalies']} anomalous rows ({100 * ev['anomalies'] / ev['rows']:.2f} %)")
        print(f"ROC-AUC {fmt_metric(ev['roc_auc'])}  PR-AUC {fmt_metric(ev['pr_auc'])}")
        print(f"at threshold: precision {ev['precision']:.4f}  recall {ev['recall']:.4f}  F1 {ev['f1']:.4f}")
    if segs:
        top = sorted(segs, key=lambda g: -g["peak_score"])[:5]
        print(f"{len(segs)} flagged segment(s); highest peaks (rows, peak score, top metrics by share of the score):")
        for g in top:
            col = "" if ds.header else "column "
            named = ", ".join(f"{col}{m['metric']} {100 * m['share']:.0f}%" for m in g["top_metrics"])
            print(f"  rows {g['start']}-{g['end']}  peak {g['peak_score']:.4f}  {named}")
    if args.output:
        print(f"per-row scores: {args.output}")
    if args.plot:
        print(f"plot: {args.plot}")
    return 0


def write_rows(path: str, scores: np.ndarray, flags: np.ndarray, labels: np.ndarray | None, segs: list[dict],
               ds=None) -> None:
    """Write ``row,[time,]score,anomaly[,label],top_metrics`` per row to path; top_metrics (names
    joined by ``;``, largest share first) is set on the rows of a flagged segment, empty elsewhere;
    ``time`` (ISO 8601 UTC) when the dataset ``ds`` has a time index (rows in time order).
    Raises CliError if the file cannot be written."""
    from ..dataset.core import iso_utc

    times = ds.time.seconds if ds is not None and ds.time is not None else None
    top = [""] * scores.shape[0]
    for g in segs:
        names = ";".join(m["metric"] for m in g["top_metrics"])
        top[g["start"] : g["end"] + 1] = [names] * (g["end"] + 1 - g["start"])
    try:
        with open(path, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f, lineterminator="\n")
            w.writerow(["row"] + (["time"] if times is not None else []) + ["score", "anomaly"]
                       + (["label"] if labels is not None else []) + ["top_metrics"])
            for i, (s, a) in enumerate(zip(scores.tolist(), flags.tolist())):
                w.writerow([i] + ([iso_utc(float(times[i]))] if times is not None else []) + [f"{s:.6g}", int(a)]
                           + ([int(labels[i])] if labels is not None else []) + [top[i]])
    except OSError as e:
        raise CliError(f"{path}: cannot write: {e.strerror}") from None


