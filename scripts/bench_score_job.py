#!/usr/bin/env python3
"""Benchmark: one scoring job (docs/scoring.md) of a 1,000-row chunk, in a forkserver child as the
daemon runs a job (:mod:`opt_ds_ops.daemon.worker`), from the fork to the child's exit.

Trains a small model (3,000 rows of the bundled SMD machine-1-2, one epoch) once, then scores
``--chunks`` consecutive chunks of its test period (``--rows`` rows each, written as CSV into a
job directory as the daemon's claim leaves it) with :func:`opt_ds_ops.scoring.job.score_job`, each
in a fresh child of a forkserver preloaded with ``--preload`` (default: the daemon's job modules
plus the scoring job's and the text reader). Prints the median, min and max wall time and a JSON
line. The drop -> alert figure of the scoring spool adds the daemon's claim and journal to it.

Usage: scripts/bench_score_job.py [--rows 1000] [--chunks 15] [--preload MOD,MOD,...] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
PRELOAD = ("opt_ds_ops.daemon.worker,opt_ds_ops.training.job,opt_ds_ops.health.policy,torch._dynamo,"
           "opt_ds_ops.scoring.job,opt_ds_ops.dataset.text,pyarrow.csv")


def child(job_dir: str, cfg) -> None:
    from opt_ds_ops.scoring.job import score_job

    score_job(job_dir, cfg)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1000)
    ap.add_argument("--chunks", type=int, default=15)
    ap.add_argument("--preload", default=PRELOAD)
    ap.add_argument("--dir")
    args = ap.parse_args()
    from opt_ds_ops.config.conffile import Config, with_overrides
    from opt_ds_ops.training.job import run_job

    root = args.dir or tempfile.mkdtemp(prefix="ds-ops-bench-score-")
    smd = os.path.join(REPO, "data", "smd")
    train = np.loadtxt(os.path.join(smd, "train", "machine-1-2.txt.gz"), delimiter=",", dtype=np.float32)
    test = np.loadtxt(os.path.join(smd, "test", "machine-1-2.txt.gz"), delimiter=",", dtype=np.float32)
    np.savetxt(os.path.join(root, "m1.csv"), train[:3000], delimiter=",", fmt="%.6f")
    cfg = with_overrides(Config(), {"models_dir": os.path.join(root, "models"), "train.epochs": 1, "device": "cpu",
                                    "scoring.results_dir": os.path.join(root, "scores")})
    run_job(os.path.join(root, "m1.csv"), cfg)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([m for m in args.preload.split(",") if m])
    warm = ctx.Process(target=len, args=((),))
    warm.start()
    warm.join()
    times = []
    for i in range(args.chunks):
        job_id = f"20261201T000000.{i:06d}Z-bench{i:03d}"
        job_dir = os.path.join(root, "processing", job_id)
        os.makedirs(job_dir)
        rows = test[(i * args.rows) % (test.shape[0] - args.rows):][: args.rows]
        np.savetxt(os.path.join(job_dir, "dataset.csv"), rows, delimiter=",", fmt="%.6f")
        with open(os.path.join(job_dir, "job.json"), "w") as f:
            json.dump({"job_id": job_id, "dataset": "m1.csv", "data_file": "dataset.csv"}, f)
        t = time.perf_counter()
        p = ctx.Process(target=child, args=(job_dir, cfg))
        p.start()
        p.join()
        times.append(time.perf_counter() - t)
        if p.exitcode != 0:
            raise SystemExit(f"the scoring job of chunk {i} exited {p.exitcode}")
    med = statistics.median(times)
    print(f"score_job of {args.rows:,} rows x 38 in a forkserver child: median {med * 1000:.0f} ms, "
          f"min {min(times) * 1000:.0f} ms, max {max(times) * 1000:.0f} ms over {len(times)} chunks")
    print(json.dumps({"rows": args.rows, "chunks": len(times), "median_s": round(med, 4),
                      "min_s": round(min(times), 4), "max_s": round(max(times), 4), "dir": root}))


if __name__ == "__main__":
    main()
