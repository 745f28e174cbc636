"""``ds-ops models`` as an operator and a member meet it: removing a model removes its scoring
series, names a member wrote never reach the terminal as control sequences, a held version is not
called promoted, unpin says what is pinned, and a member who may not change the store hears so
before anything else. Real files, real training, the real command."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, run_cli
from opt_ds_ops.config.conffile import Config, with_overrides
from opt_ds_ops.scoring.job import score_job
from opt_ds_ops.training.job import run_job

MEMBER_UID = 12345


def chunk_job(root, job_id: str, rows: np.ndarray, dataset: str):
    """A scoring job's directory as the daemon claims a chunk for model m (its sidecar names it, as
    an exporter's does): processing/JOB with the rows, the sidecar and job.json; return its path."""
    job = root / "processing" / job_id
    job.mkdir(parents=True)
    np.savetxt(job / "dataset.csv", rows, delimiter=",", fmt="%.6f")
    (job / "sidecar.yaml").write_text("model: m\n")
    (job / "job.json").write_text(json.dumps({"job_id": job_id, "dataset": dataset, "data_file": "dataset.csv",
                                              "sidecar": dataset.rsplit(".", 1)[0] + ".yaml"}))
    return job


@pytest.fixture
def trained(tmp_path, smd_rows):
    """A model ``m`` trained from 2,000 real rows under a file name with an escape sequence in it,
    a chunk scored with it (its series under scores/m), and a conffile naming both."""
    name = "m\x1b[2J\x1b]0;owned\x07.csv"
    np.savetxt(tmp_path / name, smd_rows[3000:5000], delimiter=",", fmt="%.6f")
    cfg = with_overrides(Config(), {"models_dir": str(tmp_path / "models"), "train.epochs": 1, "device": "cpu",
                                    "scoring.results_dir": str(tmp_path / "scores")})
    run_job(str(tmp_path / name), cfg, name="m", explicit_name=True)
    score_job(str(chunk_job(tmp_path, "j1", smd_rows[5000:5300] + 20.0, "chunk.csv")), cfg)
    conf = tmp_path / "trainer.yaml"
    conf.write_text(f"models_dir: {tmp_path / 'models'}\nscoring:\n  results_dir: {tmp_path / 'scores'}\n")
    return tmp_path, conf


def test_rm_of_a_model_removes_its_scoring_series_so_a_new_owner_starts_from_nothing(trained):
    """Before, scores/m (state, history.npz, results) stayed: the next member to train m inherited
    the first owner's counters, drift ratio and history, and would have retrained on them."""
    root, conf = trained
    assert (root / "scores" / "m" / "history.npz").exists()
    r = run_cli("models", "rm", "m", "--config", str(conf))
    print("\n" + r.stdout)
    assert r.returncode == 0, r.stderr
    assert "its scoring series" in r.stdout and not (root / "scores" / "m").exists()
    assert not [p for p in (root / "scores").iterdir()]


def test_a_chunk_scored_while_its_model_is_removed_leaves_no_series_behind(trained, smd_rows, monkeypatch):
    """``models rm m`` between the job's load of the model and its results: before, the job
    wrote scores/m again (state, history, results) and the name's next owner inherited them."""
    root, conf = trained
    import opt_ds_ops.scoring.job as sj
    from opt_ds_ops.scoring.job import ScoringError

    cfg = with_overrides(Config(), {"models_dir": str(root / "models"), "device": "cpu",
                                    "scoring.results_dir": str(root / "scores")})
    loaded = sj.load_model

    def load_then_rm(path):  # the operator's rm lands while the chunk is scored
        stored = loaded(path)
        assert run_cli("models", "rm", "m", "--config", str(conf)).returncode == 0
        return stored

    monkeypatch.setattr(sj, "load_model", load_then_rm)
    with pytest.raises(ScoringError, match="was removed while the file was scored"):
        score_job(str(chunk_job(root, "j2", smd_rows[5300:5400], "chunk2.csv")), cfg)
    assert not (root / "scores" / "m").exists() and not list((root / "scores").iterdir())


def test_a_series_left_by_an_earlier_model_of_the_name_is_not_the_next_owners(trained, smd_rows):
    """``models rm m`` killed after the model went and before its series did (or a chunk that wrote
    it back): the name's next model starts its series afresh, its history without the old rows."""
    import shutil

    from opt_ds_ops.lifecycle.history import read_history
    from opt_ds_ops.store.model_dir import model_lineage

    root, conf = trained
    cfg = with_overrides(Config(), {"models_dir": str(root / "models"), "train.epochs": 1, "device": "cpu",
                                    "scoring.results_dir": str(root / "scores")})
    old = json.loads((root / "scores" / "m" / "state.json").read_text())
    assert old["lineage"] == model_lineage(str(root / "models" / "m")) and old["rows_scored"] == 300
    shutil.rmtree(root / "models" / "m")  # the model removed, its series left behind
    np.savetxt(root / "new.csv", smd_rows[:2000], delimiter=",", fmt="%.6f")
    run_job(str(root / "new.csv"), cfg, name="m", explicit_name=True)  # the next owner's m
    assert model_lineage(str(root / "models" / "m")) not in (None, old["lineage"])
    summary = score_job(str(chunk_job(root, "j3", smd_rows[2000:2100], "c3.csv")), cfg)
    print("\n" + "; ".join(summary["resets"]))
    assert any("an earlier model's of that name" in r for r in summary["resets"])
    new = json.loads((root / "scores" / "m" / "state.json").read_text())
    assert new["rows_scored"] == 100 and new["lineage"] != old["lineage"]
    assert read_history(str(root / "scores" / "m" / "history.npz")).values.shape[0] == 100
    assert len([p for p in (root / "scores" / "m").iterdir() if p.is_dir()]) == 1  # the old results went too


