"""A version's reading contract: what the model reads (levels, or each metric's change beside its
level) is stored with it and read back. A version saved before inputs of differences existed
scores after the upgrade exactly as it did; a model of differences survives the store."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import SMD_TEST
from opt_ds_ops.config.conffile import TrainConfig
from opt_ds_ops.health.device import plan_device
from opt_ds_ops.model.detection import in_memory_model, score_rows
from opt_ds_ops.store.versions import StoreError, load_model, model_payload, save_model
from opt_ds_ops.training.fit import train

BEFORE = Path(__file__).parent / "data" / "version-before-differences"


def test_a_version_saved_before_inputs_of_differences_scores_as_it_did(tmp_path):
    """tests/store/data/version-before-differences: model.pt saved by ds-ops before this change
    (commit d6c6bc1, 150 steps on 3,000 rows of machine-1-2) and scores.npy, the scores that code
    gave rows 15000-16999 of its test period. Loaded and scored now: the same scores (1e-6), and
    it reads levels alone."""
    version = tmp_path / "machine-1-2" / "v"
    shutil.copytree(BEFORE, version)
    stored = load_model(str(version))
    assert stored.diff is None and stored.input_window == 1 and stored.model.n_features == 38
    rows = np.loadtxt(SMD_TEST, delimiter=",", dtype=np.float32)[15000:17000]
    then = np.load(BEFORE / "scores.npy")
    np.testing.assert_allclose(score_rows(stored, rows), then, rtol=0, atol=1e-6)


def test_a_model_of_differences_is_stored_and_read_back_with_its_scaler(tmp_path, smd_rows):
    torch.manual_seed(0)
    result = train(smd_rows[:3000], TrainConfig(max_steps=100, input_differences=True, difference_term="mean"),
                   plan_device("cpu", "off"))
    path, _ = save_model(str(tmp_path), "m", model_payload(result), {"dataset": {"file": "m.csv"}})
    stored = load_model(path)
    assert (stored.input_window, stored.window_error, stored.model.n_features) == (2, "window", 76)
    assert all(t.shape == (38,) and t.dtype == torch.float32 for t in stored.diff)
    rows = smd_rows[3000:4000]
    assert np.array_equal(score_rows(stored, rows), score_rows(in_memory_model(result), rows))  # the gate's = live
    payload = torch.load(os.path.join(path, "model.pt"), weights_only=True)
    for broken in ({"diff_std": payload["diff_std"][:5]}, {"input_window": 1}, {"window_error": "last"},
                   {"diff_mean": None}):
        torch.save(dict(payload, **broken), os.path.join(path, "model.pt"))
        with pytest.raises(StoreError, match="reading differences"):
            load_model(path)


def test_inputs_of_differences_need_input_window_1_and_the_rows_in_memory(smd_rows):
    from opt_ds_ops.training.fit import TrainingError

    with pytest.raises(TrainingError, match="needs train.input_window 1"):
        train(smd_rows[:500], TrainConfig(epochs=1, input_differences=True, input_window=3), plan_device("cpu", "off"))


def test_a_model_whose_term_is_the_larger_of_change_and_level_keeps_it_in_its_contract(tmp_path, smd_rows):
    """train.difference_term max: each metric's term is the larger of its change's and its level's
    normalised error (window_error ``max`` in model.pt); read back, it scores as in memory, and
    its cells are the elementwise max of the two halves of the model's own errors."""
    from opt_ds_ops.model.detection import normalised_errors, standardise_rows
    from opt_ds_ops.model.network import feature_errors, model_inputs

    torch.manual_seed(0)
    result = train(smd_rows[:3000], TrainConfig(max_steps=100, difference_term="max"), plan_device("cpu", "off"))
    path, _ = save_model(str(tmp_path), "m", model_payload(result), {"dataset": {"file": "m.csv"}})
    stored = load_model(path)
    assert (stored.input_window, stored.window_error, stored.model.n_features) == (2, "max", 76)
    rows = smd_rows[3000:4000]
    assert np.array_equal(score_rows(stored, rows), score_rows(in_memory_model(result), rows))
    x = standardise_rows(stored, rows).clamp_(-stored.input_clip, stored.input_clip)
    terms = (feature_errors(stored.model, model_inputs(x, 2, diff=stored.diff, clip=stored.input_clip))
             / stored.error_scale).reshape(len(rows), 2, 38)
    cells = normalised_errors(stored, rows)
    np.testing.assert_array_equal(cells, terms.amax(dim=1).numpy())
    assert (cells > terms.mean(dim=1).numpy()).mean() > 0.5  # not the mean of the two
    payload = torch.load(os.path.join(path, "model.pt"), weights_only=True)
    torch.save(dict(payload, window_error="last"), os.path.join(path, "model.pt"))
    with pytest.raises(StoreError, match="window or max"):
        load_model(path)


def test_window_error_max_is_refused_for_a_model_of_levels(tmp_path, smd_rows):
    """max folds a metric's change and level terms: a model without differences saying it is refused."""
    torch.manual_seed(0)
    result = train(smd_rows[:500], TrainConfig(max_steps=5, input_differences=False, input_window=2,
                                               window_error="window"), plan_device("cpu", "off"))
    path, _ = save_model(str(tmp_path), "m", model_payload(result), {"dataset": {"file": "m.csv"}})
    payload = torch.load(os.path.join(path, "model.pt"), weights_only=True)
    torch.save(dict(payload, window_error="max"), os.path.join(path, "model.pt"))
    with pytest.raises(StoreError, match="window_error max is for a model reading differences"):
        load_model(path)
