"""Real export shapes through ``ds-ops train`` (tests/export_cases.py), Parquet/Arrow, sidecars, model names."""

from __future__ import annotations

import decimal
import json

import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest
import torch

from export_cases import CASES, gzip_bomb
from opt_ds_ops import cli
from opt_ds_ops.config.conffile import DatasetConfig
from opt_ds_ops.dataset import DatasetError, load_dataset


def train_cli(capsys, tmp_path, path, *extra: str) -> tuple[int, dict | str]:
    """Run ``ds-ops train PATH --json`` in this process; return (exit code, summary or stderr)."""
    code = cli.main(["train", str(path), "--json", "--models-dir", str(tmp_path / "models"), "--device", "cpu",
                     "--epochs", "1", "--config", str(tmp_path / "none.yaml"), *extra])
    out, err = capsys.readouterr()
    return code, (json.loads(out.strip().splitlines()[-1]) if code == 0 else err)


@pytest.fixture
def no_conffile(tmp_path):
    (tmp_path / "none.yaml").write_text("")


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_each_export_shape_gives_what_a_user_expects_in_ds_ops_train(capsys, tmp_path, no_conffile, case):
    _, file_name, content, expect = case
    path = tmp_path / file_name
    path.write_bytes(content())
    code, got = train_cli(capsys, tmp_path, path)
    if expect[0] == "refused":
        assert code == 1 and "Traceback" not in got
        assert got.startswith(f"ds-ops: error: {path}: ") and expect[1] in got, got
        return
    assert code == 0, got
    assert got["features"] == expect[1]
    md = json.loads((tmp_path / "models" / got["name"] / "current" / "metadata.json").read_text())
    summary = dict(got, header=md["dataset"]["header"])
    if expect[2] is not None:
        expect[2](summary)


def test_a_gzip_that_inflates_past_max_dataset_bytes_is_stopped_while_read(capsys, tmp_path):
    path = tmp_path / "bomb.csv.gz"
    path.write_bytes(gzip_bomb())
    assert path.stat().st_size < 20_000
    (tmp_path / "none.yaml").write_text("spool:\n  max_dataset_bytes: 1000000\n")
    code, err = train_cli(capsys, tmp_path, path)
    assert code == 1 and "more than 1000000 bytes of text after decompression" in err
    assert "spool.max_dataset_bytes" in err


def test_two_file_names_that_clean_up_to_one_model_name_are_never_merged(capsys, tmp_path, no_conffile):
    rows = "".join(f"{i % 7},{i % 5}\n" for i in range(200)).encode()
    first, second = tmp_path / "gpu nöde 1.csv", tmp_path / "gpu_nüde_1.csv"
    first.write_bytes(rows)
    second.write_bytes(rows)
    code, got = train_cli(capsys, tmp_path, first)
    assert code == 0 and got["name"] == "gpu_n_de_1"
    code, err = train_cli(capsys, tmp_path, second)
    assert code == 1 and "is already the model of another dataset, 'gpu nöde 1.csv'" in err
    assert [p.name for p in (tmp_path / "models" / "gpu_n_de_1").iterdir()
            if not p.is_symlink() and not p.name.startswith(".")] == [got["version"]]  # .current.log: the store's
    code, again = train_cli(capsys, tmp_path, first)  # the same file again: a new version, as before
    assert code == 0 and again["name"] == "gpu_n_de_1" and again["version"] != got["version"]
    (tmp_path / "gpu_nüde_1.yaml").write_text("name: gpu_nuede_1\n")  # the sidecar sets the name
    code, named = train_cli(capsys, tmp_path, second)
    assert code == 0 and named["name"] == "gpu_nuede_1"


def test_a_sidecar_leaves_out_text_columns_and_an_invalid_one_is_refused_by_key(capsys, tmp_path, no_conffile):
    path = tmp_path / "nvsmi.csv"  # nvidia-smi --query-gpu=timestamp,name,temperature.gpu,pstate --format=csv,noheader,nounits
    path.write_text("".join(f"2024/05/18 12:00:{i % 60:02d}.{i:03d}, NVIDIA H200, {40 + i % 7}, P{i % 2}\n"
                            for i in range(120)))
    code, err = train_cli(capsys, tmp_path, path)
    assert code == 1 and "column 2 holds text ('NVIDIA H200', line 1)" in err and "exclude_columns: [2, 4]" in err
    (tmp_path / "nvsmi.yaml").write_text("exclude_columns: [2, 4]\n")
    code, got = train_cli(capsys, tmp_path, path)
    assert code == 0 and got["features"] == 1 and got["time"]["kind"] == "iso8601"
    assert {d["column"] for d in got["left_out"]} == {"column 1", "column 2", "column 4"}
    (tmp_path / "nvsmi.yaml").write_text("exclude_column: [2, 4]\n")
    code, err = train_cli(capsys, tmp_path, path)
    assert code == 1 and "nvsmi.yaml: unknown key 'exclude_column'" in err


