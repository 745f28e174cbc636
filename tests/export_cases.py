"""Small inputs shaped like real exports, each with what ds-ops must do with it.

Used by tests/dataset/test_dataset_exports.py (``ds-ops train``) and tests/daemon/test_daemon_exports.py (the
daemon's spool). ``expect`` is ("ok", features, check) or ("refused", text in the error).
"""

from __future__ import annotations

import gzip
import io

import numpy as np
import torch

RNG = np.random.default_rng(9)
ROWS = 300


def _metrics(rows: int = ROWS, cols: int = 2) -> np.ndarray:
    return np.round(RNG.random((rows, cols)) * 10, 3)


def grafana_epoch_ms() -> bytes:
    m = _metrics()
    lines = ['"Time","node_load1","cpu_busy"'] + [f"{1716000000000 + 60000 * i},{a},{b}" for i, (a, b) in enumerate(m)]
    return ("\n".join(lines) + "\n").encode()


def collectd_epoch_s() -> bytes:
    m = _metrics(cols=1)
    return ("epoch,value\n" + "".join(f"{1716000000 + 10 * i}.000,{v[0]}\n" for i, v in enumerate(m))).encode()


def telegraf_iso() -> bytes:
    m = _metrics()
    return ("time,cpu,load\n" + "".join(f"2024-05-18T{i // 60:02d}:{i % 60:02d}:00Z,{a},{b}\n"
                                        for i, (a, b) in enumerate(m))).encode()


def pandas_index() -> bytes:
    m = _metrics(cols=3)
    return (",cpu,load,mem\n" + "".join(f"{i},{a},{b},{c}\n" for i, (a, b, c) in enumerate(m))).encode()


def decimal_comma() -> bytes:
    return b"".join(f"{40 + i % 9},{i % 10:02d}\n".encode() for i in range(ROWS))


def rfc4180_quoted() -> bytes:
    m = _metrics()
    return ('"cpu","load"\n' + "".join(f'"{a}","{b}"\n' for a, b in m)).encode()


def quoted_names_with_commas() -> bytes:
    m = _metrics()
    head = '"Time","{cpu=""0"", mode=""idle""}","{cpu=""1"", mode=""idle""}"'
    return (head + "\n" + "".join(f"2024-05-18 00:{i // 60:02d}:{i % 60:02d},{a},{b}\n"
                                  for i, (a, b) in enumerate(m))).encode()


WIDE_COLUMNS = 3000


def wide_header() -> bytes:
    names = ",".join(f"node_network_receive_bytes_total_{i:04d}" for i in range(WIDE_COLUMNS))  # ~120 KB
    rows = "".join(",".join(f"{(r * 7 + c) % 13}.5" for c in range(WIDE_COLUMNS)) + "\n" for r in range(8))
    return (names + "\n" + rows).encode()


def pt_requires_grad() -> bytes:
    buf = io.BytesIO()
    torch.save(torch.rand(ROWS, 3, requires_grad=True), buf)
    return buf.getvalue()


def npy_beyond_float32() -> bytes:
    a = np.ones((ROWS, 3))
    a[5, 1] = 1e39
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def gzip_bomb() -> bytes:
    """A .csv.gz of about 10 KB that inflates to 3.8 MB of valid rows."""
    return gzip.compress(b"0.5,0.25\n" * 420_000, compresslevel=9)


def check_time(kind: str, column: str):
    def check(summary: dict) -> None:
        assert summary["time"]["kind"] == kind and summary["time"]["column"] == column, summary["time"]
        assert all(column not in str(h) for h in summary.get("header") or [])
    return check


def check_header(names: list[str]):
    def check(summary: dict) -> None:
        assert summary["header"] == names, summary["header"]
    return check


def check_left_out(label: str):
    def check(summary: dict) -> None:
        assert any(d["column"] == label for d in summary["left_out"]), summary["left_out"]
    return check


# name, file name, content, expect
CASES = [
    ("grafana_epoch_ms", "grafana.csv", grafana_epoch_ms, ("ok", 2, check_time("epoch_ms", "Time"))),
    ("collectd_epoch_s", "collectd.csv", collectd_epoch_s, ("ok", 1, check_time("epoch_s", "epoch"))),
    ("telegraf_iso", "telegraf.csv", telegraf_iso, ("ok", 2, check_time("iso8601", "time"))),
    ("pandas_index", "pandas.csv", pandas_index, ("ok", 3, check_left_out("column 1"))),
    ("decimal_comma", "decimal.csv", decimal_comma, ("refused", "line 1: '40,00' looks like a number with a decimal comma")),
    ("rfc4180_quoted", "quoted.csv", rfc4180_quoted, ("ok", 2, check_header(["cpu", "load"]))),
    ("quoted_names_with_commas", "prom.csv", quoted_names_with_commas,
     ("ok", 2, check_header(['{cpu="0", mode="idle"}', '{cpu="1", mode="idle"}']))),
    ("wide_header", "wide.csv", wide_header, ("ok", WIDE_COLUMNS, None)),
    ("pt_requires_grad", "grad.pt", pt_requires_grad, ("ok", 3, None)),
    ("npy_beyond_float32", "big.npy", npy_beyond_float32, ("refused", "row 6, column 2: value 1e+39 is beyond float32's range")),
]
