"""Datasets built to break the readers: crafted Arrow buffers, all-constant
columns, CR-only line endings, a streamed float64 .npy. Real files; ``ds-ops train`` as a process."""

from __future__ import annotations

import dataclasses
import gzip
import json
import pickle
import struct
import tracemalloc
import zipfile

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
import torch
from conftest import pt_with_pickle, run_cli

from opt_ds_ops.config.conffile import DatasetConfig, JobConfig
from opt_ds_ops.dataset import DatasetError, DatasetLimits, load_dataset
from opt_ds_ops.dataset.npyrows import NpyRows

LIMITS = DatasetLimits.from_config(JobConfig())
TRAINING = dataclasses.replace(LIMITS, refuse_constant=True)
ROWS = 4


def _arrow_bytes(table: pa.Table, stream: bool) -> bytearray:
    sink = pa.BufferOutputStream()
    with (ipc.new_stream if stream else ipc.new_file)(sink, table.schema) as w:
        w.write_table(table)
    return bytearray(sink.getvalue().to_pybytes())


def _patch_offsets(data: bytearray, offsets: list[int], new: list[int]) -> None:
    """Overwrite the int32 offsets buffer that holds ``offsets`` (found in the IPC body) with ``new``."""
    old = struct.pack(f"<{len(offsets)}i", *offsets)
    assert data.count(old) == 1
    pos = data.find(old)
    data[pos : pos + len(old)] = struct.pack(f"<{len(new)}i", *new)


def crafted_arrow(path, stream: bool = False, reach: str = "far") -> str:
    """An Arrow IPC file (or stream) of a float column, a string column ``host`` ("ab" each row) and
    a string column ``note``; ``host``'s offsets are patched to point past its 8-byte data buffer:
    ``far``, 2 GB on (past the file: the first read of the value faults); ``note``, into ``note``'s
    bytes (the value would carry another column's bytes into messages)."""
    table = pa.table({"cpu": pa.array([float(i) for i in range(ROWS)]), "host": pa.array(["ab"] * ROWS),
                      "note": pa.array(["MARKER-OF-ANOTHER-COLUMN"] * ROWS)})
    data = _arrow_bytes(table, stream)
    offsets = [2 * i for i in range(ROWS + 1)]
    if reach == "far":
        new = offsets[:2] + [0x7FFF0000] * (ROWS - 1)
    else:
        new = [0] + [data.find(b"MARKER") - data.find(b"abababab") + 30] * ROWS
    _patch_offsets(data, offsets, new)
    path.write_bytes(bytes(data))
    return str(path)


# ------------------------------------------------------------------ row 3: Arrow buffers


def test_an_arrow_file_whose_string_offsets_point_past_its_buffers_is_refused_by_ds_ops_train(tmp_path):
    path = crafted_arrow(tmp_path / "crafted.arrow", reach="far")
    p = run_cli("train", path, "--models-dir", str(tmp_path / "models"), "--epochs", "1")
    assert p.returncode == 1, (p.returncode, p.stderr[-2000:])  # was 135 (SIGBUS) or 139 (SIGSEGV)
    assert "a record batch is not valid Arrow data" in p.stderr and "out of bounds" in p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize("stream", [False, True], ids=["file", "stream"])
@pytest.mark.parametrize("reach", ["far", "note"])
def test_a_crafted_arrow_batch_is_refused_before_a_value_is_read(tmp_path, stream, reach):
    path = crafted_arrow(tmp_path / "crafted.arrow", stream=stream, reach=reach)
    with pytest.raises(DatasetError, match=r"crafted.arrow: a record batch is not valid Arrow data \(.*out of bounds") as e:
        load_dataset(path, options=DatasetConfig(exclude_columns=("note",)))
    assert "MARKER" not in str(e.value)  # before: "column 2 ('host') holds text ('abababab\x00...MARKER-OF-...')"


def _long_cell(tmp_path, fmt: str) -> str:
    cell = "A" * 50_000
    if fmt == "csv":
        path = tmp_path / "long.csv"
        path.write_text(f"cpu,host\n1,{cell}\n2,b\n3,c\n")
    else:
        path = tmp_path / "long.arrow"
        path.write_bytes(bytes(_arrow_bytes(pa.table({"cpu": [1.0, 2.0, 3.0], "host": [cell, "b", "c"]}), False)))
    return str(path)


