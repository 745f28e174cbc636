"""The threshold kept to an alarm budget (opt_ds_ops.model.calibration): at the first row of each
day each series sets its threshold to the lowest at which its last days scored give at most the
budget's alarms a day, never under the model's own; the same in one chunk or many; bounded state."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from opt_ds_ops.config.conffile import TrainConfig
from opt_ds_ops.health.device import plan_device
from opt_ds_ops.model.detection import in_memory_model, score_rows
from opt_ds_ops.model.threshold import alarms_at
from opt_ds_ops.model import calibration as calib
from opt_ds_ops.model.calibration import EDGES, CalibrationPolicy
from opt_ds_ops.scoring.incidents import IncidentPolicy
from opt_ds_ops.scoring.series import SeriesState, fresh_state, score_chunk
from opt_ds_ops.training.fit import train

NAMES = [f"m{j}" for j in range(38)]
DAY = 1440  # 1-minute rows
BUDGET = CalibrationPolicy(budget_per_day=1.0, days=3.0, min_days=1.0)


@pytest.fixture(scope="module")
def model(smd_rows):
    torch.manual_seed(0)
    stored = in_memory_model(train(smd_rows[:6000], TrainConfig(max_steps=150), plan_device("cpu", "off")))
    stored.metadata = {"version": "v1", "config": {"train": {"sample_period_s": 60.0}}}
    return stored


@pytest.fixture(scope="module")
def period(smd_rows):
    """Rows 6000-17519 of machine-1-2's training file, unseen by the model: 8 days of 1-minute rows."""
    return smd_rows[6000:6000 + 8 * DAY]


def scored(stored, rows, k, policy=BUDGET, times=None):
    state, parts = fresh_state("m", stored), []
    for idx in np.array_split(np.arange(rows.shape[0]), k):
        r = score_chunk(stored, rows[idx], None, None if times is None else times[idx], state, names=NAMES,
                        max_gap_periods=10, policy=IncidentPolicy(), calibration=policy)
        state = r.state
        parts.append(r)
    scored.incident = np.concatenate([p.incident for p in parts])  # each row's incident id, as known then
    scored.live = np.concatenate([p.live for p in parts])  # an incident open at each row, as known there
    return (np.concatenate([p.scores for p in parts]), np.concatenate([p.flags for p in parts]),
            [e for p in parts for e in p.events], state)


