"""Issue 20: the history a model scored (kept to retrain from, bounded, written atomically by the
scoring job) and training only on normal rows (flagged segments and a margin left out). Real
files, real training, real SMD rows."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from conftest import REPO, SMD_TEST
from opt_ds_ops.config import Config, with_overrides
from opt_ds_ops.history import HISTORY_FILE, read_history
from opt_ds_ops.job import run_job
from opt_ds_ops.scoring import score_job


@pytest.fixture(scope="module")
def store(tmp_path_factory, smd_rows):
    root = tmp_path_factory.mktemp("retrain")
    np.savetxt(root / "m1.csv", smd_rows[:3000], delimiter=",", fmt="%.6f")
    cfg = with_overrides(Config(), {"models_dir": str(root / "models"), "train.epochs": 1, "device": "cpu"})
    run_job(str(root / "m1.csv"), cfg)
    return {"models": str(root / "models"), "test": np.loadtxt(SMD_TEST, delimiter=",", dtype=np.float32)[:6000]}


def scoring_cfg(store, tmp_path, **retrain) -> Config:
    over = {"models_dir": store["models"], "scoring.results_dir": str(tmp_path / "scores"), "device": "cpu"}
    over.update({f"retrain.{k}": v for k, v in retrain.items()})
    return with_overrides(Config(), over)


def make_job(tmp_path, i: int, rows: np.ndarray) -> str:
    """A job directory as the daemon's claim leaves it (job.json, dataset.csv)."""
    job_id = f"20261201T0000{i:02d}.000000Z-{i:08x}"
    jdir = tmp_path / "processing" / job_id
    jdir.mkdir(parents=True)
    np.savetxt(jdir / "dataset.csv", rows, delimiter=",", fmt="%.6f")
    (jdir / "job.json").write_text(json.dumps({"job_id": job_id, "dataset": "m1.csv", "data_file": "dataset.csv"}))
    return str(jdir)


def anomaly_column(result_dir: str) -> np.ndarray:
    with open(os.path.join(result_dir, "rows.csv"), newline="") as f:
        return np.array([r["anomaly"] == "1" for r in csv.DictReader(f)])


def test_the_history_keeps_the_scored_rows_with_their_flags_in_a_rolling_window(store, tmp_path):
    cfg = scoring_cfg(store, tmp_path, window="2500")
    test = store["test"]
    flags = []
    for i, (a, b) in enumerate(((0, 1000), (1000, 2000), (2000, 3000)), 1):
        flags.append(anomaly_column(score_job(make_job(tmp_path, i, test[a:b]), cfg)["result_dir"]))
    h = read_history(str(tmp_path / "scores" / "m1" / HISTORY_FILE))
    assert h.values.shape == (2500, 38) and h.last_job.endswith("00000003")
    np.testing.assert_allclose(h.rows(), test[500:3000], atol=1e-6)  # the newest 2,500 rows, as scored (6 decimals)
    assert np.array_equal(h.flags, np.concatenate(flags)[500:])
    assert h.flags.any(), "the SMD test period has flagged rows"
    assert np.isnan(h.times).all()  # headerless: no time column


def test_the_history_is_bounded_in_bytes_and_a_replayed_job_appends_nothing(store, tmp_path):
    per_row = 38 * 4 + 1 + 8
    cfg = scoring_cfg(store, tmp_path, max_history_bytes=per_row * 1200)
    test = store["test"]
    score_job(make_job(tmp_path, 1, test[:1000]), cfg)
    jdir = make_job(tmp_path, 2, test[1000:2000])
    state = tmp_path / "scores" / "m1" / "state.json"
    before = state.read_bytes()
    score_job(jdir, cfg)
    state.write_bytes(before)  # killed after the history was written, before the state: the job runs again
    redone = score_job(jdir, cfg)
    assert not redone["replayed"]
    h = read_history(str(tmp_path / "scores" / "m1" / HISTORY_FILE))
    assert h.values.shape[0] == 1200
    np.testing.assert_allclose(h.rows(), test[800:2000], atol=1e-6)  # not test[1000:2000] twice


KILLED_WRITER = textwrap.dedent("""
    import sys, numpy as np
    from opt_ds_ops.history import record_chunk
    rng = np.random.default_rng(0)
    i = 0
    while True:
        i += 1
        record_chunk(sys.argv[1], f"job-{i}", rng.normal(size=(500, 38)), None, rng.random(500) < 0.1, None,
                     "100000", 64 << 20)
        print(i, flush=True)
""")


def test_a_sigkill_while_the_history_is_written_leaves_a_whole_history(tmp_path):
    model_dir = tmp_path / "scores" / "m"
    model_dir.mkdir(parents=True)
    for delay in (0.3, 0.7, 1.1):
        p = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(model_dir)], cwd=REPO,
                             stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline()  # one chunk written at least
        time.sleep(delay)
        p.send_signal(signal.SIGKILL)
        p.wait(30)
        h = read_history(str(model_dir / HISTORY_FILE))
        assert h.values.shape[0] % 500 == 0 and h.values.shape[0] == h.flags.shape[0] > 0
        assert h.last_job.startswith("job-")
    assert [e for e in os.listdir(model_dir) if not e.startswith(".")] == [HISTORY_FILE]
