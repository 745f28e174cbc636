"""Training on real SMD rows: convergence, the known traps, exact resume from a checkpoint."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from opt_ds_ops.config.conffile import TrainConfig
from opt_ds_ops.health.device import plan_device
from opt_ds_ops.training.fit import (
    CheckpointMismatch,
    TrainingError,
    TrainingInterrupted,
    batch_bounds,
    fit_scaler,
    split_rows,
    standardise,
    threshold_at,
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
    assert r.mean.shape == r.std.shape == (38,)
    # as shipped it reads each metric's change beside its level: an error scale per input column
    # (change, level) and the differences' own scaler (train.input_differences); a metric's term is
    # the mean of the two (train.difference_term mean, since round 21; window_error "window")
    assert (r.input_window, r.window_error) == (2, "window") and r.error_scale.shape == (2 * 38,)
    assert r.diff is not None and r.diff[0].shape == r.diff[1].shape == (38,) and np.all(r.diff[1] > 0)
    assert r.rows_train == 5400 and r.rows_val == 600
    assert r.threshold > 0 and (r.score_window, r.score_smoothing, r.input_clip) == (5, "ema", 20.0)
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
    with pytest.raises(CheckpointMismatch, match=r"the checkpoint has \d+ training rows, this run 2700"):
        train(rows[:3000], TrainConfig(epochs=2, batch_size=512), CPU, resume=stop.value.checkpoint)
    assert issubclass(CheckpointMismatch, TrainingError)  # what a caller that does not retry sees


def test_threshold_is_exact_for_more_than_2_pow_24_scores():
    n = 2**24 + 3  # torch.quantile refuses more than 2**24 elements
    scores = torch.arange(n, dtype=torch.float64).flip(0)
    assert threshold_at(scores, 0.99) == pytest.approx(0.99 * (n - 1), rel=0, abs=1e-6)
    assert threshold_at(np.array([3.0, 1.0, 2.0]), 0.5) == 2.0


def test_standardise_works_in_float64_so_a_column_far_from_zero_keeps_its_signal():
    rows = np.array([[1e8 + 1.0], [1e8 - 1.0], [1e8 + 0.5]])
    mean, std = fit_scaler(rows)
    assert mean.dtype == std.dtype == np.float64 and mean[0] == 1e8 + 0.5 / 3
    x = standardise(rows, mean, std)
    assert x.dtype == torch.float32
    torch.testing.assert_close(x[:, 0].double(), torch.from_numpy((rows[:, 0] - mean[0]) / std[0]))


def test_the_scaler_mean_adds_the_dataset_offset_back_exactly():
    rng = np.random.default_rng(3)
    values = np.column_stack([1e8 + rng.normal(size=400), rng.random(400)])
    offset = values[:50].mean(axis=0)  # what load_dataset keeps: the first block's column means
    centred = (values - offset).astype(np.float32)
    r = train(centred, TrainConfig(epochs=1, batch_size=64), CPU, offset=offset)
    exact = values[: r.rows_train]
    assert r.mean.dtype == np.float64
    np.testing.assert_allclose(r.mean, exact.mean(axis=0), rtol=0, atol=1e-6)  # float32 alone: a step of 8
    np.testing.assert_allclose(r.std, exact.std(axis=0), rtol=1e-5)
    with pytest.raises(ValueError, match="offset has shape"):
        train(centred, TrainConfig(epochs=1), CPU, offset=offset[:1])


def test_a_memory_mapped_dataset_trains_like_its_copy_in_memory(tmp_path, rows):
    np.save(tmp_path / "rows.npy", rows)
    mapped = np.load(tmp_path / "rows.npy", mmap_mode="r")
    a = train(mapped, TrainConfig(epochs=1), CPU)
    b = train(np.array(rows), TrainConfig(epochs=1), CPU)
    assert a.threshold == b.threshold and np.array_equal(a.mean, b.mean)
