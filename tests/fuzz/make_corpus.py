"""Write the fuzzers' seed corpus, tests/fuzz/corpus/TARGET/, from real files (run once; committed).

Rows are cut from the bundled SMD machine (data/smd) and, where the shared data sets are laid out
beside the checkout (../shared/data/{smd,asd,nab}, as CI does), from ASD and NAB; each seed is a
few KB. Sidecars are the examples of docs/datasets.md and the man page; the conffile is
etc/ds-ops/trainer.yaml. ``python tests/fuzz/make_corpus.py`` rewrites every seed the same way.
"""

from __future__ import annotations

import gzip
import io
import zipfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
CORPUS = Path(__file__).resolve().parent / "corpus"
SHARED = REPO.parent / "shared" / "data"


def _lines(path: Path, n: int) -> bytes:
    """The first n lines of a text file (gzip or not), as bytes."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        return b"".join(f.readline() for _ in range(n))


def _rows(path: Path, n: int, cols: int) -> np.ndarray:
    """The first n rows, first cols columns, of a headerless comma-separated file."""
    return np.loadtxt(io.BytesIO(_lines(path, n)), delimiter=",", dtype=np.float64, ndmin=2)[:, :cols]


def _put(target: str, name: str, data: bytes) -> None:
    d = CORPUS / target
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data)
    assert len(data) <= 12 * 1024, f"{target}/{name}: {len(data)} bytes, a seed should be a few KB"


def _gz(data: bytes) -> bytes:
    return gzip.compress(data, mtime=0)


def text_seeds() -> dict[str, bytes]:
    """Real exports as text: SMD/ASD rows, a NAB series with its time column, docs/datasets.md's formats."""
    smd = REPO / "data" / "smd" / "train" / "machine-1-2.txt.gz"
    seeds = {
        "smd-machine-1-2.csv": _lines(smd, 12),
        "smd-machine-1-2-test.csv": _lines(REPO / "data" / "smd" / "test" / "machine-1-2.txt.gz", 8),
        "smd-labels.csv": _lines(REPO / "data" / "smd" / "test_label" / "machine-1-2.txt.gz", 40),
        "smd-tab.tsv": _lines(smd, 6).replace(b",", b"\t"),
        "smd-crlf.csv": _lines(smd, 6).replace(b"\n", b"\r\n"),
        # docs/datasets.md's exporter table, one line each plus a few rows
        "grafana.csv": b'"Time","{cpu=""0"", mode=""idle""}"\n1716000000000,0.93\n1716000060000,0.91\n1716000120000,0.95\n',
        "telegraf.csv": (b"timestamp,measurement,host,usage_idle\n1716000000,cpu,gpu1,93.1\n"
                         b"1716000010,cpu,gpu1,92.7\n1716000020,cpu,gpu1,93.4\n"),
        "collectd.csv": b"epoch,value\n1716000000.123,1.5\n1716000010.123,1.6\n1716000020.123,1.4\n",
        "nvidia-smi.csv": (b"2024/05/18 12:00:00.123, 45, 150.21\n2024/05/18 12:00:01.123, 46, 151.02\n"
                           b"2024/05/18 12:00:02.123, 46, 149.88\n"),
        "pandas.csv": b",cpu,load\n0,26.06,1.31\n1,25.12,1.29\n2,27.40,1.35\n",
    }
    for csv in sorted((SHARED / "nab" / "realAWSCloudwatch").glob("ec2_cpu_utilization_*.csv"))[:2]:
        seeds[f"nab-{csv.stem}.csv"] = _lines(csv, 60)
    for gz in sorted((SHARED / "asd" / "train").glob("omi-*.txt.gz"))[:2]:
        seeds[f"asd-{gz.name.removesuffix('.txt.gz')}.csv"] = _lines(gz, 20)
    for gz in sorted((SHARED / "smd" / "train").glob("machine-*.txt.gz"))[1:3]:
        seeds[f"smd-{gz.name.removesuffix('.txt.gz')}.csv"] = _lines(gz, 8)
    return seeds


def array_seeds() -> dict[str, np.ndarray]:
    """Matrices of real rows in the dtypes and layouts the array readers take."""
    smd = _rows(REPO / "data" / "smd" / "train" / "machine-1-2.txt.gz", 12, 38)
    out = {"smd-f32": smd.astype(np.float32), "smd-f64": smd[:6], "smd-f16": smd[:6].astype(np.float16),
           "smd-fortran": np.asfortranarray(smd[:6, :10].astype(np.float32)),
           "smd-i64": (smd[:6, :12] * 1000).astype(np.int64), "smd-u8": (smd[:6, :12] * 255).astype(np.uint8)}
    asd = sorted((SHARED / "asd" / "train").glob("omi-*.txt.gz"))
    if asd:
        out["asd-f32"] = _rows(asd[0], 12, 19).astype(np.float32)
    return out


