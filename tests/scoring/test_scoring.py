"""The scoring job: a claimed chunk -> its model's series -> results on disk, written
so that nothing half-scored is visible, a refused chunk never moves the series, and a replay of
the same job scores nothing twice. Real files, a real trained model, real SMD rows."""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import stat

import numpy as np
import pytest

from conftest import SMD_TEST
from opt_ds_ops.config.conffile import Config, with_overrides
from opt_ds_ops.dataset import DatasetError
from opt_ds_ops.lifecycle.history import read_history, write_history
from opt_ds_ops.training.job import JobError, run_job
from opt_ds_ops.model.detection import score_rows
from opt_ds_ops.model import calibration as calib
from opt_ds_ops.model.calibration import EDGES, CalibrationPolicy
from opt_ds_ops.scoring.incidents import IncidentPolicy, incidents_of
from opt_ds_ops.scoring.job import ScoringError, history_seed, score_job
from opt_ds_ops.store.versions import load_model

NAMES = [f"metric_{j}" for j in range(38)]


@pytest.fixture(scope="module")
def store(tmp_path_factory, smd_rows):
    """A models_dir with model ``m1`` trained on 3,000 real SMD rows of a headerless CSV, its metric
    names from ``dataset.metric_names``; and the 3,000 test-period rows to score."""
    root = tmp_path_factory.mktemp("scoring")
    np.savetxt(root / "m1.csv", smd_rows[:3000], delimiter=",", fmt="%.6f")
    cfg = with_overrides(Config(), {"models_dir": str(root / "models"), "train.epochs": 1, "device": "cpu",
                                    "dataset.metric_names": NAMES})
    job = run_job(str(root / "m1.csv"), cfg)
    assert job.metadata["metric_names"] == NAMES
    test = np.loadtxt(SMD_TEST, delimiter=",", dtype=np.float32)[4000:7000]
    return {"root": root, "models": str(root / "models"), "test": test, "model_dir": job.model_dir}


@pytest.fixture
def cfg(store, tmp_path):
    """The model's threshold, not the alarm budget's (shipped on: tests/scoring/test_calibration.py), so
    that flags are the stored threshold's on every day of the test period."""
    return with_overrides(Config(), {"models_dir": store["models"], "scoring.results_dir": str(tmp_path / "scores"),
                                     "device": "cpu", "scoring.alarm_budget_per_day": 0})


def make_job(tmp_path, job_id: str, rows: np.ndarray | None, name: str = "m1.csv", text: str | None = None,
             sidecar: str | None = None, header: str | None = None) -> str:
    """A job directory as the daemon's claim leaves it: job.json, dataset.<ext>, sidecar.yaml."""
    jdir = tmp_path / "processing" / job_id
    jdir.mkdir(parents=True)
    ext = name.split(".", 1)[1]
    data = jdir / f"dataset.{ext}"
    if text is not None:
        data.write_text(text)
    else:
        np.savetxt(data, rows, delimiter=",", fmt="%.6f", header=header or "", comments="")
    record = {"job_id": job_id, "dataset": name, "data_file": data.name, "state": "claimed"}
    if sidecar is not None:
        (jdir / "sidecar.yaml").write_text(sidecar)
        record["sidecar"] = name.split(".")[0] + ".yaml"
    (jdir / "job.json").write_text(json.dumps(record))
    return str(jdir)


def job_id(i: int) -> str:
    return f"20261201T0000{i:02d}.000000Z-{i:08x}"