@pytest.mark.parametrize("fmt", ["csv", "arrow"])
def test_an_error_quotes_at_most_200_characters_of_a_cell(tmp_path, fmt):
    path = _long_cell(tmp_path, fmt)
    with pytest.raises(DatasetError, match=r"column 2 \('host'\) holds text \('A{200}'\.\.\. \(50000 characters\)") as e:
        load_dataset(path)
    assert len(str(e.value)) < 700


def test_an_error_quotes_at_most_200_characters_of_a_column_name(tmp_path):
    path = tmp_path / "name.csv"
    path.write_text(f"cpu,{'N' * 30_000}\n1,x\n2,y\n")
    with pytest.raises(DatasetError) as e:
        load_dataset(str(path))
    assert "N" * 200 in str(e.value) and "N" * 201 not in str(e.value) and len(str(e.value)) < 1000


# ------------------------------------------------------------------ row 4: constant columns


def _stride0_zeros(path, rows: int = 3_000_000, cols: int = 64) -> str:
    torch.save(torch.zeros(1, cols).expand(rows, cols), path)
    assert path.stat().st_size < 4096  # 3M x 64 float32 zeros: 768 MB as a matrix
    return str(path)


def test_a_dataset_whose_every_column_is_constant_is_refused_by_ds_ops_train(tmp_path):
    path = _stride0_zeros(tmp_path / "zeros.pt")
    p = run_cli("train", path, "--models-dir", str(tmp_path / "models"), "--epochs", "1")
    assert p.returncode == 1, (p.returncode, p.stderr[-2000:])
    assert "zeros.pt: every feature column is constant (64 columns" in p.stderr
    assert not (tmp_path / "models" / "zeros").exists()


def test_an_expanded_constant_tensor_is_refused_before_it_is_materialised(tmp_path):
    path = _stride0_zeros(tmp_path / "zeros.pt")
    tracemalloc.start()
    try:
        with pytest.raises(DatasetError, match="every feature column is constant"):
            load_dataset(path, TRAINING)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 1024**2, peak  # the float32 matrix would be 768 MB


@pytest.mark.parametrize("name, content", [
    ("flat.csv", "cpu,mem\n" + "0.5,7\n" * 100),
    ("flat.txt", "3 3 3\n" * 10),
])
def test_all_constant_text_is_refused_for_training_and_read_for_scoring(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DatasetError, match="every feature column is constant"):
        load_dataset(str(path), TRAINING)
    assert load_dataset(str(path), LIMITS).rows > 1  # new data to score may well be flat


def test_constant_columns_among_others_are_noted_in_the_metadata(tmp_path):
    rng = np.random.default_rng(0)
    rows = np.column_stack([rng.normal(size=400), np.full(400, 7.0), rng.normal(size=400), np.zeros(400)])
    path = tmp_path / "some-flat.csv"
    np.savetxt(path, rows, delimiter=",", header="cpu,fans,mem,errors", comments="", fmt="%.6f")
    p = run_cli("train", str(path), "--models-dir", str(tmp_path / "models"), "--epochs", "1")
    assert p.returncode == 0, p.stderr[-2000:]
    md = json.loads((tmp_path / "models" / "some-flat" / "current" / "metadata.json").read_text())
    assert any(n.startswith("2 of 4 feature columns are constant (fans, errors)") for n in md["dataset"]["notes"]), md


def test_constant_columns_of_a_file_without_a_header_are_named_by_the_models_metric_names(tmp_path):
    """A retrained version's history is an .npz without names; its model's names come as
    dataset.metric_names, and the note says them, as the first version's did."""
    rng = np.random.default_rng(0)
    path = tmp_path / "history.npy"
    np.save(path, np.column_stack([rng.normal(size=400), np.full(400, 7.0), rng.normal(size=400)]).astype(np.float32))
    ds = load_dataset(str(path), TRAINING, DatasetConfig(metric_names=("cpu", "fans", "mem")))
    assert any(n.startswith("1 of 3 feature columns are constant (fans)") for n in ds.notes), ds.notes
    ds = load_dataset(str(path), TRAINING)
    assert any(n.startswith("1 of 3 feature columns are constant (2)") for n in ds.notes), ds.notes


# ------------------------------------------------------------------ row 5: CR-only line endings


