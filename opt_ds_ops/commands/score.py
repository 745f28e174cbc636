"""``ds-ops score MODEL_DIR DATASET``: per-row anomaly scores and flags; detection metrics with --labels."""

from __future__ import annotations

import csv
import json
import os

import numpy as np

from ..config.conffile import DEFAULT_CONFIG_PATH
from ..dataset import DatasetError, DatasetLimits, load_dataset
from ..model.detection import evaluate, flagged_segments, fmt_metric, load_labels
from ..scoring.job import ScoringError, match_columns, stored_options
from ..scoring.series import fresh_state, model_metric_names, score_chunk
from ..store.versions import load_model, model_path
from . import CliError, load_cfg

FLAGGED_EXIT = 3  # ds-ops score's exit status when rows are flagged (0: none; 1: bad input; 2: usage)
STDIN_FORMATS = ("csv", "tsv", "txt", "csv.gz", "tsv.gz", "txt.gz", "parquet", "feather", "arrow", "npy", "npz", "pt")
STDIN = "standard input"


def add_parser(sub) -> None:
    s = sub.add_parser("score", help="score a dataset with a trained model (per-row reconstruction error)",
                       description="Score a dataset with a trained model: the rows over its stored threshold, the "
                                   "flagged segments and their top metrics. The incident rule and the alarm budget "
                                   "(the conffile's scoring.* keys) are not applied: they are the daemon's, for "
                                   "files dropped into the score spool (man ds-ops, SPOOL).")
    s.add_argument("model_dir", metavar="MODEL_DIR", help="a model version directory, its 'current' link, the model name's directory or a model name under models_dir")
    s.add_argument("dataset", metavar="DATASET", help="the file to score; - reads standard input (at most "
                   "spool.max_dataset_bytes; its format from --format, else from its first bytes)")
    s.add_argument("--format", choices=STDIN_FORMATS, help="the format of standard input (default: gzip, .npy, "
                   ".npz, Parquet and Arrow by their magic bytes, else text)")
    s.add_argument("--labels", help="file of one 0/1 per row: also print ROC-AUC, PR-AUC, precision, recall, F1")
    s.add_argument("--output", help="write per-row CSV: row[,time],score,anomaly[,label],top_metrics (time: a dataset with a time column)")
    s.add_argument("--top", type=int, default=3, metavar="N",
                   help="metrics named per flagged segment, largest share of the score first (default 3)")
    s.add_argument("--config", help=f"configuration file, for the job.* dataset budgets (default: {DEFAULT_CONFIG_PATH} if present)")
    s.add_argument("--plot", metavar="FILE", help="draw the score over the rows with the threshold (and the labels) to a PNG")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=run)


def align_columns(stored, ds) -> None:
    """Put ds's feature columns in the order of the model's, by header name, where both have names
    (columns the model was not trained on are left out); raise CliError naming the columns the
    model needs and the file lacks (:func:`opt_ds_ops.scoring.job.match_columns`)."""
    names = (stored.metadata.get("dataset") or {}).get("header")
    if not names or not ds.header:
        return
    try:
        match_columns(stored, ds, extra_ok=True)
    except ScoringError as e:
        raise CliError(str(e)) from None


def sniff_format(head: bytes) -> str:
    """Return the suffix of a dataset from its first bytes: gzip (``csv.gz``), ``npy``, ``npz`` (a
    zip: ``.pt`` files are zips too, give ``--format pt``), ``parquet``, ``arrow``, else ``csv``."""
    for magic, fmt in ((b"\x1f\x8b", "csv.gz"), (b"\x93NUMPY", "npy"), (b"PK\x03\x04", "npz"), (b"PAR1", "parquet"),
                       (b"ARROW1", "arrow")):
        if head.startswith(magic):
            return fmt
    return "csv"


