#!/usr/bin/env python3
"""Benchmark: a fleet of hosts on one server, through a real daemon (docs/performance.md, "A fleet").

Trains one base model per shared machine used (``--bases``: SMD and ASD machines from
../shared/data, the bundled SMD machine-1-2 where they are absent) with ``ds-ops train``, copies
them to N model names (``host-0000``, ...), starts a real daemon (``ds-ops daemon``, its journal
captured at systemd-python's ``send`` with the time of each entry) and drops one chunk per model
per ``--interval-s`` (5 rows of its base machine's test period, moved by a per-host offset and
noise so the hosts' scores differ; every ``--spike-every``-th chunk with one metric pushed far out:
an incident) the safe way (sidecar, then ``.part`` renamed), at the fleet's rate N / interval,
for ``--seconds``. Then the same again with ``--train-queue`` training datasets dropped into
incoming/ at the start (a burst of retrainings beside the scoring), and with ``--retrain-daily``
the same again with one training dataset per host per day dropped at that pace through the window
(N / 86,400 a second, the k-th at (k + 0.5) / rate: the day's retrainings as they come; first
trainings of new names, so a retraining's own work, its history copy and the gate, is not in it).

Prints per phase: chunks dropped and scored, sustained chunks/s, drop -> result and drop -> alert
p50/p95/max, the backlog at the end of the window (chunks dropped but not scored) and how long
it took to drain, the daemon's CPU seconds per chunk and everything's (the daemon's process tree:
its forkserver and every job process, the reaped ones included) over the window and the drain,
the daemon's peak RSS, ds_ops.prom's size, series and rewrites,
``ds-ops status``'s wall time, and the training queue's models/hour under the scoring load.
With ``--stacked K``, then K hosts trained with the shipped defaults one at a time and as one stack
(scripts/bench_stacked.py: the trainer itself, in this process), then the same K files dropped at
once into a fresh daemon, one job process per file against stacks (``daemon.stack_max``).
Ratios against the same run with one model in the same script (``--baseline-seconds``). No
assertion: figures only.

Usage: python scripts/bench_fleet.py [--models 100] [--interval-s 300] [--seconds 120]
"""

from __future__ import annotations

import argparse
import glob
import gzip
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(os.path.dirname(REPO), "shared", "data")
BUNDLED = os.path.join(REPO, "data", "smd", "train", "machine-1-2.txt.gz")
TICK = os.sysconf("SC_CLK_TCK")
sys.path.insert(0, REPO)
from bench_score_spool import CAPTURE, entries, rename_in  # noqa: E402 - this folder: the scoring spool's bench
from opt_ds_ops.observe.journal import MESSAGE_IDS  # noqa: E402

OPENED = MESSAGE_IDS["incident-opened"]


def bases(count: int) -> list[tuple[str, str, str]]:
    """Return (name, train file, test file) of ``count`` shared machines, SMD and ASD in turn."""
    found = []
    for corpus in ("smd", "asd"):
        for path in sorted(glob.glob(os.path.join(SHARED, corpus, "train", "*.txt.gz"))):
            found.append((corpus, path))
    smd = [p for c, p in found if c == "smd"]
    asd = [p for c, p in found if c == "asd"]
    mixed = [p for pair in zip(smd, asd) for p in pair] + smd[len(asd):] + asd[len(smd):]
    out = [(os.path.basename(p)[:-7], p, p.replace("/train/", "/test/")) for p in mixed[:count]]
    return out or [("machine-1-2", BUNDLED, BUNDLED.replace("/train/", "/test/"))]


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def tree_cpu_s(root: int) -> float:
    """CPU seconds of root and its descendants, the reaped ones included (cutime, cstime): the
    daemon, its forkserver and every job process it ran."""
    parent, times = {}, {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(pid)] = int(fields[1])
        times[int(pid)] = sum(int(x) for x in fields[11:15]) / TICK
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += times.get(pid, 0.0)
        todo += [c for c, p in parent.items() if p == pid]
    return total


def peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


