"""Dataset reading: every accepted format and every refused one, on real files."""

from __future__ import annotations

import dataclasses
import gzip
import os
import pickle
import tracemalloc

import numpy as np
import pytest
import torch
from conftest import pt_with_pickle

from opt_ds_ops.config.conffile import JobConfig, TrainConfig
from opt_ds_ops.dataset import DatasetError, DatasetLimits, dataset_stem, load_dataset
from opt_ds_ops.health.device import plan_device
from opt_ds_ops.training.fit import train

ROWS = np.array([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [0.7, 0.8, 0.9]], dtype=np.float32)


def write(tmp_path, name: str, text: str | bytes) -> str:
    path = tmp_path / name
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return str(path)


@pytest.mark.parametrize(
    "name, text",
    [
        ("comma.csv", "0.1,0.2,0.3\n0.4,0.5,0.6\n0.7,0.8,0.9\n"),
        ("semicolon.csv", "0.1;0.2;0.3\n0.4;0.5;0.6\n0.7;0.8;0.9\n"),
        ("tab.tsv", "0.1\t0.2\t0.3\n0.4\t0.5\t0.6\n0.7\t0.8\t0.9\n"),
        ("space.txt", "0.1 0.2  0.3\n0.4 0.5 0.6\n 0.7 0.8 0.9\n"),
        ("header.csv", "cpu,mem,disk\n0.1,0.2,0.3\n0.4,0.5,0.6\n0.7,0.8,0.9\n"),
        ("bom_crlf.csv", "\ufeffcpu,mem,disk\r\n0.1,0.2,0.3\r\n0.4,0.5,0.6\r\n0.7,0.8,0.9\r\n"),
        ("trailing_delim.csv", "0.1,0.2,0.3,\n0.4,0.5,0.6,\n0.7,0.8,0.9,\n"),
        ("blank_tail.csv", "0.1,0.2,0.3\n0.4,0.5,0.6\n0.7,0.8,0.9\n\n\n  \n"),
        ("no_final_newline.csv", "0.1,0.2,0.3\n0.4,0.5,0.6\n0.7,0.8,0.9"),
    ],
)
def test_text_variants_found_in_real_exports_load_to_the_same_matrix(tmp_path, name, text):
    ds = load_dataset(write(tmp_path, name, text))
    np.testing.assert_allclose(ds.values(), ROWS, rtol=1e-6)
    assert ds.data.dtype == np.float32 and ds.offset.dtype == np.float64


def test_header_names_are_kept(tmp_path):
    ds = load_dataset(write(tmp_path, "h.csv", "\ufeffcpu,mem,disk,\r\n1,2,3,\r\n4,5,6,\r\n"))
    assert ds.header == ["cpu", "mem", "disk"]
    assert ds.data.shape == (2, 3)


def test_gzip_text_and_real_smd_file(tmp_path):
    path = tmp_path / "rows.csv.gz"
    with gzip.open(path, "wt") as f:
        f.write("1,2\n3,4\n")
    assert load_dataset(str(path)).values().tolist() == [[1, 2], [3, 4]]
    from conftest import SMD_TRAIN

    smd = load_dataset(str(SMD_TRAIN))
    assert smd.data.shape == (23694, 38)
    assert smd.name == "machine-1-2"


def test_npy_is_memory_mapped_not_copied(tmp_path):
    path = tmp_path / "rows.npy"
    np.save(path, ROWS)
    ds = load_dataset(str(path))
    assert isinstance(ds.data, np.memmap)
    np.testing.assert_array_equal(ds.data, ROWS)


def test_npz_with_one_array_and_pt_plain_tensor(tmp_path):
    np.savez(tmp_path / "one.npz", rows=ROWS)
    np.testing.assert_array_equal(load_dataset(str(tmp_path / "one.npz")).data, ROWS)
    torch.save(torch.from_numpy(ROWS), tmp_path / "t.pt")
    np.testing.assert_array_equal(load_dataset(str(tmp_path / "t.pt")).data, ROWS)


def test_integer_npy_is_accepted(tmp_path):
    np.save(tmp_path / "ints.npy", np.arange(12, dtype=np.int64).reshape(4, 3))
    assert load_dataset(str(tmp_path / "ints.npy")).data.shape == (4, 3)


