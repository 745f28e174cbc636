"""Dataset reading: every accepted format and every refused one, on real files."""

from __future__ import annotations

import gzip
import os
import pickle

import numpy as np
import pytest
import torch

from opt_ds_ops.dataset import DatasetError, dataset_stem, load_dataset

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
    np.testing.assert_allclose(ds.data, ROWS, rtol=1e-6)
    assert ds.data.dtype == np.float32


def test_header_names_are_kept(tmp_path):
    ds = load_dataset(write(tmp_path, "h.csv", "\ufeffcpu,mem,disk,\r\n1,2,3,\r\n4,5,6,\r\n"))
    assert ds.header == ["cpu", "mem", "disk"]
    assert ds.data.shape == (2, 3)


def test_gzip_text_and_real_smd_file(tmp_path):
    path = tmp_path / "rows.csv.gz"
    with gzip.open(path, "wt") as f:
        f.write("1,2\n3,4\n")
    assert load_dataset(str(path)).data.tolist() == [[1, 2], [3, 4]]
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
        ("header_only.csv", "a,b,c\n", "empty file"),
        ("one_row.csv", "1,2,3\n", "1 row(s); at least 2"),
        ("cell.csv", "1,2,3\n4,5,6\n7,x,9\n", "line 3, column 2: could not convert string 'x'"),
        ("cell_after_header.csv", "a,b\n1,2\n3,oops\n", "line 3, column 2"),
        ("ragged.csv", "1,2,3\n4,5,6\n7,8\n", "line 3: ragged rows"),
        ("nan.csv", "1,2,3\n4,nan,6\n", "line 2, column 2: value nan is not finite"),
        ("inf.csv", "a,b\n1,2\n3,4\n5,inf\n", "line 4, column 2: value inf is not finite"),
        ("data.json", "{}", "unknown dataset format"),
        ("data.parquet", "PAR1", "unknown dataset format"),
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

    with open(tmp_path / "evil.pt", "wb") as f:
        pickle.dump(Evil(), f, protocol=2)  # the protocol torch.save uses
    torch.save({"rows": torch.zeros(3, 2)}, tmp_path / "dict.pt")
    with pytest.raises(DatasetError, match="weights_only=True"):
        load_dataset(str(tmp_path / "evil.pt"))
    assert not marker.exists()
    with pytest.raises(DatasetError, match="holds a dict"):
        load_dataset(str(tmp_path / "dict.pt"))


def test_unreadable_and_corrupt_gzip_are_clear_errors(tmp_path):
    with pytest.raises(DatasetError, match="cannot read"):
        load_dataset(str(tmp_path / "missing.csv"))
    path = write(tmp_path, "broken.csv.gz", b"\x1f\x8b\x08\x00not really gzip")
    with pytest.raises(DatasetError, match="cannot read"):
        load_dataset(path)
    path = write(tmp_path, "latin1.csv", b"a,b\n1,2\n\xff\xfe,3\n")
    with pytest.raises(DatasetError, match="cannot read"):
        load_dataset(path)


def test_dataset_stem_strips_format_and_gzip_suffixes():
    assert dataset_stem("/x/machine-1-2.txt.gz") == "machine-1-2"
    assert dataset_stem("rows.npy") == "rows"
    assert dataset_stem("a.b.csv") == "a.b"
    assert dataset_stem("weird") == "weird"
