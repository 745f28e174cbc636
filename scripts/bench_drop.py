#!/usr/bin/env python3
"""Benchmark: drop -> model latency of the ds-trainer daemon for one SMD machine dropped by rename.

Starts a real daemon (``ds-ops daemon``, job processes from its forkserver) on a temporary spool,
waits until it is ready, then drops the bundled SMD machine-1-2 training file (23,694 x 38, gzip
text) ``--drops`` times the safe way (write NAME.part, rename to NAME) and measures the wall time
from the rename to ``done/NAME.result.json`` appearing. In the same script, as the baseline, the
same work runs in this process without a daemon (:func:`opt_ds_ops.training.job.run_job`: parse, train,
save), so the printed overhead and ratio compare like with like on the same machine and load.

Usage: python scripts/bench_drop.py [--drops 5] [--epochs N]  (default: the shipped train: defaults)
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
SMD = os.path.join(REPO, "data", "smd", "train", "machine-1-2.txt.gz")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drops", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=None,
                    help="train.epochs (default: the shipped defaults, a plateau rule capped by max_steps)")
    args = ap.parse_args()

    from opt_ds_ops.config.conffile import load_config
    from opt_ds_ops.training.job import run_job

    root = tempfile.mkdtemp(prefix="ds-ops-bench-drop-")
    conf = os.path.join(root, "trainer.yaml")
    with open(conf, "w") as f:
        epochs = f"train:\n  epochs: {args.epochs}\n" if args.epochs else ""
        f.write(f"models_dir: {root}/models\ndevice: cpu\n{epochs}"
                f"spool:\n  dir: {root}/spool\n  settle_s: 2.0\n")
    cfg = load_config(conf)
    env = dict(os.environ, PYTHONPATH=REPO)
    env.pop("NOTIFY_SOCKET", None)
    log = open(os.path.join(root, "daemon.log"), "wb")
    daemon = subprocess.Popen([sys.executable, "-m", "opt_ds_ops.cli", "daemon", "--config", conf],
                              stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    latencies, work = [], []
    try:
        deadline = time.monotonic() + 180
        while b"ds-trainer ready" not in open(log.name, "rb").read():
            if time.monotonic() > deadline or daemon.poll() is not None:
                raise SystemExit(f"daemon did not start:\n{open(log.name).read()}")
            time.sleep(0.05)
        incoming, done = os.path.join(root, "spool", "incoming"), os.path.join(root, "spool", "done")
        for i in range(args.drops):
            name = f"machine-1-2-{i}.txt.gz"
            shutil.copyfile(SMD, os.path.join(incoming, name + ".part"))
            t0 = time.perf_counter()
            os.rename(os.path.join(incoming, name + ".part"), os.path.join(incoming, name))
            result = os.path.join(done, name + ".result.json")
            while not os.path.exists(result):
                if daemon.poll() is not None:
                    raise SystemExit(f"daemon exited:\n{open(log.name).read()}")
                time.sleep(0.002)
            latencies.append(time.perf_counter() - t0)
            # baseline: the same job's work in this process (parse + train + save), no daemon
            t1 = time.perf_counter()
            run_job(SMD, cfg, name=f"baseline-{i}")
            work.append(time.perf_counter() - t1)
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(60)
        log.close()
    med_l, med_w = statistics.median(latencies), statistics.median(work)
    how = f"{args.epochs} epochs" if args.epochs else "the shipped train: defaults"
    print(f"drop -> model by rename, SMD machine-1-2 (23,694 x 38, {how}, cpu), {args.drops} drops")
    print(f"  daemon latency   median {med_l:.3f} s  (min {min(latencies):.3f}, max {max(latencies):.3f}; "
          f"in drop order: {', '.join(f'{x:.2f}' for x in latencies)})")
    print(f"  in-process work  median {med_w:.3f} s  (parse + train + save, same machine, same run)")
    print(f"  overhead of the daemon path: {med_l - med_w:+.3f} s; latency / work = {med_l / med_w:.2f}x")
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
