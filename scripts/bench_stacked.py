#!/usr/bin/env python3
"""Benchmark: a fleet's trainings one at a time against one stack (opt_ds_ops/training/stacked.py).

K hosts' datasets (``--rows`` rows each: 8,640 by default, six days at one row a minute, the length of an ASD machine's training file) are made from the
shared SMD and ASD machines (the bundled SMD machine-1-2 where they are absent), each host with
its own offset and noise, one width per run (``--width``: the first columns of each machine). Each
is trained with the shipped defaults (etc/ds-ops/trainer.yaml's ``train:`` section: the plateau
rule, batch 1024, lr 1e-2, at most 600 steps) first alone, one after the other
(:func:`opt_ds_ops.training.fit.train`, what a job does today), then all K in one stack
(:func:`opt_ds_ops.training.stacked.train_stacked`), after an untimed warm-up of both. Prints the
models/hour of each, their ratio, and the largest relative difference of a threshold and of a
weight between the two (0 on the CPU: the stack computes what one model does).

With ``--daemon``, the same hosts through a real daemon instead (``ds-ops daemon``, device cpu,
the shipped training defaults): all K files dropped into incoming/ at once (each written beside
and renamed in), first with ``daemon.stack_max: 0`` (one job process per file, what the daemon did
before), then with stacks (``stack_max`` K, ``stack_min`` 2); each run's wall time from the drop
to the last result in done/, its models/hour, the ratio, and the largest relative difference
between the two runs' thresholds.

Usage: python scripts/bench_stacked.py [--models 16] [--rows 8640] [--device cpu|cuda] [--amp auto] [--daemon] [--json]
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(os.path.dirname(REPO), "shared", "data")
BUNDLED = os.path.join(REPO, "data", "smd", "train", "machine-1-2.txt.gz")
sys.path.insert(0, REPO)
from opt_ds_ops.config.conffile import load_config  # noqa: E402
from opt_ds_ops.health.device import plan_device  # noqa: E402
from opt_ds_ops.training.fit import train  # noqa: E402
from opt_ds_ops.training.stacked import train_stacked  # noqa: E402


def host_datasets(count: int, rows: int, width: int, seed: int = 0) -> list[np.ndarray]:
    """``count`` datasets (rows, width) float32: shared machines in turn, each host moved by its own
    offset (up to one standard deviation per column) and noise (a tenth of one)."""
    files = sorted(glob.glob(os.path.join(SHARED, "smd", "train", "*.txt.gz")))
    files += sorted(glob.glob(os.path.join(SHARED, "asd", "train", "*.txt.gz")))
    machines = []
    for path in files or [BUNDLED]:
        with gzip.open(path, "rt") as f:
            m = np.loadtxt(f, delimiter=",", dtype=np.float32)
        if m.shape[1] >= width and m.shape[0] >= rows:
            machines.append(m[:rows, :width])
    if not machines:
        raise SystemExit(f"no machine has {rows} rows and {width} columns")
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        base = machines[i % len(machines)]
        sd = base.std(axis=0) + 1e-3
        moved = base + rng.uniform(-1, 1, width).astype(np.float32) * sd
        out.append((moved + rng.normal(0, 0.1, base.shape).astype(np.float32) * sd).astype(np.float32))
    return out


def measure(count: int, rows: int, width: int, device: str, amp: str) -> dict:
    """Train ``count`` hosts alone then stacked; return the figures (see the module docstring)."""
    cfg = load_config(os.path.join(REPO, "etc", "ds-ops", "trainer.yaml")).train
    plan = plan_device(device, amp)
    data = host_datasets(count, rows, width)
    warm = data[:2]
    [train(d, cfg, plan) for d in warm]
    train_stacked(warm, cfg, plan)
    t0 = time.perf_counter()
    alone = [train(d, cfg, plan) for d in data]
    t_alone = time.perf_counter() - t0
    t0 = time.perf_counter()
    stacked = train_stacked(data, cfg, plan)
    t_stacked = time.perf_counter() - t0
    failed = [i for i, r in enumerate(stacked) if isinstance(r, Exception)]
    pairs = [(a, s) for a, s in zip(alone, stacked) if not isinstance(s, Exception)]
    thr = max(abs(s.threshold - a.threshold) / abs(a.threshold) for a, s in pairs) if pairs else float("nan")
    weight = max(float((s.model.state_dict()[k].float() - a.model.state_dict()[k].float()).abs().max())
                 for a, s in pairs for k in a.model.state_dict()) if pairs else float("nan")
    steps = [a.stopping.get("steps", 0) for a in alone]
    return {"models": count, "rows": rows, "width": width, "device": device, "amp": str(plan.amp_dtype),
            "alone_s": t_alone, "stacked_s": t_stacked, "alone_per_h": count / t_alone * 3600,
            "stacked_per_h": count / t_stacked * 3600, "ratio": t_alone / t_stacked, "failed": failed,
            "threshold_rel_diff": thr, "weight_abs_diff": weight, "steps_min": min(steps), "steps_max": max(steps)}


def daemon_run(data: list[np.ndarray], stack_max: int, root: str) -> tuple[float, dict[str, float]]:
    """Drop ``data`` as host-NNN.csv into a fresh daemon's incoming/ at once; return (seconds from
    the drop to the last result in done/, each host's threshold)."""
    import signal
    import subprocess
    import tempfile

    conf = os.path.join(root, "trainer.yaml")
    with open(conf, "w") as f:
        f.write(f"models_dir: {root}/models\ndevice: cpu\nspool:\n  dir: {root}/spool\n  settle_s: 0.2\n  quiet_s: 0\n"
                f"daemon:\n  stack_max: {stack_max}\n  stack_min: 2\n  stack_max_bytes: 1073741824\n"
                f"metrics:\n  textfile_dir: ''\n")
    staging = tempfile.mkdtemp(dir=root)
    names = []
    for i, d in enumerate(data):
        names.append(f"host-{i:03d}.csv")
        np.savetxt(os.path.join(staging, names[-1]), d, delimiter=",", fmt="%.6g")
    env = dict(os.environ, PYTHONPATH=REPO)
    log = open(os.path.join(root, "daemon.log"), "w")
    daemon = subprocess.Popen([sys.executable, "-m", "opt_ds_ops.cli", "daemon", "--config", conf], env=env,
                              stdout=log, stderr=subprocess.STDOUT)
    done = os.path.join(root, "spool", "done")
    try:
        deadline = time.monotonic() + 300
        while "ds-trainer ready" not in open(os.path.join(root, "daemon.log")).read():
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the daemon did not start:\n{open(os.path.join(root, 'daemon.log')).read()[-3000:]}")
            time.sleep(0.2)
        t0 = time.monotonic()
        for name in names:
            os.rename(os.path.join(staging, name), os.path.join(root, "spool", "incoming", name))
        while sum(n.endswith(".result.json") for n in os.listdir(done)) < len(names):
            failed = [n for n in os.listdir(os.path.join(root, "spool", "failed")) if n.endswith(".error.json")]
            if failed or daemon.poll() is not None:
                raise SystemExit(f"failed: {failed}\n{open(os.path.join(root, 'daemon.log')).read()[-3000:]}")
            time.sleep(0.1)
        seconds = time.monotonic() - t0
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(120)
        log.close()
    thresholds = {}
    for name in names:
        with open(os.path.join(done, f"{name}.result.json")) as f:
            thresholds[name] = json.load(f)["threshold"]
    return seconds, thresholds


