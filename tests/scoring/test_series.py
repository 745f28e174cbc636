"""One series per model across chunks: a labelled SMD test period scored in chunks
equals it scored whole (scores and incidents), for every smoothing and window setting and incident
rule; resets; the state is not moved."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import SMD_LABELS, SMD_TEST
from opt_ds_ops.config.conffile import TrainConfig
from opt_ds_ops.health.device import plan_device
from opt_ds_ops.model.detection import ScoreError, flagged_segments, in_memory_model, score_with_cells
from opt_ds_ops.scoring.incidents import IncidentPolicy, incidents_of
from opt_ds_ops.scoring.series import SeriesState, fresh_state, sample_period_s, score_chunk
from opt_ds_ops.training.fit import train

PERIOD = slice(4000, 7000)  # 3,000 rows of machine-1-2's test period holding three labelled anomalies
# "defaults" is the shipped TrainConfig (each metric's change read beside its level since round 10);
# windowed inputs cannot read differences (fit.train refuses input_window > 1 with them), so those
# settings read levels alone, and "levels alone" keeps a one-row model of levels (the shipped
# score before round 10, and what a streamed or distributed training gives) in the comparison.
SETTINGS = {
    "defaults": {},
    "levels alone": {"input_differences": False},
    "input_window 4": {"input_window": 4, "input_differences": False},
    "mean smoothing": {"score_smoothing": "mean", "score_window": 15},
    "window error": {"input_window": 4, "window_error": "window", "input_differences": False},
    "differences": {"input_differences": True},
    "differences, max term": {"input_differences": True, "difference_term": "max"},
}
NAMES = [f"m{j}" for j in range(38)]


@pytest.fixture(scope="module")
def test_period(smd_rows):
    rows = np.loadtxt(SMD_TEST, delimiter=",", dtype=np.float32)[PERIOD]
    labels = np.loadtxt(SMD_LABELS)[PERIOD]
    assert labels.sum() > 100
    return rows


@pytest.fixture(scope="module")
def models(smd_rows):
    out = {}
    for key, kw in SETTINGS.items():
        torch.manual_seed(0)
        stored = in_memory_model(train(smd_rows[:3000], TrainConfig(epochs=1, **kw), plan_device("cpu", "off")))
        stored.metadata = {"version": "v1", "config": {"train": {"sample_period_s": 60.0}}}
        out[key] = stored
    return out


ROWS_RULE = IncidentPolicy(open_window_s=0, quiet_s=0)  # every flagged run its own incident (segments)
PERSIST = IncidentPolicy(open_window_s=600, open_share=0.5, quiet_s=1800)  # 5 of 10 rows open, 30 rows close


def scored_in(stored, data, k, times=None, policy=None):
    """Score data in k consecutive chunks; return (scores, events, final state)."""
    state, scores, events = fresh_state("m", stored), [], []
    for part in np.array_split(np.arange(data.shape[0]), k):
        r = score_chunk(stored, data[part], None, None if times is None else times[part], state, names=NAMES,
                        max_gap_periods=10, policy=policy)
        assert r.first_row == part[0] and r.notes == []
        state, scores, events = r.state, scores + [r.scores], events + r.events
    return np.concatenate(scores), events, state


def incidents_from(events, state):
    """(first flagged row, row that opened it, last flagged row, top metrics or None) per incident."""
    got = [(e["started_row"], e["opened_row"], e["row"], [m["metric"] for m in e["top_metrics"]])
           for e in events if e["event"] == "incident-closed"]
    if state.open_incident is not None:
        inc = state.open_incident
        got.append((inc["start_row"], inc["opened_row"], inc["last_row"], None))
    return got


@pytest.mark.parametrize("k", [1, 7, 50])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_a_period_scored_in_chunks_equals_it_scored_whole(models, test_period, setting, k):
    """The same scores (to 1e-6), incidents and events in 1, 7 and 50 chunks; with the rule that
    makes every flagged run an incident, the incidents are the flagged segments, top metrics too."""
    stored = models[setting]
    whole, cells = score_with_cells(stored, test_period)
    segments = flagged_segments(whole, stored.threshold, cells, NAMES)
    assert len(segments) >= 3  # the labelled anomalies are flagged: there are incidents to split
    scores, events, state = scored_in(stored, test_period, k, policy=ROWS_RULE)
    np.testing.assert_allclose(scores, whole, rtol=0, atol=1e-6)
    got = incidents_from(events, state)
    assert [(g[0], g[2]) for g in got] == [(e["start"], e["end"]) for e in segments]
    assert [g[1] for g in got] == [e["start"] for e in segments]  # one flagged row opens it
    closed = [e for e in segments if e["end"] < test_period.shape[0] - 1 or state.open_incident is None]
    assert [g[3] for g in got if g[3] is not None] == [[m["metric"] for m in e["top_metrics"]] for e in closed]
    opened = [e for e in events if e["event"] == "incident-opened"]
    assert [e["incident"] for e in opened] == list(range(1, len(segments) + 1))
    assert state.rows_scored == 3000 and state.rows_flagged == int((whole > stored.threshold).sum())
    assert state.incidents == len(segments)
    reference, ref_events, _ = scored_in(stored, test_period, 1, policy=ROWS_RULE)
    assert json.dumps(events, sort_keys=True) == json.dumps(ref_events, sort_keys=True)


def test_a_model_of_differences_carries_the_previous_row_across_chunks_and_a_short_gap(models, test_period):
    """Each row's change is read against the row before it, carried in the series state from one
    chunk to the next: chunks with times and a gap of 5 missing rows between two of them (under
    scoring.max_gap_periods, 10) score as the whole file with the same gap does (to 1e-6). A gap
    over max_gap_periods starts the series again: its first row has no row before it (a change of 0)."""
    stored = models["differences"]
    assert stored.diff is not None and stored.input_window == 2 and stored.model.n_features == 2 * 38
    times = 1.8e9 + 60.0 * np.arange(test_period.shape[0])
    times[1500:] += 300.0  # five rows missing before row 1500
    whole = scored_in(stored, test_period, 1, times=times)[0]
    state, parts = fresh_state("m", stored), []
    for idx in (np.arange(0, 1500), np.arange(1500, 2200), np.arange(2200, 3000)):
        r = score_chunk(stored, test_period[idx], None, times[idx], state, names=NAMES, max_gap_periods=10)
        assert r.notes == []  # no reset: the gap is 6 periods
        state, parts = r.state, parts + [r.scores]
    np.testing.assert_allclose(np.concatenate(parts), whole, rtol=0, atol=1e-6)
    assert len(state.context) == 1 and len(state.context[0]) == 38  # the last row, standardised and clipped
    far = times.copy()
    far[1500:] += 3600.0  # an hour missing: over 10 periods, the series starts again at row 1500
    first = score_chunk(stored, test_period[:1500], None, far[:1500], fresh_state("m", stored), names=NAMES,
                        max_gap_periods=10)
    after = score_chunk(stored, test_period[1500:], None, far[1500:], first.state, names=NAMES, max_gap_periods=10)
    alone = score_chunk(stored, test_period[1500:], None, far[1500:], fresh_state("m", stored), names=NAMES,
                        max_gap_periods=10)
    assert after.notes and "gap" in after.notes[0]
    np.testing.assert_allclose(after.scores, alone.scores, rtol=0, atol=1e-6)  # as a series that starts there


@pytest.mark.parametrize("k", [1, 7, 50, 300])
@pytest.mark.parametrize("policy", [None, PERSIST], ids=["shipped", "persist"])
def test_incidents_in_chunks_are_the_incidents_of_the_whole_period(models, test_period, policy, k):
    """The shipped rule (flagged runs < 30 min apart are one incident) and a persistence rule open and
    close the same incidents however the series is cut, as incidents_of finds them in the whole."""
    stored = models["defaults"]
    whole, _ = score_with_cells(stored, test_period)
    rule = policy or IncidentPolicy()
    expected = incidents_of(whole, stored.threshold, rule, 60.0)
    segments = flagged_segments(whole, stored.threshold, np.zeros((whole.shape[0], 38)), NAMES)
    assert 1 <= len(expected) < len(segments)  # the rule merges or drops some flagged runs
    _, events, state = scored_in(stored, test_period, k, policy=policy)
    got = incidents_from(events, state)
    assert [(g[0], g[1], g[2]) for g in got] == [(e["start"], e["opened"], e["end"]) for e in expected]
    sev = [e["severity"] for e in events if e["event"] == "incident-closed"]
    assert sev == [e["severity"] for e in expected if not e["open"]]
    assert state.incidents == len(expected)
    assert state.critical_incidents == sum(e["severity"] == "critical" for e in expected) > 0


def test_an_incident_spanning_chunks_is_one_opened_and_one_closed_event(models, test_period):
    stored = models["defaults"]
    whole, cells = score_with_cells(stored, test_period)
    seg = max(flagged_segments(whole, stored.threshold, cells, NAMES), key=lambda g: g["end"] - g["start"])
    assert seg["end"] - seg["start"] >= 4
    cut = (seg["start"] + seg["end"]) // 2
    state = fresh_state("m", stored)
    first = score_chunk(stored, test_period[:cut], None, None, state, names=NAMES, max_gap_periods=10,
                        policy=ROWS_RULE)
    assert first.active and first.events[-1]["event"] == "incident-opened" and first.events[-1]["row"] == seg["start"]
    assert set(first.incident[seg["start"]:cut].tolist()) == {first.events[-1]["incident"]}  # rows.csv's column
    second = score_chunk(stored, test_period[cut:], None, None, first.state, names=NAMES, max_gap_periods=10,
                         policy=ROWS_RULE)
    ended = [e for e in second.events if e["event"] == "incident-closed"]
    assert not [e for e in second.events if e["event"] == "incident-opened" and e["row"] == cut]
    assert ended[0]["started_row"] == seg["start"] and ended[0]["row"] == seg["end"]
    assert ended[0]["rows"] == seg["end"] - seg["start"] + 1 and ended[0]["peak_row"] == seg["peak_row"]
    assert ended[0]["top_metrics"][0]["metric"] == seg["top_metrics"][0]["metric"]
    assert ended[0]["top_metrics"][0]["share"] == pytest.approx(seg["top_metrics"][0]["share"], rel=1e-5)


def test_the_state_round_trips_through_json_exactly(models, test_period):
    stored = models["input_window 4"]
    first = score_chunk(stored, test_period[:1500], None, None, fresh_state("m", stored), names=NAMES,
                        max_gap_periods=10)
    again = SeriesState.from_dict(json.loads(json.dumps(first.state.to_dict())))
    a = score_chunk(stored, test_period[1500:], None, None, first.state, names=NAMES, max_gap_periods=10)
    b = score_chunk(stored, test_period[1500:], None, None, again, names=NAMES, max_gap_periods=10)
    assert np.array_equal(a.scores, b.scores) and a.events == b.events
    with pytest.raises(ValueError, match="unknown format"):
        SeriesState.from_dict(dict(first.state.to_dict(), format=99))


def test_a_state_written_before_incidents_is_read_and_its_series_goes_on(models, test_period):
    """An upgrade keeps each model's series: a format-1 state.json (an open anomaly ``segment`` and
    a ``segments`` count) is read, its counters and carried context kept, the old segment dropped."""
    stored = models["input_window 4"]
    first = score_chunk(stored, test_period[:1500], None, None, fresh_state("m", stored), names=NAMES,
                        max_gap_periods=10)
    old = {k: v for k, v in first.state.to_dict().items() if k not in ("incident", "incidents")}
    old.update(format=1, segments=7, segment={"start_row": 1400, "sums": [0.0] * 38})
    state = SeriesState.from_dict(json.loads(json.dumps(old)))
    assert state.incidents == 7 and state.open_incident is None and state.next_row == 1500
    r = score_chunk(stored, test_period[1500:], None, None, state, names=NAMES, max_gap_periods=10)
    b = score_chunk(stored, test_period[1500:], None, None, first.state, names=NAMES, max_gap_periods=10)
    assert r.notes == [] and np.array_equal(r.scores, b.scores)  # the window context carried over


def test_score_chunk_never_changes_the_state_it_is_given(models, test_period):
    stored = models["defaults"]
    state = score_chunk(stored, test_period[:700], None, None, fresh_state("m", stored), names=NAMES,
                        max_gap_periods=10).state
    before = json.dumps(state.to_dict(), sort_keys=True)
    score_chunk(stored, test_period[700:900], None, None, state, names=NAMES, max_gap_periods=10)
    with pytest.raises(ScoreError, match="data has 37 features, model expects 38"):
        score_chunk(stored, test_period[700:900, 1:], None, None, state, names=NAMES, max_gap_periods=10)
    assert json.dumps(state.to_dict(), sort_keys=True) == before


def _active_state(stored, data, times=None):
    """Score up to the middle of a flagged segment; return (rows scored, state with an open incident)."""
    whole = score_with_cells(stored, data)[0]
    flagged = np.flatnonzero(whole > stored.threshold)
    cut = int(flagged[len(flagged) // 2]) + 1
    while not whole[cut - 1] > stored.threshold:
        cut += 1
    r = score_chunk(stored, data[:cut], None, None if times is None else times[:cut], fresh_state("m", stored),
                    names=NAMES, max_gap_periods=10)
    assert r.active
    return cut, r.state


def test_a_gap_keeps_the_versions_own_rows_and_a_new_version_starts_them_at_0(models, test_period):
    """version_rows, the drift trigger's own rows: a gap restarts the series (rows from 0) but the
    version's rows go on; a new current version starts them again."""
    import copy

    stored = models["defaults"]
    t = 1.7e9 + 60.0 * np.arange(400)
    r = score_chunk(stored, test_period[:100], None, t[:100], fresh_state("m", stored), names=NAMES, max_gap_periods=10)
    assert r.state.version_rows == 100
    r = score_chunk(stored, test_period[100:200], None, t[200:300], r.state, names=NAMES, max_gap_periods=10)
    assert r.first_row == 0 and r.notes and r.state.version_rows == 200 and r.state.rows_scored == 200
    other = copy.copy(stored)
    other.metadata = dict(stored.metadata, version="v2")
    r = score_chunk(other, test_period[200:250], None, t[300:350], r.state, names=NAMES, max_gap_periods=10)
    assert r.first_row == 0 and r.state.version_rows == 50 and r.state.rows_scored == 250


