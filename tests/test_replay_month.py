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
