"""opt_ds_ops.daemon.scoreslot's pieces that need no daemon: what status and the metrics read from the
results directory, the metrics families, and the retention of result directories.
The daemon's side runs in real daemon processes in tests/daemon/test_daemon_scoring.py."""

from __future__ import annotations

import json
import os
import time
from datetime import datetime, timezone

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from opt_ds_ops.observe.metrics import MetricsWriter
from opt_ds_ops.scoring.results import model_view, model_views, prune_results
from opt_ds_ops.observe.incident_entries import top_text


def write_model(results, name: str, state: dict, summary: dict | None = None, result: str = "20261201T000000.000000Z-j1"):
    mdir = results / name
    (mdir / result).mkdir(parents=True)
    if summary is not None:
        (mdir / result / "summary.json").write_text(json.dumps(summary))
    (mdir / "state.json").write_text(json.dumps(dict(state, last_result=result)))
    return mdir


OPEN = {"id": 2, "start_row": 2900, "severity": "critical", "sums": []}
STATE = {"model": "m", "version": "v1", "rows_scored": 3000, "rows_flagged": 40, "incidents": 2,
         "critical_incidents": 1, "last_score": 0.9,
         "threshold": 0.5, "incident": {"recent": [], "open": OPEN, "opened": 2}, "format": 2}
CLOSED = {"recent": [], "open": None, "opened": 2}
SUMMARY = {"model": "m", "version": "v1", "active": True, "scored_at": "2026-12-01T00:00:00.000000Z",
           "top_metrics": [{"metric": "disk_util", "share": 0.6}, {"metric": "cpu", "share": 0.3},
                           {"metric": "net", "share": 0.05}, {"metric": "mem", "share": 0.05}]}


def test_a_models_view_takes_its_counters_from_state_json_and_its_top_metrics_from_the_last_summary(tmp_path):
    write_model(tmp_path, "m", STATE, SUMMARY)
    (v,) = model_views(str(tmp_path)).values()
    assert (v["rows_total"], v["flagged_total"], v["incidents_total"]) == (3000, 40, 2)
    assert v["active"] and [t["metric"] for t in v["top_metrics"]] == ["disk_util", "cpu", "net"]
    assert v["severity"] == "critical"
    assert v["scored_at"] == 1796083200.0 and v["last_score"] == 0.9 and v["threshold"] == 0.5


def test_a_state_json_written_before_incidents_still_shows_its_model(tmp_path):
    """Until a model's next chunk after an upgrade, its format-1 state.json (an open ``segment``,
    a ``segments`` count) still gives status and the metrics its counters and open anomaly."""
    old = {k: v for k, v in STATE.items() if k not in ("incident", "incidents")}
    write_model(tmp_path, "m", dict(old, format=1, segments=5, segment={"start_row": 2900}), SUMMARY)
    v = model_views(str(tmp_path))["m"]
    assert v["incidents_total"] == 5 and v["active"] and v["severity"] is None


def test_a_closed_incident_shows_no_top_metrics_and_a_broken_state_json_no_model(tmp_path):
    write_model(tmp_path, "m", dict(STATE, incident=CLOSED), SUMMARY)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "state.json").write_text("{not json")
    os.mkfifo(tmp_path / "fifo-model")  # a FIFO is never opened (read_small)
    views = model_views(str(tmp_path))
    assert list(views) == ["m"] and not views["m"]["active"] and views["m"]["top_metrics"] == []


def test_a_summary_named_by_a_hostile_last_result_is_not_read(tmp_path):
    write_model(tmp_path, "m", STATE, SUMMARY)
    state = json.loads((tmp_path / "m" / "state.json").read_text())
    (tmp_path / "m" / "state.json").write_text(json.dumps(dict(state, last_result="../../etc")))
    assert model_views(str(tmp_path))["m"]["scored_at"] is None