def test_a_new_current_version_resets_the_series_and_closes_the_open_incident(models, test_period):
    stored = models["defaults"]
    cut, state = _active_state(stored, test_period)
    stored.metadata = dict(stored.metadata, version="v2")
    try:
        r = score_chunk(stored, test_period[cut:], None, None, state, names=NAMES, max_gap_periods=10)
    finally:
        stored.metadata = dict(stored.metadata, version="v1")
    assert r.notes and "changed from v1 to v2" in r.notes[0]
    assert r.events[0]["event"] == "incident-closed" and r.events[0]["reason"] == "reset"
    assert r.events[0]["row"] == cut - 1 and r.first_row == 0 and r.state.version == "v2"
    assert r.events[0]["version"] == "v1"  # the version that flagged it, not the new one
    fresh = score_with_cells(stored, test_period[cut:])[0]
    np.testing.assert_array_equal(r.scores, fresh)  # scored as a new series: no carried context
    assert r.state.rows_scored == test_period.shape[0]  # the counters are the model's, they go on


@pytest.mark.parametrize("how", ["backwards", "gap"])
def test_time_going_backwards_or_a_gap_resets_the_series_with_a_note(models, test_period, how):
    stored = models["defaults"]
    assert sample_period_s(stored) == 60.0
    times = 1.7e9 + 60.0 * np.arange(test_period.shape[0])
    cut, state = _active_state(stored, test_period, times)
    later = times[cut:] - 3600.0 if how == "backwards" else times[cut:] + 601.0  # > 10 periods of 60 s
    r = score_chunk(stored, test_period[cut:], None, later, state, names=NAMES, max_gap_periods=10)
    assert len(r.notes) == 1 and ("went backwards" if how == "backwards" else "max_gap_periods") in r.notes[0]
    assert r.events[0]["reason"] == "reset" and r.events[0]["duration_s"] is not None
    np.testing.assert_array_equal(r.scores, score_with_cells(stored, test_period[cut:])[0])
    within = score_chunk(stored, test_period[cut:], None, times[cut:] + 540.0, state, names=NAMES,
                         max_gap_periods=10)
    assert within.notes == [] and within.first_row == cut  # a gap of 10 periods (600 s) is no reset
    never = score_chunk(stored, test_period[cut:], None, times[cut:] + 1e6, state, names=NAMES, max_gap_periods=0)
    assert never.notes == []  # 0: never by gap


def test_the_sample_period_is_the_training_files_median_step_when_it_had_times(models):
    stored = models["defaults"]
    old = stored.metadata
    stored.metadata = dict(old, dataset={"time": {"median_step_s": 5.0}})
    try:
        assert sample_period_s(stored) == 5.0
    finally:
        stored.metadata = old
