"""``ds-ops score MODEL_DIR DATASET``: per-row anomaly scores and flags; detection metrics with --labels."""

from __future__ import annotations

import json

import numpy as np

from ..config import DEFAULT_CONFIG_PATH
from ..dataset import DatasetLimits, load_dataset
from ..score import evaluate, fmt_metric, load_labels, score_rows
from ..store import load_model
from . import CliError, load_cfg


def add_parser(sub) -> None:
    s = sub.add_parser("score", help="score a dataset with a trained model (per-row reconstruction error)")
    s.add_argument("model_dir", metavar="MODEL_DIR", help="a model version directory, its 'current' link or the model name's directory")
    s.add_argument("dataset", metavar="DATASET")
    s.add_argument("--labels", help="file of one 0/1 per row: also print ROC-AUC, PR-AUC, precision, recall, F1")
    s.add_argument("--output", help="write per-row CSV: row,score,anomaly[,label]")
    s.add_argument("--config", help=f"configuration file, for the job.* dataset budgets (default: {DEFAULT_CONFIG_PATH} if present)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=run)


def run(args) -> int:
    """``ds-ops score MODEL_DIR DATASET``: per-row anomaly scores and flags; metrics with --labels."""
    cfg = load_cfg(args, {})
    stored = load_model(args.model_dir)
    ds = load_dataset(args.dataset, DatasetLimits.from_config(cfg.job, cfg.spool.max_dataset_bytes))
    scores = score_rows(stored, ds.data, offset=ds.offset)
    flags = scores > stored.threshold
    labels = load_labels(args.labels, ds.rows) if args.labels else None
    if args.output:
        cols = [np.arange(ds.rows), scores, flags.astype(np.int8)]
        header, fmt = "row,score,anomaly", ["%d", "%.6g", "%d"]
        if labels is not None:
            cols.append(labels.astype(np.int8))
            header, fmt = header + ",label", fmt + ["%d"]
        try:
            np.savetxt(args.output, np.column_stack(cols), delimiter=",", header=header, comments="", fmt=fmt)
        except OSError as e:
            raise CliError(f"{args.output}: cannot write: {e.strerror}") from None
    summary = {
        "model_dir": stored.path,
        "dataset": args.dataset,
        "rows": ds.rows,
        "threshold": stored.threshold,
        "score_window": stored.score_window,
        "flagged": int(flags.sum()),
        "output": args.output,
    }
    if labels is not None:
        summary["evaluation"] = evaluate(scores, labels, stored.threshold).as_dict()
    if args.json:
        print(json.dumps(summary, sort_keys=True))
        return 0
    print(f"scored {ds.rows} rows with {stored.path}")
    print(f"threshold {stored.threshold:.4f}: {summary['flagged']} rows flagged ({100 * summary['flagged'] / ds.rows:.2f} %)")
    if labels is not None:
        ev = summary["evaluation"]
        print(f"labels: {ev['anomalies']} anomalous rows ({100 * ev['anomalies'] / ev['rows']:.2f} %)")
        print(f"ROC-AUC {fmt_metric(ev['roc_auc'])}  PR-AUC {fmt_metric(ev['pr_auc'])}")
        print(f"at threshold: precision {ev['precision']:.4f}  recall {ev['recall']:.4f}  F1 {ev['f1']:.4f}")
    if args.output:
        print(f"per-row scores: {args.output}")
    return 0


