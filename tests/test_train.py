"""Training on real SMD rows: convergence, the known traps, exact resume from a checkpoint."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from opt_ds_ops.config import TrainConfig
from opt_ds_ops.device import plan_device
from opt_ds_ops.train import (
    TrainingError,
    TrainingInterrupted,
    batch_bounds,
    fit_scaler,
    split_rows,
    train,
)

CPU = plan_device("cpu", "off")


@pytest.fixture(scope="module")
def rows(smd_rows):
    return smd_rows[:6000]


def test_loss_falls_and_the_result_carries_scaler_and_threshold(rows):
    r = train(rows, TrainConfig(epochs=4), CPU)
    losses = [h.train_loss for h in r.history]
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert all(np.isfinite(losses)) and all(h.val_loss is not None for h in r.history)
    assert r.mean.shape == r.std.shape == r.error_scale.shape == (38,)
    assert r.rows_train == 5400 and r.rows_val == 600
    assert r.threshold > 0 and r.score_window == 15
    assert r.samples_per_s > 0 and r.skipped_steps == 0


def test_same_seed_same_model(rows):
    a = train(rows, TrainConfig(epochs=2), CPU)
    b = train(rows, TrainConfig(epochs=2), CPU)
    for (k, va), vb in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.equal(va, vb), k


def test_validation_is_the_most_recent_stretch():
    train_idx, val_idx = split_rows(100, 0.1)
    assert val_idx.tolist() == list(range(90, 100)) and train_idx.tolist() == list(range(90))
    assert split_rows(2, 0.1)[1].size == 0  # 2 rows: both train (BatchNorm needs 2)
    assert split_rows(3, 0.1)[1].tolist() == [2]


def test_zero_std_column_is_centred_not_divided_by_zero():
    x = np.array([[1.0, 5.0], [3.0, 5.0]], dtype=np.float32)
    mean, std = fit_scaler(x)
    assert mean.tolist() == [2.0, 5.0] and std.tolist() == [1.0, 1.0]
    r = train(np.tile(x, (20, 1)), TrainConfig(epochs=1, val_fraction=0), CPU)
    assert np.isfinite(r.threshold)


def test_a_last_batch_of_one_row_joins_the_previous_batch():
    assert batch_bounds(2049, 2048) == [(0, 2049)]
    assert batch_bounds(4097, 2048) == [(0, 2048), (2048, 4097)]
    assert batch_bounds(4098, 2048)[-1] == (4096, 4098)
    rows = np.random.default_rng(1).random((2 * 64 + 1, 6), dtype=np.float32)
    r = train(rows, TrainConfig(epochs=1, batch_size=64, val_fraction=0), CPU)  # would raise in BatchNorm1d
    assert r.rows_train == 129


def test_non_finite_loss_stops_with_the_epoch_named(rows):
    with pytest.raises(TrainingError, match=r"non-finite loss in epoch 1 \(\d+ of \d+ batches\)"):
        train(rows, TrainConfig(epochs=3, lr=1e6, batch_size=256), CPU)


def test_fp16_grad_scaler_counts_skipped_steps_and_reports_collapse(rows):
    fp16 = plan_device("cpu", "fp16")
    ok = train(rows, TrainConfig(epochs=1), fp16)
    assert ok.skipped_steps == 0 and np.isfinite(ok.history[0].train_loss)
    with pytest.raises(TrainingError, match=r"fp16 loss-scale collapse in epoch \d: all \d+ steps skipped by GradScaler"):
        train(rows, TrainConfig(epochs=3, lr=1e3, batch_size=256), fp16)


def test_bf16_autocast_trains_on_the_cpu(rows):
    r = train(rows, TrainConfig(epochs=1), plan_device("cpu", "bf16"))
    assert r.plan.amp_name == "bf16" and np.isfinite(r.history[0].train_loss)


def test_interrupt_and_resume_gives_the_same_model_as_an_uninterrupted_run(rows):
    cfg = TrainConfig(epochs=3, batch_size=512)
    straight = train(rows, cfg, CPU)
    polls = {"n": 0}

    def stop_in_epoch_two():
        polls["n"] += 1
        return polls["n"] == 14  # 10 full batches per epoch: the 4th batch of epoch 2

    with pytest.raises(TrainingInterrupted) as stop:
        train(rows, cfg, CPU, should_stop=stop_in_epoch_two)
    ckpt = stop.value.checkpoint
    assert (ckpt["epoch"], ckpt["batch"], len(ckpt["history"])) == (1, 4, 1)
    buf = io.BytesIO()
    torch.save(ckpt, buf)
    buf.seek(0)
    resumed = train(rows, cfg, CPU, resume=torch.load(buf, weights_only=True))
    for (k, va), vb in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        torch.testing.assert_close(va, vb, msg=k)
    assert [h.epoch for h in resumed.history] == [1, 2, 3]
    assert resumed.history[1].train_loss == pytest.approx(straight.history[1].train_loss, rel=1e-5)
    assert resumed.threshold == pytest.approx(straight.threshold, rel=1e-5)


def test_a_checkpoint_of_another_dataset_is_refused(rows):
    with pytest.raises(TrainingInterrupted) as stop:
        train(rows, TrainConfig(epochs=2, batch_size=512), CPU, should_stop=lambda: True)
    with pytest.raises(TrainingError, match="checkpoint does not match"):
        train(rows[:3000], TrainConfig(epochs=2, batch_size=512), CPU, resume=stop.value.checkpoint)