def test_the_metrics_show_the_top_metric_shares_of_an_open_incident_only_three_of_them():
    m = MetricsWriter("", "/nonexistent")
    m.score_done(model_view("m", STATE, SUMMARY))
    m.score_done(model_view("calm", dict(STATE, incident=CLOSED), SUMMARY))
    m.score_done(model_view("warm", dict(STATE, incident=dict(STATE["incident"], open=dict(OPEN, severity="warning"))),
                            SUMMARY))
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for fam in text_string_to_metric_families(generate_latest(m.registry()).decode()) for s in fam.samples}
    tops = sorted(k for k in got if k[0] == "ds_ops_incident_top_metric_share" and dict(k[1])["model"] == "m")
    assert sorted(dict(k[1])["rank"] for k in tops) == ["1", "2", "3"]
    assert not [k for k in got if k[0] == "ds_ops_incident_top_metric_share" and dict(k[1])["model"] == "calm"]
    assert got[("ds_ops_incident_open", (("model", "m"),))] == 1
    assert got[("ds_ops_incident_open", (("model", "calm"),))] == 0
    assert got[("ds_ops_incident_critical", (("model", "m"),))] == 1
    assert got[("ds_ops_incident_critical", (("model", "warm"),))] == 0
    assert got[("ds_ops_incident_open", (("model", "warm"),))] == 1
    assert got[("ds_ops_scored_rows_total", (("model", "m"),))] == 3000
    assert got[("ds_ops_incidents_total", (("model", "calm"),))] == 2
    assert got[("ds_ops_critical_incidents_total", (("model", "m"),))] == 1


def test_results_past_their_age_go_but_state_json_the_newest_and_hidden_ones_stay(tmp_path):
    mdir = tmp_path / "m"
    old = time.time() - 40 * 86400
    for i, name in enumerate(["20261001T000000Z-a", "20261002T000000Z-b", "20261201T000000Z-c"]):
        (mdir / name).mkdir(parents=True)
        (mdir / name / "rows.csv").write_bytes(b"x" * 100)
        if i < 2:
            os.utime(mdir / name, (old + i, old + i))
    (mdir / ".tmp-job").mkdir()
    os.utime(mdir / ".tmp-job", (old, old))
    (mdir / "state.json").write_text("{}")
    os.utime(mdir / "state.json", (old, old))
    assert prune_results(str(tmp_path), 30, 0) == ["m/20261001T000000Z-a", "m/20261002T000000Z-b"]
    assert sorted(os.listdir(mdir)) == [".tmp-job", "20261201T000000Z-c", "state.json"]
    assert prune_results(str(tmp_path), 30, 1) == [], "the newest result is never removed"


def test_results_beyond_the_byte_limit_go_oldest_first_per_model(tmp_path):
    for model in ("a", "b"):
        for i in range(3):
            d = tmp_path / model / f"2026120{i}T000000Z-j{i}"
            d.mkdir(parents=True)
            (d / "rows.csv").write_bytes(b"x" * 100)
            os.utime(d, (1000 + i, 1000 + i))
    assert prune_results(str(tmp_path), 0, 150, now=2000) == ["a/20261200T000000Z-j0", "a/20261201T000000Z-j1",
                                                               "b/20261200T000000Z-j0", "b/20261201T000000Z-j1"]
    assert prune_results(str(tmp_path), 0, 0) == []


def test_top_metrics_read_as_names_with_their_shares():
    assert top_text(SUMMARY["top_metrics"][:2]) == "disk_util 60%, cpu 30%" and top_text([]) == "none"


def test_a_state_json_that_names_its_top_metrics_and_time_needs_no_summary(tmp_path):
    top = [{"metric": "disk_util", "share": 0.7}]
    write_model(tmp_path, "m", dict(STATE, top_metrics=top, scored_at="2026-12-01T00:00:00.000000Z"))
    v = model_views(str(tmp_path))["m"]
    assert v["top_metrics"] == top and v["scored_at"] == 1796083200.0


class Journal:
    """Records what the scoring slot journals (event, priority, fields) as the daemon's EventLog is called."""

    def __init__(self):
        self.entries = []

    def event(self, event, message, *, priority=6, **fields):
        self.entries.append(dict(fields, event=event, message=message, priority=priority))


