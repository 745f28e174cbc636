"""The month replay, small: scripts/replay_month.py on three days of the bundled SMD
machine-1-2 (a week to train, then 12-hour chunks through the real daemon with retrain.every
on). The full month is run by hand (docs/retraining.md, "A month, replayed")."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO


def test_a_replay_retrains_by_retrain_every_judges_each_challenger_and_keeps_the_invariants(tmp_path):
    out = tmp_path / "figures.json"
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "replay_month.py"), "--smd", str(REPO / "data" / "smd"),
                        "--days", "3", "--every", "1d", "--max-steps", "300", "--root", str(tmp_path / "root"),
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
    assert "ds-ops status" in r.stdout and "next retrain once the data reaches 20" in r.stdout and "gate: " in r.stdout
    assert "      retrained (every): " in r.stdout and " history rows, " in r.stdout  # ds-ops models list says so


def test_the_operator_figures_count_pages_by_where_an_alert_starts():
    """Paged: an alert starts inside the labelled segment or at most an hour before it; a segment
    that falls inside an alert which began hours earlier pages nobody, but that alert is no false one."""
    import numpy as np

    sys.path.insert(0, str(REPO / "scripts"))
    from replay_month import operator_figures

    n = 1440  # one day of 1-minute rows
    labels, flags = np.zeros(n, bool), np.zeros(n, bool)
    labels[100:150] = labels[600:620] = True
    flags[80:120] = True    # starts 20 minutes before the first segment: a page
    flags[300:310] = True   # touches no label: a false alarm
    flags[400:700] = True   # began 200 minutes before the second segment: covers it, pages nobody
    o = operator_figures(flags, labels, 60.0)
    assert (o["alerts"], o["false_alarms"], o["labelled"], o["paged"]) == (3, 1, 2, 1), o
    assert o["false_alarms_per_day"] == 1.0 and o["paged_share"] == 0.5
    assert o["normal_in_alarm"] == round((20 + 10 + 280) / (n - 70), 4)
    five_min = operator_figures(flags[::5], labels[::5], 300.0)  # ASD's rows: an hour is 12 rows
    assert five_min["days"] == 1.0 and five_min["paged"] == 1
