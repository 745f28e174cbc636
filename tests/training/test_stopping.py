"""Training to convergence: the plateau rule, min/max steps, the epochs cap, the best
weights restored, exact resume with the rule's state, and the suspect-split warnings."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch

from conftest import run_cli
from opt_ds_ops.config.conffile import TrainConfig
from opt_ds_ops.health.device import plan_device
from opt_ds_ops.model.network import feature_errors
from opt_ds_ops.training.suspect import split_warnings
from opt_ds_ops.training.fit import TrainingInterrupted, split_rows, standardise, train

CPU = plan_device("cpu", "off")
# 6,000 SMD rows at batch 512: 5,400 training rows, 11 optimizer steps an epoch. Levels alone
# (input_differences false): the stopping rule and its measured figures are under test, not the
# model's input; val_loss_of feeds the model level rows.
QUICK = dict(batch_size=512, epochs=1000, min_steps=0, max_steps=100_000, input_differences=False)


@pytest.fixture(scope="module")
def rows(smd_rows):
    return smd_rows[:6000]


def val_loss_of(result, rows) -> float:
    """The validation loss of result's model, computed here from the raw rows."""
    _, val_idx = split_rows(len(rows), 0.1)
    x = standardise(rows[val_idx], result.mean, result.std).clamp(-20, 20)
    return float(feature_errors(result.model, x).mean())


def test_a_plateau_stops_training_and_the_best_weights_come_back(rows):
    cfg = TrainConfig(**QUICK, lr=0.05, eval_every_steps=5, patience=4, min_delta=0.01)
    r = train(rows, cfg, CPU)
    st = r.stopping
    assert st["reason"] == "plateau" and st["steps"] < 1000, st
    assert st["restored_best"] and st["best_step"] < st["steps"]
    assert st["steps"] % 5 == 0 and st["evaluations"] == st["steps"] // 5
    # the stored model is the best evaluation's, not the last step's
    assert val_loss_of(r, rows) == pytest.approx(st["best_val_loss"], rel=1e-5)
    assert r.stopping_line.startswith(f"stopped: plateau after {st['steps']:,} steps (best val_loss")


def test_min_steps_holds_a_plateau_back(rows):
    # every evaluation fails a 90 % improvement: without min_steps it would stop at the patience'th
    cfg = TrainConfig(**dict(QUICK, min_steps=200), eval_every_steps=10, patience=2, min_delta=0.9)
    r = train(rows, cfg, CPU)
    assert (r.stopping["reason"], r.stopping["steps"]) == ("plateau", 200)


def test_max_steps_ends_training_inside_an_epoch(rows):
    cfg = TrainConfig(**dict(QUICK, max_steps=37), eval_every_steps=1000, patience=3)
    r = train(rows, cfg, CPU)
    assert (r.stopping["reason"], r.stopping["steps"]) == ("max_steps", 37)
    assert len(r.history) == 4  # 3 epochs of 11 steps, then 4 steps of the 4th
    # each epoch carries the run's steps so far: the daemon's progress ratio and epoch line read them
    assert [h.steps for h in r.history] == [11, 22, 33, 37]
    assert r.history[1].line(1000, 37).startswith("epoch 2/1000 step 22/37 loss=")
    assert " step " not in r.history[1].line(1000)


def test_the_epochs_count_is_a_cap(rows):
    r = train(rows, TrainConfig(**dict(QUICK, epochs=2), eval_every_steps=5, patience=50), CPU)
    assert (r.stopping["reason"], r.stopping["steps"], len(r.history)) == ("epochs", 22, 2)


@pytest.mark.parametrize("limits, last_step", [(dict(max_steps=100), 100), (dict(epochs=5), 55)])
def test_the_weights_at_the_stop_are_evaluated_and_published_while_the_loss_still_falls(rows, limits, last_step):
    # evaluations at steps 50 and 100 (max_steps) / 50 and 55 (the epochs cap, 11 steps an epoch):
    # the loss still falls, so the last step's weights are the best and are the ones published
    r = train(rows, TrainConfig(**dict(QUICK, **limits), eval_every_steps=50, patience=50), CPU)
    st = r.stopping
    assert (st["steps"], st["best_step"], st["evaluations"], st["restored_best"]) == (last_step, last_step, 2, False), st
    assert val_loss_of(r, rows) == pytest.approx(st["best_val_loss"], rel=1e-5)
    assert r.val_loss == pytest.approx(val_loss_of(r, rows), rel=1e-5)  # metadata's final_val_loss


def test_stopping_epochs_runs_exactly_the_epochs_as_the_benchmark_does(rows):
    r = train(rows, TrainConfig(batch_size=512, epochs=3, stopping="epochs", max_steps=5, patience=1), CPU)
    assert len(r.history) == 3 and r.stopping == {"rule": "epochs", "reason": "epochs", "steps": 33}


