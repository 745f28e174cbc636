#!/usr/bin/env python3
"""Would a linear second opinion raise the ceiling? (docs/detection-protocol.md, "A second opinion:
the ceiling, explored"; design evidence, not a selection.)

Every shared series is trained once with the shipped defaults (``evaluate_machine``, as
``page_ceiling.py``), and ``page_ceiling.py``'s hindsight ceiling (the most labelled segments a
threshold chosen per series with its labels pages, within 1 false page a day / and 2 % of normal
rows in alarm, the shipped incident rule) is printed for these scores of its test period, each
smoothed by the shipped EMA 5:

* ``ae``: the shipped autoencoder's (checked against ``evaluate_machine``'s: ``check``);
* ``pca``: a PCA (95 % of the variance) on the autoencoder's own inputs (standardised, clipped
  levels and differences), each cell's squared residual over its mean on the validation split,
  a metric's term the larger of its change's and level's (the autoencoder's until round 21);
* ``pcaLD``: a PCA on standardised levels and differences as they are (no clip, no scale, the
  row mean of the 2D cells: the issue's held-out study's);
* combinations: ``max``/``mean`` of the autoencoder's and a PCA's raw scores, each over its
  validation split's 0.99 quantile (``q99``) or median (``med``).

The protocol's figures were taken with the incident rule shipped then, ``--open-window-s 0``.

Usage: scripts/second_opinion_ceiling.py [--seed N] [--open-window-s S] [--json PATH]   (about 13 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from eval_incidents import FLEETS, SHARED  # noqa: E402
from opt_ds_ops.config.conffile import Config, TrainConfig  # noqa: E402
from opt_ds_ops.dataset import DatasetLimits, load_dataset  # noqa: E402
from opt_ds_ops.health.device import plan_device  # noqa: E402
from opt_ds_ops.model.detection import standardise_rows  # noqa: E402
from opt_ds_ops.model.network import feature_errors, fold_window, model_inputs, smooth  # noqa: E402
from opt_ds_ops.scoring.evaluate import evaluate_machine, smd_machines  # noqa: E402
from opt_ds_ops.scoring.incidents import IncidentPolicy  # noqa: E402
from opt_ds_ops.store.versions import load_model  # noqa: E402
from opt_ds_ops.training.common import split_rows  # noqa: E402
from page_ceiling import IN_ALARM, ceiling, sweep  # noqa: E402

EMA = 5  # the shipped score smoothing: an EMA over 5 rows
PCA_VARIANCE = 0.95  # the share of the variance a PCA keeps
QUANTILES = (("q99", 0.99), ("med", 0.5))  # a combination's scale: its validation scores' quantile


class PCA:
    """A PCA fitted in float64 on rows X (rows, D): the fewest components that keep ``var`` of the
    variance; :meth:`cells` gives each cell's squared residual off them."""

    def __init__(self, X: torch.Tensor, var: float = PCA_VARIANCE):
        X = X.double().numpy()
        self.mu = X.mean(0)
        Z = X - self.mu
        ev, V = np.linalg.eigh(Z.T @ Z / Z.shape[0])
        ev, V = ev[::-1].clip(min=0), V[:, ::-1]
        k = int(np.searchsorted(np.cumsum(ev) / ev.sum(), var - 1e-12) + 1)
        self.V = V[:, :k]
        self.k = k

    def cells(self, X: torch.Tensor) -> np.ndarray:
        """Return the squared residuals (rows, D), float64, of rows X off the components."""
        Z = X.double().numpy() - self.mu
        R = Z - (Z @ self.V) @ self.V.T
        return R * R