LF_CASES = [
    ("header.csv", "cpu,mem,disk\n" + "".join(f"{i},{i * 0.5},{i % 7}\n" for i in range(200))),
    ("plain.csv", "".join(f"{i};{i * 0.5};{i % 7}\n" for i in range(200))),
    ("spaces.txt", "".join(f" {i}  {i * 0.5} {i % 7}\n" for i in range(200))),
    ("quoted.csv", '"cpu","mem"\n' + "".join(f'"{i}","{i * 2}"\n' for i in range(200))),
    ("gzipped.csv.gz", "a,b\n" + "".join(f"{i},{-i}\n" for i in range(200))),
]


def _write(path, text: str) -> str:
    data = text.encode()
    path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)
    return str(path)


@pytest.mark.parametrize("name, text", LF_CASES, ids=[c[0] for c in LF_CASES])
@pytest.mark.parametrize("last", ["\r", ""], ids=["final-cr", "no-final-cr"])
def test_cr_only_line_endings_read_as_the_lf_file(tmp_path, name, text, last):
    (tmp_path / "lf").mkdir()
    (tmp_path / "cr").mkdir()
    text = text if last else text[:-1]  # the same file, ending with a line break or not
    lf = load_dataset(_write(tmp_path / "lf" / name, text))
    cr = load_dataset(_write(tmp_path / "cr" / name, text.replace("\n", "\r")))
    np.testing.assert_array_equal(cr.data, lf.data)
    np.testing.assert_array_equal(cr.offset, lf.offset)
    assert cr.header == lf.header


def test_a_cr_only_file_names_the_line_of_its_error(tmp_path):
    path = tmp_path / "mac.csv"
    path.write_bytes(("".join(f"{i},{i}\r" for i in range(100)) + "1,2,3\r4,5\r").encode())
    with pytest.raises(DatasetError, match=r"mac.csv: line 101: ragged rows: the number of columns changes from 2 to 3"):
        load_dataset(str(path))


def test_a_cr_only_csv_trains_with_ds_ops_train(tmp_path):
    rng = np.random.default_rng(1)
    path = tmp_path / "excel.csv"
    path.write_bytes(("cpu,mem\r" + "".join(f"{a:.4f},{b:.4f}\r" for a, b in rng.normal(size=(300, 2)))).encode())
    p = run_cli("train", str(path), "--models-dir", str(tmp_path / "models"), "--epochs", "1")
    assert p.returncode == 0, p.stderr[-2000:]  # was a traceback: _csv.Error: new-line character seen in unquoted field
    assert "trained excel on 300 rows x 2 features" in p.stdout


def test_a_csv_module_error_is_a_dataset_error(tmp_path):
    path = tmp_path / "field.csv"
    path.write_text('a,b\n1,"' + "x" * 200_000 + '"\n3,4\n')
    with pytest.raises(DatasetError, match=r"field.csv: cannot split the lines into fields: field larger than field limit"):
        load_dataset(str(path))


# ------------------------------------------------------------------ row 6: streamed float64/int64 .npy


@pytest.mark.parametrize("dtype", ["float64", "int64", ">f8"])
@pytest.mark.parametrize("exclude", [(), ("2",)], ids=["all-columns", "exclude-2"])
def test_a_streamed_npy_has_the_float32_bits_and_offset_of_the_loaded_one(tmp_path, dtype, exclude):
    rng = np.random.default_rng(2)
    n = 300_000
    if dtype == "int64":
        cols = [10**12 + rng.integers(-1000, 1000, n), rng.integers(0, 5, n), rng.integers(-50, 50, n)]
    else:
        cols = [1e8 + rng.normal(size=n), rng.normal(size=n), 1e3 * rng.normal(size=n)]
    path = tmp_path / "far-from-zero.npy"
    np.save(path, np.column_stack(cols).astype(dtype))
    options = DatasetConfig(exclude_columns=exclude)
    loaded = load_dataset(str(path), LIMITS, options)
    streamed = load_dataset(str(path), dataclasses.replace(LIMITS, max_matrix_bytes=1 << 20, stream_large_npy=True),
                            options)
    assert isinstance(streamed.data, NpyRows) and isinstance(loaded.data, np.ndarray)
    assert streamed.offset is not None and streamed.offset.tobytes() == loaded.offset.tobytes()
    rows = streamed.data.read(0, n)
    assert rows.tobytes() == np.ascontiguousarray(loaded.data).tobytes()
    assert len(np.unique(rows[:, 0])) >= 1000  # was 3 distinct values: 1e8 + N(0, 1) cast straight to float32