def read_stdin(tmp_dir: str, fmt: str | None, max_bytes: int, stream=None) -> str:
    """Copy standard input (or ``stream``, a binary file) into ``tmp_dir``/stdin.<fmt> and return
    the path; ``fmt``: a :data:`STDIN_FORMATS` suffix or None (:func:`sniff_format`). Raises
    CliError past ``max_bytes`` (``spool.max_dataset_bytes``)."""
    import sys

    src = stream if stream is not None else sys.stdin.buffer
    head = src.read(min(max_bytes + 1, 1 << 20))
    path = os.path.join(tmp_dir, f"stdin.{fmt or sniff_format(head)}")
    total = len(head)
    with open(path, "xb") as f:
        while head:
            f.write(head)
            if total > max_bytes:
                raise CliError(f"{STDIN}: more than spool.max_dataset_bytes ({max_bytes:,} bytes)")
            head = src.read(min(max_bytes + 1 - total, 1 << 20)) if total <= max_bytes else b""
            total += len(head)
    return path


def run(args) -> int:
    """``ds-ops score MODEL_DIR DATASET``: per-row anomaly scores and flags; metrics with --labels.
    Returns 0, or :data:`FLAGGED_EXIT` when rows are flagged."""
    import tempfile

    cfg = load_cfg(args, {})
    stored = load_model(model_path(args.model_dir, cfg.models_dir))  # a bare model name too
    if args.top < 1:
        raise CliError(f"--top {args.top}: must be >= 1")
    limits = DatasetLimits.from_config(cfg.job, cfg.spool.max_dataset_bytes)
    if args.dataset != "-":
        ds = load_dataset(args.dataset, limits, stored_options(stored, cfg))
        return _scored(args, stored, ds)
    with tempfile.TemporaryDirectory(prefix="ds-ops-score-") as tmp:
        path = read_stdin(tmp, args.format, cfg.spool.max_dataset_bytes)
        try:
            ds = load_dataset(path, limits, stored_options(stored, cfg))
        except DatasetError as e:
            raise DatasetError(str(e).replace(path, STDIN)) from None
        ds.path = STDIN
        return _scored(args, stored, ds)


def _scored(args, stored, ds) -> int:
    """Score the loaded dataset ds as a fresh series (the spool's scoring, :mod:`opt_ds_ops.scoring.series`),
    print and write what ``run`` says; return the exit status."""
    align_columns(stored, ds)
    names = model_metric_names(stored, ds.metric_labels())
    result = score_chunk(stored, np.asarray(ds.data), ds.offset, None, fresh_state(ds.name, stored), names=names,
                         max_gap_periods=0, top=args.top)
    scores, flags = result.scores, result.flags
    labels = load_labels(args.labels, ds.rows) if args.labels else None
    order = ds.time.order if ds.time is not None else None
    if labels is not None and order is not None:
        labels = labels[order]  # the labels follow the file's rows; the rows were sorted by time
    segs = flagged_segments(scores, stored.threshold, result.cells.astype(np.float64), names, args.top)
    named = bool(stored.metadata.get("metric_names") or (stored.metadata.get("dataset") or {}).get("header")
                 or ds.header)
    if args.output:
        write_rows(args.output, scores, flags, labels, segs, ds)
    if args.plot:
        from ..training.report import ReportError, write_score_plot

        try:
            write_score_plot(scores, stored.threshold, args.plot, labels=labels,
                             title=f"{os.path.basename(ds.path)} scored with {stored.path}")
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
        "input_differences": stored.diff is not None,
        "threshold_method": stored.metadata.get("threshold_method", "quantile"),
        "flagged": int(flags.sum()),
        "output": args.output,
        "plot": args.plot,
        "segments": segs,
        "notes": ds.notes,
    }
    if labels is not None:
        summary["evaluation"] = evaluate(scores, labels, stored.threshold).as_dict()
    code = FLAGGED_EXIT if summary["flagged"] else 0
    summary["exit_status"] = code
    if args.json:
        print(json.dumps(summary, sort_keys=True))
        return code
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
            col = "" if named else "column "
            shown = ", ".join(f"{col}{m['metric']} {100 * m['share']:.0f}%" for m in g["top_metrics"])
            print(f"  rows {g['start']}-{g['end']}  peak {g['peak_score']:.4f}  {shown}")
    if args.output:
        print(f"per-row scores: {args.output}")
    if args.plot:
        print(f"plot: {args.plot}")
    return code


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