def alarms_outside(scores: np.ndarray, in_incident: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """alarms_at's count of runs over each threshold, without the runs that start inside an incident."""
    s = np.asarray(scores, dtype=np.float64)
    lo = np.r_[-np.inf, s[:-1]]
    up = (lo < s) & ~in_incident
    lo, hi = np.sort(lo[up]), np.sort(s[up])
    return np.searchsorted(lo, thresholds, side="right") - np.searchsorted(hi, thresholds, side="right")


def test_the_run_histogram_counts_what_alarms_at_counts_from_the_scores():
    rng = np.random.default_rng(0)
    cal = calib.fresh(2.0)
    scores = np.abs(rng.standard_cauchy(5000)).astype(np.float32) * 2.0
    for part in np.array_split(scores, 7):  # across chunks: the run that spans a boundary is counted once
        calib.add(cal, part)
    delta = np.zeros(EDGES.size + 1, dtype=np.int64)
    for b, v in cal["runs"].items():
        delta[int(b)] += v
    assert np.array_equal(np.cumsum(delta)[: EDGES.size], alarms_at(scores.astype(np.float64), EDGES * 2.0))
    assert cal["rows"] == 5000


def test_the_threshold_is_the_lowest_within_the_budget_over_the_last_days_and_never_under_the_models(model, period):
    base = float(model.threshold)
    plain, plain_flags, _, _ = scored(model, period, 1, policy=None)
    scores, flags, events, state = scored(model, period, 1)
    assert np.array_equal(scores, plain)  # the scores are the model's; only the threshold moves
    moves = [e for e in events if e["event"] == "threshold-calibrated"]
    assert moves and all(e["row"] % DAY == 0 for e in moves)
    threshold = np.full(period.shape[0], base)
    for e in moves:
        threshold[e["row"]:] = e["threshold"]
    assert np.array_equal(flags, scores > threshold.astype(np.float32))
    in_incident = np.zeros(scores.shape[0], dtype=bool)  # BUDGET learns from all runs (learns: all)
    held = 0
    for day in range(1, 8):  # what the threshold of each day must be, from the scores and incidents alone
        days = slice(max(0, day - 3) * DAY, day * DAY)
        runs = alarms_outside(scores[days], in_incident[days], EDGES * base)  # normal rows' runs only
        over = np.flatnonzero(runs > math.floor(BUDGET.budget_per_day * (days.stop - days.start) / DAY + 1e-9))
        k = max(int(over[-1]) + 1 if over.size else 0, int(np.searchsorted(EDGES, 1.0)))
        prev = threshold[day * DAY - 1]
        want = min(max(EDGES[k] * base, base, prev / calib.MAX_DAY_FACTOR), prev * calib.MAX_DAY_FACTOR)
        held += want != EDGES[k] * base
        assert threshold[day * DAY] == pytest.approx(want, rel=1e-12), day
    print(f"days whose move the bound (x{calib.MAX_DAY_FACTOR:g} a day) held back: {held}")
    assert threshold.min() == base and threshold.max() > base  # machine-1-2 drifts past its threshold
    day_alarms = [alarms_at(scores[d * DAY:(d + 1) * DAY].astype(np.float64), np.array([threshold[d * DAY]]))[0]
                  for d in range(8)]
    plain_alarms = [alarms_at(plain[d * DAY:(d + 1) * DAY].astype(np.float64), np.array([base]))[0] for d in range(8)]
    print(f"alarms a day, the model's threshold {[int(a) for a in plain_alarms]}, the budget's {[int(a) for a in day_alarms]}")
    assert sum(day_alarms[1:]) < sum(plain_alarms[1:])
    assert int(plain_flags.sum()) > int(flags.sum())
    assert state.threshold == threshold[-1] and len(state.calibration["days"]) <= 3  # bounded: the last days only
    assert len(json.dumps(state.calibration)) < 20000


@pytest.mark.parametrize("k", [5, 37, 400])
@pytest.mark.parametrize("learns", ["all", "warnings", "normal"])
def test_the_same_in_one_chunk_or_many(model, period, k, learns):
    """Whatever the budget learns from: which runs count is decided at each row with what is known
    there (an incident open, critical or not), never relabelled by a later chunk."""
    policy = CalibrationPolicy(budget_per_day=1.0, days=3.0, min_days=1.0, learns=learns)
    one = scored(model, period, 1, policy=policy)
    many = scored(model, period, k, policy=policy)
    assert np.array_equal(one[0], many[0]) and np.array_equal(one[1], many[1])
    assert [e for e in one[2] if e["event"] == "threshold-calibrated"] == \
        [e for e in many[2] if e["event"] == "threshold-calibrated"]
    assert one[3].calibration == many[3].calibration


def test_days_follow_the_rows_times_and_a_gap_keeps_the_history(model, period):
    t0 = 1_700_000_000.0 - (1_700_000_000.0 % 86400) + 3600  # an hour into a UTC day
    times = t0 + 60.0 * np.arange(period.shape[0])
    times[5 * DAY:] += 3 * 3600  # three hours missing: the series starts again, the same version
    _, _, events, state = scored(model, period, 4, times=times)
    moves = [e for e in events if e["event"] == "threshold-calibrated"]
    assert moves and all("T00:00:00" in e["time"] for e in moves), [e["time"] for e in moves]
    assert all(e["row"] % DAY == 23 * 60 for e in moves if e["row"] < 5 * DAY)  # 23 hours into the rows
    assert state.calibration["days"] and state.calibration["base"] == float(model.threshold)


def test_a_new_version_starts_from_its_own_threshold(model, period):
    _, _, _, state = scored(model, period[: 3 * DAY], 1)
    assert state.threshold > float(model.threshold)
    other = _retrained(model)
    r = score_chunk(other, period[3 * DAY: 3 * DAY + 100], None, None, state, names=NAMES, max_gap_periods=10,
                    policy=IncidentPolicy(), calibration=BUDGET)
    assert r.state.threshold == float(other.threshold) and r.state.calibration["days"] == []
    assert r.state.calibration["base"] == float(other.threshold)


def expected_threshold(history: np.ndarray, base: float, covered_days: float, budget: float = 1.0) -> float:
    """The budget's threshold from the scores alone (alarms_at over the days kept, as one stream)."""
    runs = alarms_at(np.asarray(history, dtype=np.float64), EDGES * base)
    over = np.flatnonzero(runs > math.floor(budget * covered_days + 1e-9))
    return float(EDGES[max(int(over[-1]) + 1 if over.size else 0, int(np.searchsorted(EDGES, 1.0)))] * base)


def seeded_threshold(history: np.ndarray, base: float, day_starts: list, min_days: float = 1.0) -> float:
    """The threshold a seed by rows ends at: the history counted day by day as if the new version had
    scored it, so at each day's first row (``day_starts``: its index in the history, the history's
    length for the new version's row 0) the budget's threshold of the rows before it
    (:func:`expected_threshold`; the model's own under ``min_days``), held within MAX_DAY_FACTOR of
    the day before's, as every day's move is (all the history is within BUDGET's 3 days)."""
    threshold = base
    for start in day_starts:
        want = expected_threshold(history[:start], base, start / DAY) if start / DAY >= min_days else base
        threshold = min(max(want, base, threshold / calib.MAX_DAY_FACTOR), threshold * calib.MAX_DAY_FACTOR)
    return threshold


SEEDED = CalibrationPolicy(budget_per_day=1.0, days=3.0, min_days=1.0, from_history=True)


def seeded_chunk(other, state, rows, seed, times=None):
    return score_chunk(other, rows, None, times, state, names=NAMES, max_gap_periods=10,
                       policy=IncidentPolicy(), calibration=SEEDED, calibration_seed=seed)


@pytest.mark.parametrize("history_rows", [3 * DAY, 2 * DAY + 700])
def test_a_new_version_seeded_from_the_history_starts_from_the_threshold_those_days_give(model, period, history_rows):
    _, _, _, state = scored(model, period[:history_rows], 1)  # days scored by the first version
    other = _retrained(model)
    base = float(other.threshold)
    history = score_rows(other, period[:history_rows])  # what the job gives: those rows, scored by the new version
    r = seeded_chunk(other, state, period[history_rows: history_rows + 100], (history, None, None))
    # by rows: the history's rows are the rows before the new version's row 0, its days counted back from
    # there, each day's move held within MAX_DAY_FACTOR as if the new version had scored them. The shipped
    # score (each metric's change beside its level, smoothed over 10 rows) gives these unseen days more
    # runs high over the model's threshold: 3 days want about 4.6 times it, which their moves (up to 8
    # times) reach; 2 days and 700 rows want about 5.4 times it and reach 4 (their first 700 rows are
    # under min_days, then two moves of at most 2 times), where the old score's never needed the bound.
    starts = list(range(history_rows % DAY or DAY, history_rows + 1, DAY))
    want = seeded_threshold(history, base, starts)
    print(f"seeded from {history_rows} rows: {want / base:.3f} x the model's threshold; the whole history as one "
          f"stream, unbounded, {expected_threshold(history, base, history_rows / DAY) / base:.3f}")
    assert want > base and r.state.threshold == want
    ev = [e for e in r.events if e["event"] == "threshold-calibrated"]
    assert len(ev) == 1 and ev[0]["threshold"] == want and ev[0]["previous"] == base and ev[0]["row"] == 0
    assert ev[0]["seeded_rows"] == history_rows and ev[0]["days"] == pytest.approx(history_rows / DAY, abs=1e-3)
    assert np.array_equal(r.flags, r.scores > np.float32(want))
    assert calib.valid(r.state.calibration, base)
    # the next chunk goes on from there: no second start, the seeded days kept
    again = seeded_chunk(other, r.state, period[history_rows + 100: history_rows + 200], (history, None, None))
    assert not [e for e in again.events if e["event"] == "threshold-calibrated"]
    assert again.state.threshold == want
    # without the seed: from the new version's own threshold, as before
    plain = score_chunk(other, period[history_rows: history_rows + 100], None, None, state, names=NAMES,
                        max_gap_periods=10, policy=IncidentPolicy(), calibration=SEEDED)
    assert plain.state.threshold == base and plain.state.calibration["days"] == []


@pytest.mark.parametrize("start", ["the history's last day", "the next day"])
def test_a_seed_by_the_rows_times_counts_their_utc_days_up_to_the_first_rows(model, period, start):
    _, _, _, state = scored(model, period[:DAY], 1)
    other = _retrained(model)
    base = float(other.threshold)
    t0 = 20000 * 86400.0 + 600 * 60.0  # 10 hours into a UTC day: 2.5 days of history span 3 days
    times = t0 + 60.0 * np.arange(period.shape[0])
    k = 2 * DAY + DAY // 2
    history = score_rows(other, period[:k])
    live = k if start == "the history's last day" else (20003 * 86400 - int(t0)) // 60  # the next UTC day's first row
    r = seeded_chunk(other, state, period[live: live + 60], (history, times[:k], None), times=times[live: live + 60])
    day = np.floor(times[:k] / 86400)
    starts = (np.flatnonzero(np.diff(day)) + 1).tolist()  # the history's UTC days after its first, then
    if day[-1] < np.floor(times[live] / 86400):  # the live row's, if it is another
        starts.append(k)
    want = base  # each day's threshold from the days before it, held within the bound of the day before's
    for j in starts:
        wanted = expected_threshold(history[:j], base, len(np.unique(day[:j])))
        want = min(max(wanted, base, want / calib.MAX_DAY_FACTOR), want * calib.MAX_DAY_FACTOR)
    ev = [e for e in r.events if e["event"] == "threshold-calibrated"]
    assert r.state.threshold == want
    assert ([e["threshold"] for e in ev] == [want]) if want > base else not ev
    assert r.state.calibration["clock"] == "time"


def test_a_seed_of_another_clock_or_not_finite_is_not_counted():
    cal = calib.fresh(1.0)
    scores = np.random.default_rng(4).uniform(0.5, 3.0, 3 * DAY)
    assert calib.seed(cal, scores, None, None, 60.0, BUDGET, 20003, "time") is None  # the rows have times, the history not
    assert cal == calib.fresh(1.0)
    times = 20000 * 86400.0 + 60.0 * np.arange(3 * DAY)
    assert calib.seed(cal, np.r_[scores[:-1], np.inf], times, None, 60.0, BUDGET, 20003, "time") is None
    assert cal == calib.fresh(1.0)
    moved = calib.seed(cal, scores, times, None, 60.0, BUDGET, 20003, "time")
    assert moved["seeded_rows"] == 3 * DAY and [d[0] for d in cal["days"]] == [20000, 20001, 20002]
    assert cal["prev"] is None  # the series starts again: its next row starts a run of its own


def test_a_seed_does_not_learn_the_rows_the_versions_before_flagged():
    """A history whose second and third days hold six loud incidents (flagged by the version
    before, each with its retraining margin outside ``normal``): seeded from its normal rows, the
    new version keeps its own threshold, so the same incidents again are paged; counting every run
    (``learns: all``, before round 17) the seed learned them, 4 times the model's in two days."""
    scores = np.random.default_rng(5).uniform(0.2, 0.9, 3 * DAY)
    normal = np.ones(3 * DAY, dtype=bool)
    for k in range(6):
        i = DAY + k * 400 + 100
        scores[i:i + 10] = 5.0
        normal[i - 30:i + 40] = False
    seeded = CalibrationPolicy(budget_per_day=1.0, days=3.0, min_days=1.0, from_history=True, learns="warnings")
    cal = calib.fresh(1.0)
    assert calib.seed(cal, scores, None, normal, 60.0, seeded, 0, "rows") is None and cal["threshold"] == 1.0
    assert [d[0] for d in cal["days"]] == [-3, -2, -1]  # the days before row 0 are kept: the next roll rests on them
    for policy, mask in ((seeded, None), (dataclasses.replace(seeded, learns="all"), normal)):
        every = calib.fresh(1.0)
        moved = calib.seed(every, scores, None, mask, 60.0, policy, 0, "rows")
        assert moved["threshold"] == every["threshold"] == 4.0 and moved["previous"] == 1.0  # two days of 2 times
        assert moved["seeded_left_out"] == 0  # every run counted
    # loud runs outside what was flagged move it, and the event says how many rows' runs were not counted
    louder = scores.copy()
    for k in range(6):
        louder[2 * DAY + k * 200 + 50: 2 * DAY + k * 200 + 60] = 3.0
    cal = calib.fresh(1.0)
    moved = calib.seed(cal, louder, None, normal, 60.0, seeded, 0, "rows")
    assert moved["threshold"] > 1.0 and moved["seeded_left_out"] == int((~normal).sum()) == 6 * 70


def test_the_rows_a_seed_scores_are_the_last_days_by_time_or_by_rows():
    times = 20000 * 86400.0 + 60.0 * np.arange(5 * DAY)
    assert calib.seed_rows(times, times.size, BUDGET, 60.0) == 3 * DAY  # the last 3 days (BUDGET.days)
    assert calib.seed_rows(None, times.size, BUDGET, 60.0) == 3 * DAY
    assert calib.seed_rows(None, times.size, BUDGET, 300.0) == 3 * DAY // 5
    back = np.r_[times, times[:10]]  # rows of the first day sent again, last: the newest time still counts
    assert calib.seed_rows(back, back.size, BUDGET, 60.0) == 3 * DAY + 10  # from the first row of the last 3 days
    assert calib.seed_rows(times[:100], 100, BUDGET, 60.0) == 100


def _retrained(model):
    """Another version of the model: trained on other rows, its own threshold."""
    rows = model.mean.numpy() + np.random.default_rng(1).standard_normal((3000, 38)) * model.std.numpy()
    torch.manual_seed(1)
    other = in_memory_model(train(rows.astype(np.float32), TrainConfig(max_steps=50), plan_device("cpu", "off")))
    other.metadata = {"version": "v2", "config": {"train": {"sample_period_s": 60.0}}}
    return other


def test_off_is_the_models_threshold_and_a_state_with_a_bad_calibration_starts_it_again(model, period):
    plain, flags, events, state = scored(model, period[:2 * DAY], 1, policy=None)
    assert state.calibration is None and np.array_equal(flags, plain > np.float32(model.threshold))
    assert not [e for e in events if e["event"] == "threshold-calibrated"]
    broken = SeriesState.from_dict(dict(state.to_dict(), calibration={"base": float(model.threshold), "days": "x"}))
    r = score_chunk(model, period[2 * DAY: 2 * DAY + 10], None, None, broken, names=NAMES, max_gap_periods=10,
                    policy=IncidentPolicy(), calibration=BUDGET)
    assert r.state.calibration["days"] == [] and r.state.threshold == float(model.threshold)
    with pytest.raises(ValueError):
        SeriesState.from_dict(dict(state.to_dict(), calibration=[1, 2]))


def _day(cal, day, scores, policy=BUDGET, clock="rows"):
    calib.roll(cal, day, policy, 60.0, clock)
    calib.add(cal, np.asarray(scores, dtype=np.float64))


def _noisy_day(rng, alarms):
    """A day of 1-minute scores under a threshold of 1.0 with ``alarms`` short runs at 1.5."""
    s = rng.uniform(0.1, 0.5, DAY)
    for i in range(alarms):
        s[100 + 60 * i: 103 + 60 * i] = 1.5
    return s


def test_time_going_back_keeps_the_days_scored_and_merges_the_day_it_returns_to():
    rng = np.random.default_rng(0)
    cal = calib.fresh(1.0)
    for d in range(20000, 20004):
        _day(cal, d, _noisy_day(rng, 3), clock="time")
    calib.roll(cal, 20004, BUDGET, 60.0, "time")
    assert [d[0] for d in cal["days"]] == [20001, 20002, 20003]  # the last 3 days (BUDGET.days)
    _day(cal, 20002, _noisy_day(rng, 2), clock="time")  # a file of an earlier day, sent again
    calib.roll(cal, 20005, BUDGET, 60.0, "time")
    assert [d[0] for d in cal["days"]] == [20002, 20003]  # within 3 days of the newest, 20005
    merged = next(d for d in cal["days"] if d[0] == 20002)
    assert merged[1] == 2 * DAY  # the day's rows twice: merged into its entry, none of the others dropped


def test_by_the_rows_times_a_day_is_a_day_whatever_the_rows_cadence():
    rng = np.random.default_rng(1)
    cal = calib.fresh(1.0)
    for d in range(20000, 20003):  # 10-second rows against a model of 1-minute rows: 6 x the rows a day
        s = np.concatenate([_noisy_day(rng, 4 if k == 0 else 0) for k in range(6)])
        _day(cal, d, s, clock="time")
    calib.roll(cal, 20003, BUDGET, 60.0, "time")
    threshold, basis = calib.budget_threshold(cal["days"], BUDGET, 1.0, 60.0, "time")
    assert basis["days"] == 3.0 and threshold > 1.0  # 12 alarms in 3 days: over a budget of 1 a day
    by_rows, rbasis = calib.budget_threshold(cal["days"], BUDGET, 1.0, 60.0, "rows")
    assert rbasis["days"] == 18.0 and by_rows == 1.0  # counted by rows, 3 days would pass for 18


def test_a_series_whose_clock_changes_starts_its_history_again():
    rng = np.random.default_rng(2)
    cal = calib.fresh(1.0)
    for d in range(3):
        _day(cal, d, _noisy_day(rng, 1))
    _day(cal, 20010, _noisy_day(rng, 1), clock="time")
    assert cal["days"] == [] and cal["clock"] == "time"


def test_a_budget_even_the_top_edge_cannot_keep_is_said_capped():
    cal = calib.fresh(1.0)
    flapping = np.tile([0.5, 2000.0], DAY // 2)  # runs far over 1024 x the threshold, all day
    _day(cal, 0, flapping)
    moved = calib.roll(cal, 1, BUDGET, 60.0)
    assert moved["wanted"] == EDGES[-1] and moved["capped"] and moved["alarms"] == DAY // 2
    assert moved["threshold"] == calib.MAX_DAY_FACTOR  # one day moves it by the bound, no more
    for d in range(1, 11):  # ten more such days: it doubles each day up to the top edge
        _day(cal, d, flapping)
        moved = calib.roll(cal, d + 1, BUDGET, 60.0) or moved
    assert cal["threshold"] == EDGES[-1] and moved["capped"]


@pytest.mark.parametrize("broken", [
    {"runs": {"999": 3}}, {"runs": {"-1": 3}}, {"runs": {"5": True}}, {"threshold": 0.06}, {"threshold": 0.0},
    {"prev": float("nan")}, {"rows": True}, {"days": [[1, 10, {"9999": 1}]]}, {"clock": "weeks"},
])
def test_a_state_out_of_range_is_not_valid_and_starts_again(broken):
    cal = dict(calib.fresh(1.0), **broken)
    assert not calib.valid(cal, 1.0)
    assert calib.valid(calib.fresh(1.0), 1.0)


@pytest.mark.parametrize("learns", ["normal", "warnings"])
def test_runs_inside_incidents_teach_the_budget_nothing_as_learns_says(model, period, learns):
    """learns normal: no run that starts where an incident is open is counted; warnings: none where
    a critical one is open (critical when it opened, or since it escalated); and none over the
    threshold from such an incident's first row to the row it opened or escalated, that day. Each
    day's threshold is then what the other runs allow, within the day's bound, checked against the
    scores and incidents alone."""
    policy = CalibrationPolicy(budget_per_day=1.0, days=3.0, min_days=1.0, learns=learns)
    base = float(model.threshold)
    scores, flags, events, state = scored(model, period, 1, policy=policy)
    threshold = np.full(period.shape[0], base)
    for e in events:
        if e["event"] == "threshold-calibrated":
            threshold[e["row"]:] = e["threshold"]
    left_out = scored.live > 0 if learns == "normal" else scored.live == 2  # known at the row, never relabelled
    assert left_out.any()  # machine-1-2's unseen days have incidents, and critical ones
    taken_back = np.zeros_like(left_out)
    for e in events:  # the flagged rows before it opened (or escalated), the same day, are taken back
        if e["event"] == "incident-escalated" or (e["event"] == "incident-opened"
                                                   and (learns == "normal" or e["severity"] == "critical")):
            rows = np.arange(max(e["started_row"], e["row"] // DAY * DAY), e["row"] + 1)
            taken_back[rows] |= flags[rows] & ~left_out[rows]
    if learns == "warnings":
        assert taken_back.any()  # a warning that escalated: its runs before are not learned either
    left_out |= taken_back
    for day in range(1, 8):
        days = slice(max(0, day - 3) * DAY, day * DAY)
        runs = alarms_outside(scores[days], left_out[days], EDGES * base)
        over = np.flatnonzero(runs > math.floor(policy.budget_per_day * (days.stop - days.start) / DAY + 1e-9))
        k = max(int(over[-1]) + 1 if over.size else 0, int(np.searchsorted(EDGES, 1.0)))
        prev = threshold[day * DAY - 1]
        want = min(max(EDGES[k] * base, base, prev / calib.MAX_DAY_FACTOR), prev * calib.MAX_DAY_FACTOR)
        assert threshold[day * DAY] == pytest.approx(want, rel=1e-12), day
    print(f"{learns}: {int(left_out.sum())} rows left out; thresholds by day "
          f"{[round(float(threshold[d * DAY]) / base, 2) for d in range(8)]} x the model's")


def test_a_run_held_until_its_day_closes_is_counted_unless_an_incident_takes_it_back():
    """A run over the threshold in force waits for its day's end: an incident that opens or becomes
    critical later that day, from its first row, takes it back; one that does not is counted as
    add() without rows counts it; a gap counts what is held (no incident spans it)."""
    policy = CalibrationPolicy(budget_per_day=1.0, days=14.0, min_days=1.0)
    loud = np.r_[np.zeros(5), np.full(3, 3.0), np.zeros(5), np.full(3, 3.0), np.zeros(1424)]  # two runs at 3 x
    plain, held, taken = calib.fresh(1.0), calib.fresh(1.0), calib.fresh(1.0)
    for cal in (plain, held, taken):
        calib.roll(cal, 0, policy, 60.0, "rows")
    calib.add(plain, loud)
    calib.add(held, loud, row0=0)
    calib.add(taken, loud[:10], row0=0)
    calib.forget_from(taken, 8, 9)  # an incident from row 8, opened at 9: not the first run (rows 5-7)
    calib.add(taken, loud[10:], row0=10)
    calib.forget_from(taken, 13, 14)  # one from row 13: the second run
    assert [p[0] for p in held["pending"]] == [5, 13] and [p[0] for p in taken["pending"]] == [5]
    for cal in (plain, held, taken):
        calib.roll(cal, 1, policy, 60.0, "rows")
    assert held["days"] == plain["days"] and held["pending"] == []
    assert calib.budget_threshold(held["days"], policy, 1.0, 60.0)[0] >= 3.0  # two runs, one allowed: over them
    assert calib.budget_threshold(taken["days"], policy, 1.0, 60.0) == (1.0, {"days": 1.0, "alarms": 1, "allowed": 1})
    gapped = calib.fresh(1.0)
    calib.add(gapped, loud[:10], row0=0)
    calib.gap(gapped)
    assert gapped["pending"] == [] and gapped["runs"] == plain_runs_of(loud[:10])
    assert not calib.valid(dict(calib.fresh(1.0), pending=[[0, 9999, 1]]), 1.0)


def test_held_runs_over_the_cap_are_counted_the_same_in_one_chunk_or_many(monkeypatch):
    """More held runs in a day than MAX_PENDING: the held ones are counted when the next would
    pass it, at the same row in any chunking (take-backs between chunks apply in row order)."""
    monkeypatch.setattr(calib, "MAX_PENDING", 5)
    scores = np.tile([0.0, 3.0], 40)  # 40 runs over the threshold, one every two rows
    forget = [(10, 11), (31, 33), (50, 51)]  # incidents that open at rows 11, 33, 51 from rows 10, 31, 50

    def counted(cuts):
        cal = calib.fresh(1.0)
        calib.roll(cal, 0, CalibrationPolicy(budget_per_day=1.0), 60.0, "rows")
        for a, b in zip([0, *cuts], [*cuts, scores.size]):
            calib.add(cal, scores[a:b], row0=a, forget=[f for f in forget if a <= f[1] < b])
        return cal

    one = counted([])
    assert one["pending"] and sum(v for v in one["runs"].values() if v > 0) > 0  # some counted at the cap
    for cuts in ([11], [12, 33], [5, 31, 32, 50, 52], list(range(1, 80))):
        assert counted(cuts) == one, cuts


@pytest.mark.parametrize("broken", [{"pending": [[1, 2]]}, {"pending": 7}, {"runs": None}])
def test_a_malformed_state_after_a_gap_starts_the_calibration_again_not_a_crash(model, period, broken):
    """A state.json whose calibration is not of its shape, then a chunk after a gap (a reset
    before the state is judged): scored, the calibration started again."""
    times = 1_790_000_000.0 + 60.0 * np.arange(2 * DAY)
    first = score_chunk(model, period[:DAY], None, times[:DAY], fresh_state("m", model), names=NAMES,
                        max_gap_periods=10, policy=IncidentPolicy(), calibration=BUDGET)
    state = SeriesState.from_dict(first.state.to_dict())
    state.calibration = dict(state.calibration, **broken)
    after = score_chunk(model, period[DAY:2 * DAY], None, times[DAY:] + 3600.0, state, names=NAMES,
                        max_gap_periods=10, policy=IncidentPolicy(), calibration=BUDGET)
    assert after.notes and calib.valid(after.state.calibration, float(model.threshold))


def plain_runs_of(scores: np.ndarray) -> dict:
    cal = calib.fresh(1.0)
    calib.add(cal, scores)
    return cal["runs"]


def test_one_day_moves_the_threshold_by_at_most_the_bound_and_says_it_held_back():
    """A day of loud runs wants the threshold 100 times higher: it doubles (MAX_DAY_FACTOR), the
    event carries what the budget wanted, and the journal entry is at warning level."""
    from opt_ds_ops.observe.incident_entries import incident_entry
    from opt_ds_ops.observe.journal import LOG_WARNING

    cal = calib.fresh(1.0)
    policy = CalibrationPolicy(budget_per_day=1.0, days=14.0, min_days=1.0)
    calib.roll(cal, 0, policy, 60.0, "rows")
    loud = np.tile(np.r_[np.zeros(10), np.full(5, 100.0)], 96)  # 96 runs at 100 x the threshold in one day
    calib.add(cal, loud)
    moved = calib.roll(cal, 1, policy, 60.0, "rows")
    assert moved["threshold"] == 2.0 and moved["wanted"] > 90 and moved["previous"] == 1.0
    assert calib.far(moved)
    entry = incident_entry(dict(moved, event="threshold-calibrated", row=1440, time=None, version="v1",
                                model_threshold=1.0, budget_per_day=1.0), model="m", version="v1", file="f.csv")
    assert entry is not None and entry[2] == LOG_WARNING and "held to 2 times" in entry[1], entry


def test_a_floor_under_one_lets_the_budget_lower_a_threshold_one_event_set_high():
    """A model threshold 10 times what the series needs (one event in its validation split): with
    the floor at 1 the budget never goes under it; with 0.25 it goes down, by at most the day's
    bound, to the floor, not under, and the move is said; the floor raised later (a conffile
    reload) lifts a kept threshold at once and keeps its days."""
    rng = np.random.default_rng(1)
    quiet = lambda: rng.uniform(0.01, 0.05, DAY)  # noqa: E731  scores a tenth of the model's threshold and under
    got = {}
    for floor in (1.0, 0.25):
        policy = CalibrationPolicy(budget_per_day=1.0, days=14.0, min_days=1.0, floor=floor)
        cal, moves = calib.fresh(1.0), []
        for d in range(6):
            moved = calib.roll(cal, d, policy, 60.0, "rows")
            moves.append(moved)
            calib.add(cal, quiet())
        got[floor] = (cal["threshold"], [m for m in moves if m])
    assert got[1.0] == (1.0, [])  # never under the model's
    threshold, moves = got[0.25]
    assert threshold == 0.25  # the floor: the days allow less, the floor holds
    assert [m["threshold"] for m in moves] == [0.5, 0.25]  # halved a day at most (MAX_DAY_FACTOR), then the floor
    assert all(m["previous"] / m["threshold"] <= calib.MAX_DAY_FACTOR + 1e-12 for m in moves)
    assert calib.valid(cal, 1.0)
    kept = len(cal["days"])
    calib.floored(cal, CalibrationPolicy(budget_per_day=1.0, floor=0.5))
    assert cal["threshold"] == 0.5 and len(cal["days"]) == kept
    calib.floored(cal, CalibrationPolicy(budget_per_day=1.0, floor=1.0))
    assert cal["threshold"] == 1.0


def test_the_floor_rounds_up_to_an_edge_and_one_is_the_models_threshold():
    assert EDGES[calib.floor_bin(1.0)] == 1.0 and EDGES[calib.floor_bin(0.5)] == 0.5
    assert 0.3 <= EDGES[calib.floor_bin(0.3)] < 0.3 * 2 ** (1 / calib.PER_OCTAVE)
    assert calib.floor_bin(0.0625) == 0


def test_a_series_kept_under_a_floor_since_raised_runs_at_the_new_floor_at_once(model, period):
    """A series' state kept at a quarter of the model's threshold (floor 0.25), scored after the
    floor went back to 1: its first row is judged at the model's threshold, its kept days stay."""
    low = CalibrationPolicy(budget_per_day=1.0, days=3.0, min_days=1.0, floor=0.25)
    _, _, _, state = scored(model, period[:2 * DAY - 100], 1, policy=low)  # the next rows are of the same day
    cal = dict(state.calibration, threshold=0.25 * float(model.threshold))
    kept = SeriesState.from_dict(dict(state.to_dict(), calibration=cal, threshold=cal["threshold"]))
    r = score_chunk(model, period[2 * DAY - 100:2 * DAY - 90], None, None, kept, names=NAMES, max_gap_periods=10,
                    policy=IncidentPolicy(), calibration=BUDGET)
    assert r.state.threshold == float(model.threshold) and r.state.calibration["days"] == cal["days"]
    assert np.array_equal(r.flags, r.scores > np.float32(model.threshold))
    lifted = [e for e in r.events if e["event"] == "threshold-calibrated"]  # said, as every change is
    assert len(lifted) == 1 and lifted[0]["floor"] == 1.0 and lifted[0]["previous"] == cal["threshold"]
    assert lifted[0]["threshold"] == float(model.threshold) and lifted[0]["row"] == 2 * DAY - 100 and lifted[0]["far"]
    from opt_ds_ops.observe.incident_entries import incident_entry

    _, message, _, _ = incident_entry(lifted[0], model="m", version="v1", file="f.csv")
    assert "lifted to scoring.alarm_budget_floor, 1 times the model's" in message, message


def test_the_budgets_basis_carries_the_alarms_it_allowed():
    """The allowance is counted from the rows kept, not from the days rounded for the event: 34,559
    ten-second rows are 3.9999 days (allowed 0 at 0.25 a day) though the event says 4.0."""
    policy = CalibrationPolicy(budget_per_day=0.25, days=14.0, min_days=1.0)
    _, basis = calib.budget_threshold([[0, 34559, {}]], policy, 1.0, 10.0)
    assert basis["days"] == 4.0 and basis["allowed"] == 0
