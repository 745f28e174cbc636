"""A change of regime through the real daemon with the shipped defaults (the score of levels alone):
two metrics of a machine move to new levels and stay there. The daemon says so once, naming the
metrics with their old and new levels (journal, summary, status, metrics), no incident stays open
on the new regime, the model is retrained on the new regime's rows after retrain.regime_learn_s
and promoted by the gate, and a real incident injected after that is paged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timezone

import numpy as np

from conftest import REPO
from daemon_kit import Daemon, base_env, spool_dir, versions, write_config
from opt_ds_ops.store.versions import current_version, read_metadata

T0 = 1_790_000_000.0  # 2026-09-21: one row a minute from here
CHUNK = 720  # 12 hours of rows
NAMES = [f"m{j}" for j in range(38)]


def write_rows(path, rows: np.ndarray, first: int) -> None:
    """rows as a CSV with a time column (one row a minute from T0 + first minutes), by rename."""
    part = path.with_name(path.name + ".part")
    with open(part, "w") as f:
        f.write("time," + ",".join(NAMES) + "\n")
        for i, r in enumerate(rows):
            t = datetime.fromtimestamp(T0 + 60 * (first + i), timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
            f.write(t + "," + ",".join(f"{v:.6g}" for v in r) + "\n")
    os.rename(part, path)


def test_a_level_shift_is_said_once_learned_and_a_real_incident_after_it_pages(tmp_path, smd_rows):
    # the shipped conffile's scoring and retraining (only paths and the spool's pace are the test's),
    # the change of regime on as shipped, with the score of levels alone (before round 10): the
    # shipped score reads each metric's change too, pages this shift's onset (33 of the first 720 rows
    # flagged, incidents of 2-16 rows) and holds no incident open for 6 hours, so it never needs a
    # change of regime (tests/daemon/test_daemon_threshold.py: the shipped score through a shift).
    # The levels score holds the shift in alarm: the mechanism is shown on it.
    conf = write_config(tmp_path, shipped_training=True, scan_interval_s=0.5,
                        train_keys=("input_differences: false", "score_window: 30"),
                        extra=["scoring:", f"  results_dir: {tmp_path / 'scores'}", "  regime_after_s: 21600"])
    # a quiet stretch of machine-1-2: a model of rows 12000..15000 flags under 1 % of the 8,640 after them
    steady = smd_rows[12000:15000]
    std = steady.std(axis=0) + 1e-3
    before = smd_rows[15000:15000 + 4 * CHUNK]  # two days scored as they were
    regime = smd_rows[15000 + 4 * CHUNK:15000 + 11 * CHUNK].copy()  # then three and a half days where:
    regime[:, 3] += 10 * std[3]  # two metrics move for good
    regime[:, 20] -= 8 * std[20]
    d = Daemon(conf)
    summaries = []

    def score(rows: np.ndarray, first: int) -> dict:
        write_rows(spool_dir(tmp_path, "score") / "m.csv", rows, first)
        d.wait_until(lambda: d.log().count(" scored with version ") > len(summaries) or "failed in stage" in d.log(),
                     "the chunk to be scored")
        assert "failed in stage" not in d.log(), d.log()
        results = sorted(p for p in (tmp_path / "scores" / "m").iterdir() if p.is_dir() and not p.name.startswith("."))
        summaries.append(json.loads((results[-1] / "summary.json").read_text()))
        got = summaries[-1]
        print(f"chunk {len(summaries)}: {got['flagged']} of {got['rows']} flagged by {got['version']}; events "
              + ", ".join(f"{e['event']} {e.get('incident') or e.get('regime')} row {e['row']}"
                          + (f" ({e.get('rows_flagged')} flagged)" if e['event'] == 'incident-closed' else "")
                          for e in got["events"]))
        return got

    try:
        d.wait_until(lambda: "ds-trainer ready" in d.log(), "the daemon to be ready", timeout_s=120)
        write_rows(spool_dir(tmp_path, "incoming") / "m.csv", steady, 0)
        d.wait_until(lambda: len(versions(tmp_path, "m")) == 1, "the first model")
        first = versions(tmp_path, "m")[0]
        at = steady.shape[0]
        for k in range(4):
            s = score(before[k * CHUNK:(k + 1) * CHUNK], at + k * CHUNK)
            assert s["regime"] is None and s["flagged"] < 0.05 * CHUNK, s["flagged"]
        at += before.shape[0]
        s = score(regime[:CHUNK], at)  # 12 hours of the new regime
        said = [e for e in s["events"] if e["event"] == "regime-changed"]
        assert len(said) == 1, s["events"]
        moved = {m["metric"]: m for m in said[0]["metrics"]}
        assert {"m3", "m20"} <= set(moved), moved
        assert moved["m3"]["after"] - moved["m3"]["before"] > 8 * std[3]
        assert moved["m20"]["after"] - moved["m20"]["before"] < -6 * std[20]
        assert said[0]["row"] - said[0]["started_row"] + 1 >= 360  # 6 hours of rows, not before
        assert not s["active"], ("an incident is still open on the new regime", s["events"])
        assert s["regime"]["metrics"][:2] and not s["regime"]["learn_due"]
        line = [x for x in d.log().splitlines() if ": change of regime at " in x]
        assert len(line) == 1 and "m3 " in line[0] and " -> " in line[0], line
        status = subprocess.run([sys.executable, "-m", "opt_ds_ops.cli", "status", "--config", str(conf)],
                                capture_output=True, text=True, cwd=REPO, env=base_env(), timeout=60)
        assert "CHANGE OF REGIME since" in status.stdout and "not yet learned" in status.stdout, status.stdout
        for k in range(1, 5):  # two more days of the new regime: learned after retrain.regime_learn_s (2 days)
            s = score(regime[k * CHUNK:(k + 1) * CHUNK], at + k * CHUNK)
            assert not [e for e in s["events"] if e["event"] == "regime-changed"], "said twice"
            assert not [e for e in s["events"] if e["event"] == "incident-opened" and e["rows_flagged"] > 60], s["events"]
        d.wait_until(lambda: "retraining queued" in d.log(), "the retraining on the new regime")
        assert "(regime): a change of regime (m" in d.log(), d.log()
        d.wait_until(lambda: len(versions(tmp_path, "m")) == 2 and not any(spool_dir(tmp_path, "processing").iterdir()),
                     "the retrained version")
        second = versions(tmp_path, "m")[1]
        assert d.log().count("retraining queued") == 1, "the drift trigger did not wait for the change of regime"
        md = read_metadata(str(tmp_path / "models" / "m" / second))
        assert md["retrain"]["trigger"] == "regime" and 2880 <= md["retrain"]["regime"]["rows"] <= 5 * CHUNK
        moved = md["excluded"]["regime"]
        assert before.shape[0] <= moved["rows_moved"] <= before.shape[0] + 10 and {j for j, _ in moved["shift"]} >= {3, 20}
        gate = md["promotion"]
        # the challenger is judged against the champion as it scores now: re-baselined
        assert {j for j, _ in gate["champion"]["rebased_by"]} >= {3, 20} and gate["champion"]["flagged_share"] < 0.05
        promoted = current_version(str(tmp_path / "models" / "m")) == second
        assert promoted == (gate["failed"] is None), gate
        k = 5
        s = score(regime[k * CHUNK:(k + 1) * CHUNK], at + k * CHUNK)
        if promoted:  # the new version knows the new levels: its series starts again without the re-baseline
            assert s["version"] == second and s["regime"] is None, s
        else:  # refused (it flags more than the re-baselined champion): the re-baseline stays, the regime unlearned
            assert s["version"] == first and s["regime"]["metrics"], s
            assert "not promoted by the gate: flagged-vs-champion" in d.log()
        assert s["flagged"] / s["rows"] < 0.05 and not s["active"], s["flagged"]
        burst = regime[6 * CHUNK:7 * CHUNK].copy()
        burst[300:330] += 6 * std  # a real incident on the new regime
        s = score(burst, at + 6 * CHUNK)
        opened = [e for e in s["events"] if e["event"] == "incident-opened"]
        row0 = s["first_row"]
        assert any(row0 + 295 <= e["row"] <= row0 + 330 for e in opened), (row0, opened)
        rc, _ = d.stop()
        assert rc == 0, d.log()
    finally:
        d.kill()