def report(tmp_path, summary: dict, *, fail_after: int | None = None, views: dict | None = None) -> list[dict]:
    """Run a scored file's summary through the daemon's ScoreSlot._report, for job j1 whose
    directory is tmp_path/spool/processing/j1 (kept between calls, as a restart finds it); return
    the journal's entries. ``fail_after``: the journal dies (as the daemon would, SIGKILLed) when
    asked for that many more entries."""
    from types import SimpleNamespace

    from opt_ds_ops.config.conffile import Config, with_overrides
    from opt_ds_ops.daemon.duties import Duties
    from opt_ds_ops.daemon.scoreslot import ScoreSlot
    from opt_ds_ops.spool import Spool

    cfg = with_overrides(Config(), {"scoring.results_dir": str(tmp_path / "scores"), "models_dir": str(tmp_path)})
    (tmp_path / "spool" / "processing" / "j1").mkdir(parents=True, exist_ok=True)
    slot = ScoreSlot.__new__(ScoreSlot)
    log = Journal() if fail_after is None else DyingJournal(fail_after)
    slot.d = SimpleNamespace(cfg=cfg, log=log, metrics=MetricsWriter(str(tmp_path), str(tmp_path)),
                             spool=Spool(str(tmp_path / "spool")))
    slot.d.metrics.scores = dict(views or {})
    slot.d.duties = Duties(slot.d)
    try:
        slot._report({"job_id": "j1", "dataset": "m.csv"}, summary)
    except Killed:
        return slot.d.log.entries
    assert slot.d.metrics.scores["m"]["rows_total"] == summary["rows_scored"]  # the metrics are updated either way
    return slot.d.log.entries


class Killed(BaseException):
    """The daemon's death in the middle of its report."""


class DyingJournal(Journal):
    def __init__(self, entries: int):
        super().__init__()
        self.left = entries

    def event(self, event, message, **fields):
        if self.left == 0:
            raise Killed
        self.left -= 1
        super().event(event, message, **fields)


EVENTS = [{"event": "incident-closed", "incident": 2, "row": 9, "version": "v1", "duration_s": 60.0, "rows": 2,
           "rows_flagged": 2, "peak_score": 2.0, "severity": "critical", "reason": "reset", "top_metrics": []},
          {"event": "incident-opened", "incident": 3, "row": 12, "started_row": 12, "threshold": 0.5, "score": 0.9,
           "severity": "warning", "top_metrics": []}]
SCORED = dict(SUMMARY, version="v2", rows=20, flagged=8, rows_scored=3020, rows_flagged=48, incidents=3,
              events=EVENTS, resets=["the model's current version changed from v1 to v2: the series starts again"],
              notes=["rows sorted by time"], replayed=False)


def test_a_replayed_summary_journals_no_anomaly_and_no_reset_again(tmp_path):
    """Said once: a summary reported whole and then replayed (the daemon killed before it
    removed the job) says nothing again; the reset comes before the events it caused."""
    assert [e["event"] for e in report(tmp_path, SCORED)] == ["score-reset", "incident-closed", "incident-opened",
                                                             "scored"]
    assert [e["event"] for e in report(tmp_path, dict(SCORED, replayed=True))] == []


def test_a_summary_the_daemon_died_on_is_said_after_the_restart_only_where_it_was_not(tmp_path):
    """Said at least once and at most once: killed after two of the four entries, the replay
    after the restart says the other two, each once."""
    first = report(tmp_path, SCORED, fail_after=2)
    again = report(tmp_path, dict(SCORED, replayed=True))
    print(f"\nbefore the kill: {[e['event'] for e in first]}; after the restart: {[e['event'] for e in again]}")
    assert [e["event"] for e in first] == ["score-reset", "incident-closed"]
    assert [e["event"] for e in again] == ["incident-opened", "scored"]
    assert "(replayed)" in again[-1]["message"]


def test_a_summary_scored_before_a_kill_that_came_before_any_entry_is_said_whole_after_the_restart(tmp_path):
    """The job wrote its results (state.json: scored) and the daemon died before it journaled
    anything: the replay says every anomaly, where it said none before."""
    assert report(tmp_path, SCORED, fail_after=0) == []
    again = report(tmp_path, dict(SCORED, replayed=True))
    print(f"\nafter the restart: {[e['event'] for e in again]}")
    assert [e["event"] for e in again] == ["score-reset", "incident-closed", "incident-opened", "scored"]


def test_only_resets_are_journaled_as_score_reset_the_files_notes_go_in_the_scored_line(tmp_path):
    entries = report(tmp_path, SCORED)
    assert [e["reason"] for e in entries if e["event"] == "score-reset"] == [SCORED["resets"][0]]
    assert "rows sorted by time" in entries[-1]["message"]


