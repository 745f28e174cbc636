"""Datasets larger than the job's memory budget: an .npy streamed from disk (opt_ds_ops.stream)."""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml

from opt_ds_ops.config import Config, JobConfig, TrainConfig
from opt_ds_ops.dataset import DatasetError, DatasetLimits, load_dataset
from opt_ds_ops.device import plan_device
from opt_ds_ops.job import run_job
from opt_ds_ops.score import score_rows
from opt_ds_ops.store import load_model
from opt_ds_ops.stream import NpyRows, streaming_scaler
from opt_ds_ops.train import TrainingInterrupted, fit_scaler, train


def _write_npy(path, rows: int, cols: int = 8, dtype=np.float32, seed: int = 0, chunk: int = 1_000_000):
    """A low-rank telemetry-like matrix written chunk by chunk (never whole in memory)."""
    rng = np.random.default_rng(seed)
    mix = rng.standard_normal((4, cols))
    out = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=(rows, cols))
    for s in range(0, rows, chunk):
        e = min(s + chunk, rows)
        out[s:e] = (rng.standard_normal((e - s, 4)) @ mix + 0.1 * rng.standard_normal((e - s, cols)) + 50).astype(dtype)
    out.flush()
    del out
    return path


def _limits(matrix_bytes: int) -> DatasetLimits:
    return DatasetLimits(max_decompressed_bytes=1 << 40, max_columns=4096, max_matrix_bytes=matrix_bytes,
                         stream_large_npy=True)


def test_an_npy_over_the_budget_is_opened_for_streaming_and_reads_the_same_rows(tmp_path):
    path = _write_npy(tmp_path / "big.npy", 30_000, dtype=np.float64)
    ds = load_dataset(str(path), _limits(100_000))
    assert isinstance(ds.data, NpyRows) and ds.rows == 30_000 and ds.features == 8
    full = np.load(path)
    np.testing.assert_array_equal(ds.data.read(123, 4567), full[123:4567].astype(np.float32))
    # without the flag (scoring, ds-ops check) the same file is refused by the budget, as before
    with pytest.raises(DatasetError, match="max_matrix_bytes"):
        load_dataset(str(path), dataclasses.replace(_limits(100_000), stream_large_npy=False))
    # a streamed dataset is checked like a loaded one: a NaN is named by row and column
    bad = np.load(path)
    bad[20_000, 3] = np.nan
    np.save(tmp_path / "nan.npy", bad)
    with pytest.raises(DatasetError, match=r"row 20001, column 4: value nan is not finite"):
        load_dataset(str(tmp_path / "nan.npy"), _limits(100_000))
    # a truncated file is refused before training
    with open(tmp_path / "cut.npy", "wb") as f:
        f.write(path.read_bytes()[:-100])
    with pytest.raises(DatasetError, match="truncated"):
        load_dataset(str(tmp_path / "cut.npy"), _limits(100_000))


def test_columns_are_picked_while_rows_are_read(tmp_path):
    from opt_ds_ops.config import DatasetConfig

    path = _write_npy(tmp_path / "big.npy", 5_000)
    ds = load_dataset(str(path), _limits(1000), DatasetConfig(exclude_columns=["2", "5"]))
    assert ds.features == 6 and ds.feature_columns == [0, 2, 3, 5, 6, 7]
    np.testing.assert_array_equal(ds.data.read(0, 10), np.load(path)[:10][:, [0, 2, 3, 5, 6, 7]])


def test_the_streaming_scaler_equals_the_in_memory_one(tmp_path, monkeypatch):
    import opt_ds_ops.stream as stream

    monkeypatch.setattr(stream, "CHUNK_BYTES", 4096)  # many chunks of 128 rows
    path = _write_npy(tmp_path / "s.npy", 20_001)
    src = load_dataset(str(path), _limits(1000)).data
    mean, std = streaming_scaler(src, 19_000)
    ref_mean, ref_std = fit_scaler(np.load(path)[:19_000])
    np.testing.assert_allclose(mean, ref_mean, rtol=1e-12)
    np.testing.assert_allclose(std, ref_std, rtol=1e-9)


