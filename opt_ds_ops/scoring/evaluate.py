"""Detection quality on labelled data: train like ``ds-ops train``, score like ``ds-ops score``,
and compare in the same run with two baselines (``ds-ops evaluate``).

Per machine (a training file, a test file, one 0/1 label per test row, optionally SMD's
interpretation_label), three scores of the test rows:

* ``ds-ops``: the stored model's score, computed by :func:`opt_ds_ops.model.detection.score_with_cells`
  on the model loaded back from the store, so ``ds-ops score`` gives the same numbers.
* ``z-ema``: model-free; the row's mean squared z-score against the training file's column
  mean/std, then a causal EMA with alpha = 2/11 (the baseline of docs/detection.md).
* ``pca-ema``: model-free and linear (docs/detection-protocol.md); the row's mean squared reconstruction error by
  the principal components holding 95 % of the standardised training file's variance
  (:func:`opt_ds_ops.model.detection.pca_cells`), then the same EMA as ``z-ema``.
* ``seed-mse``: the seed lab script's score, the per-row reconstruction MSE of the same model
  (standardised, clipped and windowed inputs as the model was trained, the MSE over the whole
  window's cells; no per-feature normalisation, no smoothing).

Metrics, point-wise (each row counts once): ROC-AUC, PR-AUC (average precision), best F1 over all
thresholds (an upper bound: it looks at the labels), F1 at the threshold set from the validation
split without labels (the stored one for ds-ops; the baselines get theirs from their own
validation-split scores by the same method), false alarms per day of normal data, and
HitRate@100 % / @150 % against interpretation_label: ``hit_rate_*`` of the ranking ``ds-ops
score`` gives a segment (one figure per labelled segment, :func:`segment_hit_rate`) and
``row_hit_rate_*`` of each labelled row's own ranking by the smoothed terms (OmniAnomaly's
per-point definition, :func:`hit_rate`). The z-score baseline ranks by each metric's squared
z-score the same two ways. Point-adjusted F1
is not reported: it rates random scores as state of the art (Kim et al., AAAI 2022).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from dataclasses import dataclass

import numpy as np

from ..config.conffile import Config
from ..dataset import ARRAY_SUFFIXES, TEXT_SUFFIXES, DatasetLimits, dataset_stem, load_dataset
from ..health.device import DevicePlan
from ..model.detection import (
    EMA_BASELINE_WINDOW, ScoreError, best_f1, contributions, evaluate, false_alarms_per_day, hit_rate,
    segment_hit_rate, segments_flagged, load_interpretation, load_labels, pca_ema_baseline, score_with_cells,
    standardise_rows, zscore_cells
)
from ..model.network import feature_errors, model_inputs, smooth
from ..model.threshold import pick_threshold
from ..store.versions import load_model
from ..training.fit import split_rows
from ..training.job import run_job

SCORES = ("ds-ops", "z-ema", "pca-ema", "seed-mse")
METRICS = ("roc_auc", "pr_auc", "best_f1", "f1", "alarms_per_day", "segments_flagged", "hit_rate_100",
           "hit_rate_150", "row_hit_rate_100", "row_hit_rate_150")


class EvaluateError(ScoreError):
    """Evaluation input that cannot be used: a missing folder or file, an unknown machine."""


@dataclass
class MachineFiles:
    """One labelled machine: its name and the paths of its files (interpretation may be None)."""

    name: str
    train: str
    test: str
    labels: str
    interpretation: str | None = None


def _find(folder: str, name: str, suffixes: tuple[str, ...]) -> str | None:
    for suffix in suffixes:
        path = os.path.join(folder, name + suffix)
        if os.path.isfile(path):
            return path
    return None


def smd_machines(root: str, names: list[str] | None = None) -> list[MachineFiles]:
    """Return the machines of an SMD-layout folder: ``train/NAME.*``, ``test/NAME.*``,
    ``test_label/NAME.txt[.gz]`` and optionally ``interpretation_label/NAME.txt``, sorted by name
    (or in the order of ``names``). Raises EvaluateError for a missing folder, a machine without
    test or label file, or a name in ``names`` that has no training file.
    """
    train_dir = os.path.join(root, "train")
    if not os.path.isdir(train_dir):
        raise EvaluateError(f"{root}: no train/ folder (an SMD-layout folder has train/ test/ test_label/)")
    found = sorted(dataset_stem(f) for f in os.listdir(train_dir) if not f.startswith("."))
    if names:
        missing = [n for n in names if n not in found]
        if missing:
            raise EvaluateError(f"{root}: no machine {missing[0]!r} in train/ (there: {', '.join(found) or 'none'})")
        found = list(names)
    if not found:
        raise EvaluateError(f"{train_dir}: no training files")
    data_suffixes = tuple(x + z for x in TEXT_SUFFIXES for z in (".gz", "")) + ARRAY_SUFFIXES
    out = []
    for name in found:
        paths = {}
        for folder, suffixes in (("train", data_suffixes), ("test", data_suffixes), ("test_label", (".txt", ".txt.gz"))):
            paths[folder] = _find(os.path.join(root, folder), name, suffixes)
            if paths[folder] is None:
                raise EvaluateError(f"{root}: machine {name} has no file in {folder}/")
        interp = _find(os.path.join(root, "interpretation_label"), name, (".txt",))
        out.append(MachineFiles(name, paths["train"], paths["test"], paths["test_label"], interp))
    return out


def _threshold_metrics(scores, labels, threshold: float, period_s: float) -> dict:
    ev = evaluate(scores, labels, threshold)
    return {
        "roc_auc": ev.roc_auc,
        "pr_auc": ev.pr_auc,
        "best_f1": best_f1(scores, labels),
        "f1": ev.f1,
        "threshold": float(threshold),
        "alarms_per_day": false_alarms_per_day(scores > threshold, labels, period_s),
        "segments_flagged": segments_flagged(scores > threshold, labels),
    }


def evaluate_machine(files: MachineFiles, cfg: Config, plan: DevicePlan | None = None, *,
                     models_dir: str, keep_scores: bool = False) -> dict:
    """Train on files.train as ``ds-ops train`` does (model saved under models_dir), score
    files.test with the stored model and the two baselines; return a JSON-able dict.

    Keys: ``machine``, ``model_dir``, ``rows``, ``anomalies``, and per score name (``SCORES``) a
    dict of the ``METRICS`` (None where undefined: no positives, or no interpretation file for
    the HitRates; ``seed-mse`` has no HitRate). With ``keep_scores`` also ``_scores`` (the three
    (rows,) score arrays), ``_labels`` and ``_thresholds`` for plotting (not JSON-able). Raises
    JobError (training), DatasetError or ScoreError (files that do not fit).
    """
    run_cfg = dataclasses.replace(cfg, models_dir=models_dir)
    job = run_job(files.train, run_cfg, name=files.name, plan=plan)
    stored = load_model(job.model_dir)
    limits = DatasetLimits.from_config(cfg.job)
    test = load_dataset(files.test, limits)
    labels = load_labels(files.labels, test.rows)
    tcfg = cfg.train
    period = tcfg.sample_period_s

    ours, cells = score_with_cells(stored, test.data, offset=test.offset)
    ours_contrib = contributions(stored, cells)

    train_values = job.dataset.values()
    _, val_idx = split_rows(train_values.shape[0], tcfg.val_fraction)
    ref = train_values[val_idx] if val_idx.size else train_values
    z_test_cells = zscore_cells(train_values, test.values())
    z_contrib = smooth(z_test_cells, EMA_BASELINE_WINDOW, "ema")
    z_test = z_contrib.mean(axis=1)  # EMA is linear: the mean of smoothed cells is the smoothed mean
    z_val = smooth(zscore_cells(train_values, ref).mean(axis=1), EMA_BASELINE_WINDOW, "ema")

    def seed_mse(values: np.ndarray) -> np.ndarray:
        x = standardise_rows(stored, values)
        if stored.input_clip > 0:
            x.clamp_(-stored.input_clip, stored.input_clip)
        x = model_inputs(x, stored.input_window, diff=stored.diff, clip=stored.input_clip)
        return feature_errors(stored.model, x).mean(dim=1).double().numpy()

    seed_test, seed_val = seed_mse(test.values()), seed_mse(ref)
    pca_test, pca_val = pca_ema_baseline(train_values, test.values()), pca_ema_baseline(train_values, ref)
    thresholds = {
        "ds-ops": stored.threshold,
        "z-ema": pick_threshold(z_val, tcfg),
        "pca-ema": pick_threshold(pca_val, tcfg),
        "seed-mse": pick_threshold(seed_val, tcfg),
    }
    scores = {"ds-ops": ours, "z-ema": z_test, "pca-ema": pca_test, "seed-mse": seed_test}
    result = {"machine": files.name, "model_dir": job.model_dir, "rows": test.rows, "anomalies": int(labels.sum())}
    truth = load_interpretation(files.interpretation, test.rows, test.features) if files.interpretation else None
    for name in SCORES:
        m = _threshold_metrics(scores[name], labels, thresholds[name], period)
        contrib = {"ds-ops": ours_contrib, "z-ema": z_contrib}.get(name)
        terms = {"ds-ops": cells, "z-ema": z_test_cells}.get(name)
        for pct in (100, 150):
            ok = truth is not None and contrib is not None
            m[f"hit_rate_{pct}"] = segment_hit_rate(terms, truth, pct) if ok else None
            m[f"row_hit_rate_{pct}"] = hit_rate(contrib, truth, pct) if ok else None
        result[name] = m
    if keep_scores:
        result.update(_scores=scores, _labels=labels, _thresholds=thresholds)
    return result


def mean_row(results: list[dict]) -> dict:
    """Return ``{score: {metric: mean over machines (None where no machine has it)}}``."""
    out = {}
    for name in SCORES:
        out[name] = {}
        for metric in METRICS:
            vals = [r[name][metric] for r in results if r[name].get(metric) is not None]
            out[name][metric] = float(np.mean(vals)) if vals else None
    return out


def format_table(results: list[dict], means: dict) -> list[str]:
    """Return the human table: one line per machine and score, then the means."""
    def f(v, spec=".4f"):
        return "n/a" if v is None else format(v, spec)

    head = (f"{'machine':<14}{'score':<10}{'ROC-AUC':>8}{'PR-AUC':>8}{'best-F1':>8}{'F1@thr':>8}"
            f"{'alarms/d':>9}{'seg-hit':>8}{'HR@100':>8}{'HR@150':>8}")
    lines = [head]
    for r in results + [{"machine": "mean", **means}]:
        for i, name in enumerate(SCORES):
            m = r[name]
            lines.append(
                f"{r['machine'] if i == 0 else '':<14}{name:<10}{f(m['roc_auc']):>8}{f(m['pr_auc']):>8}"
                f"{f(m['best_f1']):>8}{f(m['f1']):>8}{f(m['alarms_per_day'], '.2f'):>9}"
                f"{f(m['segments_flagged'], '.3f'):>8}{f(m['hit_rate_100']):>8}{f(m['hit_rate_150']):>8}"
            )
    return lines


def plot(results: list[dict], path: str, machine: str | None = None) -> None:
    """Write a PNG to path: per machine (or only ``machine``), ds-ops's score over the test rows
    (log scale), its threshold and the labelled segments shaded. results need ``_scores``
    (:func:`evaluate_machine` with keep_scores). Raises EvaluateError for an unknown machine or
    an unwritable path."""
    try:
        import matplotlib
    except ImportError:
        raise EvaluateError("--plot needs matplotlib (pip install 'ds-ops[plot]', or matplotlib==3.11.2)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..model.threshold import segments

    chosen = [r for r in results if machine is None or r["machine"] == machine]
    if not chosen:
        raise EvaluateError(f"--plot-machine {machine}: not among the evaluated machines")
    fig, axes = plt.subplots(len(chosen), 1, figsize=(12, 2.2 * len(chosen)), squeeze=False)
    for ax, r in zip(axes[:, 0], chosen):
        s = np.asarray(r["_scores"]["ds-ops"], dtype=np.float64)
        ax.plot(s, lw=0.6, color="tab:blue", label="ds-ops score")
        ax.axhline(r["_thresholds"]["ds-ops"], color="tab:red", lw=0.8, ls="--", label="threshold")
        for a, b in zip(*segments(r["_labels"])):
            ax.axvspan(a, b, color="tab:orange", alpha=0.3, lw=0)
        ax.set_yscale("log")
        m = r["ds-ops"]
        ax.set_title(f"{r['machine']}: ROC-AUC {m['roc_auc']:.3f}  PR-AUC {m['pr_auc']:.3f}  (labelled: orange)",
                     fontsize=9)
        ax.set_xlim(0, s.size)
    axes[-1, 0].set_xlabel("test row")
    axes[0, 0].legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100)
    except OSError as e:
        raise EvaluateError(f"{path}: cannot write plot: {e.strerror}") from None
    finally:
        plt.close(fig)


def run_evaluation(machines: list[MachineFiles], cfg: Config, plan: DevicePlan | None = None, *,
                   models_dir: str | None = None, keep_scores: bool = False, on_machine=None) -> list[dict]:
    """Evaluate every machine (:func:`evaluate_machine`); models go to models_dir, or to a
    temporary folder removed afterwards when None. ``on_machine(result)`` is called after each."""
    with tempfile.TemporaryDirectory(prefix="ds-ops-evaluate-") as tmp:
        results = []
        for files in machines:
            r = evaluate_machine(files, cfg, plan, models_dir=models_dir or tmp, keep_scores=keep_scores)
            if models_dir is None:
                r["model_dir"] = None
            results.append(r)
            if on_machine is not None:
                on_machine(r)
        return results