def test_command_line_options_select_columns_and_the_time_column(capsys, tmp_path, no_conffile):
    path = tmp_path / "m.csv"
    path.write_text("when,cpu,mem,host\n" + "".join(f"{1716000000 + i},{i % 7},{i % 3},h1\n" for i in range(100)))
    code, err = train_cli(capsys, tmp_path, path)
    assert code == 1 and "column 4 ('host') holds text" in err  # 'when' is not a time name: a feature
    code, got = train_cli(capsys, tmp_path, path, "--time-column", "when", "--exclude-columns", "host")
    assert code == 0 and got["features"] == 2 and got["time"]["column"] == "when"
    code, got = train_cli(capsys, tmp_path, path, "--columns", "cpu", "--time-column", "none")
    assert code == 0 and got["features"] == 1 and got["time"] is None


def test_rows_out_of_time_order_are_sorted_or_refused(tmp_path):
    path = tmp_path / "late.csv"
    path.write_text("time,v\n2024-05-18T00:00:00Z,1\n2024-05-18T00:02:00Z,3\n2024-05-18T00:01:00Z,2\n"
                    "2024-05-18T00:03:00Z,4\n")
    ds = load_dataset(str(path))
    np.testing.assert_allclose(ds.values()[:, 0], [1, 2, 3, 4])
    assert ds.time.sorted_rows == 2 and "first at line 4" in ds.notes[0]
    s = ds.time.summary()
    assert s["first"] == "2024-05-18T00:00:00.000000Z" and s["median_step_s"] == 60.0 and s["gaps"] == 0
    with pytest.raises(DatasetError, match=r"line 4: time 2024-05-18T00:01:00.000000Z is earlier than the row before"):
        load_dataset(str(path), options=DatasetConfig(time_order="refuse"))


def test_gaps_and_a_bad_timestamp_later_in_the_file(tmp_path):
    path = tmp_path / "gappy.csv"
    times = [0, 60, 120, 180, 900, 960, 1020]
    path.write_text("timestamp,v\n" + "".join(f"{1716000000 + t},{t % 7}\n" for t in times))
    assert load_dataset(str(path)).time.summary()["gaps"] == 1  # 720 s > 3 x 60 s
    bad = tmp_path / "bad.csv"
    bad.write_text("time,v\n" + "".join(f"2024-05-18T00:{i:02d}:00Z,{i}\n" for i in range(55)) + "yesterday,3\n")
    with pytest.raises(DatasetError, match=r"line 57, column 1 \('time'\): 'yesterday' is not an ISO 8601 timestamp"):
        load_dataset(str(bad))