def test_a_resumed_job_stops_where_an_uninterrupted_one_does(rows):
    cfg = TrainConfig(**QUICK, lr=0.05, eval_every_steps=3, patience=4, min_delta=0.02)
    straight = train(rows, cfg, CPU)
    assert straight.stopping["reason"] == "plateau" and straight.stopping["steps"] > 40
    polls = {"n": 0}

    def stop_late():  # after several evaluations, some of them counted against patience
        polls["n"] += 1  # polled after every step but an epoch's last (11 steps, 10 polls an epoch)
        return polls["n"] == (straight.stopping["steps"] - 8) * 10 // 11

    with pytest.raises(TrainingInterrupted) as stop:
        train(rows, cfg, CPU, should_stop=stop_late)
    ckpt = stop.value.checkpoint
    assert ckpt["stopping"]["evaluations"] > 3 and ckpt["stopping"]["best_state"] is not None
    buf = io.BytesIO()
    torch.save(ckpt, buf)
    buf.seek(0)
    resumed = train(rows, cfg, CPU, resume=torch.load(buf, weights_only=True))
    assert resumed.stopping == straight.stopping
    for (k, va), vb in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        torch.testing.assert_close(va, vb, msg=k)
    assert resumed.threshold == pytest.approx(straight.threshold, rel=1e-5)


def shifted(rows: np.ndarray, column: int, sd: float) -> np.ndarray:
    """rows with column stepped by sd training standard deviations in the last 10 %."""
    out = rows.copy()
    n_train = len(split_rows(len(rows), 0.1)[0])
    out[n_train:, column] += sd * rows[:n_train, column].std()
    return out


def test_a_step_in_the_validation_split_names_the_column(rows):
    r = train(shifted(rows, 4, 20.0), TrainConfig(epochs=2, batch_size=512), CPU)
    warnings = split_warnings(r.split_check, 3.0, 6.0)
    assert any("column 5 " in w and "1 column(s) moved" in w for w in warnings), warnings
    assert split_warnings(r.split_check, 3.0, 6.0, header=[f"m{i}" for i in range(38)])[-1].count("'m4'") == 1


def test_a_clean_split_does_not_warn():
    x = np.random.default_rng(0).normal(size=(6000, 12)).astype(np.float32)
    r = train(x, TrainConfig(epochs=3, batch_size=512), CPU)
    assert r.split_check["val_loss"] > 0 and len(r.split_check["shift_sd"]) == 12
    assert split_warnings(r.split_check, 3.0, 6.0) == []


def test_a_shift_warning_clips_long_header_names():
    from opt_ds_ops.training.suspect import MAX_NAME_CHARS, MAX_WARNING_CHARS

    check = {"train_loss": 1.0, "val_loss": 1.0, "shift_sd": [9.0] * 10}
    (w,) = split_warnings(check, 3.0, 6.0, header=["x" * 10_000] * 10)
    assert len(w) <= MAX_WARNING_CHARS and "x" * (MAX_NAME_CHARS + 1) not in w, len(w)
    assert w.startswith("10 column(s) moved more than 6") and "column 1 ('xxx" in w


def test_the_loss_ratio_bound_warns():
    check = {"train_loss": 0.38, "val_loss": 8.9, "shift_sd": [0.1, 0.2]}
    (w,) = split_warnings(check, 3.0, 6.0)
    assert "23.4x the training loss" in w
    assert split_warnings(dict(check, val_loss=1.0), 3.0, 6.0) == []


def test_ds_ops_train_says_why_it_stopped_and_that_the_model_is_suspect(tmp_path, rows):
    path = tmp_path / "stepped.csv"
    np.savetxt(path, shifted(rows, 4, 20.0), delimiter=",", fmt="%.6f")
    models = tmp_path / "models"
    p = run_cli("train", str(path), "--models-dir", str(models), "--epochs", "3", shipped_defaults=True)
    assert p.returncode == 0, p.stderr
    # 5,400 training rows at the shipped batch of 1,024: 6 steps an epoch, 3 epochs
    assert "stopped: epochs after 18 steps" in p.stdout
    assert "ds-ops: warning: suspect model:" in p.stderr and "column 5 " in p.stderr
    md_path = models / "stepped" / "current" / "metadata.json"
    md = json.loads(md_path.read_text())
    assert md["stopping"]["reason"] == "epochs" and md["stopping"]["steps"] == 18
    assert any("column 5 " in w for w in md["warnings"])
    assert (md_path.parent / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_epoch_lines_are_one_a_second_past_epoch_10_under_the_plateau_rule_only():
    from types import SimpleNamespace

    from opt_ds_ops.training.stopping import throttled

    seen = []
    call = throttled(seen.append, TrainConfig())
    for e in range(1, 301):  # 300 epochs in well under a second
        call(SimpleNamespace(epoch=e))
    assert [s.epoch for s in seen] == list(range(1, 11))
    def every(stats):
        seen.append(stats)

    assert throttled(every, TrainConfig(stopping="epochs")) is every


def test_no_epoch_printed_a_lower_validation_loss_than_the_published_model(rows):
    """The new-user trial: make demo printed val_loss 0.141916 at an epoch's end, then "best val_loss 0.144232":
    an epoch's end is between two evaluations; its weights are now kept when they are the lowest."""
    r = train(rows, TrainConfig(**dict(QUICK, max_steps=600), lr=1e-2, eval_every_steps=25, patience=6,
                                min_delta=0.002), CPU)
    assert r.stopping["best_val_loss"] <= min(h.val_loss for h in r.history) + 1e-12
    assert val_loss_of(r, rows) == pytest.approx(r.stopping["best_val_loss"], rel=1e-5)
