"""``ds-ops status``'s estimate of a running job's time left."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
from pathlib import Path

import pytest

from opt_ds_ops.commands.status import time_left_s
from opt_ds_ops.spool.layout import SUBDIRS

REPO = Path(__file__).resolve().parents[2]


def ago(seconds: float) -> str:
    return (dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def test_the_time_left_is_counted_to_the_plateau_rules_step_cap_not_the_epochs_cap():
    """As reported: "about 663 s left" for a job that ended 12 s after its drop. 10 s in, epoch
    10 of 1,000 but step 210 of the rule's 600: about 10 s * 600/210 - 10 s = 18.6 s, not 990 s."""
    job = {"epoch": 10, "epochs": 1000, "steps": 210, "max_steps": 600, "started_at": ago(10), "updated_at": ago(0)}
    left = time_left_s(job)
    print(f"\n10 s in, step 210/600, epoch 10/1000: about {left:.1f} s left")
    assert left == pytest.approx(10 * 600 / 210 - 10, abs=0.5)


def test_without_steps_the_epochs_cap_counts_and_a_job_past_its_caps_has_none_left():
    assert time_left_s({"epoch": 2, "epochs": 10, "started_at": ago(20), "updated_at": ago(0)}) == pytest.approx(80, abs=0.5)
    assert time_left_s({"epoch": 2, "epochs": 10, "started_at": ago(25), "updated_at": ago(5)}) == pytest.approx(75, abs=0.5)
    assert time_left_s({"epoch": 5, "epochs": 10, "steps": 700, "max_steps": 600,
                        "started_at": ago(20), "updated_at": ago(0)}) == 0.0
    assert time_left_s({"epoch": 0, "epochs": 10, "started_at": ago(1), "updated_at": ago(0)}) is None


def test_read_and_admin_commands_start_without_torch(tmp_path):
    """status, models, requeue and check-config read the spool, the store and the conffile only: none
    imports torch or the training and model code (1.2-1.8 s each before, about 0.15 s now), and each
    still answers (a real spool and store in tmp_path, a conffile naming them)."""
    conf = tmp_path / "trainer.yaml"
    conf.write_text(f"spool:\n  dir: {tmp_path / 'spool'}\nmodels_dir: {tmp_path / 'models'}\n")
    (tmp_path / "models").mkdir()
    for which in SUBDIRS:
        (tmp_path / "spool" / which).mkdir(parents=True)
    runs = {"status": ["status", "--spool-dir", str(tmp_path / "spool"), "--json"],
            "models": ["models", "list", "--models-dir", str(tmp_path / "models"), "--json"],
            "requeue": ["requeue", "--spool-dir", str(tmp_path / "spool"), "absent.csv"],
            "check-config": ["check-config", "--config", str(conf)]}
    code = ("import json, sys; from opt_ds_ops.cli import main; rc = main(json.loads(sys.argv[1])); sys.stdout.flush(); "
            "print('\\nLOADED', rc, sorted(m for m in ('torch', 'opt_ds_ops.training', 'opt_ds_ops.model') if m in sys.modules))")
    for name, argv in runs.items():
        p = subprocess.run([sys.executable, "-c", code, json.dumps(argv)], capture_output=True, text=True, cwd=REPO,
                           timeout=120)
        last = p.stdout.strip().split("\n")[-1]
        rc = 1 if name == "requeue" else 0  # nothing named absent.csv is in failed/: one error line
        assert last == f"LOADED {rc} []", (name, p.stdout, p.stderr)
        assert "Traceback" not in p.stderr, p.stderr
        if name == "requeue":
            assert "absent.csv" in p.stderr and p.stderr.startswith("ds-ops: error:"), p.stderr
