"""A change of regime: flagged rows that are a sustained shift of some metrics, not an incident.

After a kernel upgrade, a new workload or a resized disk, some metrics move to a new level and stay
there. The model, trained on the old levels, flags every row from then on: one incident that never
closes, and every real incident inside it pages nobody. ds-ops tells that apart from an incident and
says it once, then learns it:

* **Detected** on an open incident that has lasted at least ``after_s`` seconds with at least half
  of its rows flagged. Over its flagged rows each metric's standardised level (its value in the
  model's scaling, before clipping) has a recent mean ``m`` and spread ``s`` (exponentially
  weighted over about a quarter of ``after_s``, so the rows before the shift have all but left them). A metric has **shifted**
  when ``|m| >= shift_sd`` (training standard deviations from the level the series is scored
  against) and ``s <= |m| / 2`` (it moved and stayed: a level, not a storm). It is a change of
  regime when some metrics shifted and the shift explains the alarm, as ``scoring.regime_explains``
  says: ``share`` (the rule until round 14), the shifted metrics carry at least half of the incident's
  reconstruction error (its ``sums``, summed since it opened); ``model`` (as shipped), the incident's last
  flagged rows (``ltail``, :func:`tail_rows`), moved back by the shift fit to the model
  (:func:`refined`), would be flagged at most half of the time at the threshold in force, their
  unsmoothed scores as round 13 measured (a moved metric also raises the errors of the metrics the
  model reconstructs from it, which the share counts against the shift). The model is asked at
  most once every :func:`tail_rows` rows of an incident, once it holds 8 of them (the row asked is
  carried, ``regime_checked``, so chunks change nothing).
* **Said once**: the incident closes (``reason: regime``) and an event ``regime-changed`` names
  the metrics with their old and new levels in the data's units.
* **Re-baselined at once**: from the next row on, the series is scored with those metrics moved
  back by their shift (``rebase``, standardised units, carried in the series state), so rows on
  the new levels look like the old normal and a real incident on top of them still stands out.
* **Learned behind the gate**: once ``retrain.regime_learn_s`` seconds of rows of the new regime
  were scored, the daemon retrains the model (:mod:`opt_ds_ops.daemon.retrainer`, trigger
  ``regime``) on its whole history with the rows before the change moved to the new levels
  (:func:`opt_ds_ops.lifecycle.retrain_data.rebased_history`): the new regime's few days alone
  make a model that flags most of the days after them (a threshold fit on too little), the history
  moved keeps what the model knew; a promoted version knows the new levels, and its series
  starts again without the rebase. A challenger the gate refuses leaves the rebase in place.

The functions here are pure: :func:`opt_ds_ops.scoring.incidents.track` calls :func:`shifted` on an
open incident's carried level sums, and :mod:`opt_ds_ops.scoring.series` applies the rebase.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

EXPLAINS = 0.5  # the shifted metrics must carry at least this share of the incident's error
STEADY = 0.5  # a shifted metric's spread over the incident is at most this share of its shift
SUSTAINED = 0.5  # the incident's rows must be flagged at least this share of the time
MIN_TAIL = 8  # the fewest of an incident's last rows the model's fit and question are made on


@dataclass(frozen=True)
class RegimePolicy:
    """When an incident is a change of regime (the conffile's ``scoring.regime_*`` keys)."""

    after_s: float = 21600.0  # 0: never (every alarm stays an incident)
    shift_sd: float = 3.0
    explains: str = "share"  # scoring.regime_explains: "share" or "model" (how a shift explains the alarm)

    @classmethod
    def from_config(cls, scoring) -> RegimePolicy:
        return cls(after_s=scoring.regime_after_s, shift_sd=scoring.regime_shift_sd, explains=scoring.regime_explains)

    def rows(self, period_s: float) -> int:
        """The rows an incident must span before it is checked (0: off), rows ``period_s`` apart."""
        if self.after_s <= 0:
            return 0
        period = period_s if period_s and period_s > 0 and math.isfinite(period_s) else 60.0
        return max(2, math.ceil(self.after_s / period - 1e-9))


def shifted(inc: dict, policy: RegimePolicy, min_rows: int, row: int,
            explained=None) -> list[tuple[int, float]] | None:
    """Given an open incident at series row ``row`` (its ``lmean``/``lvar``/``lrows``: each metric's
    exponentially weighted mean and variance of its flagged rows' standardised levels and how many
    rows, and ``sums``: their errors), return the shifted metrics ``[(column, mean level)]`` by
    size of shift if it is a change of regime (see the module docstring), else None. Under
    ``explains: model``, ``explained(shift, tail)`` answers whether the incident's last rows moved
    back by the shift would no longer be sustained (None: never a change of regime); it is asked
    when ``inc["regime_checked"]`` (updated here) is at least :func:`tail_rows` rows back."""
    span = row - inc["start_row"] + 1
    n = int(inc.get("lrows") or 0)
    if not min_rows or span < min_rows or n < min_rows // 2 or inc["rows_flagged"] < SUSTAINED * span:
        return None
    m = np.asarray(inc["lmean"], dtype=np.float64)
    sd = np.sqrt(np.maximum(np.asarray(inc["lvar"], dtype=np.float64), 0.0))
    moved = (np.abs(m) >= policy.shift_sd) & (sd <= STEADY * np.abs(m))
    if not moved.any():
        return None
    cols = np.flatnonzero(moved)
    cols = cols[np.argsort(-np.abs(m[cols]), kind="stable")]
    shift = [(int(j), float(m[j])) for j in cols]
    if policy.explains == "model":
        tail = inc.get("ltail") or []
        asked = int(inc.get("regime_checked", -min_rows))
        if explained is None or len(tail) < MIN_TAIL or row < asked + tail_rows(min_rows):
            return None
        inc["regime_checked"] = int(row)
        return shift if explained(shift, tail) else None
    err = np.asarray(inc.get("sums") or [], dtype=np.float64)
    if err.shape == m.shape and err.sum() > 0 and err[moved].sum() < EXPLAINS * err.sum():
        return None
    return shift


def weight(min_rows: int) -> float:
    """The exponential weight of a new row in the level statistics: a span of a quarter of
    ``min_rows``, so that by the time an incident is checked the rows before a shift weigh less
    than 0.2 % (``(1 - 2 / (min_rows / 4 + 1)) ** (3 min_rows / 4)``)."""
    return 2.0 / (max(min_rows // 4, 1) + 1)


def add_levels(inc: dict, levels, alpha: float, tail: int = 0) -> None:
    """Add one flagged row's standardised levels (D,) to the open incident's level statistics
    (exponentially weighted with ``alpha``; the first row starts them), and keep the last ``tail``
    rows themselves (``ltail``: what :func:`refined` fits the new levels on)."""
    x = np.asarray(levels, dtype=np.float64)
    if not np.isfinite(x).all():
        return
    if tail > 0:
        inc["ltail"] = [*(inc.get("ltail") or [])[-(tail - 1):], [float(v) for v in x]] if tail > 1 else [x.tolist()]
    if not inc.get("lmean"):
        inc["lmean"], inc["lvar"], inc["lrows"] = x.tolist(), [0.0] * x.shape[0], 1
        return
    m, v = np.asarray(inc["lmean"]), np.asarray(inc["lvar"])
    d = x - m
    inc["lmean"] = (m + alpha * d).tolist()
    inc["lvar"] = ((1.0 - alpha) * (v + alpha * d * d)).tolist()
    inc["lrows"] = int(inc.get("lrows") or 0) + 1


def tail_rows(min_rows: int) -> int:
    """Rows of an open incident kept for :func:`refined`: a quarter of ``min_rows``, 8 to 120."""
    return max(MIN_TAIL, min(120, min_rows // 4)) if min_rows else 0


REFINE_STEPS = 10


def refined(stored, shift: list[tuple[int, float]], tail) -> list[tuple[int, float]]:
    """Fit the shifts to the model: starting from the shifted metrics' mean levels, move each by
    the mean of its residual (standardised value less shift less the model's reconstruction) over
    the incident's last rows ``tail`` (k, D), ``REFINE_STEPS`` times. A metric the model reconstructs
    from the others (its level follows them) is then re-baselined where the model expects it, not
    at a mean that may sit a fraction of an SD off, which a metric with a small error scale would
    still flag. Fewer than ``MIN_TAIL`` rows, or a windowed model: the mean levels as they are."""
    import torch

    from ..model.network import model_inputs

    rows = np.asarray(tail or [], dtype=np.float64)
    if rows.ndim != 2 or rows.shape[0] < MIN_TAIL or rows.shape[1] != stored.n_features or not shift:
        return shift
    d, w = stored.n_features, stored.input_window
    delta = np.zeros(d)
    cols = [j for j, _ in shift]
    for j, m in shift:
        delta[j] = m
    model = stored.model
    model.eval()
    with torch.no_grad():
        for _ in range(REFINE_STEPS):
            x = torch.from_numpy((rows - delta).astype(np.float32))
            if stored.input_clip > 0:
                x = x.clamp(-stored.input_clip, stored.input_clip)
            recon = model(model_inputs(x, w, diff=stored.diff, clip=stored.input_clip)).float()[:, -d:]
            resid = (x - recon).double().numpy().mean(axis=0)
            delta[cols] += resid[cols]
    if not np.isfinite(delta).all():
        return shift
    return [(j, float(delta[j])) for j in cols]


def described(shift: list[tuple[int, float]], names: list[str], mean: np.ndarray, std: np.ndarray,
              rebase: np.ndarray) -> list[dict]:
    """The event's ``metrics``: ``[{"metric", "column", "before", "after", "shift_sd"}]`` in the data's units
    (``mean``/``std``: the model's scaling; ``rebase``: the series' shift before this one)."""
    out = []
    for j, m in shift:
        before = float(mean[j] + rebase[j] * std[j])
        out.append({"metric": names[j], "column": j, "before": before, "after": float(before + m * std[j]),
                    "shift_sd": m})
    return out
