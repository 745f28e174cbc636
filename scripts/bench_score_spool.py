#!/usr/bin/env python3
"""Benchmark: drop -> results and drop -> journal alert of the scoring spool (docs/scoring.md).

Starts a real daemon (``ds-ops daemon``, job processes from its forkserver, the journal captured
at systemd-python's ``send`` inside the daemon process with the time of each entry) on a temporary
spool, drops the bundled SMD machine-1-2 training file into incoming/ by rename and measures
drop -> model (the rename to ``done/NAME.result.json``). Then it drops ``--drops`` files of
``--rows`` rows (SMD training rows, one metric pushed far out for 100 rows in the middle: one
incident each, by the shipped incident rule, ``scoring.incident_*`` left as shipped: the flagged
rows open it, and the rows after them close it inside the file, before the next file's) into
score/ the safe way (a sidecar ``model: m`` first, then NAME.part renamed to NAME), one at a
time, and measures from each rename to its ``summary.json`` under the results directory and to
its first "incident opened" journal entry. Prints medians and the ratio to the training figure;
no assertion on them.

Usage: python scripts/bench_score_spool.py [--drops 20] [--rows 1000] [--epochs 1]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMD = os.path.join(REPO, "data", "smd", "train", "machine-1-2.txt.gz")
CAPTURE = """
import json, os, sys, time
import systemd.journal
out = open(os.environ["JOURNAL_CAPTURE"], "a")
def send(MESSAGE, **fields):
    out.write(json.dumps(dict(fields, MESSAGE=MESSAGE, T=time.time())) + "\\n")
    out.flush()
systemd.journal.send = send
from opt_ds_ops.cli import main
sys.exit(main(sys.argv[1:]))
"""


def wait(predicate, daemon, log: str, timeout_s: float = 300.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if daemon.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"daemon exited or timed out:\n{open(log).read()}")
        time.sleep(0.002)


def entries(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


def rename_in(directory: str, name: str, data: bytes) -> float:
    """Write directory/NAME.part, rename it to NAME; return time.time() of the rename."""
    part = os.path.join(directory, name + ".part")
    with open(part, "wb") as f:
        f.write(data)
    t = time.time()
    os.rename(part, os.path.join(directory, name))
    return t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drops", type=int, default=20)
    ap.add_argument("--rows", type=int, default=1000)
    ap.add_argument("--epochs", type=int, default=1)
    args = ap.parse_args()
    sys.path.insert(0, REPO)
    from opt_ds_ops.observe.journal import MESSAGE_IDS

    root = tempfile.mkdtemp(prefix="ds-ops-bench-score-")
    conf, capture, log = (os.path.join(root, n) for n in ("trainer.yaml", "journal.jsonl", "daemon.log"))
    with open(conf, "w") as f:
        f.write(f"models_dir: {root}/models\ndevice: cpu\ntrain:\n  epochs: {args.epochs}\n"
                f"spool:\n  dir: {root}/spool\n  settle_s: 2.0\nscoring:\n  results_dir: {root}/scores\n")
    env = dict(os.environ, PYTHONPATH=REPO, JOURNAL_STREAM="8:1", JOURNAL_CAPTURE=capture, OMP_NUM_THREADS="1")
    env.pop("NOTIFY_SOCKET", None)
    out = open(log, "wb")
    daemon = subprocess.Popen([sys.executable, "-c", CAPTURE, "daemon", "--config", conf], stdout=out,
                              stderr=subprocess.STDOUT, env=env, cwd=REPO)
    opened_id = MESSAGE_IDS["incident-opened"]
    to_results, to_alert = [], []
    try:
        wait(lambda: any(e.get("MESSAGE_ID") == MESSAGE_IDS["daemon-started"] for e in entries(capture)), daemon, log)
        spool = os.path.join(root, "spool")
        t0 = rename_in(os.path.join(spool, "incoming"), "m.txt.gz", open(SMD, "rb").read())
        wait(lambda: os.path.exists(os.path.join(spool, "done", "m.txt.gz.result.json")), daemon, log)
        train_s = time.time() - t0
        rows = np.loadtxt(SMD, delimiter=",", dtype=np.float32)
        score = os.path.join(spool, "score")
        for i in range(args.drops):
            chunk = rows[(i * args.rows) % (len(rows) - args.rows):][: args.rows].copy()
            mid = args.rows // 2
            chunk[mid - 50: mid + 50, 5] += 40.0
            data = "".join(",".join(f"{v:.6g}" for v in r) + "\n" for r in chunk).encode()
            rename_in(score, f"c{i:04d}.yaml", b"model: m\n")
            alerts_before = sum(e.get("MESSAGE_ID") == opened_id for e in entries(capture))
            t = rename_in(score, f"c{i:04d}.csv", data)
            summary = wait(lambda: sorted(glob.glob(os.path.join(root, "scores", "m", "*-*", "summary.json")))[i:i + 1],
                           daemon, log)[0]
            to_results.append(os.stat(summary).st_mtime - t)
            alert = wait(lambda: [e for e in entries(capture) if e.get("MESSAGE_ID") == opened_id][alerts_before:],
                         daemon, log)
            to_alert.append(alert[0]["T"] - t)
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(60)
        out.close()
    med_r, med_a = statistics.median(to_results), statistics.median(to_alert)
    print(f"scoring spool, SMD machine-1-2 model ({args.epochs} epoch(s), cpu), {args.drops} files of {args.rows} "
          f"rows x 38 dropped by rename into score/, os.cpu_count() = {os.cpu_count()}")
    print(f"  drop -> results (summary.json)   median {med_r:.3f} s  (min {min(to_results):.3f}, "
          f"max {max(to_results):.3f})")
    print(f"  drop -> journal 'incident opened' median {med_a:.3f} s  (min {min(to_alert):.3f}, max {max(to_alert):.3f})")
    print(f"  training drop -> model (23,694 rows, same daemon): {train_s:.3f} s; "
          f"drop -> results / drop -> model = {med_r / train_s:.3f}")
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