def test_an_incident_closed_by_a_new_version_is_journaled_with_the_version_that_flagged_it(tmp_path):
    entries = [e for e in report(tmp_path, SCORED) if e["event"].startswith("incident-")]
    assert entries[0]["version"] == "v1" and "(2 rows flagged, version v1)" in entries[0]["message"]
    assert "critical incident 2 closed (the series was reset)" in entries[0]["message"], entries[0]["message"]
    assert entries[1]["version"] == "v2"


def test_an_incident_is_journaled_at_the_priority_of_its_severity(tmp_path):
    """A critical incident opens at PRIORITY crit (2), a warning one at warning (4): an operator's
    `journalctl -p crit` shows only what is critical."""
    crit = dict(SCORED, resets=[], events=[dict(EVENTS[1], severity="critical")])
    (opened, _scored) = report(tmp_path / "crit", crit)
    assert opened["priority"] == 2 and opened["severity"] == "critical" and opened["incident"] == 3
    assert opened["message"].startswith("m: critical incident 3 opened at row 12"), opened["message"]
    (opened, _scored) = report(tmp_path / "warn", dict(crit, events=[EVENTS[1]]))
    assert opened["priority"] == 4 and "warning incident 3 opened" in opened["message"]


def test_a_scored_file_prunes_only_its_own_models_results(tmp_path):
    from types import SimpleNamespace

    from opt_ds_ops.config.conffile import Config, with_overrides
    from opt_ds_ops.daemon.scoreslot import ScoreSlot

    results = tmp_path / "scores"
    old = time.time() - 40 * 86400
    for name in ("a", "b"):
        for k in range(3):
            (results / name / f"2026110{k}T000000.000000Z-j{k}").mkdir(parents=True)
            os.utime(results / name / f"2026110{k}T000000.000000Z-j{k}", (old, old))
    cfg = with_overrides(Config(), {"scoring.results_dir": str(results), "models_dir": str(tmp_path)})
    slot = ScoreSlot.__new__(ScoreSlot)
    slot.d, slot._swept = SimpleNamespace(cfg=cfg, log=Journal()), time.monotonic()
    slot.retention("a")  # the start's sweep was just done: only a's
    assert len(os.listdir(results / "a")) == 1 and len(os.listdir(results / "b")) == 3
    slot._swept = None
    slot.retention("a")  # the sweep (start, then hourly): every model's
    assert len(os.listdir(results / "a")) == 1 and len(os.listdir(results / "b")) == 1


def test_a_state_json_over_a_mebibyte_still_shows_its_model(tmp_path):
    big = dict(STATE, context=[[0.123456789] * 4096] * 40)  # a windowed model with many columns
    write_model(tmp_path, "m", big)
    assert (tmp_path / "m" / "state.json").stat().st_size > 1 << 20
    assert model_views(str(tmp_path))["m"]["rows_total"] == 3000


def test_an_incident_of_headerless_data_ends_after_its_rows_and_names_only_metrics_with_a_share(tmp_path):
    untimed = dict(SCORED, resets=[], events=[{"event": "incident-closed", "incident": 1, "row": 570, "rows": 44,
                                               "rows_flagged": 40, "duration_s": None, "peak_score": 69.4,
                                               "severity": "critical", "reason": "recovered", "top_metrics": []}])
    (ended, *_rest) = report(tmp_path / "untimed", untimed)
    assert "after 44 rows," in ended["message"] and "?" not in ended["message"], ended["message"]
    timed = dict(untimed, events=[dict(untimed["events"][0], duration_s=2640.0)])
    assert "after 44 rows, 2640 s," in report(tmp_path / "timed", timed)[0]["message"]
    long = dict(untimed, events=[dict(untimed["events"][0], rows=173, duration_s=10320.0)])  # replay_month's longest
    assert "after 173 rows, 10320 s (2.9 h)," in report(tmp_path / "long", long)[0]["message"]
    shares = [{"metric": "30", "share": 0.99}, {"metric": "34", "share": 0.001}, {"metric": "5", "share": 0.0}]
    assert top_text(shares) == "30 99%"
    assert top_text([{"metric": "5", "share": 0.0}]) == "none"