def read_rows(result_dir: str) -> list[dict]:
    with open(os.path.join(result_dir, "rows.csv"), newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("k", [1, 7])
def test_chunks_dropped_one_after_another_score_as_the_whole_period(store, cfg, tmp_path, k):
    """Files written by text, each read with its own column offset, give the whole file's scores
    and the same segments; rows are series rows; the metrics are named by dataset.metric_names."""
    test = store["test"]
    whole_file = tmp_path / "whole.csv"
    np.savetxt(whole_file, test, delimiter=",", fmt="%.6f")
    stored = load_model(store["model_dir"])
    whole = score_rows(stored, np.loadtxt(whole_file, delimiter=",", dtype=np.float64).astype(np.float32))
    rows, events = [], []
    for i, part in enumerate(np.array_split(np.arange(test.shape[0]), k)):
        summary = score_job(make_job(tmp_path, job_id(i), test[part]), cfg)
        assert summary["first_row"] == part[0] and summary["rows"] == len(part) and not summary["replayed"]
        rows += read_rows(summary["result_dir"])
        events += summary["events"]
    assert [int(r["row"]) for r in rows] == list(range(test.shape[0]))
    np.testing.assert_allclose([float(r["score"]) for r in rows], whole, rtol=1e-5, atol=1e-6)  # %.6g in the file
    flagged = [int(r["row"]) for r in rows if r["anomaly"] == "1"]
    assert flagged and flagged == np.flatnonzero(whole > stored.threshold).tolist()
    opened = [e for e in events if e["event"] == "incident-opened"]
    assert opened and all(m["metric"] in NAMES for e in opened for m in e["top_metrics"])
    assert all(r["top_metrics"].split(";")[0] in NAMES for r in rows if r["anomaly"] == "1")
    # rows.csv names each row's incident: every flagged row from an incident's opening row to its last
    # is in one, a flagged row outside them all (a blip the shipped 5-minute window does not open on)
    # in none, and the incidents are the series'
    found = incidents_of(whole, stored.threshold, IncidentPolicy.from_config(cfg.scoring), 60.0)
    opened_to_end = {r for i in found for r in range(i["opened"], i["end"] + 1)}
    assert opened_to_end & set(flagged)
    assert all(rows[r]["incident"] for r in flagged if r in opened_to_end)
    assert not any(rows[r]["incident"] for r in flagged if not any(i["start"] <= r <= i["end"] for i in found))
    assert {int(r["incident"]) for r in rows if r["incident"]} == {e["incident"] for e in opened}
    state = json.loads((tmp_path / "scores" / "m1" / "state.json").read_text())
    assert state["rows_scored"] == test.shape[0] and state["last_job"] == job_id(k - 1)


def test_results_are_group_readable_and_nothing_hidden_is_left(store, cfg, tmp_path):
    summary = score_job(make_job(tmp_path, job_id(1), store["test"][:1000]), cfg)
    model_dir = tmp_path / "scores" / "m1"
    assert sorted(os.listdir(model_dir)) == sorted([os.path.basename(summary["result_dir"]), "state.json",
                                                    "history.npz"])  # the rows to retrain from
    assert stat.S_IMODE(os.stat(model_dir).st_mode) == 0o750
    assert stat.S_IMODE(os.stat(summary["result_dir"]).st_mode) == 0o750
    for f in ("rows.csv", "summary.json"):
        assert stat.S_IMODE(os.stat(os.path.join(summary["result_dir"], f)).st_mode) == 0o640
    assert stat.S_IMODE(os.stat(model_dir / "state.json").st_mode) == 0o640
    kept = json.loads(open(os.path.join(summary["result_dir"], "summary.json")).read())
    assert kept == summary and kept["model"] == "m1" and kept["source"] == "m1.csv"


BAD = {
    "named columns": ("m1.csv", "a,b\n1,2\n3,4\n", None),
    "NaN": ("m1.csv", None, "nan"),
    "text cell": ("m1.csv", None, "text"),
    "column count": ("m1.csv", "1,2\n3,4\n", None),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_refused_chunk_leaves_the_series_state_byte_identical(store, cfg, tmp_path, case):
    test = store["test"]
    score_job(make_job(tmp_path, job_id(1), test[:500]), cfg)
    state_file = tmp_path / "scores" / "m1" / "state.json"
    before, listing = state_file.read_bytes(), sorted(os.listdir(state_file.parent))
    name, text, poison = BAD[case]
    if poison is not None:
        lines = [",".join(f"{v:.6f}" for v in row) for row in test[500:600]]
        lines[37] = lines[37].replace(lines[37].split(",")[5], "nan" if poison == "nan" else "busy", 1)
        text = "\n".join(lines) + "\n"
    jdir = make_job(tmp_path, job_id(2), None, name, text=text)
    with pytest.raises((DatasetError, ScoringError)) as e:
        score_job(jdir, cfg)
    assert "m1.csv" in str(e.value) and "processing" not in str(e.value)
    assert {"NaN": "line 38", "text cell": "line 38", "column count": "2 feature columns; model expects 38",
            "named columns": "2 feature columns"}[case] in str(e.value)
    assert state_file.read_bytes() == before and sorted(os.listdir(state_file.parent)) == listing


def test_named_columns_must_match_the_models_and_are_listed(tmp_path, smd_rows):
    """A model trained with a header: a chunk lacking some names and having others is refused
    naming both; the same columns in another order are scored in the model's order."""
    header = [f"c{j}" for j in range(38)]
    train_file = tmp_path / "named.csv"
    np.savetxt(train_file, smd_rows[:2000], delimiter=",", fmt="%.6f", header=",".join(header), comments="")
    cfg = with_overrides(Config(), {"models_dir": str(tmp_path / "models"), "train.epochs": 1, "device": "cpu",
                                    "scoring.results_dir": str(tmp_path / "scores")})
    assert run_job(str(train_file), cfg).metadata["metric_names"] == header
    order = list(range(37, -1, -1))
    jdir = make_job(tmp_path, job_id(1), smd_rows[2000:2100][:, order], "named.csv",
                    header=",".join(header[j] for j in order))
    reordered = score_job(jdir, cfg)
    stored = load_model(str(tmp_path / "models" / "named" / "current"))
    np.testing.assert_allclose([float(r["score"]) for r in read_rows(reordered["result_dir"])],
                               score_rows(stored, smd_rows[2000:2100]), rtol=1e-5, atol=1e-6)
    state_file = tmp_path / "scores" / "named" / "state.json"
    before = state_file.read_bytes()
    wrong = header[:36] + ["disk_util", "fan_rpm"]
    jdir = make_job(tmp_path, job_id(2), smd_rows[2100:2200], "named.csv", header=",".join(wrong))
    with pytest.raises(ScoringError) as e:
        score_job(jdir, cfg)
    assert "lacks the model's columns 'c36', 'c37'" in str(e.value)
    assert "columns the model was not trained on: 'disk_util', 'fan_rpm'" in str(e.value)
    assert state_file.read_bytes() == before and len(os.listdir(state_file.parent)) == 3  # and history.npz


def test_a_replayed_job_is_not_scored_twice(store, cfg, tmp_path):
    test = store["test"]
    score_job(make_job(tmp_path, job_id(1), test[:500]), cfg)
    jdir = make_job(tmp_path, job_id(2), test[500:1000])
    state_file = tmp_path / "scores" / "m1" / "state.json"
    before = state_file.read_bytes()
    first = score_job(jdir, cfg)
    after = state_file.read_bytes()
    again = score_job(jdir, cfg)  # the daemon was killed after the job finished, before it moved the file
    assert again["replayed"] and dict(again, replayed=False) == first and state_file.read_bytes() == after
    state_file.write_bytes(before)  # killed after the result's rename, before the state's
    redone = score_job(jdir, cfg)
    assert not redone["replayed"] and redone["first_row"] == 500
    assert [e for e in os.listdir(state_file.parent) if e.endswith(job_id(2))] == [os.path.basename(redone["result_dir"])]
    assert json.loads(state_file.read_bytes())["rows_scored"] == 1000


def test_a_model_without_a_current_version_is_refused_with_that_reason(store, cfg, tmp_path):
    with pytest.raises(ScoringError, match="model nosuch has no current version"):
        score_job(make_job(tmp_path, job_id(1), store["test"][:10], "nosuch.csv"), cfg)
    assert not (tmp_path / "scores" / "nosuch").exists()


def test_a_sidecar_names_the_model_by_model_or_name_but_not_both(store, cfg, tmp_path):
    summary = score_job(make_job(tmp_path, job_id(1), store["test"][:50], "chunk-0001.csv", sidecar="model: m1\n"), cfg)
    assert summary["model"] == "m1"
    summary = score_job(make_job(tmp_path, job_id(2), store["test"][50:90], "chunk-0002.csv", sidecar="name: m1\n"), cfg)
    assert summary["model"] == "m1" and summary["first_row"] == 50
    with pytest.raises(ScoringError, match="keys 'name' and 'model' both name the model"):
        score_job(make_job(tmp_path, job_id(3), store["test"][:10], "chunk-0003.csv", sidecar="model: m1\nname: m1\n"), cfg)


def test_training_refuses_metric_names_of_another_count(tmp_path, smd_rows):
    np.savetxt(tmp_path / "short.csv", smd_rows[:500], delimiter=",", fmt="%.6f")
    cfg = with_overrides(Config(), {"models_dir": str(tmp_path / "models"), "train.epochs": 1, "device": "cpu",
                                    "dataset.metric_names": ["a", "b"]})
    with pytest.raises(JobError, match="dataset.metric_names gives 2 names for 38 feature columns") as e:
        run_job(str(tmp_path / "short.csv"), cfg)
    assert e.value.stage == "dataset" and not (tmp_path / "models").exists()


def test_series_status_says_per_model_whether_an_anomaly_is_open_and_its_metrics(store, cfg, tmp_path):
    from opt_ds_ops.scoring.job import series_status

    stored = load_model(store["model_dir"])
    whole = score_rows(stored, store["test"])
    inside = [i for i in range(1, len(whole) - 1) if whole[i - 1] > stored.threshold and whole[i] > stored.threshold]
    cut = inside[len(inside) // 2]
    assert series_status(cfg.scoring.results_dir) == []
    summary = score_job(make_job(tmp_path, job_id(1), store["test"][:cut]), cfg)
    assert summary["active"] and summary["top_metrics"]
    (status,) = series_status(cfg.scoring.results_dir)
    assert status["model"] == "m1" and status["active"] and status["rows_scored"] == cut
    assert status["top_metrics"] == summary["top_metrics"] and status["scored_at"] == summary["scored_at"]
    assert all(m["metric"] in NAMES for m in status["top_metrics"])
    (tmp_path / "scores" / "broken").mkdir()
    (tmp_path / "scores" / "broken" / "state.json").write_text("{")
    assert series_status(cfg.scoring.results_dir)[0]["error"].startswith("the series state")


def test_one_row_chunks_continue_the_series(store, cfg, tmp_path):
    """An exporter that writes a file per sample: one-row chunks are scored (training needs 2)."""
    test = store["test"][:40]
    whole = score_rows(load_model(store["model_dir"]), np.loadtxt(
        make_job(tmp_path, "whole", test) + "/dataset.csv", delimiter=",", dtype=np.float64).astype(np.float32))
    rows = read_rows(score_job(make_job(tmp_path, job_id(0), test[:30]), cfg)["result_dir"])
    for i in range(30, 40):
        summary = score_job(make_job(tmp_path, job_id(i), test[i : i + 1]), cfg)
        assert summary["rows"] == 1 and summary["first_row"] == i
        rows += read_rows(summary["result_dir"])
    np.testing.assert_allclose([float(r["score"]) for r in rows], whole, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("first", ["row index", "epoch seconds"])
def test_short_headerless_chunks_are_read_as_the_training_file_was(tmp_path, smd_rows, first):
    """A headerless export with a row index or unnamed epoch seconds before the metrics: the
    training file's reading (column 1 left out, or the time) holds for two-row chunks, whose
    values alone would not show it (an index from 2000; two times)."""
    n = 2012
    lead = np.arange(n) if first == "row index" else 1.7e9 + 60 * np.arange(n)
    full = np.column_stack([lead, smd_rows[:n]])
    fmt = ["%d"] + ["%.6f"] * 38
    np.savetxt(tmp_path / "exp.csv", full[:2000], delimiter=",", fmt=fmt)
    cfg = with_overrides(Config(), {"models_dir": str(tmp_path / "models"), "train.epochs": 1, "device": "cpu",
                                    "scoring.results_dir": str(tmp_path / "scores")})
    md = run_job(str(tmp_path / "exp.csv"), cfg).metadata["dataset"]
    assert md["feature_columns"] == list(range(2, 40)) and (md["time"] is not None) == (first == "epoch seconds")
    rows = []
    for i, start in enumerate(range(2000, 2010, 2)):
        jdir = make_job(tmp_path, job_id(i), None, "exp.csv", text="")
        np.savetxt(os.path.join(jdir, "dataset.csv"), full[start : start + 2], delimiter=",", fmt=fmt)
        summary = score_job(jdir, cfg)
        assert summary["notes"] == [] and (summary["first_time"] is not None) == (first == "epoch seconds")
        rows += read_rows(summary["result_dir"])
    stored = load_model(str(tmp_path / "models" / "exp" / "current"))
    np.testing.assert_allclose([float(r["score"]) for r in rows], score_rows(stored, smd_rows[2000:2010]),
                               rtol=1e-5, atol=1e-6)
    jdir = make_job(tmp_path, job_id(9), None, "exp.csv", text="")
    np.savetxt(os.path.join(jdir, "dataset.csv"), full[2010:2012, 1:], delimiter=",", fmt=fmt[1:])
    with pytest.raises(ScoringError, match="exp.csv: 38 columns; the model's training file had 39"):
        score_job(jdir, cfg)


@pytest.mark.parametrize("bad", ["{", '{"format": 1, "model": "m1", "next_row": "x"}', '{"format": 7}'])
def test_an_unreadable_series_state_starts_the_series_again_with_a_note(store, cfg, tmp_path, bad):
    (tmp_path / "scores" / "m1").mkdir(parents=True)
    (tmp_path / "scores" / "m1" / "state.json").write_text(bad)
    summary = score_job(make_job(tmp_path, job_id(1), store["test"][:20]), cfg)
    assert summary["first_row"] == 0 and "could not be read" in summary["resets"][0]
    assert json.loads((tmp_path / "scores" / "m1" / "state.json").read_text())["next_row"] == 20


def test_a_chunk_dropped_by_another_uid_than_the_models_owner_is_refused(tmp_path, smd_rows):
    """The model name belongs to the uid that first trained it (docs/trust.md): another member of
    group ds-ops can neither feed its series nor reset it."""
    np.savetxt(tmp_path / "owned.csv", smd_rows[:500], delimiter=",", fmt="%.6f")
    cfg = with_overrides(Config(), {"models_dir": str(tmp_path / "models"), "train.epochs": 1, "device": "cpu",
                                    "scoring.results_dir": str(tmp_path / "scores")})
    run_job(str(tmp_path / "owned.csv"), cfg, uploader_uid=4201)
    jdir = make_job(tmp_path, job_id(1), smd_rows[500:520], "owned.csv")
    record = json.loads(open(os.path.join(jdir, "job.json")).read())
    with open(os.path.join(jdir, "job.json"), "w") as f:
        json.dump(dict(record, uploader_uid=4202), f)
    with pytest.raises(ScoringError, match="model 'owned' belongs to uid 4201"):
        score_job(jdir, cfg)
    assert not (tmp_path / "scores" / "owned").exists()
    with open(os.path.join(jdir, "job.json"), "w") as f:
        json.dump(dict(record, uploader_uid=4201), f)
    assert score_job(jdir, cfg)["rows"] == 20


def test_a_chunk_that_scores_inf_is_refused_and_the_next_one_scores_normally(tmp_path, smd_rows):
    """train.input_clip 0: a 1e30 cell would make the raw score inf and the carried EMA inf for good."""
    np.savetxt(tmp_path / "m2.csv", smd_rows[:3000], delimiter=",", fmt="%.6f")
    cfg = with_overrides(Config(), {"models_dir": str(tmp_path / "models"), "train.epochs": 1, "device": "cpu",
                                    "train.input_clip": 0, "scoring.results_dir": str(tmp_path / "scores")})
    run_job(str(tmp_path / "m2.csv"), cfg)
    test = np.loadtxt(SMD_TEST, delimiter=",", dtype=np.float32)[4000:4300]
    score_job(make_job(tmp_path, job_id(1), test[:100], "m2.csv"), cfg)
    state_file = tmp_path / "scores" / "m2" / "state.json"
    before, listing = state_file.read_bytes(), sorted(os.listdir(state_file.parent))
    bad = test[100:200].copy()
    bad[41, 3] = 1e30
    with pytest.raises(ScoringError, match=r"m2.csv: data row \d+ scores inf \(not finite\)"):
        score_job(make_job(tmp_path, job_id(2), bad, "m2.csv"), cfg)
    assert state_file.read_bytes() == before and sorted(os.listdir(state_file.parent)) == listing
    s = score_job(make_job(tmp_path, job_id(3), test[100:200], "m2.csv"), cfg)
    assert s["first_row"] == 100 and "Infinity" not in state_file.read_text()
    plain = with_overrides(cfg, {"scoring.results_dir": str(tmp_path / "plain")})  # the series without the bad chunk
    score_job(make_job(tmp_path / "p", job_id(1), test[:100], "m2.csv"), plain)
    p = score_job(make_job(tmp_path / "p", job_id(3), test[100:200], "m2.csv"), plain)
    assert read_rows(s["result_dir"]) == read_rows(p["result_dir"]) and s["flagged"] == p["flagged"]


def test_the_files_notes_are_not_resets(store, cfg, tmp_path):
    s = score_job(make_job(tmp_path, job_id(1), store["test"][:50]), cfg)
    assert s["resets"] == [] and s["notes"] == []
    (tmp_path / "scores" / "m1" / "state.json").write_text("{broken")
    s = score_job(make_job(tmp_path, job_id(2), store["test"][50:100]), cfg)
    assert len(s["resets"]) == 1 and s["notes"] == []


@pytest.mark.parametrize("from_history", [False, True])
def test_a_new_versions_alarm_budget_starts_from_the_scored_history_when_asked(tmp_path, smd_rows, from_history):
    """scoring.alarm_budget_history: the first chunk a new version scores starts its budget from the
    series' history (the rows the version before scored), scored again by the new version; a kill
    after the history was appended and before the state was written scores the job again with
    the same start (its own rows are not history)."""
    np.savetxt(tmp_path / "m1.csv", smd_rows[:3000], delimiter=",", fmt="%.6f")
    cfg = with_overrides(Config(), {"models_dir": str(tmp_path / "models"), "train.epochs": 1, "device": "cpu",
                                    "scoring.results_dir": str(tmp_path / "scores"),
                                    "scoring.alarm_budget_history": from_history})
    run_job(str(tmp_path / "m1.csv"), cfg)
    test = np.loadtxt(SMD_TEST, delimiter=",", dtype=np.float32)[15000:19000]  # machine-1-1's test period
    for i in range(3):
        score_job(make_job(tmp_path, job_id(i), test[1000 * i:1000 * (i + 1)]), cfg)
    second = run_job(str(tmp_path / "m1.csv"), with_overrides(cfg, {"train.epochs": 2}))  # the new current version
    state_path = tmp_path / "scores" / "m1" / "state.json"
    before = state_path.read_bytes()
    job = make_job(tmp_path, job_id(3), test[3000:])
    summary = score_job(job, cfg)
    assert summary["version"] == os.path.basename(second.model_dir) and summary["first_row"] == 0
    seeded = [e for e in summary["events"] if e["event"] == "threshold-calibrated"]
    if not from_history:
        assert not seeded and summary["threshold"] == summary["model_threshold"]
        return
    new = load_model(second.model_dir)
    base = float(new.threshold)
    history = score_rows(new, test[:3000]).astype(np.float64)  # the three chunks before, no more
    flags = read_history(str(tmp_path / "scores" / "m1" / "history.npz")).flags[:3000]
    assert flags.any()  # what the first version flagged (and 30 rows each side) teaches the seed nothing
    near = np.convolve(flags, np.ones(61), mode="same") > 0

    def budget(rows: np.ndarray, allowed: int) -> float:
        thresholds = EDGES * base
        over = rows[:, None] > thresholds
        starts = over & ~np.vstack([np.zeros((1, thresholds.size), dtype=bool), over[:-1]])
        runs = (starts & ~near[:rows.size, None]).sum(axis=0)
        over = np.flatnonzero(runs > allowed)
        return float(EDGES[max(int(over[-1]) + 1 if over.size else 0, int(np.searchsorted(EDGES, 1.0)))] * base)

    # by rows, the history is series rows -3000..-1 at 60 s: days -3 (120 rows), -2 and -1 (1,440 each).
    # Day -1 starts from days -3 and -2 (1.08 days), day 0 from all (2.08 days): at the shipped 0.5 alarms
    # a day, none and 1 allowed; each day's move is held to MAX_DAY_FACTOR of the threshold before it
    bound, per_day = calib.MAX_DAY_FACTOR, cfg.scoring.alarm_budget_per_day
    first = min(max(budget(history[:1560], int(per_day * 1560 / 1440)), base / bound), base * bound)
    want = min(max(budget(history, int(per_day * 3000 / 1440)), first / bound, base), first * bound)
    assert want > base
    assert len(seeded) == 1 and seeded[0]["seeded_rows"] == 3000 and seeded[0]["previous"] == base
    assert seeded[0]["seeded_left_out"] == int(near.sum())  # the rows whose runs it did not count, said
    assert seeded[0]["threshold"] == pytest.approx(want) and summary["threshold"] == pytest.approx(want)
    # killed after history.npz took the job's rows, before state.json was replaced: scored again, the same start
    state_path.write_bytes(before)
    again = score_job(job, cfg)
    assert [e for e in again["events"] if e["event"] == "threshold-calibrated"] == seeded
    assert again["threshold"] == summary["threshold"]


def test_a_versions_own_series_and_a_learned_change_of_regime_start_no_seed(tmp_path, smd_rows):
    """Only a new version of a series scored before starts from the history: not a series whose state
    is gone (the same version), nor a version that learned a change of regime (the history before it
    is at the old levels)."""
    np.savetxt(tmp_path / "m1.csv", smd_rows[:3000], delimiter=",", fmt="%.6f")
    cfg = with_overrides(Config(), {"models_dir": str(tmp_path / "models"), "train.epochs": 1, "device": "cpu",
                                    "scoring.results_dir": str(tmp_path / "scores"),
                                    "scoring.alarm_budget_history": True})
    first = run_job(str(tmp_path / "m1.csv"), cfg)
    test = np.loadtxt(SMD_TEST, delimiter=",", dtype=np.float32)[15000:18000]
    for i in range(2):
        score_job(make_job(tmp_path, job_id(i), test[1000 * i:1000 * (i + 1)]), cfg)
    (tmp_path / "scores" / "m1" / "state.json").write_text("{not json")
    summary = score_job(make_job(tmp_path, job_id(2), test[2000:]), cfg)
    assert not [e for e in summary["events"] if e["event"] == "threshold-calibrated" and "seeded_rows" in e]
    stored = load_model(first.model_dir)
    policy = CalibrationPolicy(budget_per_day=1.0, days=14.0, from_history=True)
    got = history_seed(str(tmp_path / "scores" / "m1"), stored, policy, "another-job", 0, False, 30)
    assert got is not None and got[0].shape == (3000,) and got[1] is None
    # the rows the seed learns from: not a flagged row nor 30 rows each side, the margin of a segment
    # just before the day scored included; the last job's own rows (a kill) are not the history's
    path = str(tmp_path / "scores" / "m1" / "history.npz")
    h = read_history(path)
    h.flags = np.zeros(3000, dtype=bool)
    h.flags[[1545, 1546, 2500, 2990]] = True  # the day scored (1,440 rows by rows) starts at row 1560
    write_history(path, dataclasses.replace(h, last_job="the-killed-job"))
    day = CalibrationPolicy(budget_per_day=1.0, days=1.0, from_history=True)
    want = np.ones(3000, dtype=bool)
    want[1515:1577] = want[2470:2531] = want[2960:] = False
    got = history_seed(str(tmp_path / "scores" / "m1"), stored, day, "another-job", 0, False, 30)
    assert np.array_equal(got[2], want[1560:])
    got = history_seed(str(tmp_path / "scores" / "m1"), stored, day, "the-killed-job", 1000, False, 30)
    assert np.array_equal(got[2], want[560:2000]) and got[0].shape == (1440,)
    stored.metadata = dict(stored.metadata, retrain={"trigger": "regime", "regime": {"rows": 500, "shift": [[3, 1.0]]}})
    assert history_seed(str(tmp_path / "scores" / "m1"), stored, policy, "another-job", 0, False, 30) is None
    (tmp_path / "scores" / "m1" / "history.npz").write_bytes(b"PK\x03\x04 truncated")
    assert history_seed(str(tmp_path / "scores" / "m1"), load_model(first.model_dir), policy, "x", 0, False, 30) is None


def _timed(rows: np.ndarray, first: int) -> str:
    """rows as CSV text with a time column (one row a minute from 2026-09-21 + first minutes), as the puller writes."""
    t0 = 1_790_000_000
    return "time," + ",".join(NAMES) + "\n" + "".join(
        ",".join([str(t0 + 60 * (first + i))] + [repr(float(v)) for v in r]) + "\n" for i, r in enumerate(rows))


def test_a_chunk_sent_again_is_scored_from_its_first_new_row_and_pages_nothing_twice(store, cfg, tmp_path):
    """Before: a puller killed after its drop, before saving its state, dropped the chunk again with
    more rows; the daemon saw time go backwards, reset the series, closed the open incident and
    opened a second one for the same rows. Now rows at or before the series' last row whose time
    and values the history holds are known as scored: the chunk continues the series from its first
    new row (a note says so), and a chunk of nothing new is refused, naming why. Rows at those times
    with other values (a host clock set back) still start the series again."""
    test, side = store["test"], "model: m1\ntime_column: time\n"
    first = score_job(make_job(tmp_path, job_id(1), None, text=_timed(test[:1000], 0), sidecar=side), cfg)
    again = score_job(make_job(tmp_path, job_id(2), None, text=_timed(test[:1200], 0), sidecar=side), cfg)
    assert again["resets"] == [] and (again["first_row"], again["rows"]) == (1000, 200)
    assert any("1000 row(s)" in n and "scored already" in n for n in again["notes"]), again["notes"]
    whole = score_job(make_job(tmp_path / "w", job_id(3), None, text=_timed(test[:1200], 0), sidecar=side),
                      with_overrides(cfg, {"scoring.results_dir": str(tmp_path / "w" / "scores")}))
    # rows.csv holds each score as %.6g: the same score, carried across the chunks or scored whole, can
    # round to neighbouring sixth digits (1.80359 and 1.8036). The shipped score (differences beside
    # levels, round 10) runs over 1 in these rows, where that digit is 1e-5 (an absolute 1e-6 holds
    # only under 1): the two files agree to one unit of their sixth significant digit.
    carried = np.array([float(r["score"]) for r in read_rows(again["result_dir"])])
    scored_whole = np.array([float(r["score"]) for r in read_rows(whole["result_dir"])[1000:]])
    sixth_digit = 10.0 ** (np.floor(np.log10(np.abs(scored_whole))) - 5)
    assert carried.shape == (200,) and np.all(np.abs(carried - scored_whole) <= sixth_digit * (1 + 1e-9)), \
        np.abs(carried - scored_whole).max()
    assert again["incidents"] == whole["incidents"]  # no incident opened twice
    with pytest.raises(ScoringError, match="200 rows .* were scored already"):
        score_job(make_job(tmp_path, job_id(4), None, text=_timed(test[1000:1200], 1000), sidecar=side), cfg)
    other = test[1000:1200] + 1.0  # the same times, other values: a clock set back, not a chunk sent again
    moved = score_job(make_job(tmp_path, job_id(5), None, text=_timed(other, 1000), sidecar=side), cfg)
    assert moved["resets"] and "went backwards" in moved["resets"][0] and moved["first_row"] == 0