def test_a_streamed_float64_value_beyond_float32_is_refused_as_in_memory(tmp_path):
    rows = np.ones((300_000, 2))
    rows[123_456, 1] = 1e39
    path = tmp_path / "huge.npy"
    np.save(path, rows)
    want = r"huge.npy: row 123457, column 2: value 1e\+39 is beyond float32's range"
    with pytest.raises(DatasetError, match=want):
        load_dataset(str(path), LIMITS)
    with pytest.raises(DatasetError, match=want):
        load_dataset(str(path), dataclasses.replace(LIMITS, max_matrix_bytes=1 << 20, stream_large_npy=True))


# ------------------------------------------------------------------ found by fuzzing load_dataset: each a DatasetError


def test_an_npy_header_that_does_not_parse_is_a_dataset_error(tmp_path):
    header = "{'descr': '<f8', 'fortran_order': False, 'shape': (40, 3, }"  # a parenthesis left open
    body = header.encode().ljust(118) + b"\n"
    path = tmp_path / "open-paren.npy"
    path.write_bytes(b"\x93NUMPY\x01\x00" + len(body).to_bytes(2, "little") + body + bytes(40 * 3 * 8))
    with pytest.raises(DatasetError, match=r"open-paren.npy: not a plain numeric .npy array"):
        load_dataset(str(path))  # was tokenize.TokenError (numpy's parser for headers Python 2 wrote)


def _patched_npz(tmp_path, name: str, field: int, value: bytes) -> str:
    """A one-array .npz with bytes ``field``.. of its central directory record replaced by ``value``."""
    np.savez(tmp_path / "good.npz", x=np.arange(12.0).reshape(4, 3))
    data = bytearray((tmp_path / "good.npz").read_bytes())
    at = data.rfind(b"PK\x01\x02") + field
    data[at : at + len(value)] = value
    (tmp_path / name).write_bytes(bytes(data))
    return str(tmp_path / name)


@pytest.mark.parametrize("why, field, value", [
    ("an unknown zip version needed", 6, b"\xff\xff"),  # was NotImplementedError
    ("compression method 99", 10, b"\x63\x00"),  # was NotImplementedError
    ("flag bit 5, patched data", 8, b"\x20\x00"),  # was NotImplementedError
    ("a member name that starts with NUL", 46, b"\x00"),  # was IndexError in ZipInfo.is_dir
])
def test_a_malformed_npz_archive_is_a_dataset_error(tmp_path, why, field, value):
    path = _patched_npz(tmp_path, "patched.npz", field, value)
    with pytest.raises(DatasetError, match=r"patched.npz: not a plain numeric .npz archive \(.+\)"):
        load_dataset(path)


def test_a_time_column_with_a_number_among_its_times_is_a_dataset_error(tmp_path):
    path = tmp_path / "split.csv"
    lines = [f"2024-05-18T00:00:{i:02d}Z,{i}.5,{i % 3}" for i in range(30)]
    lines[20:21] = ["2024-05-18T00:00:20Z,0", "696,-1.184"]  # a '.' turned into a line break
    path.write_text("time,cpu,mem\n" + "\n".join(lines) + "\n")
    with pytest.raises(DatasetError, match=r"column 1 \('time'\) is named like a time column but holds '696' \(line 23\)"):
        load_dataset(str(path))  # was StopIteration: a column of times and numbers had no example


@pytest.mark.parametrize("stream", [False, True], ids=["file", "stream"])
def test_an_arrow_file_with_a_repeated_column_name_is_a_dataset_error(tmp_path, stream):
    table = pa.Table.from_arrays([pa.array([1.0, 2.0, 3.0])] * 3, names=["cpu", "load", "load"])
    path = tmp_path / "twice.arrow"
    path.write_bytes(bytes(_arrow_bytes(table, stream)))
    with pytest.raises(DatasetError, match=r"column name 'load' appears 2 times; rename the columns"):
        load_dataset(str(path))  # was KeyError: Field "load" exists 2 times in schema


# ------------------------------------------------------------------ .pt: what its pickle may call


