"""Thresholds: the target alarm rate against a brute-force count, SPOT and its GPD fit against known tails."""

from __future__ import annotations

import numpy as np
import pytest

from opt_ds_ops.config.conffile import TrainConfig
from opt_ds_ops.health.device import plan_device
from opt_ds_ops.model.threshold import alarm_rate_threshold, alarms_at, gpd_fit, pick_threshold, segments, spot_threshold
from opt_ds_ops.training.fit import train


def brute_alarms(scores, t):
    return len(segments(scores > t)[0])


@pytest.mark.parametrize("seed", range(4))
def test_alarm_counts_for_every_threshold_match_a_brute_force_count(seed):
    s = np.random.default_rng(seed).integers(0, 12, 300).astype(float)
    ts = np.r_[np.unique(s), -1.0, 0.5, 20.0]
    assert alarms_at(s, ts).tolist() == [brute_alarms(s, t) for t in ts]


@pytest.mark.parametrize("per_day", [0.0, 1.0, 5.0, 40.0])
def test_alarm_rate_threshold_is_the_lowest_within_budget_at_and_above_it(per_day):
    s = np.convolve(np.random.default_rng(1).exponential(size=2900), np.ones(5) / 5, mode="same")  # 2880 min = 2 days
    t = alarm_rate_threshold(s, per_day, 60.0)
    budget = int(per_day * s.size * 60 / 86400)
    assert all(brute_alarms(s, u) <= budget for u in np.unique(s) if u >= t)
    lower = np.unique(s)[np.unique(s) < t]
    assert lower.size == 0 or brute_alarms(s, lower[-1]) > budget
    if per_day == 0:
        assert t == s.max()


def test_gpd_fit_recovers_known_parameters():
    rng = np.random.default_rng(7)
    u = rng.random(20000)
    for gamma, sigma in ((0.25, 2.0), (-0.2, 1.0)):
        y = sigma / gamma * (u ** -gamma - 1)  # inverse of the GPD survival function
        g, s = gpd_fit(y)
        assert g == pytest.approx(gamma, abs=0.03) and s == pytest.approx(sigma, rel=0.05)
    g, s = gpd_fit(rng.exponential(3.0, 20000))
    assert abs(g) < 0.03 and s == pytest.approx(3.0, rel=0.05)
    with pytest.raises(ValueError, match="at least 2 excesses"):
        gpd_fit(np.array([1.0]))


def test_spot_finds_the_tail_quantile_of_a_known_distribution():
    x = np.random.default_rng(2).exponential(1.0, 200000)
    # exceeded with probability 1e-4: -log(1e-4) = 9.21; far beyond the 0.98 quantile (3.9)
    assert spot_threshold(x, 1e-4, 0.98) == pytest.approx(-np.log(1e-4), rel=0.05)
    # a risk above the excess rate is the plain quantile
    assert spot_threshold(x, 0.1, 0.98) == pytest.approx(np.quantile(x, 0.9))


def test_the_method_is_stored_and_each_method_gives_its_own_threshold(smd_rows):
    thresholds = {}
    for method in ("quantile", "alarm_rate", "spot"):
        r = train(smd_rows[:8000], TrainConfig(epochs=1, threshold_method=method), plan_device("cpu", "off"))
        assert r.threshold_method == method and np.isfinite(r.threshold)
        thresholds[method] = r.threshold
    assert len(set(thresholds.values())) == 3
    with pytest.raises(ValueError, match="unknown threshold method"):
        pick_threshold(np.ones(3), type("C", (), {"threshold_method": "nope"})())
