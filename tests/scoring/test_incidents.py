"""Incidents (opt_ds_ops.scoring.incidents): the persistence rule that opens one, the quiet spell
that closes one, severity, chunking, and the operator's figures computed from them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from opt_ds_ops.config.conffile import ConfigError, load_config
from opt_ds_ops.scoring.incidents import IncidentPolicy, Tracker, incidents_of, operator_figures, track

T = 1.0  # threshold


def scores_from(flags: str, high: float = 1.5) -> np.ndarray:
    """'..##.#' -> scores: '#' over the threshold (``high``), '.' under it, '!' at 3x the threshold."""
    return np.array([{"#": high, ".": 0.2, "!": 3.0}[c] for c in flags])


def spans(flags: str, policy: IncidentPolicy, period: float = 60.0) -> list[tuple[int, int, int]]:
    return [(i["start"], i["opened"], i["end"]) for i in incidents_of(scores_from(flags), T, policy, period)]


def test_every_flagged_run_is_an_incident_without_persistence_or_quiet_spell():
    rule = IncidentPolicy(open_window_s=0, quiet_s=0)
    assert rule.rows(60.0) == (1, 1, 1)
    assert spans("..#..##...#", rule) == [(2, 2, 2), (5, 5, 6), (10, 10, 10)]


def test_flagged_runs_closer_than_the_quiet_spell_are_one_incident():
    rule = IncidentPolicy(open_window_s=0, quiet_s=180)  # 3 unflagged rows of 60 s close it
    assert spans("#..#..#...#", rule) == [(0, 0, 6), (10, 10, 10)]
    assert spans("#...#", rule) == [(0, 0, 0), (4, 4, 4)]  # three unflagged rows in a row: closed


def test_a_persistence_rule_opens_only_on_enough_flagged_rows_and_starts_at_the_first():
    rule = IncidentPolicy(open_window_s=300, open_share=0.6, quiet_s=60)  # 3 of the last 5 rows
    assert rule.rows(60.0) == (5, 3, 1)
    assert spans("#...#...#...#", rule) == []  # scattered rows page nobody
    assert spans("..#.#.#....", rule) == [(2, 6, 6)]  # opened at the third, started at the first
    assert spans("..###", rule) == [(2, 4, 4)]


def test_the_rule_counts_rows_of_the_model_s_sample_period():
    rule = IncidentPolicy(open_window_s=600, open_share=0.5, quiet_s=1800)
    assert rule.rows(60.0) == (10, 5, 30)
    assert rule.rows(300.0) == (2, 1, 6)  # ASD's 5-minute rows
    assert rule.rows(0.0) == rule.rows(60.0)  # an unknown period counts minutes


def test_severity_is_critical_once_the_peak_reaches_the_ratio():
    rule = IncidentPolicy(open_window_s=0, quiet_s=120, critical_ratio=2.0)
    done = track(*(lambda s: (s > T, s))(scores_from("#.#.!..#...")), T, Tracker(), rule, 60.0)
    kinds = [(k, i, inc["severity"]) for k, i, inc in done.changes]
    # the first incident opens as a warning, is escalated once at its 3x row and closes critical;
    # the second stays a warning
    assert kinds == [("opened", 0, "warning"), ("escalated", 4, "critical"), ("closed", 6, "critical"),
                     ("opened", 7, "warning"), ("closed", 9, "warning")]
    done = track(*(lambda s: (s > T, s))(scores_from("!!.!")), T, Tracker(), rule, 60.0)
    assert [(k, inc["severity"]) for k, _, inc in done.changes] == [("opened", "critical")]  # critical from the start


@pytest.mark.parametrize("rule", [IncidentPolicy(), IncidentPolicy(open_window_s=300, open_share=0.6, quiet_s=180),
                                  IncidentPolicy(open_window_s=600, open_share=0.5, quiet_s=120, critical_ratio=1.8)])
def test_chunks_open_and_close_the_same_incidents_as_the_whole(rule):
    """Whatever the cuts (one row, a window's middle, empty chunks), the same incidents: ids, rows,
    times, peak, severity, escalations, flagged rows and each metric's sum, as the whole series."""
    rng = np.random.default_rng(3)
    n = 2000
    s = np.where(rng.random(n) < 0.08, rng.uniform(1.01, 2.6, n), 0.2) + np.where(np.arange(n) % 400 < 30, 1.0, 0.0)
    cells = rng.random((n, 4)).astype(np.float32)
    times = 1.7e9 + 60.0 * np.arange(n)

    def key(changes):
        return [(k, i, inc["id"], inc["start_row"], inc["start_time"], inc["last_row"], inc["peak_row"],
                 inc["peak_score"], inc["severity"], inc["rows_flagged"], inc["sums"]) for k, i, inc in changes]

    whole = track(s > T, s, T, Tracker(), rule, 60.0, times=times, cells=cells)
    for cuts in ([0, n], [0, 1, 2, 399, 400, 1200, n], list(range(0, n + 1, 7)) + [n], [0, 5, 5, 6, 1000, 1000, n]):
        tr, changes = Tracker(), []
        for a, b in zip(cuts[:-1], cuts[1:]):
            part = track(s[a:b] > T, s[a:b], T, tr, rule, 60.0, row0=a, times=times[a:b], cells=cells[a:b])
            tr = Tracker.from_dict(json.loads(json.dumps(part.tracker.to_dict())))  # as state.json carries it
            changes += [(k, a + i, inc) for k, i, inc in part.changes]
        assert key(changes) == key(whole.changes)
    kinds = [k for k, _, _ in whole.changes]
    assert kinds.count("opened") >= 5 and "escalated" in kinds or rule.critical_ratio == 2.0


def test_an_opening_window_cut_by_a_chunk_keeps_the_previous_chunk_s_peak():
    """A persistence window that reaches into the previous chunk counts its rows' scores: the peak
    (and so the severity) of the whole series, not only this chunk's."""
    rule = IncidentPolicy(open_window_s=300, open_share=0.6, quiet_s=60)  # 3 of the last 5 rows
    s = np.array([0.1, 5.0, 1.2, 0.1, 1.3, 0.1])
    whole = track(s > T, s, T, Tracker(), rule, 60.0)
    first = track(s[:3] > T, s[:3], T, Tracker(), rule, 60.0)
    second = track(s[3:] > T, s[3:], T, Tracker.from_dict(first.tracker.to_dict()), rule, 60.0, row0=3)
    (_, _, a), (_, _, b) = whole.changes[0], second.changes[0]
    assert (a["peak_score"], a["severity"], a["start_row"]) == (b["peak_score"], b["severity"], b["start_row"]) \
        == (5.0, "critical", 1)


def test_a_closed_incident_s_rows_never_open_the_next_one():
    """A quiet spell shorter than the opening window: the rows of a closed incident no longer count,
    so one flagged row after it pages nobody (before, it reopened at once over the same rows)."""
    rule = IncidentPolicy(open_window_s=600, open_share=0.5, quiet_s=180)  # 5 of 10 rows open, 3 close
    assert spans("#####..." "#" + "." * 12, rule) == [(0, 4, 4)]
    assert spans("#####..." "#####" + "." * 12, rule) == [(0, 4, 4), (8, 12, 12)]


def test_a_severity_never_falls_back_and_escalates_once_when_the_ratio_changes():
    s = np.array([2.5, 2.5, 2.5])
    first = track(s[:1] > T, s[:1], T, Tracker(), IncidentPolicy(quiet_s=600, critical_ratio=2.0), 60.0)
    assert first.tracker.open["severity"] == "critical"
    raised = track(s[1:] > T, s[1:], T, first.tracker, IncidentPolicy(quiet_s=600, critical_ratio=3.0), 60.0, row0=1)
    assert raised.changes == [] and raised.tracker.open["severity"] == "critical"


def test_the_incident_column_names_each_row_from_first_to_last_flagged_row():
    rule = IncidentPolicy(open_window_s=0, quiet_s=180)
    s = scores_from("..#.#.....#")
    done = track(s > T, s, T, Tracker(), rule, 60.0)
    assert done.incident.tolist() == [0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 2]  # the quiet tail is not the incident's


@pytest.mark.parametrize("bad", [{"recent": "x"}, {"open": {"sums": 3}}, {"open": {"sums": []}}, {"opened": -5},
                                 {"recent": [1], "recent_times": [10 ** 400]}, {"recent": [1], "recent_scores": ["x"]},
                                 {"open": dict(id=1, start_row=0, opened_row=0, last_row=0, quiet=0, rows_flagged=1,
                                               peak_row=0, peak_score=2.0, severity="loud", sums=[])}])
def test_the_tracker_refuses_a_state_of_the_wrong_shape(bad):
    with pytest.raises(ValueError, match="incident tracker"):
        Tracker.from_dict(bad)


def test_the_tracker_reads_its_own_state_and_nothing():
    assert Tracker.from_dict(None).opened == 0
    s = scores_from("..##....")
    done = track(s > T, s, T, Tracker(), IncidentPolicy(open_window_s=180, quiet_s=600), 60.0)
    assert Tracker.from_dict(json.loads(json.dumps(done.tracker.to_dict()))) == done.tracker


def test_operator_figures_count_pages_false_pages_paged_segments_and_time_in_alarm():
    labels = np.zeros(1440 * 2, dtype=int)  # two days of minutes
    labels[600:660] = 1  # one labelled segment of an hour
    labels[2000:2010] = 1  # one that no incident touches
    incidents = [{"start": 570, "opened": 570, "end": 700, "severity": "warning", "open": False},  # paged, 30 min early
                 {"start": 1000, "opened": 1000, "end": 1009, "severity": "warning", "open": False}]  # false
    f = operator_figures(incidents, labels, 60.0)
    assert f["pages"] == 2 and f["false_pages"] == 1 and f["false_per_day"] == pytest.approx(0.5)
    assert f["segments"] == 2 and f["paged"] == pytest.approx(0.5)
    assert f["normal_in_alarm"] == pytest.approx((131 - 60 + 10) / (2880 - 70))
    late = [{"start": 500, "opened": 500, "end": 700, "severity": "warning", "open": False}]  # 100 min before: no page
    assert operator_figures(late, labels, 60.0)["paged"] == 0.0


def test_the_conffile_sets_the_rule_and_refuses_nonsense(tmp_path):
    conf = tmp_path / "trainer.yaml"
    conf.write_text("scoring:\n  incident_open_window_s: 600\n  incident_open_share: 0.5\n  incident_quiet_s: 900\n")
    rule = IncidentPolicy.from_config(load_config(str(conf)).scoring)
    assert rule == IncidentPolicy(open_window_s=600, open_share=0.5, quiet_s=900, critical_ratio=2.0)
    for bad in ("incident_open_share: 0", "incident_quiet_s: -1", "incident_critical_ratio: 0.5",
                "incident_quiet_s: .inf", "incident_open_window_s: .nan", "incident_critical_ratio: .inf"):
        conf.write_text(f"scoring:\n  {bad}\n")
        with pytest.raises(ConfigError, match=bad.split(":")[0]):
            load_config(str(conf))
