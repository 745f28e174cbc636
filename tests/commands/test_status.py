"""``ds-ops status``'s estimate of a running job's time left."""

from __future__ import annotations

import datetime as dt

import pytest

from opt_ds_ops.commands.status import time_left_s


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