@pytest.mark.parametrize(
    "name, content, expected",
    [
        ("empty.csv", "", "empty file"),
        ("blank.csv", "\n\n  \n", "empty file"),
        ("header_only.csv", "a,b,c\n", "only a header line (line 1), no data rows"),
        ("one_row.csv", "1,2,3\n", "1 row(s); at least 2"),
        ("cell.csv", "1,2,3\n4,5,6\n7,x,9\n", "line 3, column 2: 'x' is not a number"),
        ("cell_after_header.csv", "a,b\n1,2\n3,oops\n", "line 3, column 2"),
        ("ragged.csv", "1,2,3\n4,5,6\n7,8\n", "line 3: ragged rows"),
        ("short_after_trailing_delim.csv", "1,2,3,\n4,5,6,\n7,8\n", "line 3: ragged rows: the number of columns changes from 3 to 2"),
        ("nan.csv", "1,2,3\n4,nan,6\n", "line 2, column 2: a missing value (empty, NA or NaN)"),
        ("empty_cell.csv", "a,b\n1,2\n3,\n", "line 3, column 2 ('b'): a missing value"),
        ("inf.csv", "a,b\n1,2\n3,4\n5,inf\n", "line 4, column 2 ('b'): value inf is not finite"),
        ("data.json", "{}", "unknown dataset format"),
        ("data.parquet", "PAR1", "not a readable Parquet file"),
        ("data.feather", "ARROW1", "not an Arrow IPC file or stream"),
    ],
)
def test_bad_text_is_refused_naming_file_line_and_column(tmp_path, name, content, expected):
    path = write(tmp_path, name, content)
    with pytest.raises(DatasetError) as err:
        load_dataset(path)
    assert str(err.value).startswith(path + ": ")
    assert expected in str(err.value)


def test_bad_arrays_are_refused(tmp_path):
    np.save(tmp_path / "rank1.npy", np.arange(5.0))
    np.save(tmp_path / "rank3.npy", np.zeros((2, 2, 2)))
    np.save(tmp_path / "obj.npy", np.array([[{"a": 1}, None]], dtype=object), allow_pickle=True)
    np.save(tmp_path / "complex.npy", np.zeros((3, 2), dtype=np.complex64))
    np.save(tmp_path / "nan.npy", np.array([[1.0, 2.0], [np.nan, 1.0]]))
    np.savez(tmp_path / "two.npz", a=ROWS, b=ROWS)
    expectations = {
        "rank1.npy": "rank 1",
        "rank3.npy": "rank 3",
        "obj.npy": "not a plain numeric .npy",
        "complex.npy": "dtype complex64",
        "nan.npy": "row 2, column 1: value nan is not finite",
        "two.npz": "holds 2 arrays",
    }
    for name, expected in expectations.items():
        with pytest.raises(DatasetError, match=expected):
            load_dataset(str(tmp_path / name))


