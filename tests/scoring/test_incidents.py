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


@pytest.mark.parametrize("rule", [IncidentPolicy(), IncidentPolicy(open_window_s=300, open_share=0.6, quiet_s=180)])
def test_chunks_open_and_close_the_same_incidents_as_the_whole(rule):
    rng = np.random.default_rng(3)
    s = np.where(rng.random(2000) < 0.08, 1.5, 0.2) + np.where(np.arange(2000) % 400 < 30, 1.0, 0.0)
    times = 1.7e9 + 60.0 * np.arange(2000)
    whole = track(s > T, s, T, Tracker(), rule, 60.0, times=times)
    for cuts in ([0, 2000], [0, 1, 2, 399, 400, 1200, 2000], list(range(0, 2001, 7)) + [2000]):
        tr, changes = Tracker(), []
        for a, b in zip(cuts[:-1], cuts[1:]):
            if a == b:
                continue
            part = track(s[a:b] > T, s[a:b], T, tr, rule, 60.0, row0=a, times=times[a:b])
            tr = Tracker.from_dict(json.loads(json.dumps(part.tracker.to_dict())))  # as state.json carries it
            changes += [(k, a + i, inc) for k, i, inc in part.changes]
        assert [(k, i, inc["id"], inc["start_row"], inc["start_time"], inc["last_row"], inc["peak_row"])
                for k, i, inc in changes] == [
            (k, i, inc["id"], inc["start_row"], inc["start_time"], inc["last_row"], inc["peak_row"])
            for k, i, inc in whole.changes]
    assert sum(k == "opened" for k, _, _ in whole.changes) >= 5


def test_the_incident_column_names_each_row_from_first_to_last_flagged_row():
    rule = IncidentPolicy(open_window_s=0, quiet_s=180)
    s = scores_from("..#.#.....#")
    done = track(s > T, s, T, Tracker(), rule, 60.0)
    assert done.incident.tolist() == [0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 2]  # the quiet tail is not the incident's


def test_the_tracker_refuses_a_state_of_the_wrong_shape():
    with pytest.raises(ValueError):
        Tracker.from_dict({"recent": "x"})
    with pytest.raises(ValueError):
        Tracker.from_dict({"open": {"sums": 3}})
    assert Tracker.from_dict(None).opened == 0


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
    for bad in ("incident_open_share: 0", "incident_quiet_s: -1", "incident_critical_ratio: 0.5"):
        conf.write_text(f"scoring:\n  {bad}\n")
        with pytest.raises(ConfigError, match=bad.split(":")[0]):
            load_config(str(conf))
