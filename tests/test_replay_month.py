"""The month replay, small: scripts/replay_month.py on three days of the bundled SMD
machine-1-2 (a week to train, then 12-hour chunks through the real daemon with retrain.every
on). The full month is run by hand (docs/retraining.md, "A month, replayed")."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO


@pytest.mark.slow  # a long run: see the marker in pyproject.toml
def test_a_replay_retrains_by_retrain_every_judges_each_challenger_and_keeps_the_invariants(tmp_path):
    out = tmp_path / "figures.json"
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "replay_month.py"), "--smd", str(REPO / "data" / "smd"),
                        "--days", "3", "--every", "1d", "--max-steps", "300",
                        "--set", "retrain.drift_rate=0", "--root", str(tmp_path / "root"),
                        "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=170)
    print(r.stdout[-3000:])
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    figures = doc["figures"]
    assert doc["failures"] == [] and figures["chunks"] == 6 and figures["rows_scored"] == 3 * 1440
    retrains = figures["retrains"]
    assert len(retrains) >= 2, retrains  # retrain.every fires again after the first challenger, kept or refused
    for x in retrains:
        assert x["trigger"] == "every" and isinstance(x["challenger"], float) and isinstance(x["champion"], float), x
        assert x["left_out"] > 0 and x["trained_flagged"] == 0, x  # the flagged segments stayed out
        # the gate seeded the challenger's alarm budget from the job's copy of the history (the worker passed it)
        assert isinstance(x["seeded_factor"], float) and x["seeded_factor"] >= 1, x
    assert "ds-ops status" in r.stdout and "next retrain once the data reaches 20" in r.stdout and "gate: " in r.stdout
    assert "      retrained (every): " in r.stdout and " history rows, " in r.stdout  # ds-ops models list says so


@pytest.mark.slow  # a long run: see the marker in pyproject.toml
def test_an_upgrade_replay_trains_the_first_version_on_the_old_conffile_and_the_rest_on_the_new(tmp_path):
    root = tmp_path / "root"
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "replay_month.py"), "--smd", str(REPO / "data" / "smd"),
                        "--days", "1.5", "--every", "1d", "--max-steps", "300", "--set", "retrain.drift_rate=0",
                        "--before-set", "train.difference_term=max", "--root", str(root),
                        "--json", str(tmp_path / "figures.json")], cwd=REPO, capture_output=True, text=True, timeout=170)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert "the first model trained before an upgrade, with train.difference_term=max" in r.stdout
    assert (root / "daemon.log").read_text().count("ds-trainer ready") == 2  # stopped, started on the new conffile
    assert "difference_term: max" in (root / "trainer-before.yaml").read_text()
    assert "difference_term" not in (root / "trainer.yaml").read_text()
    versions = sorted(p for p in (root / "models" / "machine-1-2").iterdir() if p.name[0].isdigit())
    terms = [json.loads((v / "metadata.json").read_text())["window_error"] for v in versions]
    # the stored term: "max", or "window" (the mean over the level and its change: difference_term mean)
    assert terms[0] == "max" and len(terms) >= 2 and set(terms[1:]) == {"window"}, terms


def test_the_operator_figures_count_pages_by_where_an_incident_opens():
    """Paged: an incident opens inside the labelled segment or at most an hour before it; a segment
    that falls inside an incident which opened hours earlier pages nobody, but that incident is no
    false page. Normal rows in alarm: those from an incident's first to its last flagged row."""
    import numpy as np

    sys.path.insert(0, str(REPO / "scripts"))
    from replay_month import operator_figures

    n = 1440  # one day of 1-minute rows
    labels = np.zeros(n, bool)
    labels[100:150] = labels[600:620] = True
    incidents = [{"start": 80, "opened": 80, "end": 119},     # opens 20 minutes before the first segment: a page
                 {"start": 300, "opened": 300, "end": 309},   # touches no label: a false page
                 {"start": 400, "opened": 400, "end": 699}]   # opened 200 minutes before the second: pages nobody
    o = operator_figures(incidents, labels, 60.0)
    assert (o["pages"], o["false_pages"], o["labelled"], o["paged"]) == (3, 1, 2, 1), o
    assert o["false_pages_per_day"] == 1.0 and o["paged_share"] == 0.5
    assert o["normal_in_alarm"] == round((20 + 10 + 280) / (n - 70), 4)
    fifths = [{k: v // 5 for k, v in inc.items()} for inc in incidents]
    five_min = operator_figures(fifths, labels[::5], 300.0)  # ASD's rows: an hour is 12 rows
    assert five_min["days"] == 1.0 and five_min["paged"] == 1


def test_the_incidents_are_read_from_the_results_rows_and_events(tmp_path):
    """An incident's rows: rows.csv's incident column, from its first to its last flagged row,
    with the unflagged rows between them that the chunk which wrote them could not yet know were
    its own; the row that opened it: its incident-opened event."""
    import numpy as np

    sys.path.insert(0, str(REPO / "scripts"))
    from replay_month import START, incidents_in, iso, operator_figures, result_incidents

    def chunk(name: str, first: int, flags: list[int], incident: list[int], events: list[dict]) -> None:
        d = tmp_path / name
        d.mkdir()
        lines = ["row,time,score,anomaly,incident,top_metrics"]
        lines += [f"{first + i},{iso(START + 60 * (first + i))},{2.0 if f else 0.5},{f},{k or ''},{'m1' if f else ''}"
                  for i, (f, k) in enumerate(zip(flags, incident))]
        (d / "rows.csv").write_text("\n".join(lines) + "\n")
        (d / "summary.json").write_text(json.dumps({"events": events}))

    t = lambda row: iso(START + 60 * row)  # noqa: E731
    chunk("a", 0, [0, 1, 1, 0, 0], [0, 1, 1, 0, 0],
          [{"event": "incident-opened", "incident": 1, "row": 1, "time": t(1), "started_row": 1, "started_time": t(1),
            "severity": "warning"}])
    chunk("b", 5, [1, 0, 0, 0, 0], [1, 0, 0, 0, 0], [])  # rows 3 and 4 turned out to be inside incident 1
    (tmp_path / ".tmp-c").mkdir()  # a result being written: not read
    found = result_incidents(tmp_path)
    assert found == {1: {"start": START + 60, "end": START + 300, "opened": START + 60, "severity": "warning"}}, found
    assert incidents_in(found, START, 10, 60.0) == [{"start": 1, "end": 5, "opened": 1, "severity": "warning",
                                                     "open": False}]
    assert incidents_in(found, START + 180, 7, 60.0)[0] | {"severity": None} == {  # clipped; opened before it
        "start": 0, "end": 2, "opened": -2, "severity": None, "open": False}
    assert incidents_in(found, START + 360, 4, 60.0) == []
    o = operator_figures(incidents_in(found, START, 10, 60.0), np.zeros(10, bool), 60.0)
    assert o["pages"] == 1 and o["false_pages"] == 1 and o["normal_in_alarm"] == 0.5 and o["paged_share"] is None
