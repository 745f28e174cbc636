"""Anomaly thresholds from the validation split's scores: quantile, target alarm rate, SPOT.

A row is flagged when its score is strictly above the threshold; an alarm is a run of consecutive
flagged rows (:func:`segments`). All three methods look only at scores of normal data (the
validation split, the most recent stretch of the training file):

* ``quantile``: the ``threshold_quantile`` of the scores (ds-ops's first method).
* ``alarm_rate``: the lowest threshold at which the validation split, and every higher
  threshold, gives at most ``alarms_per_day`` alarms per day (rows are ``sample_period_s`` apart).
* ``spot``: peaks over threshold (Siffer, Fouque, Termier, Largouet, "Anomaly Detection in
  Streams with Extreme Value Theory", KDD 2017): a generalized Pareto distribution fitted to the
  excesses over a high empirical quantile, the threshold where a row's exceedance probability is
  ``spot_risk`` (:func:`spot_threshold`).
"""

from __future__ import annotations

import math

import numpy as np

METHODS = ("quantile", "alarm_rate", "spot")
SECONDS_PER_DAY = 86400.0


def segments(flags: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Return (starts, ends) int64 arrays of the runs of True in flags (n,) bool; ends exclusive."""
    d = np.diff(np.r_[0, np.asarray(flags, dtype=np.int8), 0])
    return np.flatnonzero(d == 1), np.flatnonzero(d == -1)


def quantile_threshold(scores: np.ndarray, quantile: float) -> float:
    """Return the quantile (0..1) of scores (n >= 1,), linearly interpolated, computed in float64."""
    return float(np.quantile(np.asarray(scores, dtype=np.float64), quantile))


def alarms_at(scores: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """Return, for each threshold t (k,), the number of runs of ``scores > t`` (int64, (k,)).

    A run starts at row i when ``s[i] > t >= s[i-1]`` (or i = 0 and ``s[0] > t``), so row i starts a
    run for every t in ``[s[i-1], s[i])``: counted for all thresholds at once with two sorted
    searches, O((n + k) log n).
    """
    s = np.asarray(scores, dtype=np.float64)
    lo = np.r_[-np.inf, s[:-1]]
    up = lo < s
    lo, hi = np.sort(lo[up]), np.sort(s[up])
    t = np.asarray(thresholds, dtype=np.float64)
    return np.searchsorted(lo, t, side="right") - np.searchsorted(hi, t, side="right")


def alarm_rate_threshold(scores: np.ndarray, alarms_per_day: float, sample_period_s: float) -> float:
    """Return the lowest threshold that keeps scores (n >= 1,) at or under a target alarm rate.

    ``alarms_per_day``: the target; ``sample_period_s``: seconds between rows, so the scores cover
    ``n * sample_period_s / 86400`` days and may hold ``floor(target * days)`` alarms (runs of
    rows above the threshold). The count is not monotone in the threshold (lowering it can merge
    two runs), so the threshold is the lowest score value such that it and every higher one stay
    within the budget; with a budget of 0 it is the highest score (no row of the split flagged).
    """
    s = np.asarray(scores, dtype=np.float64)
    budget = math.floor(alarms_per_day * s.size * sample_period_s / SECONDS_PER_DAY + 1e-9)
    cand = np.unique(s)[::-1]  # descending; flags are s > t, so t = the max flags nothing
    over = alarms_at(s, cand) > budget
    first_over = int(np.argmax(over)) if over.any() else cand.size
    return float(cand[max(first_over - 1, 0)])


def gpd_fit(excesses: np.ndarray) -> tuple[float, float]:
    """Return the maximum-likelihood (gamma, sigma) of a generalized Pareto distribution fitted
    to excesses (k >= 2,) > 0, float64.

    GPD survival function ``P(Y > y) = (1 + gamma * y / sigma) ** (-1 / gamma)`` (exponential
    ``exp(-y / sigma)`` at gamma = 0). Grimshaw's reduction ("Computing maximum likelihood
    estimates for the generalized Pareto distribution", Technometrics 35(2), 1993), which SPOT
    uses (Siffer et al. 2017): with ``theta = gamma / sigma`` the likelihood is
    maximised over one variable, ``gamma(theta) = mean(log(1 + theta * y))``, ``sigma =
    gamma / theta`` and log-likelihood ``L(theta) = -k log(gamma / theta) - k (1 + gamma)``
    (``-k log(mean y) - k`` at theta = 0). Grimshaw and Siffer find the roots of
    ``u(theta) v(theta) = 1``; this function instead maximises L directly over theta in
    ``(-1 / max(y), 2 (mean(y) - min(y)) / min(y)**2]`` (Siffer's bounds on the roots) on a
    log-spaced grid (theta spans many decades) refined by golden-section search, and keeps theta = 0 when no theta beats the
    exponential fit. Raises ValueError with fewer than 2 excesses or a non-positive one.
    """
    y = np.asarray(excesses, dtype=np.float64)
    if y.size < 2 or not np.all(y > 0):
        raise ValueError("a GPD fit needs at least 2 excesses, all > 0")
    k, ymax, ymin, ymean = y.size, y.max(), y.min(), y.mean()

    def loglik(theta: float) -> float:
        if theta == 0.0:
            return -k * math.log(ymean) - k
        g = float(np.mean(np.log1p(theta * y)))
        if g == 0.0 or g / theta <= 0:
            return -math.inf
        return -k * math.log(g / theta) - k * (1 + g)

    lower = -1.0 / ymax * (1 - 1e-9)
    upper = max(2 * (ymean - ymin) / ymin**2, 1e-12)
    pos_low = min(1e-8 / ymax, upper / 2)
    grid = np.r_[lower * np.geomspace(1.0, 1e-8, 80), 0.0, np.geomspace(pos_low, upper, 200)]
    values = np.array([loglik(float(t)) for t in grid])
    best = int(np.argmax(values))
    theta = float(grid[best])
    if grid[best] != 0.0:  # refine between the neighbours on the grid (L is smooth there)
        a, b = float(grid[max(best - 1, 0)]), float(grid[min(best + 1, grid.size - 1)])
        ratio = (math.sqrt(5) - 1) / 2
        for _ in range(80):
            c, d = b - ratio * (b - a), a + ratio * (b - a)
            if loglik(c) >= loglik(d):
                b = d
            else:
                a = c
        mid = (a + b) / 2
        if mid != 0.0 and loglik(mid) >= loglik(theta):
            theta = mid
    if theta == 0.0 or loglik(theta) <= loglik(0.0):
        return 0.0, float(ymean)
    gamma = float(np.mean(np.log1p(theta * y)))
    return gamma, gamma / theta


def spot_threshold(scores: np.ndarray, risk: float, level: float) -> float:
    """Return SPOT's threshold ``z_q`` for scores (n,) of normal data: a score exceeded by a
    normal row with probability ``risk``.

    Siffer et al. 2017 (the POT estimate of the tail quantile): with the initial threshold ``t`` = the ``level``
    quantile of the scores, ``N_t`` excesses ``y = s - t`` over it and a GPD fit (gamma, sigma)
    (:func:`gpd_fit`), ``z_q = t + sigma / gamma * ((risk * n / N_t) ** -gamma - 1)``, or
    ``t - sigma * log(risk * n / N_t)`` at gamma = 0. ``level`` 0.98 is the initial quantile of
    the authors' reference implementation (``SPOT.initialize(level=0.98)``). Where the fit is impossible (fewer than 2 excesses) or ``risk`` is not
    below the excess rate ``N_t / n`` (the asked quantile lies below t), the threshold is
    the plain ``1 - risk`` quantile. Raises ValueError for risk or level outside (0, 1).
    """
    if not (0 < risk < 1 and 0 < level < 1):
        raise ValueError(f"spot: risk {risk} and level {level} must be in (0, 1)")
    s = np.asarray(scores, dtype=np.float64)
    t = float(np.quantile(s, level))
    y = s[s > t] - t
    if y.size < 2 or risk * s.size >= y.size:
        return float(np.quantile(s, 1 - risk))
    gamma, sigma = gpd_fit(y)
    r = risk * s.size / y.size
    if gamma == 0.0:
        return t - sigma * math.log(r)
    return t + sigma / gamma * (r ** (-gamma) - 1)


def pick_threshold(scores: np.ndarray, cfg) -> float:
    """Return the threshold of scores (n >= 1,) by ``cfg.threshold_method`` (a TrainConfig).

    Raises ValueError for an unknown method.
    """
    if cfg.threshold_method == "quantile":
        return quantile_threshold(scores, cfg.threshold_quantile)
    if cfg.threshold_method == "alarm_rate":
        return alarm_rate_threshold(scores, cfg.alarms_per_day, cfg.sample_period_s)
    if cfg.threshold_method == "spot":
        return spot_threshold(scores, cfg.spot_risk, cfg.spot_level)
    raise ValueError(f"unknown threshold method {cfg.threshold_method!r} (one of {', '.join(METHODS)})")