def npy_bytes(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return buf.getvalue()


def columnar_tables():
    """pyarrow tables of real series: NAB with its timestamps, SMD rows with named columns."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    smd = _rows(REPO / "data" / "smd" / "train" / "machine-1-2.txt.gz", 12, 8)
    tables = {"smd": pa.table({f"m{i + 1}": smd[:, i] for i in range(smd.shape[1])})}
    nab = sorted((SHARED / "nab" / "realAWSCloudwatch").glob("ec2_cpu_utilization_*.csv"))
    if nab:
        t = pacsv.read_csv(io.BytesIO(_lines(nab[0], 60)))
        tables["nab"] = t
        tables["nab-str-time"] = t.set_column(0, "timestamp", t.column(0).cast(pa.string()))
        tables["nab-int"] = pa.table({"timestamp": t.column(0), "value": pa.array(
            (t.column(1).to_numpy() * 1000).astype(np.int32))})
    return tables


def main() -> None:
    for name, data in text_seeds().items():
        _put("csv", name.replace(".tsv", ".csv"), data)
    for name in ("smd-machine-1-2.csv", "nab-ec2_cpu_utilization_24ae8d.csv", "telegraf.csv", "smd-tab.tsv"):
        data = text_seeds().get(name)
        if data is not None:
            _put("csv_gz", name + ".gz", _gz(data))

    import torch

    for name, a in array_seeds().items():
        _put("npy", name + ".npy", npy_bytes(a))
        if name in ("smd-f32", "smd-f64", "smd-fortran", "asd-f32"):
            for how, compress in (("stored", zipfile.ZIP_STORED), ("deflated", zipfile.ZIP_DEFLATED)):
                buf = io.BytesIO()
                with zipfile.ZipFile(buf, "w", compression=compress) as z:
                    z.writestr(zipfile.ZipInfo("data.npy", date_time=(1980, 1, 1, 0, 0, 0)), npy_bytes(a),
                               compress_type=compress)
                _put("npz", f"{name}-{how}.npz", buf.getvalue())
        if name in ("smd-f32", "smd-f64", "smd-i64", "asd-f32"):
            for variant, t in (("", torch.from_numpy(np.ascontiguousarray(a))),
                               ("-transposed", torch.from_numpy(np.ascontiguousarray(a.T)).T)):
                buf = io.BytesIO()
                torch.save(t.clone() if not variant else t, buf)
                _put("pt", f"{name}{variant}.pt", buf.getvalue())
    buf = io.BytesIO()
    torch.save(torch.zeros(1, 4).expand(8, 4), buf)  # a stride-0 tensor: shape beyond its storage
    _put("pt", "expanded-zeros.pt", buf.getvalue())

    import pyarrow as pa
    import pyarrow.feather as feather
    import pyarrow.parquet as pq

    for name, t in columnar_tables().items():
        for codec in ("none", "snappy", "zstd"):
            buf = io.BytesIO()
            pq.write_table(t, buf, compression=codec, row_group_size=16)
            _put("parquet", f"{name}-{codec}.parquet", buf.getvalue())
        for codec in ("uncompressed", "lz4", "zstd"):
            buf = io.BytesIO()
            feather.write_feather(t, buf, compression=codec)
            _put("arrow", f"{name}-feather-{codec}.arrow", buf.getvalue())
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, t.schema) as w:
            for b in t.to_batches(max_chunksize=16):
                w.write_batch(b)
        _put("arrow", f"{name}-stream.arrow", sink.getvalue().to_pybytes())

    sidecars = {  # docs/datasets.md's and the man page's examples, and tests/test_daemon_exports.py's
        "nvidia-smi.yaml": b"exclude_columns: [2, 4]\nname: gpu-telemetry\n",
        "telegraf.yaml": b"exclude_columns: [measurement, host]\n",
        "name.yaml": b"name: fixed-model\n",
        "time.yaml": b"time_column: timestamp\ncolumns: [cpu, load]\ntime_order: refuse\n",
        "numbers.yaml": b"time_column: 1\ncolumns: [3, 4]\n",
        "none.yaml": b"time_column: none\nexclude_columns: [timestamp, host]\n",
        "flow.yaml": b"{time_column: auto, exclude_columns: [host], time_order: sort, name: gpu1}\n",
        "empty.yaml": b"",
    }
    for name, data in sidecars.items():
        _put("sidecar", name, data)
    conffile = (REPO / "etc" / "ds-ops" / "trainer.yaml").read_bytes()
    (CORPUS / "config").mkdir(parents=True, exist_ok=True)
    (CORPUS / "config" / "trainer.yaml").write_bytes(conffile)  # the shipped conffile, 10 KB of comments
    _put("config", "small.yaml", b"models_dir: /var/models\ndevice: cpu\ntrain:\n  epochs: 3\n  lr: 1.0e-3\n"
         b"job:\n  memory_max: 8G\nspool:\n  settle_s: 2\ndaemon:\n  max_jobs: auto\n"
         b"dataset:\n  exclude_columns: [host]\n")


if __name__ == "__main__":
    main()