class Fleet:
    """One run: a daemon on a fresh spool with N copies of the base models."""

    def __init__(self, root: str, base_models: str, base_list: list, n: int, args):
        self.root, self.n, self.args = root, n, args
        self.conf, self.capture, self.log = (os.path.join(root, x) for x in ("trainer.yaml", "journal.jsonl", "daemon.log"))
        self.spool, self.scores = os.path.join(root, "spool"), os.path.join(root, "scores")
        with open(self.conf, "w") as f:
            f.write(f"models_dir: {root}/models\ndevice: cpu\nspool:\n  dir: {self.spool}\n"
                    f"scoring:\n  results_dir: {self.scores}\nmetrics:\n  textfile_dir: {root}/prom\n"
                    "retrain:\n  every: ''\n  drift_rate: 0\n")
        os.makedirs(os.path.join(root, "prom"))
        os.makedirs(os.path.join(root, "models"))
        self.rows = {}
        for name, _train, test in base_list:
            self.rows[name] = np.loadtxt(gzip.open(test, "rt"), delimiter=",", dtype=np.float64)
        self.base_of = {}
        for i in range(n):
            name, _, _ = base_list[i % len(base_list)]
            host = f"host-{i:04d}"
            shutil.copytree(os.path.join(base_models, name), os.path.join(root, "models", host), symlinks=True)
            self.base_of[host] = name
        self.rng = np.random.default_rng(0)

    def start(self):
        env = dict(os.environ, PYTHONPATH=REPO, JOURNAL_STREAM="8:1", JOURNAL_CAPTURE=self.capture)
        env.pop("NOTIFY_SOCKET", None)
        self.out = open(self.log, "wb")
        self.daemon = subprocess.Popen([sys.executable, "-c", CAPTURE, "daemon", "--config", self.conf],
                                       stdout=self.out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        self.wait(lambda: any(e.get("MESSAGE") and "ds-trainer ready" in e["MESSAGE"] for e in entries(self.capture)), 300)

    def wait(self, predicate, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        while True:
            value = predicate()
            if value:
                return value
            if self.daemon.poll() is not None:
                raise SystemExit(f"the daemon exited:\n{open(self.log).read()[-3000:]}")
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)

    def chunk(self, host: str, k: int, spike: bool) -> bytes:
        rows = self.rows[self.base_of[host]]
        i = int(host[5:])
        lo = (k * 5 + 97 * i) % (len(rows) - 5)
        part = rows[lo:lo + 5] + 0.002 * (i % 17) + self.rng.normal(0, 0.002, (5, rows.shape[1]))
        if spike:
            part[:, 0] += 40.0
        return "".join(",".join(f"{v:.6g}" for v in r) + "\n" for r in part).encode()

    def results(self) -> dict[str, list[float]]:
        """{host: [summary.json mtimes in order]}."""
        out = {}
        for path in glob.glob(os.path.join(self.scores, "host-*", "*", "summary.json")):
            out.setdefault(path.split(os.sep)[-3], []).append(os.stat(path).st_mtime)
        return {h: sorted(v) for h, v in out.items()}

    def phase(self, seconds: float, train_queue: list[str], train_rate: float = 0.0) -> dict:
        """Score for seconds; train_queue's datasets are dropped into incoming/ at the start, or
        one every 1 / train_rate seconds from the start when train_rate > 0."""
        score = os.path.join(self.spool, "score")
        rate = self.n / self.args.interval_s
        prom = os.path.join(self.root, "prom", "ds_ops.prom")
        trained_before = len(glob.glob(os.path.join(self.spool, "done", "*.result.json")))
        queued = 0

        def queue_trainings(elapsed: float) -> int:  # datasets of the base machines
            # paced: the k-th at (k + 0.5) / train_rate, so a window holds about seconds * rate of them
            due = len(train_queue) if train_rate <= 0 else min(len(train_queue), int(elapsed * train_rate + 0.5))
            for k in range(queued, due):
                rename_in(os.path.join(self.spool, "incoming"), f"retrain-{k:04d}.txt.gz", open(train_queue[k], "rb").read())
            return max(queued, due)

        queued = queue_trainings(0.0)
        cpu0, tree0, t0 = cpu_s(self.daemon.pid), tree_cpu_s(self.daemon.pid), time.monotonic()
        drops: dict[str, list[tuple[float, bool]]] = {}
        sent, prom_mtimes, mtime = 0, 0, None
        seq = {h: len(v) for h, v in self.results().items()}
        while time.monotonic() - t0 < seconds:
            queued = queue_trainings(time.monotonic() - t0)
            due = int((time.monotonic() - t0) * rate) + 1
            while sent < due:
                host = f"host-{sent % self.n:04d}"
                k = sent // self.n
                spike = self.args.spike_every > 0 and sent % self.args.spike_every == self.args.spike_every - 1
                name = f"{host}.{int(time.time() * 1e6)}"
                rename_in(score, name + ".yaml", f"model: {host}\n".encode())
                drops.setdefault(host, []).append((rename_in(score, name + ".csv", self.chunk(host, k, spike)), spike))
                sent += 1
            try:
                m = os.stat(prom).st_mtime
                prom_mtimes += m != mtime
                mtime = m
            except FileNotFoundError:
                pass
            time.sleep(min(0.02, 1 / rate))
        window = time.monotonic() - t0
        done_in_window = sum(len(v) - seq.get(h, 0) for h, v in self.results().items())
        trained_in_window = len(glob.glob(os.path.join(self.spool, "done", "*.result.json"))) - trained_before
        backlog = sent - done_in_window
        drained = self.wait(lambda: sum(len(v) - seq.get(h, 0) for h, v in self.results().items()) >= sent,
                            max(120.0, 3 * seconds))
        drain_s = time.monotonic() - t0 - window
        cpu_daemon = cpu_s(self.daemon.pid) - cpu0
        cpu_tree = tree_cpu_s(self.daemon.pid) - tree0
        res = self.results()
        to_result, to_alert = [], []
        opened = {}
        for e in entries(self.capture):
            if e.get("MESSAGE_ID") == OPENED and str(e.get("DS_MODEL", "")).startswith("host-"):
                opened.setdefault(e["DS_MODEL"], []).append(e["T"])
        for host, ds in drops.items():
            got = res.get(host, [])[seq.get(host, 0):]
            for (t, spike), r in zip(ds, got):
                to_result.append(r - t)
                if spike:
                    later = [a for a in opened.get(host, []) if a >= t]
                    if later:
                        to_alert.append(later[0] - t)
        t_status = time.monotonic()
        subprocess.run([sys.executable, "-m", "opt_ds_ops.cli", "status", "--config", self.conf], cwd=REPO,
                       env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, check=False)
        status_s = time.monotonic() - t_status
        size = os.path.getsize(prom) if os.path.exists(prom) else 0
        series = sum(1 for line in open(prom) if line and not line.startswith("#")) if size else 0
        return {"sent": sent, "window_s": window, "scored_in_window": done_in_window, "chunks_per_s": done_in_window / window,
                "backlog": backlog, "drained": bool(drained), "drain_s": drain_s,
                "to_result": to_result, "to_alert": to_alert, "daemon_cpu_per_chunk": cpu_daemon / max(sent, 1),
                "total_cpu_per_chunk": cpu_tree / max(sent, 1),
                "daemon_rss_mib": peak_rss_mib(self.daemon.pid), "prom_bytes": size, "prom_series": series,
                "prom_rewrites": prom_mtimes, "status_s": status_s, "trained_in_window": trained_in_window,
                "models_per_hour": trained_in_window / window * 3600, "trainings_dropped": queued}

    def stop(self) -> None:
        self.daemon.send_signal(signal.SIGTERM)
        self.daemon.wait(120)
        self.out.close()


def line(label: str, r: dict, base: dict | None = None) -> str:
    ratio = lambda k: f" ({r[k] / base[k]:.2f}x one model)" if base and base.get(k) else ""  # noqa: E731
    tr, ta = r["to_result"], r["to_alert"]
    return (f"{label}: {r['sent']} chunks dropped in {r['window_s']:.0f} s, {r['scored_in_window']} scored in the window: "
            f"{r['chunks_per_s']:.2f} chunks/s; backlog at the end {r['backlog']}, "
            f"{'drained' if r['drained'] else 'NOT drained'} {r['drain_s']:.1f} s later\n"
            f"  drop -> result p50 {pct(tr, 50):.3f} s p95 {pct(tr, 95):.3f} s max {max(tr, default=float('nan')):.3f} s"
            f"{' (p95 ' + format(pct(tr, 95) / pct(base['to_result'], 95), '.2f') + 'x one model)' if base else ''}\n"
            f"  drop -> alert  p50 {pct(ta, 50):.3f} s p95 {pct(ta, 95):.3f} s max {max(ta, default=float('nan')):.3f} s "
            f"({len(ta)} incidents)\n"
            f"  CPU per chunk: daemon {1000 * r['daemon_cpu_per_chunk']:.1f} ms{ratio('daemon_cpu_per_chunk')}, "
            f"everything {1000 * r['total_cpu_per_chunk']:.1f} ms{ratio('total_cpu_per_chunk')}; daemon peak RSS "
            f"{r['daemon_rss_mib']:.0f} MiB, job processes' peak {r['jobs_rss_mib']:.0f} MiB\n"
            f"  ds_ops.prom {r['prom_bytes'] / 1024:.0f} KiB, {r['prom_series']} series, rewritten {r['prom_rewrites']} "
            f"times seen; ds-ops status {r['status_s']:.2f} s{ratio('status_s')}"
            + (f"\n  training: {r['trainings_dropped']} datasets dropped, {r['trained_in_window']} models trained in "
               f"the window: {r['models_per_hour']:.0f}/hour" if r["trainings_dropped"] else ""))


def run(n: int, seconds: float, train_queue: list, base_models: str, base_list: list, args,
        train_rate: float = 0.0) -> dict:
    root = tempfile.mkdtemp(prefix=f"ds-ops-bench-fleet-{n}-")
    fleet = Fleet(root, base_models, base_list, n, args)
    fleet.start()
    try:
        r = fleet.phase(seconds, train_queue, train_rate)
    finally:
        fleet.stop()
    r["jobs_rss_mib"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=int, nargs="+", default=[100])
    ap.add_argument("--interval-s", type=float, default=300.0)
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--baseline-seconds", type=float, default=60.0)
    ap.add_argument("--bases", type=int, default=4)
    ap.add_argument("--spike-every", type=int, default=20)
    ap.add_argument("--train-queue", type=int, default=0, help="training datasets dropped at the start of a second phase")
    ap.add_argument("--retrain-daily", action="store_true",
                    help="then a phase with one training per host per day dropped at that pace (N / 86,400 a second)")
    ap.add_argument("--stacked", type=int, default=0,
                    help="then train this many hosts one at a time and as one stack (scripts/bench_stacked.py)")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    base_list = bases(args.bases)
    base_models = tempfile.mkdtemp(prefix="ds-ops-bench-fleet-bases-")
    t = time.monotonic()
    for name, train, _test in base_list:
        subprocess.run([sys.executable, "-m", "opt_ds_ops.cli", "train", train, "--name", name, "--models-dir",
                        base_models, "--device", "cpu"], cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO),
                       check=True, capture_output=True)
    print(f"fleet benchmark on {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}: {len(base_list)} base models "
          f"({', '.join(b[0] for b in base_list)}) trained in {time.monotonic() - t:.0f} s; a 5-row chunk per model "
          f"every {args.interval_s:.0f} s, one in {args.spike_every} an incident")
    base = run(1, args.baseline_seconds, [], base_models, base_list, argparse.Namespace(**{**vars(args), "interval_s": 1.0}))
    print(line("1 model, a chunk a second (the baseline)", base))
    for n in args.models:
        r = run(n, args.seconds, [], base_models, base_list, args)
        print(line(f"{n} models at {n / args.interval_s:.2f} chunks/s", r, base))
        if args.train_queue:
            queue = [b[1] for b in base_list] * (args.train_queue // len(base_list) + 1)
            r = run(n, args.seconds, queue[:args.train_queue], base_models, base_list, args)
            print(line(f"{n} models with {args.train_queue} trainings queued", r, base))
        if args.retrain_daily:
            rate = n / 86400.0
            count = int(args.seconds * rate + 0.5)
            if not count:
                print(f"{n} models with a training per host per day: none due in {args.seconds:.0f} s "
                      f"(one every {1 / rate:.0f} s); a longer --seconds")
                continue
            queue = [b[1] for b in base_list] * (count // len(base_list) + 1)
            r = run(n, args.seconds, queue[:count], base_models, base_list, args, train_rate=rate)
            print(line(f"{n} models with a training per host per day ({3600 * rate:.1f} an hour: "
                       f"{count} in the window)", r, base))
    shutil.rmtree(base_models, ignore_errors=True)
    if args.stacked:  # models/hour alone and stacked, in this run: the trainer itself, then through a daemon
        from bench_stacked import measure, measure_daemon, report, report_daemon
        print(report(measure(args.stacked, 8640, 19, "cpu", "auto")), flush=True)
        print(report_daemon(measure_daemon(args.stacked, 8640, 19)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