def test_pickle_in_pt_is_never_executed(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    evil = pickle.dumps(Evil(), protocol=2)  # the protocol torch.save uses
    (tmp_path / "evil.pt").write_bytes(evil)  # torch.load reads a bare pickle as its legacy format
    pt_with_pickle(tmp_path / "evil-zip.pt", evil)  # a torch.save archive, its data.pkl the evil one
    torch.save({"rows": torch.zeros(3, 2)}, tmp_path / "dict.pt")
    with pytest.raises(DatasetError, match="not a torch.save zip archive"):
        load_dataset(str(tmp_path / "evil.pt"))
    with pytest.raises(DatasetError, match=r"its pickle calls (posix|os)\.system;"):
        load_dataset(str(tmp_path / "evil-zip.pt"))
    assert not marker.exists()
    with pytest.raises(DatasetError, match=r"not a plain tensor file \(its pickle has EMPTY_DICT at byte 2, building a "
                                           r"dict: save the one tensor, torch.save\(obj\[KEY\], FILE\);"):
        load_dataset(str(tmp_path / "dict.pt"))


def test_unreadable_and_corrupt_gzip_are_clear_errors(tmp_path):
    with pytest.raises(DatasetError, match="cannot read"):
        load_dataset(str(tmp_path / "missing.csv"))
    path = write(tmp_path, "broken.csv.gz", b"\x1f\x8b\x08\x00not really gzip")
    with pytest.raises(DatasetError, match="cannot read"):
        load_dataset(path)
    path = write(tmp_path, "latin1.csv", b"a,b\n1,2\n\xff\xfe,3\n")
    with pytest.raises(DatasetError, match="line 3: not UTF-8 text"):
        load_dataset(path)


def test_dataset_stem_strips_format_and_gzip_suffixes():
    assert dataset_stem("/x/machine-1-2.txt.gz") == "machine-1-2"
    assert dataset_stem("rows.npy") == "rows"
    assert dataset_stem("a.b.csv") == "a.b"
    assert dataset_stem("weird") == "weird"


# ------------------------------------------------------------------ budgets while reading

ROOMY = DatasetLimits(max_decompressed_bytes=1 << 30, max_columns=4096, max_matrix_bytes=1 << 30)


def traced_peak(fn):
    """Return (fn's exception or None, peak bytes of Python and numpy allocations while fn ran)."""
    tracemalloc.start()
    try:
        fn()
        err = None
    except DatasetError as e:
        err = e
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return err, peak


def test_limits_come_from_the_job_section_of_the_config():
    job = JobConfig(memory_max="8G", max_decompressed_bytes=1000, max_columns=7)
    assert DatasetLimits.from_config(job) == DatasetLimits(1000, 7, (8 * 1024**3 - 400 * 1024**2) // 4)
    assert DatasetLimits.from_config(JobConfig(max_matrix_bytes=12345)).max_matrix_bytes == 12345


def test_gzip_text_is_refused_once_it_inflates_past_max_decompressed_bytes(tmp_path):
    path = tmp_path / "bomb.csv.gz"
    with gzip.open(path, "wb") as f:
        f.write(b"0,0\n" * (16 * 1024**2))  # 64 MiB of text, 64 KiB on disk
    limits = dataclasses.replace(ROOMY, max_decompressed_bytes=1_000_000)
    err, peak = traced_peak(lambda: load_dataset(str(path), limits))
    assert str(err).startswith(f"{path}: more than 1000000 bytes of text after decompression")
    assert "job.max_decompressed_bytes (or spool.max_dataset_bytes, if smaller) is 1000000" in str(err)
    assert peak < 40 * 1024**2  # the float32 matrix of 16 Mi rows alone would be 128 MiB


def test_plain_text_counts_against_max_decompressed_bytes_too(tmp_path):
    path = write(tmp_path, "big.csv", "1,2\n" * 1000)
    with pytest.raises(DatasetError, match=r"more than 3999 bytes of text; job.max_decompressed_bytes \(or spool.max_dataset_bytes, if smaller\) is 3999"):
        load_dataset(path, dataclasses.replace(ROOMY, max_decompressed_bytes=3999))
    assert load_dataset(path, dataclasses.replace(ROOMY, max_decompressed_bytes=4000)).rows == 1000


@pytest.mark.parametrize("delim", [",", "\t", ";", " "])
def test_a_first_line_of_a_million_fields_is_refused_before_it_is_parsed(tmp_path, delim):
    path = write(tmp_path, "wide.csv", (delim.join(["0"] * 1_000_000) + "\n") * 3)  # 2 MB a line
    err, peak = traced_peak(lambda: load_dataset(path))  # default limits: job.max_columns 4096
    assert str(err) == f"{path}: line 1 has more than 4096 fields; job.max_columns is 4096"
    assert peak < 4 * 1024**2  # parsing it would take 3 x 1M float64 (24 MB)


def test_rows_wider_than_max_columns_are_refused_with_their_count(tmp_path):
    narrow = dataclasses.replace(ROOMY, max_columns=3)
    with pytest.raises(DatasetError, match=r"line 1 has 4 fields; job.max_columns is 3$"):
        load_dataset(write(tmp_path, "a.csv", "1,2,3,4\n5,6,7,8\n"), narrow)
    with pytest.raises(DatasetError, match=r"line 3 has 4 fields; job.max_columns is 3$"):
        load_dataset(write(tmp_path, "b.csv", "a,b,c\n\n1,2,3,4\n"), narrow)
    assert load_dataset(write(tmp_path, "c.csv", "1,2,3,\n4,5,6,\n"), narrow).features == 3  # trailing delimiter


def test_a_later_line_longer_than_max_columns_allows_is_refused_while_read(tmp_path):
    path = write(tmp_path, "long.csv", "1,2\n3,4\n" + "5" * 2_000_000 + "\n")
    with pytest.raises(DatasetError, match=r"a line longer than 1048576 bytes; job.max_columns is 4096 \(a line may take 256 bytes a field"):
        load_dataset(path)


def test_rows_past_max_matrix_bytes_are_refused_without_parsing_the_rest(tmp_path):
    limit = dataclasses.replace(ROOMY, max_matrix_bytes=100 * 3 * 4)
    rows = "".join(f"{i % 7},{i % 5},{i % 3}\n" for i in range(101))
    assert load_dataset(write(tmp_path, "hundred.csv", rows[: rows.rindex("\n", 0, -1) + 1]), limit).rows == 100
    path = write(tmp_path, "more.csv", rows + "x,y,z\n")  # line 102 lies past the limit: the limit is what is reported
    with pytest.raises(DatasetError) as err:
        load_dataset(path, limit)
    assert str(err.value) == (f"{path}: more than 100 rows of 3 columns; the float32 matrix would pass "
                              "job.max_matrix_bytes (1200 bytes, 12 bytes a row)")


def test_npy_header_is_checked_before_the_data_is_mapped(tmp_path):
    np.save(tmp_path / "int8.npy", np.zeros((4, 2_000_000), dtype=np.int8))
    with pytest.raises(DatasetError, match=r"array of shape \(4, 2000000\) has 2000000 columns; job.max_columns is 4096"):
        load_dataset(str(tmp_path / "int8.npy"))
    # a header that claims 1e12 rows, and no data at all
    header = tmp_path / "claims.npy"
    with open(header, "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": (10**12, 8)})
    with pytest.raises(DatasetError, match=r"needs 32000000000000 bytes as float32; job.max_matrix_bytes is \d+"):
        load_dataset(str(header))


def test_a_deflated_npz_is_refused_by_its_member_size_without_inflating_it(tmp_path):
    path = tmp_path / "zeros.npz"
    np.savez_compressed(path, rows=np.zeros((4096, 4096), dtype=np.float32))  # 64 MiB, ~65 KB deflated
    assert os.path.getsize(path) < 200_000
    limits = dataclasses.replace(ROOMY, max_decompressed_bytes=1_000_000)
    err, peak = traced_peak(lambda: load_dataset(str(path), limits))
    assert str(err) == f"{path}: array 'rows' inflates to 67108992 bytes; job.max_decompressed_bytes (or spool.max_dataset_bytes, if smaller) is 1000000"
    assert peak < 1024**2


def test_an_npz_member_header_is_checked_before_its_data_is_read(tmp_path):
    np.savez_compressed(tmp_path / "wide.npz", rows=np.zeros((2, 5000), dtype=np.int8))
    with pytest.raises(DatasetError, match=r"array 'rows' of shape \(2, 5000\) has 5000 columns; job.max_columns is 4096"):
        load_dataset(str(tmp_path / "wide.npz"))
    np.savez(tmp_path / "tall.npz", rows=np.zeros((100, 10), dtype=np.float64))
    with pytest.raises(DatasetError, match=r"needs 4000 bytes as float32; job.max_matrix_bytes is 3999"):
        load_dataset(str(tmp_path / "tall.npz"), dataclasses.replace(ROOMY, max_matrix_bytes=3999))


def test_an_expanded_pt_tensor_is_refused_by_its_shape_not_materialised(tmp_path):
    huge = torch.ones(1, 64, dtype=torch.float64).expand(2**31, 64)  # stride 0: 512 B of storage
    torch.save(huge, tmp_path / "huge.pt")
    assert os.path.getsize(tmp_path / "huge.pt") < 10_000
    with pytest.raises(DatasetError, match=r"tensor of shape \(2147483648, 64\) needs 549755813888 bytes as float32"):
        load_dataset(str(tmp_path / "huge.pt"))  # .float() first would ask for 512 GiB
    small = torch.arange(6, dtype=torch.float64).reshape(1, 6).expand(4, 6)
    torch.save(small, tmp_path / "small.pt")
    np.testing.assert_array_equal(load_dataset(str(tmp_path / "small.pt")).values(), small.numpy())


def test_a_pt_tensor_that_requires_grad_loads_and_trains(tmp_path):
    torch.save(torch.rand(64, 4, requires_grad=True), tmp_path / "grad.pt")
    ds = load_dataset(str(tmp_path / "grad.pt"))
    assert ds.data.shape == (64, 4) and ds.offset is None
    assert train(ds.data, TrainConfig(epochs=1, batch_size=16), plan_device("cpu", "off"), offset=ds.offset).rows_train > 0


# ------------------------------------------------------------------ float64 precision


@pytest.mark.parametrize("name, content, where", [
    ("big.csv", "1,2\n3,1e39\n5,6\n", "line 2, column 2"),
    ("big_header.tsv", "a\tb\n1\t2\n\n-4e38\t6\n", "line 4, column 1 ('a')"),
])
def test_text_values_beyond_float32_are_refused_naming_line_and_column(tmp_path, name, content, where):
    path = write(tmp_path, name, content)
    with pytest.raises(DatasetError) as err:
        load_dataset(path)
    assert str(err.value).startswith(f"{path}: {where}: value ") and "is beyond float32's range (+-3.40282e+38)" in str(err.value)


def test_array_values_beyond_float32_are_refused_naming_row_and_column(tmp_path):
    big = np.ones((4, 3))
    big[2, 1] = 1e39
    np.save(tmp_path / "big.npy", big)
    np.savez(tmp_path / "big.npz", big=big)
    torch.save(torch.from_numpy(big), tmp_path / "big.pt")
    for name in ("big.npy", "big.npz", "big.pt"):
        with pytest.raises(DatasetError, match=r"row 3, column 2: value 1e\+39 is beyond float32's range"):
            load_dataset(str(tmp_path / name))


def large_offset_rows(rows: int = 1000) -> np.ndarray:
    """(rows, 3) float64: a 1e8 + N(0, 1) column, a 1e12 counter and a small column."""
    rng = np.random.default_rng(0)
    return np.column_stack([1e8 + rng.normal(size=rows), 1e12 + np.arange(rows), rng.random(rows)])


def test_text_keeps_the_signal_of_columns_far_from_zero(tmp_path):
    values = large_offset_rows()
    path = tmp_path / "far.csv.gz"
    with gzip.open(path, "wt") as f:
        np.savetxt(f, values, delimiter=",", fmt="%.6f")
    ds = load_dataset(str(path))
    assert ds.data.dtype == np.float32 and ds.offset.dtype == np.float64 and ds.offset.shape == (3,)
    np.testing.assert_allclose(ds.values(), values, rtol=0, atol=2e-6)  # float32 alone: steps of 8 and 65536
    assert np.abs(ds.data).max() < 1000  # what is cast to float32 is centred


@pytest.mark.parametrize("name", ["far.npy", "far.npz", "far.pt"])
def test_float64_arrays_keep_the_signal_of_columns_far_from_zero(tmp_path, name):
    values = large_offset_rows()
    path = tmp_path / name
    if name.endswith(".npy"):
        np.save(path, values)
    elif name.endswith(".npz"):
        np.savez_compressed(path, far=values)
    else:
        torch.save(torch.from_numpy(values), path)
    ds = load_dataset(str(path))
    assert ds.data.dtype == np.float32 and ds.data.flags.c_contiguous and ds.offset.dtype == np.float64
    np.testing.assert_allclose(ds.values(), values, rtol=0, atol=1e-6)


def test_fortran_ordered_and_big_endian_arrays_are_read_in_row_order(tmp_path):
    values = large_offset_rows(50)
    np.save(tmp_path / "f.npy", np.asfortranarray(values))
    np.savez(tmp_path / "f.npz", f=np.asfortranarray(values))
    np.save(tmp_path / "be.npy", values.astype(">f8"))
    for name in ("f.npy", "f.npz", "be.npy"):
        np.testing.assert_allclose(load_dataset(str(tmp_path / name)).values(), values, rtol=0, atol=1e-6)


@pytest.fixture
def two_row_chunks(monkeypatch):
    """Parse text two rows of 3 columns at a time, so that chunk boundaries fall inside small files."""
    import opt_ds_ops.dataset.core as core

    monkeypatch.setattr(core, "CHUNK_BYTES", 2 * 3 * 8)


@pytest.mark.parametrize("content, expected", [
    ("1,2,3\n4,5,6\n7,8,9\n1,2,3\n  \n\n", None),  # a whitespace tail that starts a chunk
    ("1,2,3\n4,5,6\n7,8,9\n1,2,3\n1,2\n", "line 5: ragged rows: the number of columns changes from 3 to 2"),
    ("1,2,3\n4,5,6\n7,8,9\n1,2\n1,2,3\n", "line 4: ragged rows: the number of columns changes from 3 to 2"),
    ("1,2,3\n4,5,6\n\n7,8,9\n1,x,3\n", "line 5, column 2: 'x' is not a number"),
    ("a,b,c\n1,2,3\n4,5,6\n\n7,8,nan\n", "line 5, column 3 ('c'): a missing value (empty, NA or NaN)"),
])
def test_chunk_boundaries_keep_line_numbers_and_the_whitespace_tail(tmp_path, two_row_chunks, content, expected):
    path = write(tmp_path, "chunked.csv", content)
    if expected is None:
        np.testing.assert_array_equal(load_dataset(path).values(), [[1, 2, 3], [4, 5, 6], [7, 8, 9], [1, 2, 3]])
        return
    with pytest.raises(DatasetError) as err:
        load_dataset(path)
    assert str(err.value).startswith(f"{path}: {expected}")


def _write_rows(path, rows: np.ndarray, layout: str) -> None:
    """rows (float64) with a time column, as ds-ops pull writes them (epoch seconds, repr floats)
    or as scripts/replay_month.py does (ISO time, %.6g)."""
    from datetime import datetime, timezone

    start = 1_700_000_000
    with open(path, "w") as f:
        f.write("time," + ",".join(f"m{i}" for i in range(rows.shape[1])) + "\n")
        for i, r in enumerate(rows):
            t = start + 60 * i
            if layout == "puller":
                f.write(",".join([str(t)] + [repr(float(v)) for v in r]) + "\n")
            else:
                iso = datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
                f.write(iso + "," + ",".join(f"{v:.6g}" for v in r) + "\n")


def test_the_same_rows_give_the_same_matrix_and_model_whatever_the_text_layout(tmp_path):
    """10,080 rows of the bundled SMD machine (a week) written as the puller writes them and as the
    month replay does: Arrow's batches hold different numbers of rows (line lengths differ), yet the
    float32 matrix, its offset and the model trained on it are bit-identical (before: the offset
    was the first batch's means, 0.070840 against 0.070476 in one column, and two models)."""
    from tests.conftest import SMD_TRAIN

    rows = np.loadtxt(SMD_TRAIN, delimiter=",")[:10080]
    loaded = []
    for layout in ("puller", "replay"):
        path = tmp_path / f"{layout}.csv"
        _write_rows(path, rows, layout)
        loaded.append(load_dataset(str(path)))
    a, b = loaded
    assert os.path.getsize(tmp_path / "puller.csv") != os.path.getsize(tmp_path / "replay.csv")
    assert a.offset.tobytes() == b.offset.tobytes() and np.asarray(a.data).tobytes() == np.asarray(b.data).tobytes()
    cpu = plan_device("cpu", "off")
    ma = train(np.asarray(a.data), TrainConfig(epochs=2), cpu, offset=a.offset)
    mb = train(np.asarray(b.data), TrainConfig(epochs=2), cpu, offset=b.offset)
    assert ma.threshold == mb.threshold and ma.mean.tobytes() == mb.mean.tobytes()
    for (k, va), vb in zip(ma.model.state_dict().items(), mb.model.state_dict().values()):
        assert torch.equal(va, vb), k


def test_the_offset_does_not_depend_on_how_the_rows_are_cut_into_blocks():
    """Float32Builder: the same rows added in one block, in blocks of 7, or of 1500 give the same
    offset (the first OFFSET_ROWS rows' means) and the same float32 matrix."""
    from opt_ds_ops.dataset.core import OFFSET_ROWS, Float32Builder, rows_where

    rng = np.random.default_rng(5)
    values = np.column_stack([1e6 + rng.normal(size=3000), rng.random(3000)])
    out = []
    for step in (3000, 7, 1500, 1):
        build = Float32Builder("x", 2, rows_where)
        for s in range(0, len(values), step):
            build.add(values[s : s + step])
        out.append(build.finish())
    for data, offset in out:
        assert offset.tobytes() == values[:OFFSET_ROWS].mean(axis=0).tobytes()
        assert data.tobytes() == out[0][0].tobytes()
    short = Float32Builder("x", 2, rows_where)  # fewer rows than OFFSET_ROWS: all of them
    short.add(values[:10])
    short.add(values[10:20])
    assert short.n == 20 and short.finish()[1].tobytes() == values[:20].mean(axis=0).tobytes()