# bytearray(256 MiB): builtins.bytearray is on torch's weights_only list, so torch.load ran it
BYTEARRAY = b"\x80\x02cbuiltins\nbytearray\nq\x00J\x00\x00\x00\x10\x85q\x01Rq\x02."
# the same name taken from the stack (STACK_GLOBAL, protocol 4)
STACK = b"\x80\x04\x8c\x08builtins\x8c\tbytearray\x93J\x00\x00\x00\x10\x85R."
# pieces of torch.save's pickle of a (4, 3) float32 tensor (the hostile review of 2026-12-07)
REBUILD = b"ctorch._utils\n_rebuild_tensor_v2\n"
STORAGE = b"((X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x0ctQ"
ODICT = b"ccollections\nOrderedDict\n"
# a (2**20, 2) view of one float, strides (0, 0): only names torch.save writes, but torch's
# unpickler iterated it into 2**20 tensors as an OrderedDict's argument (2.1 GB)
VIEW = REBUILD + STORAGE + b"K\x00(J\x00\x00\x10\x00K\x02t(K\x00K\x00t\x89" + ODICT + b")RtR"
# the tensor with a 7th argument, metadata {'neg': True}: torch loaded it, then .numpy() raised RuntimeError
NEG = REBUILD + STORAGE + b"K\x00(K\x04K\x03t(K\x03K\x01t\x89" + ODICT + b")R}X\x03\x00\x00\x00neg\x88stR"


@pytest.mark.parametrize("pkl, why", [
    (BYTEARRAY, "its pickle calls builtins.bytearray"),
    (STACK, "its pickle is protocol 4; torch.save writes 2"),
    (b"\x80\x02" + ODICT + b"(" + VIEW + b"tR.",
     "its pickle calls collections.OrderedDict with arguments torch.save does not write for a tensor"),
    (b"\x80\x02" + ODICT + b")R" + VIEW + b"b.", "its pickle has BUILD at byte"),
    (b"\x80\x02" + NEG + b".", "its pickle has EMPTY_DICT at byte"),
], ids=["bytearray", "stack-global", "odict-of-a-view", "build", "metadata"])
def test_a_pt_whose_pickle_is_not_one_tensor_is_refused_before_memory_is_spent(tmp_path, pkl, why):
    path = pt_with_pickle(tmp_path / "bomb.pt", pkl)
    tracemalloc.start()
    try:
        with pytest.raises(DatasetError) as e:
            load_dataset(path, LIMITS)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert f"not a plain tensor file ({why}" in str(e.value)
    assert peak < 16 * 1024**2, peak  # torch.load took 256 MiB to 2.1 GB


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
                                   torch.int16, torch.uint8, torch.uint16, torch.uint32], ids=str)
def test_a_pt_of_every_real_dtype_reads_as_torch_converts_it(tmp_path, dtype):
    t = (torch.randn(40, 6) * 50).abs().to(dtype)
    torch.save(t, tmp_path / "t.pt")
    got = load_dataset(str(tmp_path / "t.pt"), LIMITS)
    # a converted dtype is centred (data + offset): equal to float32's rounding
    np.testing.assert_allclose(np.asarray(got.values()), t.to(torch.float64).numpy(), rtol=1e-6, atol=1e-5)


def test_a_pt_view_of_a_larger_storage_is_refused_past_twice_the_matrix_budget(tmp_path):
    small = dataclasses.replace(LIMITS, max_matrix_bytes=4096)
    torch.save(torch.rand(1000, 64)[:2], tmp_path / "view.pt")  # torch.save writes the whole 256 KB storage
    with pytest.raises(DatasetError, match=r"storage holds 256000 bytes, over twice job.max_matrix_bytes \(4096\) "
                                           r"\(a view of a larger tensor: save the view's .clone\(\)\)"):
        load_dataset(str(tmp_path / "view.pt"), small)
    torch.save(torch.rand(1000, 64)[:2].clone(), tmp_path / "clone.pt")
    assert load_dataset(str(tmp_path / "clone.pt"), small).rows == 2


def test_a_pt_whose_pickle_does_not_parse_is_a_dataset_error(tmp_path):
    path = pt_with_pickle(tmp_path / "cut.pt", b"\x80\x02cbuiltins\nbytearr")
    with pytest.raises(DatasetError, match="its pickle does not parse"):
        load_dataset(path, LIMITS)


def test_a_legacy_pt_is_refused_with_its_reason(tmp_path):
    path = tmp_path / "old.pt"
    torch.save(torch.ones(4, 3), path, _use_new_zipfile_serialization=False)
    with pytest.raises(DatasetError, match=r"not a torch.save zip archive \(torch >= 1.6 writes one"):
        load_dataset(str(path), LIMITS)