def test_a_summary_scored_before_incidents_and_replayed_after_the_upgrade_is_still_said(tmp_path):
    """The old daemon scored a chunk and was stopped before it journaled its anomaly; the upgraded
    daemon replays the kept summary: its anomaly-started/-ended events are said (as incident
    entries), not dropped."""
    old = dict(SCORED, resets=[], replayed=True,
               events=[{"event": "anomaly-ended", "row": 9, "version": "v1", "rows": 4, "duration_s": 180.0,
                        "started_row": 6, "peak_score": 2.0, "reason": "recovered", "top_metrics": []},
                       {"event": "anomaly-started", "row": 12, "time": "2026-12-01T00:12:00Z", "threshold": 0.5,
                        "score": 0.9, "top_metrics": [{"metric": "cpu", "share": 0.9}]}])
    entries = report(tmp_path, old)
    assert [e["event"] for e in entries] == ["incident-closed", "incident-opened", "scored"]
    assert entries[1]["message"].startswith("m: warning anomaly (scored before incidents) opened at row 12 "), entries[1]
    assert "cpu 90%" in entries[1]["message"] and "after 4 rows, 180 s" in entries[0]["message"]


def test_said_keys_count_only_for_the_summary_they_were_said_of(tmp_path):
    """A job killed after part of its report, then scored anew (its kept summary gone): the new
    summary's entries are all said, the old keys do not hide them."""
    report(tmp_path, dict(SCORED, result_dir="/r/first"), fail_after=2)
    again = report(tmp_path, dict(SCORED, result_dir="/r/second"))
    assert [e["event"] for e in again] == ["score-reset", "incident-closed", "incident-opened", "scored"]


def test_the_back_off_of_a_model_that_failed_for_months_is_a_day_not_an_overflow():
    from opt_ds_ops.config.conffile import RetrainConfig
    from opt_ds_ops.daemon.retrainer import next_try_s

    assert next_try_s(RetrainConfig(every=""), {"failed_at_s": 0.0, "failures": 5000}) == 86400.0
    assert next_try_s(RetrainConfig(every="7d"), {"failed_at_s": 0.0, "failures": 5000}) == 86400.0


def test_a_failed_retraining_backs_off_hours_not_a_retrain_every():
    """retrain.every 1s (or any interval shorter than the chunks'): before, the next chunk queued
    the failed retraining again; it waits the back-off. And retrain.every 7d no longer holds the
    next try back for a week after a failure (a drift retraining after a shift, its history all
    flagged): one hour, doubled after each failure in a row, a day at most."""
    from opt_ds_ops.config.conffile import RetrainConfig
    from opt_ds_ops.daemon.retrainer import next_try_s

    assert next_try_s(RetrainConfig(every="1s"), {"failed_at_s": 0.0, "failures": 1}) == 3600.0
    assert next_try_s(RetrainConfig(every="1s"), {"failed_at_s": 0.0, "failures": 3}) == 4 * 3600.0
    assert next_try_s(RetrainConfig(every="7d"), {"failed_at_s": 0.0, "failures": 1}) == 3600.0


def test_the_back_off_counts_the_datas_clock_where_the_failure_and_the_rows_have_times():
    """A replay fed a day of data in seconds: the back-off after a failure is waited out in data
    time (the failure's data_s, the newest scored row's time when it was queued), not wall time;
    without a data time it is the wall clock's."""
    from opt_ds_ops.daemon.retrainer import backing_off

    now = time.time()
    failure = {"failed_at_s": now, "failures": 2, "data_s": 1_800_000_000.0}  # two in a row: 2 hours
    assert backing_off(failure, now, 1_800_000_000.0 + 7199)
    assert not backing_off(failure, now, 1_800_000_000.0 + 7200)  # two hours of data later, at once
    assert backing_off(dict(failure, data_s=None), now + 7199, 1_800_000_000.0 + 10**6)  # no data time: the wall's
    assert not backing_off(dict(failure, data_s=None), now + 7200, None)
    assert not backing_off(None, now, None)