def measure_daemon(count: int, rows: int, width: int) -> dict:
    """The K hosts through a real daemon, one job process per file and then in stacks."""
    import tempfile

    data = host_datasets(count, rows, width)
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        t_alone, thr_alone = daemon_run(data, 0, a)
        t_stacked, thr_stacked = daemon_run(data, count, b)
    thr = max(abs(thr_stacked[n] - thr_alone[n]) / abs(thr_alone[n]) for n in thr_alone)
    return {"models": count, "rows": rows, "width": width, "alone_s": t_alone, "stacked_s": t_stacked,
            "alone_per_h": count / t_alone * 3600, "stacked_per_h": count / t_stacked * 3600,
            "ratio": t_alone / t_stacked, "threshold_rel_diff": thr}


def report_daemon(r: dict) -> str:
    return (f"daemon, {r['models']} files of {r['rows']:,} x {r['width']} dropped at once, shipped defaults, cpu: "
            f"one job process each {r['alone_per_h']:,.0f} models/hour ({r['alone_s']:.1f} s from the drop to the last "
            f"result), stacks {r['stacked_per_h']:,.0f} models/hour ({r['stacked_s']:.1f} s): {r['ratio']:.2f}x; "
            f"largest threshold difference {r['threshold_rel_diff']:.1e} relative")


def report(r: dict) -> str:
    return (f"stacked training: {r['models']} models of {r['rows']:,} x {r['width']} rows, shipped defaults "
            f"(steps {r['steps_min']}-{r['steps_max']}), {r['device']} amp {r['amp']}: one at a time "
            f"{r['alone_per_h']:,.0f} models/hour ({r['alone_s']:.1f} s), stacked {r['stacked_per_h']:,.0f} "
            f"models/hour ({r['stacked_s']:.1f} s): {r['ratio']:.2f}x; largest difference from alone: threshold "
            f"{r['threshold_rel_diff']:.1e} relative, weight {r['weight_abs_diff']:.1e}"
            + (f"; failed in the stack: {r['failed']}" if r["failed"] else ""))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=int, nargs="+", default=[16])
    ap.add_argument("--rows", type=int, default=8640)
    ap.add_argument("--width", type=int, default=19, help="columns per host (19: what SMD and ASD both have)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--amp", default="auto")
    ap.add_argument("--json", action="store_true", help="one JSON object per count instead of a line")
    ap.add_argument("--daemon", action="store_true", help="through a real daemon: one job process per file, then stacks")
    args = ap.parse_args()
    for count in args.models:
        if args.daemon:
            r = measure_daemon(count, args.rows, args.width)
            print(json.dumps(r) if args.json else report_daemon(r), flush=True)
            continue
        r = measure(count, args.rows, args.width, args.device, args.amp)
        print(json.dumps(r) if args.json else report(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
