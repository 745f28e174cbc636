"""Many models trained as one stack (opt_ds_ops/training/stacked.py) equal each trained alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from opt_ds_ops.config.conffile import TrainConfig
from opt_ds_ops.health.device import plan_device
from opt_ds_ops.model.detection import in_memory_model, score_rows
from opt_ds_ops.training.common import TrainingError
from opt_ds_ops.training.fit import train
from opt_ds_ops.training.stacked import stack_key, train_stacked

CPU = plan_device("cpu", "off")


def _slices(smd_rows, starts, rows=3000) -> list[np.ndarray]:
    """Real SMD rows from different stretches of the bundled machine: each model stops differently."""
    return [np.ascontiguousarray(smd_rows[s:s + rows]) for s in starts]


def _assert_same(alone, stacked, test_rows) -> None:
    assert stacked.stopping == alone.stopping
    assert [h.epoch for h in stacked.history] == [h.epoch for h in alone.history]
    np.testing.assert_allclose([h.val_loss for h in stacked.history], [h.val_loss for h in alone.history], rtol=1e-6)
    assert stacked.threshold == pytest.approx(alone.threshold, rel=1e-6)
    np.testing.assert_allclose(stacked.error_scale, alone.error_scale, rtol=1e-6)
    np.testing.assert_array_equal(stacked.mean, alone.mean)
    np.testing.assert_array_equal(stacked.std, alone.std)
    sa, sb = alone.model.state_dict(), stacked.model.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        np.testing.assert_allclose(sb[key].double().numpy(), sa[key].double().numpy(), rtol=1e-5, atol=1e-7, err_msg=key)
    np.testing.assert_allclose(score_rows(in_memory_model(stacked), test_rows),
                               score_rows(in_memory_model(alone), test_rows), rtol=1e-5)


def test_models_trained_in_one_stack_equal_each_trained_alone(smd_rows):
    # a plateau rule that stops each model at its own step, some in the middle of an epoch (11
    # batches an epoch, an evaluation every 4 steps), so models leave the stack at different times
    cfg = TrainConfig(patience=3, min_delta=0.02, min_steps=0, eval_every_steps=4, batch_size=256)
    data = _slices(smd_rows, (0, 6000, 12000, 18000))
    alone = [train(d, cfg, CPU) for d in data]
    stacked = train_stacked(data, cfg, CPU)
    steps = [r.stopping["steps"] for r in alone]
    assert len(set(steps)) > 1, steps  # the test needs models that leave the stack at different steps
    assert any(s % 11 for s in steps), steps  # and one that stops mid-epoch
    for a, b in zip(alone, stacked):
        _assert_same(a, b, smd_rows[20000:21000])
        assert b.step_mode == "stacked (4 models)" and b.rows_train == a.rows_train == 2700


def test_the_shipped_defaults_in_a_stack_equal_alone_to_the_last_step(smd_rows):
    """600 steps at lr 1e-2 amplify any difference of rounding (two runs that differ only in torch's
    thread count end percents apart), so this holds only because the stack computes what one model does."""
    cfg = TrainConfig(max_steps=200)
    data = _slices(smd_rows, (1000, 9000), rows=4000)
    for a, b in zip([train(d, cfg, CPU) for d in data], train_stacked(data, cfg, CPU)):
        _assert_same(a, b, smd_rows[20000:21000])


def test_models_of_differences_stack_and_equal_each_trained_alone(smd_rows):
    """train.input_differences: each model's inputs are its metrics' changes beside their levels
    (2 x 38 wide), its difference scaler its own; a stack of them equals each trained alone."""
    cfg = TrainConfig(max_steps=120, input_differences=True)
    data = _slices(smd_rows, (1000, 9000), rows=4000)
    assert stack_key(data[0], cfg) == (4000, 38)
    for a, b in zip([train(d, cfg, CPU) for d in data], train_stacked(data, cfg, CPU)):
        _assert_same(a, b, smd_rows[20000:21000])
        assert b.model.n_features == 76 and b.input_window == 2 and b.window_error == "window"
        for x, y in zip(a.diff, b.diff):
            np.testing.assert_array_equal(x, y)


def test_a_model_whose_loss_is_not_finite_fails_alone_and_the_others_are_unchanged(smd_rows):
    cfg = TrainConfig(max_steps=30, eval_every_steps=10)
    data = _slices(smd_rows, (0, 6000, 12000))
    data[1] = data[1].copy()
    data[1][100, 3] = np.nan  # a dataset the loader would refuse, given to the trainer directly
    alone_ok = [train(data[0], cfg, CPU), train(data[2], cfg, CPU)]
    out = train_stacked(data, cfg, CPU)
    assert isinstance(out[1], TrainingError) and "non-finite" in str(out[1])
    _assert_same(alone_ok[0], out[0], smd_rows[20000:21000])
    _assert_same(alone_ok[1], out[2], smd_rows[20000:21000])


def test_datasets_of_other_shapes_or_windowed_inputs_are_not_stacked(smd_rows):
    cfg = TrainConfig()
    a, b = smd_rows[:3000], smd_rows[:2000]
    assert stack_key(a, cfg) == (3000, 38) and stack_key(b, cfg) == (2000, 38)
    assert stack_key(a, TrainConfig(input_window=4)) is None
    with pytest.raises(ValueError, match="one stack"):
        train_stacked([a, b], cfg, CPU)
    with pytest.raises(ValueError, match="one stack"):
        train_stacked([a, a[:, :30]], cfg, CPU)
    with pytest.raises(ValueError, match="one stack"):
        train_stacked([], cfg, CPU)
    with pytest.raises(ValueError, match="offsets"):
        train_stacked([a, a], cfg, CPU, offsets=[np.zeros(38)])
    with pytest.raises(ValueError, match="offsets"):
        train_stacked([a, a], cfg, CPU, offsets=[np.zeros(37), None])
    with pytest.raises(ValueError, match="GradScaler"):
        train_stacked([a, a], cfg, plan_device("cpu", "fp16"))


def test_the_stack_publishes_the_offset_in_the_scaler_mean(smd_rows):
    cfg = TrainConfig(max_steps=10, eval_every_steps=5)
    data = _slices(smd_rows, (0, 6000))
    offset = np.full(38, 1e6)
    alone = train(data[0], cfg, CPU, offset=offset)
    stacked = train_stacked(data, cfg, CPU, offsets=[offset, None])
    np.testing.assert_array_equal(stacked[0].mean, alone.mean)
    assert stacked[0].threshold == alone.threshold
    assert torch.equal(stacked[1].model.state_dict()["decoder.3.bias"], train(data[1], cfg, CPU).model.state_dict()["decoder.3.bias"])