def test_retrain_every_counts_the_datas_clock_where_the_rows_have_times():
    """A replay or a backfill fed a week in a minute: due by the data's own clock (the newest row a
    version was made from to the scored file's last row), not by how fast it was fed."""
    from opt_ds_ops.config.conffile import RetrainConfig
    from opt_ds_ops.daemon.retrainer import data_end_s, due

    day, now = 86400.0, time.time()
    rcfg = RetrainConfig(every="2d")
    dropped = {"dataset": {"time": {"first": "2026-11-01T00:00:00.000000Z", "last": "2026-11-08T00:00:00.000000Z"}}}
    trained_data = data_end_s(dropped)
    assert trained_data == 1794096000.0  # 2026-11-08T00:00:00Z
    retrained = {"dataset": dropped["dataset"], "excluded": {"held_back": {"to_time_s": trained_data + 3 * day}}}
    assert data_end_s(retrained) == trained_data + 3 * day  # its history's newest row, not its parent's file
    assert data_end_s({"dataset": dropped["dataset"], "excluded": {"held_back": {"to_time_s": None}}}) is None
    chunk = {"last_time": "2026-11-09T12:00:00.000000Z"}  # 1.5 days of data after the training's last row
    assert due(rcfg, chunk, now - 30 * day, now, trained_data) is None  # the wall clock says a month: not due
    later = {"last_time": "2026-11-10T00:00:00.000000Z"}
    trigger, why = due(rcfg, later, now, now, trained_data)  # trained a second ago by the wall clock: due
    assert trigger == "every" and "by the data's clock" in why and "2.0 d" in why, why
    untimed = {"last_time": None}
    assert due(rcfg, untimed, now - 3 * day, now, trained_data)[0] == "every"  # no times: the wall clock
    assert due(rcfg, untimed, now - day, now, trained_data) is None


def test_rows_from_the_future_do_not_stop_retrain_every():
    """A far-future row (a clock glitch, or a member's version that lost the name) counted as the
    newest data would have made every later file look older: retraining stopped for good."""
    from opt_ds_ops.daemon.retrainer import data_end_s, due, last_trained
    from opt_ds_ops.config.conffile import RetrainConfig

    now = time.time()
    far = {"last_time": "2262-01-01T00:00:00.000000Z"}
    assert due(RetrainConfig(every="1d"), far, now, now, now - 2 * 86400.0)[0] == "every"  # capped at now
    assert data_end_s({"dataset": {"time": {"last": "2262-01-01T00:00:00.000000Z"}}}) > now
    assert last_trained("/nonexistent", "m") == (None, None)


def test_the_metrics_drop_a_model_whose_series_was_removed(tmp_path):
    """``rm -r RESULTS/NAME`` (or ``ds-ops models rm``) while the daemon runs: before, its last
    figures stayed in ds_ops.prom until a restart, and DsOpsScoringStalled fired for it forever."""
    import shutil
    from types import SimpleNamespace

    from opt_ds_ops.config.conffile import Config, with_overrides
    from opt_ds_ops.daemon.duties import Duties

    results, prom = tmp_path / "scores", tmp_path / "prom"
    prom.mkdir()
    for name in ("kept", "gone"):
        write_model(results, name, STATE)
    cfg = with_overrides(Config(), {"scoring.results_dir": str(results), "models_dir": str(tmp_path)})
    m = MetricsWriter(str(prom), str(tmp_path))
    m.scores = model_views(str(results))
    d = SimpleNamespace(cfg=cfg, metrics=m, watcher=SimpleNamespace(queued=lambda: 0), pending=[], paused_until=0.0,
                        jobs={}, records={}, log=Journal(), metrics_written_at=0.0)
    shutil.rmtree(results / "gone")
    Duties(d).write_metrics()
    text = (prom / "ds_ops.prom").read_text()
    assert 'model="kept"' in text and 'model="gone"' not in text
    # the incident "gone" had open is said closed, once, as every other incident is; "kept"'s stays open
    (closed,) = d.log.entries
    assert closed["event"] == "incident-closed" and closed["reason"] == "removed" and closed["model"] == "gone"
    assert closed["incident"] == 2 and closed["severity"] == "critical" and closed["priority"] == 4
    assert closed["message"].startswith("gone: critical incident 2 closed: the model's scoring series was removed")
    d.metrics_written_at = 0.0
    Duties(d).write_metrics()
    assert len(d.log.entries) == 1


