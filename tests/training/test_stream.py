"""Datasets larger than the job's memory budget: an .npy streamed from disk (opt_ds_ops.training.stream)."""

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

from opt_ds_ops.config.conffile import Config, JobConfig, TrainConfig
from opt_ds_ops.dataset import DatasetError, DatasetLimits, load_dataset
from opt_ds_ops.health.device import plan_device
from opt_ds_ops.training.job import run_job
from opt_ds_ops.model.detection import score_rows
from opt_ds_ops.store.versions import load_model
from opt_ds_ops.dataset.npyrows import NpyRows
from opt_ds_ops.training.stream import streaming_scaler
from opt_ds_ops.training.fit import TrainingInterrupted, fit_scaler, train


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
    # centred by the offset the loaded float64 file gets: the same float32 bits either way
    loaded = load_dataset(str(path), dataclasses.replace(_limits(1 << 30), stream_large_npy=False))
    np.testing.assert_array_equal(ds.offset, loaded.offset)
    np.testing.assert_array_equal(ds.data.read(123, 4567), loaded.data[123:4567])
    np.testing.assert_allclose(ds.data.read(123, 4567) + ds.offset, full[123:4567], rtol=0, atol=1e-5)
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
    from opt_ds_ops.config.conffile import DatasetConfig

    path = _write_npy(tmp_path / "big.npy", 5_000)
    ds = load_dataset(str(path), _limits(1000), DatasetConfig(exclude_columns=["2", "5"]))
    assert ds.features == 6 and ds.feature_columns == [0, 2, 3, 5, 6, 7]
    np.testing.assert_array_equal(ds.data.read(0, 10), np.load(path)[:10][:, [0, 2, 3, 5, 6, 7]])


def test_the_streaming_scaler_equals_the_in_memory_one(tmp_path, monkeypatch):
    import opt_ds_ops.dataset.npyrows as npyrows

    monkeypatch.setattr(npyrows, "CHUNK_BYTES", 4096)  # many chunks of 128 rows
    path = _write_npy(tmp_path / "s.npy", 20_001)
    src = load_dataset(str(path), _limits(1000)).data
    mean, std = streaming_scaler(src, 19_000)
    ref_mean, ref_std = fit_scaler(np.load(path)[:19_000])
    np.testing.assert_allclose(mean, ref_mean, rtol=1e-12)
    np.testing.assert_allclose(std, ref_std, rtol=1e-9)


def test_streamed_training_learns_like_in_memory_training_and_its_threshold_scores_like_ds_ops_score(tmp_path, monkeypatch):
    import opt_ds_ops.dataset.npyrows as npyrows

    monkeypatch.setattr(npyrows, "CHUNK_BYTES", 64 * 1024)  # 2,048-row chunks: 20 windows an epoch
    path = _write_npy(tmp_path / "t.npy", 60_000)
    # levels alone: streaming equivalence with in-memory training is under test, not the model's input
    # (a streamed dataset cannot read differences: a job reads it levels alone)
    cfg = TrainConfig(epochs=3, batch_size=512, lr=1e-3,  # the seed's step size: two orders of batches compared
                      input_differences=False)
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
    from opt_ds_ops.model.detection import in_memory_model

    val = np.load(path)[54_000:]
    scores = score_rows(in_memory_model(streamed), val)
    np.testing.assert_allclose(scores, streamed.extra["validation_scores"], rtol=1e-4, atol=1e-5)
    assert streamed.threshold == pytest.approx(float(np.quantile(scores.astype(np.float64), 0.99)), rel=1e-4)


def test_a_stopped_streamed_run_resumes_exactly(tmp_path, monkeypatch):
    import opt_ds_ops.dataset.npyrows as npyrows

    monkeypatch.setattr(npyrows, "CHUNK_BYTES", 32 * 1024)
    path = _write_npy(tmp_path / "r.npy", 30_000)
    src = load_dataset(str(path), _limits(1000)).data
    cfg = TrainConfig(epochs=2, batch_size=256, input_differences=False)  # levels alone: the checkpoint is under test
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