@pytest.mark.parametrize("compression", [zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA],
                         ids=["deflate", "bzip2", "lzma"])
def test_a_pt_with_a_compressed_member_is_refused_before_anything_is_inflated(tmp_path, compression):
    # torch.save stores its members; zipfile inflates bzip2 and LZMA whole before it cuts them to size
    # (a 1.4 KB file inflated 1 GiB: the hostile review of the reader)
    path = pt_with_pickle(tmp_path / "packed.pt", compression=compression)
    with pytest.raises(DatasetError, match=r"its member 'packed/data.pkl' is compressed; torch.save stores its members"):
        load_dataset(path, LIMITS)


def _int(n: int) -> bytes:
    return pickle.dumps(n, protocol=2)[2:-1]  # the opcode pickle writes for n (BININT*, LONG1)


def _tensor(size: tuple, stride: tuple) -> bytes:
    """torch.save's pickle of a tensor of that size and stride on a storage of 12 floats."""
    def tup(t):
        return b"(" + b"".join(_int(x) for x in t) + b"t"
    return b"\x80\x02" + REBUILD + STORAGE + _int(0) + tup(size) + tup(stride) + b"\x89" + ODICT + b")RtR."


@pytest.mark.parametrize("size, stride, why", [
    ((4, 1), ((2**64 + 8) // 12, 1), "reach past its storage of 12 elements"),  # numpy's check wrapped: SIGSEGV
    ((2**58, 0), (0, 1), "of shape (288230376151711744, 0) has no columns"),  # every budget passed: a loop of 2**36
    ((4, 3), (3, 2**63), "its pickle's integer at byte"),
    ((4, 3, 1, 1, 1, 1, 1, 1, 1), (3,) * 9, "its pickle's TUPLE at byte"),
], ids=["stride-wraps", "no-columns", "integer-past-2**62", "tuple-of-9"])
def test_a_pt_whose_view_is_not_inside_its_storage_is_refused_before_a_value_is_read(tmp_path, size, stride, why):
    path = pt_with_pickle(tmp_path / "view.pt", _tensor(size, stride))
    with pytest.raises(DatasetError) as e:
        load_dataset(path, LIMITS)
    assert why in str(e.value) and len(str(e.value)) < 1000, str(e.value)[:2000]


def test_a_saved_parameter_reads_as_its_tensor(tmp_path):
    torch.save(torch.nn.Parameter(torch.arange(12.0).reshape(4, 3)), tmp_path / "p.pt")
    assert np.array_equal(load_dataset(str(tmp_path / "p.pt"), LIMITS).data, np.arange(12.0).reshape(4, 3))


def test_a_pt_over_the_matrix_budget_is_refused_with_the_format_that_streams(tmp_path):
    torch.save(torch.rand(100, 8), tmp_path / "big.pt")
    with pytest.raises(DatasetError, match=r"needs 3200 bytes as float32; job.max_matrix_bytes is 2048 \(a .pt is read "
                                           r"whole: save it as a C-ordered .npy, np.save\(path, t.numpy\(\)\), which a "
                                           r"training job streams\)"):
        load_dataset(str(tmp_path / "big.pt"), dataclasses.replace(LIMITS, max_matrix_bytes=2048))


def _flooded_zip(path, entries: int) -> str:
    """A zip of one local header and ``entries`` central directory entries of a one-byte name."""
    local = struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, 0, 0, 0, 0, 0, 0, 1, 0) + b"a"
    entry = struct.pack("<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0) + b"a"
    cd = entry * entries
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, entries & 0xFFFF, entries & 0xFFFF, len(cd), len(local), 0)
    path.write_bytes(local + cd + end)
    return str(path)


@pytest.mark.parametrize("name", ["flood.pt", "flood.npz"])
def test_a_zip_whose_directory_floods_memory_is_refused_before_zipfile_reads_it(tmp_path, name):
    # zipfile builds an object per directory entry first: 1M entries (47 MB) took 480 MB (the review)
    path = _flooded_zip(tmp_path / name, 30_000)
    tracemalloc.start()
    try:
        with pytest.raises(DatasetError, match=r"its zip directory reads 1410000 bytes at once; a dataset's lists a few "
                                               r"members \(at most 1048576 bytes\)"):
            load_dataset(path, LIMITS)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * 1024**2, peak