def test_what_a_removal_killed_midway_left_is_swept(trained):
    """A ``models rm`` SIGKILLed between its rename and its delete left scores/.rm-m-PID for good.
    One renamed over 10 minutes ago (its ctime) is swept; a younger one (a removal at work) is
    left alone. No lock is taken that a member, who may read the results, could hold."""
    import time

    root, conf = trained
    from opt_ds_ops.scoring.results import SWEEP_AFTER_S, remove_series, sweep_removed

    left = root / "scores" / ".rm-m-4242"
    os.rename(root / "scores" / "m", left)
    assert sweep_removed(str(root / "scores")) == [] and left.exists()  # just renamed: at work
    assert sweep_removed(str(root / "scores"), now=time.time() + SWEEP_AFTER_S + 1) == [left.name]
    assert not left.exists()
    young = root / "scores" / ".rm-x-1"
    young.mkdir()
    assert remove_series(str(root / "scores"), "m") is False and young.exists()  # rm sweeps too, the old only


def test_names_a_member_wrote_reach_the_terminal_escaped(trained):
    """The dataset's file name is printed by ds-ops models list, a header's metric names by ds-ops
    status (top metrics): neither may carry a control character to the operator's terminal."""
    root, conf = trained
    out = run_cli("models", "list", "--config", str(conf)).stdout
    print("\n" + out)
    assert "\x1b" not in out and "\x07" not in out and "\\x1b[2J" in out
    from opt_ds_ops.observe.incident_entries import top_text
    shown = top_text([{"metric": "cpu\x1b]0;owned\x07", "share": 0.5}])
    assert shown == "cpu\\x1b]0;owned\\x07 50%"


def test_a_version_the_gate_passed_but_not_current_is_not_listed_as_promoted():
    from opt_ds_ops.commands.models import _gate_note

    gate = {"promote": True, "flagged_share": 0.01, "champion_flagged_share": 0.9}
    assert "gate: promoted" in _gate_note(gate, current=True)
    assert "gate: passed, not current" in _gate_note(gate, current=False)


def test_a_refused_version_shows_the_gates_own_reason_not_flag_shares_that_read_as_better():
    from opt_ds_ops.commands.models import _gate_note

    reason = ("it flags 4.63% of the 1620 held-back rows the champion did not flag, design rate 1.00% "
              "(tolerance 1.00%)")
    gate = {"promote": False, "failed": "flagged-vs-design", "reason": reason, "flagged_share": 0.183,
            "champion_flagged_share": 0.1964}
    assert _gate_note(gate) == f"\n      gate: not promoted (flagged-vs-design): {reason}"
    gate = {"promote": False, "failed": "pr-auc", "flagged_share": 0.01, "champion_flagged_share": 0.945}
    assert _gate_note(gate) == "\n      gate: not promoted (pr-auc) flags 1.00% vs current-then 94.50%"  # no reason kept


def test_unpin_of_a_version_that_is_not_pinned_says_which_is(trained):
    """Before: `models unpin m` printed "unpinned by root" while the pinned version stayed P."""
    root, conf = trained
    from opt_ds_ops.store.versions import list_versions, save_model

    first = list_versions(str(root / "models" / "m"))[0]
    assert run_cli("models", "pin", f"m/{first}", "--config", str(conf)).returncode == 0
    payload = __import__("torch").load(root / "models" / "m" / first / "model.pt", weights_only=True)
    save_model(str(root / "models"), "m", payload, {"dataset": {"file": "m.csv"}})  # current moves on
    r = run_cli("models", "unpin", "m", "--config", str(conf))
    print("\n" + r.stderr)
    assert r.returncode == 1 and "is not pinned; pinned: " + first in r.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the command as another member")
def test_a_member_who_may_not_change_the_store_hears_so_before_anything_else(trained):
    """Before: a member's rm of a pinned version answered "is pinned; unpin it first"."""
    root, conf = trained
    first = next(v for v in sorted(os.listdir(root / "models" / "m")) if v[0].isdigit())
    assert run_cli("models", "pin", f"m/{first}", "--config", str(conf)).returncode == 0
    import shutil
    import tempfile

    base = tempfile.mkdtemp(prefix="ds-ops-member-")  # where the member can reach (pytest's tmp is root's, 0700)
    try:
        os.chmod(base, 0o755)
        store = shutil.copytree(root / "models", os.path.join(base, "models"), symlinks=True)
        for d, _, files in os.walk(store):
            os.chmod(d, 0o755)
        r = subprocess.run([sys.executable, "-m", "opt_ds_ops.cli", "models", "rm", f"m/{first}", "--models-dir", store],
                           capture_output=True, text=True, cwd=REPO,
                           env=dict(os.environ, PYTHONPATH=str(REPO), MPLCONFIGDIR=base, DS_OPS_CONFIG=os.devnull),
                           preexec_fn=lambda: os.setuid(MEMBER_UID), timeout=120)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print("\n" + r.stderr)
    assert r.returncode == 1 and "Permission denied; only root and the service user" in r.stderr
    assert "pinned" not in r.stderr
