#!/usr/bin/env python3
"""Benchmark: dataset parsing (MB/s) of real export shapes, against numpy's reader in the same run.

The same 500,000 x 32 float rows are written as
  numeric  headerless numeric CSV (the SMD shape; ds-ops's reader before Arrow was numpy's loadtxt)
  iso      a header line and an ISO 8601 time column first (2024-05-18T00:00:00Z), as Telegraf writes
  parquet  the iso table as Parquet (snappy, timestamp[ms, UTC] column), as pandas/pyarrow write
and each is read by ``load_dataset``; the baseline is ``np.loadtxt`` (numpy's C reader, float64)
on the numeric file, timed in the same process. MB/s is of the CSV's bytes (for Parquet: of the
iso CSV, the same table). Peak memory: Python/numpy allocations (tracemalloc) plus Arrow's pool,
as a multiple of the float32 matrix. Prints a table and a final JSON line.

Usage: scripts/bench_parse.py [--rows 500000] [--features 32] [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import tracemalloc

import numpy as np

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, REPO)

from opt_ds_ops.dataset import load_dataset  # noqa: E402


def write_files(tmp: str, rows: np.ndarray) -> dict[str, str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = {k: os.path.join(tmp, f"bench-{k}.{'parquet' if k == 'parquet' else 'csv'}") for k in ("numeric", "iso", "parquet")}
    np.savetxt(paths["numeric"], rows, delimiter=",", fmt="%.6f")
    start = np.datetime64("2024-05-18T00:00:00", "s")
    stamps = np.datetime_as_string(start + np.arange(len(rows)) * np.timedelta64(60, "s")) + "Z"
    with open(paths["numeric"]) as src, open(paths["iso"], "w") as dst:
        dst.write("time," + ",".join(f"metric_{i}" for i in range(rows.shape[1])) + "\n")
        for stamp, line in zip(stamps, src):
            dst.write(stamp + "," + line)
    cols = {"time": pa.array((start + np.arange(len(rows)) * np.timedelta64(60, "s")).astype("datetime64[ms]"),
                             type=pa.timestamp("ms", tz="UTC"))}
    cols.update({f"metric_{i}": rows[:, i].astype(np.float64) for i in range(rows.shape[1])})
    pq.write_table(pa.table(cols), paths["parquet"])
    return paths


def timed(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def peak_x_matrix(path: str) -> float:
    import pyarrow as pa

    pool = pa.default_memory_pool()
    before = pool.max_memory() or 0
    tracemalloc.start()
    ds = load_dataset(path)
    peak = tracemalloc.get_traced_memory()[1] + max(0, (pool.max_memory() or 0) - before)
    tracemalloc.stop()
    return peak / ds.data.nbytes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=500_000)
    ap.add_argument("--features", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=2, help="best of this many reads of each file")
    args = ap.parse_args()
    rows = np.random.default_rng(0).random((args.rows, args.features))
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_files(tmp, rows)
        mb = {k: os.path.getsize(p) / 1e6 for k, p in paths.items()}
        mb["parquet_csv_equivalent"] = mb["iso"]
        base_s = timed(lambda: np.loadtxt(paths["numeric"], delimiter=",", dtype=np.float64), args.repeat)
        report = {"rows": args.rows, "features": args.features, "numpy_loadtxt_mb_per_s": round(mb["numeric"] / base_s, 1)}
        for kind in ("numeric", "iso", "parquet"):
            ds = load_dataset(paths[kind])
            assert ds.features == args.features and ds.rows == args.rows, (kind, ds.data.shape)
            assert kind == "numeric" or ds.time is not None
            secs = timed(lambda: load_dataset(paths[kind]), args.repeat)
            csv_mb = mb["iso"] if kind == "parquet" else mb[kind]
            report[f"{kind}_mb_per_s"] = round(csv_mb / secs, 1)
            report[f"{kind}_ratio_to_loadtxt"] = round((csv_mb / secs) / (mb["numeric"] / base_s), 2)
            report[f"{kind}_peak_x_matrix"] = round(peak_x_matrix(paths[kind]), 2)
    print(f"{'file':<28}{'MB/s':>10}{'x loadtxt':>11}{'peak x matrix':>15}")
    print(f"{'numpy loadtxt (baseline)':<28}{report['numpy_loadtxt_mb_per_s']:>10}{1.0:>11.2f}{'':>15}")
    for kind, label in (("numeric", "ds-ops numeric CSV"), ("iso", "ds-ops CSV + ISO time"), ("parquet", "ds-ops Parquet")):
        print(f"{label:<28}{report[kind + '_mb_per_s']:>10}{report[kind + '_ratio_to_loadtxt']:>11.2f}"
              f"{report[kind + '_peak_x_matrix']:>15}")
    print(json.dumps(report, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