class LevelsAndDifferences:
    """The issue's variant's inputs: rows standardised with the training rows' mean and standard
    deviation (1 where that is 0) and their differences (the first row's 0) over the training
    rows' differences' standard deviation (1 where that is 0), no clip."""

    def __init__(self, train_rows: np.ndarray):
        self.mean = train_rows.mean(0)
        self.std = np.where(train_rows.std(0) == 0, 1, train_rows.std(0))
        _, d = self._levels_diffs(train_rows)
        dsd = d.std(0)
        dsd[dsd == 0] = 1
        self.diff_std = dsd

    def _levels_diffs(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        z = (rows - self.mean) / self.std
        d = np.diff(z, axis=0, prepend=z[:1])
        return z, d

    def __call__(self, rows: np.ndarray) -> torch.Tensor:
        """Return rows (n, D) as (n, 2D): the scaled differences, then the standardised levels."""
        z, d = self._levels_diffs(rows)
        return torch.from_numpy(np.concatenate([d / self.diff_std, z], axis=1))


def inputs(stored, rows: np.ndarray) -> torch.Tensor:
    """Return what the stored autoencoder reads for rows: standardised, clipped, windowed (and with
    each metric's change beside its level for a model reading differences)."""
    x = standardise_rows(stored, rows)
    x.clamp_(-stored.input_clip, stored.input_clip)
    return model_inputs(x, stored.input_window, diff=stored.diff, clip=stored.input_clip)


def ae_cells(stored, X: torch.Tensor) -> np.ndarray:
    """Return the autoencoder's per-row, per-metric terms (rows, D) for its inputs X."""
    return fold_window(feature_errors(stored.model, X) / stored.error_scale, stored.input_window,
                       stored.window_error).numpy()


def pca_cells(pca: PCA, pscale: np.ndarray, stored, X: torch.Tensor) -> np.ndarray:
    """Return the PCA's per-row, per-metric terms (rows, D) for the autoencoder's inputs X: each
    cell's squared residual over ``pscale``, folded over the window as the autoencoder's."""
    return fold_window(torch.from_numpy(pca.cells(X) / pscale), stored.input_window, stored.window_error).numpy()


def series_scores(files, cfg, plan, tmp: str) -> tuple[dict, int, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """Train and score one series: :func:`evaluate_machine`'s result, the PCA's number of components
    and each detector's raw (validation, test) scores (``ae``, ``pca``, ``pcaLD``)."""
    r = evaluate_machine(files, cfg, plan, models_dir=tmp, keep_scores=True)
    stored = load_model(r["model_dir"])
    limits = DatasetLimits.from_config(cfg.job)
    train = load_dataset(files.train, limits).values()
    test = load_dataset(files.test, limits).values()
    tr_idx, val_idx = split_rows(train.shape[0], cfg.train.val_fraction)
    x_tr, x_val, x_te = inputs(stored, train[tr_idx]), inputs(stored, train[val_idx]), inputs(stored, test)
    pca = PCA(x_tr)
    pscale = np.maximum(pca.cells(x_val).mean(0), cfg.train.error_floor)
    # the variant: PCA on standardised levels and differences as they are (no clip, no
    # per-cell scale, no max fold): the row mean over the 2D cells
    ld = LevelsAndDifferences(train[tr_idx])
    pca_ld = PCA(ld(train[tr_idx]))
    ld_val, ld_te = pca_ld.cells(ld(train[val_idx])).mean(1), pca_ld.cells(ld(test)).mean(1)
    raw = {"ae": (ae_cells(stored, x_val).mean(1), ae_cells(stored, x_te).mean(1)),
           "pca": (pca_cells(pca, pscale, stored, x_val).mean(1), pca_cells(pca, pscale, stored, x_te).mean(1)),
           "pcaLD": (ld_val, ld_te)}
    return r, pca.k, raw


def ema(scores: np.ndarray) -> np.ndarray:
    """Return scores smoothed as shipped: the EMA over :data:`EMA` rows."""
    return smooth(scores, EMA, "ema")


def candidates(raw: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, np.ndarray]:
    """Return each candidate's smoothed test scores, by name, from the raw (validation, test) scores."""
    ae_v, ae_t = raw["ae"]
    p_v, p_t = raw["pca"]
    ld_v, ld_t = raw["pcaLD"]
    cands = {f"ae-ema{EMA}": ema(ae_t), f"pca-ema{EMA}": ema(p_t), f"pcaLD-ema{EMA}": ema(ld_t)}
    a, p = ae_t / np.quantile(ae_v, 0.5), ld_t / np.quantile(ld_v, 0.5)
    cands[f"ae+pcaLD-mean-med-ema{EMA}"] = ema((a + p) / 2)
    cands[f"ae+pcaLD-max-med-ema{EMA}"] = ema(np.maximum(a, p))
    for qn, q in QUANTILES:
        a, p = ae_t / np.quantile(ae_v, q), p_t / np.quantile(p_v, q)
        cands[f"max-{qn}-ema{EMA}"] = ema(np.maximum(a, p))
        cands[f"mean-{qn}-ema{EMA}"] = ema((a + p) / 2)
    return cands


def segments(labels: np.ndarray) -> int:
    """Return the number of labelled segments (runs of True) in labels."""
    return int(np.sum(np.diff(np.r_[0, labels.astype(np.int8)]) == 1))


def ceilings(scores: np.ndarray, labels: np.ndarray, policy: IncidentPolicy, period: float) -> tuple[float, float]:
    """Return the share of segments paged by the best threshold in hindsight within 1 false page a
    day, and within that and :data:`IN_ALARM` of normal rows in alarm (0 where none is)."""
    pts = sweep(scores, labels, policy, period)
    day, alarm = ceiling(pts, None), ceiling(pts, IN_ALARM)
    return (day["paged"] if day else 0.0, alarm["paged"] if alarm else 0.0)


def series_row(files, cfg, plan, tmp: str, policy: IncidentPolicy, period: float) -> dict:
    """Train and score one series; its row: name, segments, the PCA's components, ``check`` (the
    largest difference of ``ae-ema5`` from ``evaluate_machine``'s scores) and each candidate's
    ceilings (:func:`ceilings`)."""
    r, k, raw = series_scores(files, cfg, plan, tmp)
    cands = candidates(raw)
    labels = np.asarray(r["_labels"]).astype(bool)
    row = {"series": files.name, "segments": segments(labels), "pca_k": k,
           "check": float(np.max(np.abs(cands[f"ae-ema{EMA}"] - np.asarray(r["_scores"]["ds-ops"]))))}
    for name, s in cands.items():
        row[name] = ceilings(s, labels, policy, period)
    return row


def print_row(fleet: str, row: dict) -> None:
    """Print one series' row: its ceilings in % (within 1 false page a day / and 2 % in alarm)."""
    print(fleet, row["series"], row["segments"], "k", row["pca_k"], "check %.2g" % row["check"],
          " ".join(f"{n}={100*v[0]:.0f}/{100*v[1]:.0f}" for n, v in row.items() if isinstance(v, tuple)), flush=True)


def print_means(fleet: str, seed: int, seconds: float, res: list[dict]) -> None:
    """Print each candidate's mean ceilings over a fleet's series."""
    names = [n for n in res[0] if isinstance(res[0][n], tuple)]
    print(f"== {fleet} seed {seed} ({seconds:.0f} s): mean ceiling <=1/day / and <=2%")
    for n in names:
        print(f"  {n:<16} {100*np.mean([r[n][0] for r in res]):5.1f} % / {100*np.mean([r[n][1] for r in res]):5.1f} %")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0, help="the training seed (default 0)")
    ap.add_argument("--open-window-s", type=float,
                    help="the incident rule's opening window (default: the shipped one; 0 before round 15)")
    ap.add_argument("--json", metavar="PATH", help="where to write the rows (default build/second_opinion_s{SEED}.json)")
    args = ap.parse_args()
    path = args.json or os.path.join("build", f"second_opinion_s{args.seed}.json")
    torch.set_num_threads(1)
    plan = plan_device("cpu", "off")
    policy = IncidentPolicy.from_config(Config().scoring)  # the shipped incident rule
    if args.open_window_s is not None:
        policy = dataclasses.replace(policy, open_window_s=args.open_window_s)
    print(f"incident rule: {policy}", flush=True)
    out = {}
    for fleet, period in FLEETS.items():
        cfg = Config(device="cpu")
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(TrainConfig(), seed=args.seed, sample_period_s=period))
        res = []
        t0 = time.time()
        with tempfile.TemporaryDirectory() as tmp:
            for files in smd_machines(os.path.join(SHARED, fleet)):
                row = series_row(files, cfg, plan, tmp, policy, period)
                res.append(row)
                print_row(fleet, row)
        print_means(fleet, args.seed, time.time() - t0, res)
        out[fleet] = res
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