def test_streamed_training_learns_like_in_memory_training_and_its_threshold_scores_like_ds_ops_score(tmp_path, monkeypatch):
    import opt_ds_ops.stream as stream

    monkeypatch.setattr(stream, "CHUNK_BYTES", 64 * 1024)  # 2,048-row chunks: 20 windows an epoch
    path = _write_npy(tmp_path / "t.npy", 60_000)
    cfg = TrainConfig(epochs=3, batch_size=512)
    plan = plan_device("cpu", "off")
    streamed = train(load_dataset(str(path), _limits(1000)).data, cfg, plan)
    loaded = train(np.load(path), cfg, plan)
    assert streamed.data_placement == "streamed" and "streamed from disk" in streamed.placement_note
    np.testing.assert_allclose(streamed.mean, loaded.mean, rtol=1e-9)
    # a block shuffle is not the in-memory permutation: the models differ, but learn as well
    assert streamed.history[-1].train_loss == pytest.approx(loaded.history[-1].train_loss, rel=0.15)
    assert streamed.history[-1].val_loss == pytest.approx(loaded.history[-1].val_loss, rel=0.15)
    assert streamed.history[-1].train_loss < streamed.history[0].train_loss
    assert streamed.threshold == pytest.approx(loaded.threshold, rel=0.25)
    # the stored threshold is the quantile of the validation scores as scoring computes them
    from opt_ds_ops.score import in_memory_model

    val = np.load(path)[54_000:]
    scores = score_rows(in_memory_model(streamed), val)
    np.testing.assert_allclose(scores, streamed.extra["validation_scores"], rtol=1e-4, atol=1e-5)
    assert streamed.threshold == pytest.approx(float(np.quantile(scores.astype(np.float64), 0.99)), rel=1e-4)


def test_a_stopped_streamed_run_resumes_exactly(tmp_path, monkeypatch):
    import opt_ds_ops.stream as stream

    monkeypatch.setattr(stream, "CHUNK_BYTES", 32 * 1024)
    path = _write_npy(tmp_path / "r.npy", 30_000)
    src = load_dataset(str(path), _limits(1000)).data
    cfg = TrainConfig(epochs=2, batch_size=256)
    plan = plan_device("cpu", "off")
    whole = train(src, cfg, plan)
    polls = {"n": 0}

    def stop_on_the_5th_window():
        polls["n"] += 1
        return polls["n"] == 5

    with pytest.raises(TrainingInterrupted) as stopped:
        train(src, cfg, plan, should_stop=stop_on_the_5th_window)
    ck = stopped.value.checkpoint
    assert ck["streamed"] and ck["epoch"] == 0 and ck["batch"] == 5
    resumed = train(src, cfg, plan, resume=ck)
    assert [h.train_loss for h in resumed.history] == [h.train_loss for h in whole.history]
    assert resumed.threshold == whole.threshold
    for a, b in zip(resumed.model.state_dict().values(), whole.model.state_dict().values()):
        assert torch.equal(a, b)


def test_a_job_streams_an_npy_over_its_budget_and_stores_a_model_that_scores(tmp_path):
    path = _write_npy(tmp_path / "fleet.npy", 40_000)
    cfg = Config(models_dir=str(tmp_path / "models"), device="cpu", amp="off",
                 train=TrainConfig(epochs=1), job=JobConfig(max_matrix_bytes=200_000))
    job = run_job(str(path), cfg)
    md = json.loads(open(os.path.join(job.model_dir, "metadata.json")).read())
    assert md["data_placement"] == "streamed" and md["dataset"]["rows"] == 40_000
    assert md["validation_scores"]["rows"] == 4_000
    model = load_model(job.model_dir)
    scores = score_rows(model, np.load(path)[-4000:])
    assert np.isfinite(scores).all()
    assert (scores > model.threshold).mean() == pytest.approx(0.01, abs=0.01)


@pytest.mark.slow
def test_a_2_gib_npy_trains_under_a_1_gib_memory_max_with_peak_rss_under_it(tmp_path):
    """Acceptance: a .npy of 2 GiB (16.8 M x 32 float32) with job.memory_max 1G trains to a model;
    `ds-ops train` runs with RLIMIT_DATA = 1 GiB and its peak RSS (wait4's ru_maxrss) stays below 1 GiB."""
    rows = 2 * 1024**3 // (32 * 4)
    path = _write_npy(tmp_path / "fleet-2g.npy", rows, cols=32)
    assert os.path.getsize(path) > 2 * 1024**3
    conf = tmp_path / "trainer.yaml"
    conf.write_text(yaml.safe_dump({"job": {"memory_max": "1G"}, "train": {"epochs": 1}, "device": "cpu"}))
    budget = 1024**3

    def limit():
        resource.setrlimit(resource.RLIMIT_DATA, (budget, budget))

    p = subprocess.Popen([sys.executable, "-m", "opt_ds_ops.cli", "train", str(path), "--config", str(conf),
                          "--models-dir", str(tmp_path / "models"), "--json"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=limit, text=True)
    out, err = p.communicate(timeout=1500)
    assert p.returncode == 0, err
    result = json.loads(out)
    md = json.loads(open(os.path.join(result["model_dir"], "metadata.json")).read())
    assert md["data_placement"] == "streamed" and md["dataset"]["rows"] == rows
    peak = md["peak_rss_bytes"]
    print(f"2 GiB .npy ({rows:,} x 32): peak RSS {peak / 1024**2:.0f} MiB, {result['samples_per_s']:,.0f} samples/s")
    assert peak < budget