@pytest.mark.parametrize("rows, reads", [(6_000, "differences"), (7_000, "levels")])
def test_a_matrix_over_half_the_budget_reads_levels_alone_and_says_why(tmp_path, rows, reads):
    """Differences need about twice training's memory beside the matrix: a dataset in memory under
    half of job.max_matrix_bytes reads them (as shipped), one over half reads levels alone, with
    the note, instead of running out of memory near the budget."""
    path = _write_npy(tmp_path / "fleet.npy", rows)  # rows x 8 float32: 192,000 and 224,000 bytes
    cfg = Config(models_dir=str(tmp_path / "models"), device="cpu", amp="off",
                 train=TrainConfig(epochs=1), job=JobConfig(max_matrix_bytes=400_000))
    md = json.loads(open(os.path.join(run_job(str(path), cfg).model_dir, "metadata.json")).read())
    assert md["data_placement"] != "streamed"
    note = [n for n in md["dataset"]["notes"] if n.startswith("reads each metric's level alone")]
    if reads == "differences":
        assert md["input_differences"] is True and note == [], md["dataset"]["notes"]
    else:
        assert md["input_differences"] is False
        assert note and "over half of the job's matrix budget (job.max_matrix_bytes, 400,000 bytes)" in note[0], note


def _telemetry_exports(tmp_path, rows: int = 20_000):
    """The same real-looking telemetry as a CSV with a header, a quoted epoch time column and a
    column near 1e6 (centring matters), and as Parquet of 4 row groups with a timestamp column."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(7)
    t = 1.7e9 + 10.0 * np.arange(rows)
    x = rng.normal(size=(rows, 5)) * [1, 10, 100, 1, 0.5] + [0, 1e6, 50, 0, 3]
    csv = tmp_path / "fleet.csv"
    with open(csv, "w") as f:
        f.write('"timestamp","cpu","mem_kb","net","disk","load"\n')
        for tr, xr in zip(t, x):
            f.write(f'"{tr:.0f}",' + ",".join(f"{v:.6f}" for v in xr) + "\n")
    parquet = tmp_path / "fleet.parquet"
    table = pa.table({"time": pa.array((t * 1e6).astype("int64")).cast(pa.timestamp("us", tz="UTC")),
                      **{f"m{i}": x[:, i] for i in range(5)}})
    pq.write_table(table, parquet, row_group_size=rows // 4)
    return csv, parquet, x


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_a_table_over_the_budget_is_converted_once_to_a_npy_that_holds_the_in_memory_matrix(tmp_path, fmt):
    """Text and Parquet over max_matrix_bytes, read by a job (spill_dir set), go into spill_dir's
    float32 .npy while they are read: the same bits, offset, time index and column names as the
    matrix read in memory under a large budget; without a spill_dir (scoring) they are refused."""
    from opt_ds_ops.dataset.core import SPILL_FILE

    csv, parquet, x = _telemetry_exports(tmp_path)
    path = str(csv if fmt == "csv" else parquet)
    spill = tmp_path / "job"
    spill.mkdir()
    big = load_dataset(path, _limits(1 << 30))
    small = load_dataset(path, dataclasses.replace(_limits(100_000), spill_dir=str(spill)))
    assert isinstance(big.data, np.ndarray) and isinstance(small.data, NpyRows)
    assert small.data.path == str(spill / SPILL_FILE) and small.rows == 20_000 and small.features == 5
    np.testing.assert_array_equal(small.data.read(0, 20_000), big.data)
    np.testing.assert_array_equal(np.load(spill / SPILL_FILE), big.data)  # a plain .npy numpy reads
    np.testing.assert_array_equal(small.offset, big.offset)
    np.testing.assert_allclose(small.data.read(0, 20_000) + small.offset, x, rtol=0, atol=1e-6 * 1e6)
    assert small.header == big.header and small.time.summary() == big.time.summary()
    with pytest.raises(DatasetError, match="max_matrix_bytes"):
        load_dataset(path, _limits(100_000))


def test_rows_out_of_time_order_in_a_table_over_the_budget_are_refused_not_sorted_on_disk(tmp_path):
    rows = np.column_stack([1.7e9 + 10.0 * np.arange(6000), np.random.default_rng(0).normal(size=(6000, 3))])
    rows[[4000, 4001]] = rows[[4001, 4000]]
    path = tmp_path / "late.csv"
    np.savetxt(path, rows, delimiter=",", header="time,a,b,c", comments="", fmt="%.6f")
    (tmp_path / "job").mkdir()
    limits = dataclasses.replace(_limits(20_000), spill_dir=str(tmp_path / "job"))
    with pytest.raises(DatasetError, match=r"line 4003: time .* is earlier than the row before .* over "
                                           r"job.max_matrix_bytes and stream from disk, where they are not sorted"):
        load_dataset(str(path), limits)
    assert load_dataset(str(path), _limits(1 << 30)).notes[0].startswith("rows out of time order")


def test_a_spill_file_that_cannot_be_written_is_a_storage_error_not_the_datasets(tmp_path):
    from opt_ds_ops.dataset import SpillError
    from opt_ds_ops.training.job import JobError

    csv, _parquet, _x = _telemetry_exports(tmp_path, rows=6000)
    (tmp_path / "not-a-dir").write_text("")
    with pytest.raises(SpillError) as e:
        load_dataset(str(csv), dataclasses.replace(_limits(20_000), spill_dir=str(tmp_path / "not-a-dir")))
    assert "cannot write" in str(e.value) and e.value.errno is not None
    cfg = Config(models_dir=str(tmp_path / "models"), device="cpu", amp="off", train=TrainConfig(epochs=1),
                 job=JobConfig(max_matrix_bytes=20_000))
    with pytest.raises(JobError) as je:
        run_job(str(csv), cfg, scratch_dir=str(tmp_path / "not-a-dir"))
    assert je.value.stage == "dataset" and je.value.errno == e.value.errno


def test_ds_ops_train_streams_a_csv_over_its_budget_and_leaves_no_conversion_behind(tmp_path):
    """The command a user runs: a 20,000-row CSV under a 100 kB matrix budget trains from its
    converted .npy (data_placement streamed), the stored scaler holds the file's column means (the
    offset added back), and models_dir keeps no .convert-PID directory, nor one a killed run left."""
    from conftest import run_cli

    csv, _parquet, x = _telemetry_exports(tmp_path)
    models = tmp_path / "models"
    (models / ".convert-999999999").mkdir(parents=True)  # a killed run's: no such process
    conf = tmp_path / "trainer.yaml"
    conf.write_text(yaml.safe_dump({"job": {"max_matrix_bytes": 100_000}}))
    p = run_cli("train", str(csv), "--models-dir", str(models), "--config", str(conf), "--epochs", "1",
                "--device", "cpu", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["data_placement"] == "streamed" and out["rows"] == 20_000 and out["features"] == 5
    model = load_model(out["model_dir"])
    np.testing.assert_allclose(model.mean, x[:18_000].mean(axis=0), rtol=1e-9, atol=1e-6)
    assert sorted(os.listdir(models)) == ["fleet"]
    # the shipped default reads differences (the conffile leaves it), which need the rows in memory:
    # the streamed run reads each metric's level alone, and its version's metadata and notes say so
    from opt_ds_ops.config.conffile import load_config

    assert load_config(str(conf)).train.input_differences is True
    md = json.loads(open(os.path.join(out["model_dir"], "metadata.json")).read())
    assert md["input_differences"] is False and model.diff is None and model.n_features == 5
    assert any(n.startswith("reads each metric's level alone") and "streams from disk" in n
               for n in md["dataset"]["notes"]), md["dataset"]["notes"]
    assert out["notes"] == md["dataset"]["notes"]


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


def test_a_streamed_run_stops_on_a_plateau_of_its_epochs_and_at_max_steps(tmp_path, monkeypatch):
    import opt_ds_ops.dataset.npyrows as npyrows

    monkeypatch.setattr(npyrows, "CHUNK_BYTES", 32 * 1024)  # 1,024-row chunks, 4 to a window of 16 steps
    path = _write_npy(tmp_path / "p.npy", 30_000)
    src = load_dataset(str(path), _limits(1000)).data
    plan = plan_device("cpu", "off")
    # levels alone: the stopping rule of a streamed run and its measured figures are under test, not the input
    cfg = TrainConfig(epochs=12, batch_size=256, patience=2, min_delta=0.0, min_steps=0, lr=0.05, error_floor=1e-9,
                      input_differences=False)
    r = train(src, cfg, plan)
    vals = [h.val_loss for h in r.history]  # measured: 0.0140 0.0148 0.0115 0.0136 0.0198
    assert (r.stopping["reason"], r.stopping["evaluated"], len(vals)) == ("plateau", "epoch", 5)
    assert r.stopping["best_val_loss"] == min(vals) == vals[2] and r.stopping["restored_best"]
    assert r.stopping["best_step"] * 5 == r.stopping["steps"] * 3
    # the error scale is the restored (epoch 3) model's: its mean is epoch 3's validation loss
    assert float(r.error_scale.mean()) == pytest.approx(vals[2], rel=1e-5)
    assert r.val_loss == pytest.approx(vals[2], rel=1e-5)  # metadata's final_val_loss: the published model's
    m = train(src, TrainConfig(epochs=50, batch_size=256, max_steps=30, input_differences=False), plan)
    assert (m.stopping["reason"], len(m.history)) == ("max_steps", 1) and 30 <= m.stopping["steps"] < 48