def test_a_time_named_column_that_holds_no_times_is_refused(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("time,v\n0.5,1\n0.2,2\n0.9,3\n")
    with pytest.raises(DatasetError, match="named like a time column but holds"):
        load_dataset(str(path))
    assert load_dataset(str(path), options=DatasetConfig(time_column="none")).features == 2


def test_a_pandas_index_of_a_filtered_or_sorted_frame_is_dropped_and_a_broken_one_refused(tmp_path):
    filtered = tmp_path / "filtered.csv"  # df[df.cpu > x].to_csv(): the index keeps its gaps
    filtered.write_text(",cpu,load\n" + "".join(f"{i},{i % 7},{i % 3}\n" for i in range(0, 400, 3)))
    ds = load_dataset(str(filtered))
    assert ds.header == ["cpu", "load"] and ds.left_out == [{"column": "column 1", "why": "row index (integers)"}]
    path = tmp_path / "idx.csv"
    path.write_text(",a\n" + "".join(f"{i},{i % 3}\n" for i in range(60)) + "99.5,1\n")
    with pytest.raises(DatasetError, match=r"line 62, column 1: 99.5 where an integer row index was expected"):
        load_dataset(str(path))
    headerless = tmp_path / "counted.csv"  # no header: only 0, 1, 2, ... is an index, checked to the end
    headerless.write_text("".join(f"{i},{i % 3}\n" for i in range(60)) + "99,1\n")
    with pytest.raises(DatasetError, match=r"line 61, column 1: 99 where the row index 60 was expected"):
        load_dataset(str(headerless))


# ---------------------------------------------------------------------------------- Parquet / Arrow

def table(rows: int = 200) -> pa.Table:
    rng = np.random.default_rng(1)
    ts = pa.array(np.datetime64("2024-05-18T00:00:00") + np.arange(rows) * np.timedelta64(60, "s"),
                  type=pa.timestamp("ms", tz="UTC"))
    return pa.table({"ts": ts, "cpu": rng.random(rows), "mem": rng.integers(0, 100, rows).astype(np.int32),
                     "up": pa.array([True] * rows), "host": pa.array(["gpu1"] * rows)})


@pytest.mark.parametrize("suffix", [".parquet", ".feather", ".arrow"])
def test_parquet_and_arrow_numeric_columns_are_features_and_timestamps_the_index(tmp_path, suffix):
    path = str(tmp_path / ("m" + suffix))
    t = table()
    write = pq.write_table if suffix == ".parquet" else feather.write_feather
    write(t, path)
    with pytest.raises(DatasetError, match=r"column 5 \('host'\) holds text \('gpu1', row 1\)"):
        load_dataset(path)
    ds = load_dataset(path, options=DatasetConfig(exclude_columns=("host",)))
    assert ds.header == ["cpu", "mem", "up"] and ds.features == 3 and ds.time.kind == "timestamp"
    assert ds.time.summary()["median_step_s"] == 60.0
    np.testing.assert_allclose(ds.values()[:, 0], t.column("cpu").to_numpy(), atol=1e-6)


def test_pandas_index_columns_in_parquet_are_dropped(tmp_path):
    t = pa.table({"cpu": [0.1, 0.2, 0.3], "__index_level_0__": [10, 11, 12]})
    meta = {b"pandas": json.dumps({"index_columns": ["__index_level_0__"], "columns": []}).encode()}
    pq.write_table(t.replace_schema_metadata(meta), tmp_path / "p.parquet")
    ds = load_dataset(str(tmp_path / "p.parquet"))
    assert ds.header == ["cpu"] and {"column": "column 2 ('__index_level_0__')", "why": "pandas index"} in ds.left_out


def test_parquet_budgets_are_checked_before_reading(tmp_path):
    from opt_ds_ops.dataset import DatasetLimits

    pq.write_table(pa.table({"a": np.zeros(100_000), "b": np.zeros(100_000)}), tmp_path / "z.parquet")
    small = DatasetLimits(max_decompressed_bytes=1 << 30, max_columns=10, max_matrix_bytes=100_000)
    with pytest.raises(DatasetError, match="100000 rows of 2 features need 800000 bytes as float32"):
        load_dataset(str(tmp_path / "z.parquet"), small)
    tight = DatasetLimits(max_decompressed_bytes=10_000, max_columns=10, max_matrix_bytes=1 << 30)
    with pytest.raises(DatasetError, match="the columns read hold 1600000 bytes decoded"):
        load_dataset(str(tmp_path / "z.parquet"), tight)


# ------------------------------------------------------------------- no traceback from any input

def odd_tensors():
    base = torch.rand(6, 4)
    yield "grad", torch.rand(6, 4, requires_grad=True)
    yield "view", base[::2]
    yield "transposed", base.t()
    yield "0-d", torch.tensor(1.5)
    yield "complex", torch.zeros(4, 2, dtype=torch.complex64)
    yield "integer", torch.arange(12).reshape(6, 2)
    yield "bool", torch.ones(6, 2, dtype=torch.bool)
    yield "expanded", torch.rand(1, 3).expand(5, 3)
    yield "half", torch.rand(6, 2).half()
    yield "rank3", torch.zeros(2, 2, 2)


def odd_arrays():
    yield "structured", np.zeros(4, dtype=[("a", "f4"), ("b", "i4")])
    yield "0-d", np.array(3.0)
    yield "bool", np.ones((4, 2), dtype=bool)
    yield "complex", np.zeros((4, 2), dtype=np.complex128)
    yield "integer", np.arange(8, dtype=np.int16).reshape(4, 2)
    yield "fortran", np.asfortranarray(np.random.default_rng(0).random((5, 3)))
    yield "strided", np.random.default_rng(0).random((8, 3))[::2]
    yield "datetime", np.array([["2024-05-18"] * 2] * 3, dtype="datetime64[D]")
    yield "bytes", np.array([[b"ab", b"cd"]] * 3)
    yield "float16", np.ones((4, 2), dtype=np.float16)


def odd_tables():
    yield "list", pa.table({"a": pa.array([[1.0], [2.0], [3.0]]), "b": [1.0, 2.0, 3.0]})
    yield "struct", pa.table({"a": pa.array([{"x": 1}, {"x": 2}]), "b": [1.0, 2.0]})
    yield "dictionary", pa.table({"a": pa.array(["x", "y"]).dictionary_encode(), "b": [1.0, 2.0]})
    yield "nulls", pa.table({"a": pa.array([None, None, None], type=pa.float64()), "b": [1.0, 2.0, 3.0]})
    yield "decimal", pa.table({"a": pa.array([decimal.Decimal("1.25"), decimal.Decimal("2.50"), decimal.Decimal("3.75")], type=pa.decimal128(10, 2)), "b": [1.0, 2.0, 3.0]})
    yield "date", pa.table({"d": pa.array([19000, 19001, 19002], type=pa.date32()), "b": [1.0, 2.0, 3.0]})
    yield "empty", pa.table({"a": pa.array([], type=pa.float64())})
    yield "no columns", pa.table({})
    yield "int64 big", pa.table({"a": pa.array([2**62, 2**62 + 1, 5], type=pa.int64())})
    yield "naive ts", pa.table({"t": pa.array([0, 60_000, 120_000], type=pa.timestamp("ms")), "b": [1.0, 2.0, 3.0]})


def test_no_reader_lets_an_odd_object_through_as_anything_but_a_dataset_error(tmp_path):
    seen = []
    for what, t in odd_tensors():
        torch.save(t, tmp_path / f"{what}.pt")
        seen.append(tmp_path / f"{what}.pt")
    for what, a in odd_arrays():
        np.save(tmp_path / f"{what}.npy", a)
        np.savez(tmp_path / f"{what}.npz", a=a)
        seen += [tmp_path / f"{what}.npy", tmp_path / f"{what}.npz"]
    for what, t in odd_tables():
        pq.write_table(t, tmp_path / f"{what}.parquet")
        feather.write_feather(t, str(tmp_path / f"{what}.feather"))
        seen += [tmp_path / f"{what}.parquet", tmp_path / f"{what}.feather"]
    outcomes = {}
    for path in seen:
        try:
            ds = load_dataset(str(path))
            assert ds.data.dtype == np.float32 and ds.data.ndim == 2 and np.isfinite(ds.data).all()
            outcomes[path.name] = "loaded"
        except DatasetError as e:
            assert str(e).startswith(str(path) + ": ") and "\n" not in str(e)
            outcomes[path.name] = "refused"
    assert outcomes["grad.pt"] == outcomes["view.pt"] == outcomes["transposed.pt"] == "loaded"
    assert outcomes["0-d.pt"] == outcomes["complex.pt"] == outcomes["structured.npy"] == "refused"
    assert outcomes["list.parquet"] == outcomes["nulls.parquet"] == outcomes["empty.feather"] == "refused"
    assert outcomes["decimal.parquet"] == outcomes["date.parquet"] == "loaded"


def test_a_grafana_time_column_gives_the_same_model_as_the_data_without_it(capsys, tmp_path, no_conffile, smd_rows):
    """Same feature count, same flagged fraction (within 1 point) on later rows."""
    from opt_ds_ops.model.detection import score_rows
    from opt_ds_ops.store.versions import load_model

    train_rows, later = smd_rows[:4000], smd_rows[4000:7000]
    names = ",".join(f'"m{i}"' for i in range(smd_rows.shape[1]))

    def write(path, rows, start, with_time):
        with open(path, "w") as f:
            f.write(('"Time",' if with_time else "") + names + "\n")
            for i, r in enumerate(rows):
                f.write((f"{1716000000000 + 60000 * (start + i)}," if with_time else "") + ",".join(f"{v:.6f}" for v in r) + "\n")

    fractions, features = {}, {}
    for with_time in (True, False):
        tag = "timed" if with_time else "plain"
        write(tmp_path / f"{tag}.csv", train_rows, 0, with_time)
        write(tmp_path / f"{tag}-later.csv", later, 4000, with_time)
        code, got = train_cli(capsys, tmp_path, tmp_path / f"{tag}.csv")
        assert code == 0, got
        features[tag] = got["features"]
        model = load_model(got["model_dir"])
        ds = load_dataset(str(tmp_path / f"{tag}-later.csv"))
        fractions[tag] = float((score_rows(model, ds.data, offset=ds.offset) > model.threshold).mean())
    assert features["timed"] == features["plain"] == smd_rows.shape[1]
    assert abs(fractions["timed"] - fractions["plain"]) <= 0.01, fractions


def test_an_arrow_stream_is_read_whole_whatever_its_batches(tmp_path):
    t = table(400)
    for batches in (1, 4):
        path = tmp_path / f"s{batches}.arrow"
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, t.schema) as w:
            for b in t.to_batches(max_chunksize=400 // batches):
                w.write_batch(b)
        ds = load_dataset(str(path), options=DatasetConfig(exclude_columns=("host",)))
        assert ds.rows == 400 and ds.time.summary()["first"] == "2024-05-18T00:00:00.000000Z"
        np.testing.assert_allclose(ds.values()[:, 0], t.column("cpu").to_numpy(), atol=1e-6)


def test_interleaved_series_train_pooled_and_say_so(tmp_path):
    path = tmp_path / "two-gpus.csv"  # nvidia-smi -l 1 on a 2-GPU server: one line per GPU per second
    path.write_text("".join(f"2024/05/18 12:{i // 120:02d}:{i // 2 % 60:02d}.000, {40 + i % 2}, {100 + i % 7}\n"
                            for i in range(240)))
    ds = load_dataset(str(path))
    assert ds.time.shared_times == 120 and "several series" in " ".join(ds.notes)


def test_score_keeps_labels_with_their_rows_and_names_file_columns(capsys, tmp_path, no_conffile):
    rng = np.random.default_rng(3)
    rows = rng.normal(size=(600, 2)) * [1, 5] + [20, 100]
    order = np.arange(600)
    order[100:110] = order[100:110][::-1]  # ten rows written out of time order
    lines = [f"2024-05-18T{i // 60:02d}:{i % 60:02d}:00Z, label-free, {a:.4f}, {b:.4f}\n" for i, (a, b) in enumerate(rows)]
    train = tmp_path / "gpu.csv"
    train.write_text("".join(lines))
    (tmp_path / "gpu.yaml").write_text("exclude_columns: [2]\n")
    code, got = train_cli(capsys, tmp_path, train)
    assert code == 0, got
    test_rows = rows.copy()
    test_rows[300:306, 1] += 200  # a spike in file column 4, rows 300-305
    spiky = [f"2024-05-18T{i // 60:02d}:{i % 60:02d}:00Z, x, {a:.4f}, {b:.4f}\n" for i, (a, b) in enumerate(test_rows)]
    shuffled = [spiky[i] for i in order]
    (tmp_path / "later.csv").write_text("".join(shuffled))
    labels = np.zeros(600, dtype=int)
    labels[300:306] = 1
    (tmp_path / "labels.txt").write_text("".join(f"{labels[i]}\n" for i in order))
    code = cli.main(["score", got["model_dir"], str(tmp_path / "later.csv"), "--labels", str(tmp_path / "labels.txt"),
                     "--output", str(tmp_path / "out.csv"), "--config", str(tmp_path / "none.yaml")])
    out = capsys.readouterr().out
    assert code == 3 and "were sorted by column 1" in out and "row numbers below count rows in time order" in out
    assert "column 4 " in out  # the spike's metric, numbered as the file numbers it (column 2 was left out)
    written = (tmp_path / "out.csv").read_text().splitlines()
    assert written[0] == "row,time,score,anomaly,label,top_metrics"
    flagged_labels = [line.split(",")[4] for line in written[1:] if line.split(",")[3] == "1"]
    assert flagged_labels and flagged_labels.count("1") == 6  # the labels moved with their rows
    assert written[301].split(",")[1] == "2024-05-18T05:00:00.000000Z"


@pytest.mark.slow  # a long run: see the marker in pyproject.toml
def test_short_commands_that_read_a_csv_never_abort_at_the_interpreters_exit(tmp_path):
    """A process that reads a small CSV and exits at once, with torch loaded (its teardown is long)
    and the other core busy, must exit with its own status. Before the text reader gave Arrow a
    buffer Arrow owns, an Arrow CPU thread releasing the Python bytes took the GIL during
    finalisation and the process died of SIGABRT ("terminate called without an active exception"):
    30 of 40 runs of this script here, 28 of 100 ``ds-ops score`` runs."""
    import subprocess
    import sys

    data = tmp_path / "narrow.csv"
    data.write_text("1,2\n3,4\n")
    script = (
        "import sys, torch\n"
        "from opt_ds_ops.dataset import load_dataset\n"
        f"load_dataset({str(data)!r})\n"
        "sys.exit(3)\n"
    )
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        codes = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
                 for _ in range(8)]
    finally:
        hog.kill()
        hog.wait()
    assert [p.returncode for p in codes] == [3] * 8, [p.stderr[-300:] for p in codes if p.returncode != 3]
