#!/usr/bin/env python3
"""Benchmark: a CSV (or Parquet) larger than the job's memory, trained by ``ds-ops train`` under
``RLIMIT_DATA`` = ``job.memory_max``, as a daemon job runs (docs/datasets.md, "Datasets larger than memory").

Writes ROWS x FEATURES of telemetry-like float rows with an epoch-seconds time column, in 1 M-row
batches (pyarrow.csv / pyarrow.parquet, so the generator never holds the table), then runs
``python -m opt_ds_ops.cli train FILE --json`` in a child limited to ``--memory-max`` of data
segment (``RLIMIT_DATA``, what a daemon job gets). The matrix budget is then a quarter of what
``memory_max`` leaves beside the job's own 400 MiB, so the file is converted once into a float32
``.npy`` (MODELS_DIR/.convert-PID) while read, and streamed. Prints the file's size, the job's
wall time, its data placement, peak RSS (getrusage, bytes) against the limit, samples/s, and a
final JSON line.

Usage: scripts/bench_convert.py [--rows 4000000] [--features 32] [--memory-max 1G] [--device cpu]
       [--format csv|parquet] [--epochs 1] [--dir DIR] [--data FILE] [--max-matrix-bytes N]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, REPO)

from opt_ds_ops.config.sizes import parse_size  # noqa: E402

BATCH_ROWS = 1_000_000


def write(path: str, rows: int, features: int, fmt: str) -> None:
    """Write the dataset in BATCH_ROWS batches: a time column (epoch s, 10 s apart), then features."""
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    scale = rng.uniform(0.1, 100, features)
    level = rng.uniform(-1e3, 1e6, features)
    names = ["timestamp"] + [f"m{i}" for i in range(features)]
    writer = None
    for start in range(0, rows, BATCH_ROWS):
        n = min(BATCH_ROWS, rows - start)
        cols = [pa.array(1.7e9 + 10.0 * np.arange(start, start + n))]
        block = rng.standard_normal((n, features), dtype=np.float32) * scale + level
        cols += [pa.array(block[:, j]) for j in range(features)]
        batch = pa.record_batch(cols, names=names)
        if writer is None:
            writer = (pq.ParquetWriter(path, batch.schema) if fmt == "parquet"
                      else pacsv.CSVWriter(path, batch.schema))
        writer.write_batch(batch) if fmt == "csv" else writer.write_table(pa.Table.from_batches([batch]))
    writer.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--features", type=int, default=32)
    ap.add_argument("--memory-max", default="1G")
    ap.add_argument("--max-matrix-bytes", type=int, default=0,
                    help="job.max_matrix_bytes (default 0: a quarter of memory_max beyond 400 MiB)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--format", choices=["csv", "parquet"], default="csv")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--dir", help="where the file and models go (default: a temporary directory, removed)")
    ap.add_argument("--data", help="use this file if it exists, else write it there and keep it (runs that share one)")
    args = ap.parse_args()
    limit = parse_size(args.memory_max, 1 << 50)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        data = args.data or os.path.join(tmp, f"fleet.{args.format}")
        if not os.path.exists(data):
            t0 = time.perf_counter()
            write(data, args.rows, args.features, args.format)
            print(f"wrote {data}: {args.rows:,} rows x {args.features} features, {os.path.getsize(data):,} bytes "
                  f"in {time.perf_counter() - t0:.1f} s", flush=True)
        size = os.path.getsize(data)
        conf = os.path.join(tmp, "trainer.yaml")
        with open(conf, "w") as f:
            f.write(f"job:\n  memory_max: {args.memory_max}\n  max_matrix_bytes: {args.max_matrix_bytes}\n")

        def limited():
            resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))

        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "opt_ds_ops.cli", "train", data, "--config", conf,
                            "--models-dir", os.path.join(tmp, "models"), "--epochs", str(args.epochs),
                            "--device", args.device, "--json"],
                           capture_output=True, text=True, preexec_fn=limited, cwd=REPO,
                           env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))))
        wall = time.perf_counter() - t0
        if p.returncode != 0:
            print(p.stderr, file=sys.stderr)
            return 1
        out = json.loads(p.stdout)
        left = sorted(os.listdir(os.path.join(tmp, "models")))
    rss = out["peak_rss_bytes"]
    print(f"ds-ops train under RLIMIT_DATA {limit:,} bytes ({args.memory_max}): {wall:.1f} s, "
          f"placement {out['data_placement']}, peak RSS {rss / 2**20:,.0f} MiB ({rss / limit:.2f} of the limit), "
          f"{out['samples_per_s']:,.0f} samples/s, device {out['device']}, models dir holds {left}")
    print(json.dumps({"format": args.format, "rows": args.rows, "features": args.features, "file_bytes": size,
                      "memory_max_bytes": limit, "wall_s": round(wall, 2), "data_placement": out["data_placement"],
                      "peak_rss_bytes": rss, "samples_per_s": out["samples_per_s"], "device": out["device"],
                      "threshold": out["threshold"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