def test_a_series_removed_and_made_again_before_the_check_still_says_the_old_incident_closed(tmp_path):
    """``rm -r RESULTS/NAME`` (or ``models rm`` and a new model of the name) and the next chunk
    before the daemon's minute check: the fresh series' first file says the old incident closed."""
    results = tmp_path / "scores"
    old = model_view("m", dict(STATE, rows_scored=3000))
    assert old["active"] and old["incident"] == 2
    write_model(results, "m", dict(STATE, rows_scored=50, rows_flagged=0, incidents=0,
                                   incident={"recent": [], "open": None, "opened": 0}), dict(SUMMARY, active=False))
    entries = report(tmp_path, dict(SUMMARY, active=False, rows_scored=50, events=[]), views={"m": old})
    closed = [e for e in entries if e["event"] == "incident-closed"]
    assert len(closed) == 1 and closed[0]["reason"] == "removed" and closed[0]["incident"] == 2
    # a series that goes on (its rows grow) says nothing of the kind
    write_model(tmp_path / "b" / "scores", "m", dict(STATE, rows_scored=3050))
    again = report(tmp_path / "b", dict(SUMMARY, rows_scored=3050, events=[]), views={"m": old})
    assert not [e for e in again if e["event"] == "incident-closed"]


def test_metrics_off_still_say_the_removed_series_incident_closed(tmp_path):
    import shutil
    from types import SimpleNamespace

    from opt_ds_ops.config.conffile import Config, with_overrides
    from opt_ds_ops.daemon.duties import Duties

    results = tmp_path / "scores"
    write_model(results, "gone", dict(STATE, incident=dict(STATE["incident"], open=dict(OPEN, severity="warning"))))
    m = MetricsWriter(str(tmp_path / "no-such-dir"), str(tmp_path))
    m.scores = model_views(str(results))
    d = SimpleNamespace(cfg=with_overrides(Config(), {"scoring.results_dir": str(results), "models_dir": str(tmp_path)}),
                        metrics=m, log=Journal(), metrics_written_at=0.0)
    shutil.rmtree(results / "gone")
    Duties(d).write_metrics()
    assert [(e["event"], e["severity"], e["priority"]) for e in d.log.entries] == [("incident-closed", "warning", 4)]


def test_a_failed_retraining_waits_its_back_off_after_the_newest_scored_row_not_the_models_data_end(
        tmp_path, monkeypatch):
    """Review of the data-clock back-off: the queued retraining recorded the current version's data
    end (days old for an `every` retraining) instead of the newest scored row, so after a failure
    every next chunk queued it again. The daemon's hooks in order: queue (on_scored), failure
    (on_failed), the next chunks (on_scored): nothing is queued until an hour of data has passed."""
    from types import SimpleNamespace

    from opt_ds_ops.config.conffile import Config, with_overrides
    from opt_ds_ops.daemon import retrainer as rt

    cfg = with_overrides(Config(), {"scoring.results_dir": str(tmp_path / "scores"), "models_dir": str(tmp_path / "m"),
                                    "retrain.every": "7d"})
    (tmp_path / "scores" / "m1").mkdir(parents=True)
    (tmp_path / "scores" / "m1" / "history.npz").write_bytes(b"x")
    events = []
    d = SimpleNamespace(cfg=cfg, records={}, log=SimpleNamespace(event=lambda *a, **k: events.append((a, k))))
    t0 = 1_790_000_000.0
    queued = []
    monkeypatch.setattr(rt, "last_trained", lambda models_dir, name: (t0, t0))  # data end: t0
    monkeypatch.setattr(rt, "current_metadata", lambda models_dir, name: {"version": "v1"})
    monkeypatch.setattr(rt.Retrainer, "queue", lambda self, name, hist, trigger, why, regime=None, data_s=None:
                        queued.append({"model": name, "data_s": data_s, "job_id": f"j{len(queued)}"}) or f"j{len(queued)}")
    r = rt.Retrainer(d)

    def summary(at: float) -> dict:
        return {"model": "m1", "version": "v1", "last_time": datetime.fromtimestamp(at, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")}

    assert r.on_scored(summary(t0 + 8 * 86400))  # due: 8 days of data since the version's data end
    assert queued[-1]["data_s"] == t0 + 8 * 86400  # the newest scored row, not the version's data end
    r.on_failed(dict(queued[-1], kind="retrain"), "0 normal rows")
    for minutes in (1, 30, 59):
        assert r.on_scored(summary(t0 + 8 * 86400 + 60 * minutes)) is None, minutes
    assert len(queued) == 1
    assert r.on_scored(summary(t0 + 8 * 86400 + 3600))  # an hour of data later: tried again
    said = [a[1] for a, _ in events if a[0] == "retrain-backoff"]
    assert said and "not queued before rows of 2026-" in said[0], said  # the data time the next try waits for
