#!/usr/bin/env python3
"""Soak test of the ds-trainer daemon: many real drops while the daemon is SIGKILLed again and again.

Everything is real: ``python -m opt_ds_ops.cli daemon`` processes on a temporary root, real files
dropped by concurrent writer threads, real training on the CPU, real SIGKILLs.

* A temporary root holds a conffile (device cpu, 1 epoch, batch 256, settle_s 0.2, quiet_s 1.0), the
  spool (incoming/ mode 3770, as the package makes it) and the model store. As root, the daemon
  runs as the service would: without CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH and CAP_FOWNER, and each drop is
  given to another member of the group (uid 12345, mode 0640), as a user's drop would be.
* ``--datasets`` distinct small datasets (300-2000 rows x 4-38 columns of the real SMD rows of
  data/smd/train/machine-1-2.txt.gz, sliced differently each, as .csv, .txt.gz or .npy) are dropped
  by ``--writers`` threads, only in the ways docs/operating.md calls safe: written under NAME.part,
  NAME.tmp or .NAME in incoming/ then renamed to NAME, or written in a staging folder on the same
  file system then renamed in. Random gaps spread the drops over the kill phase.
* Meanwhile the daemon is SIGKILLed ``--kills`` times and started again at once after each kill.
  Each kill is one of three kinds, drawn at random: ``--startup-share`` (0.4) of them come a
  uniformly random 0..``--startup-max-s`` (2.5) seconds after the daemon's start (imports,
  recovery, the forkserver); ``--event-share`` (0.16) are targeted at the moments that last only
  milliseconds, which random kills rarely hit: the soak polls the spool every 2 ms after the
  daemon's "ds-trainer ready" line and kills as soon as it sees a claim copying (state
  ``claiming``), a job parsing (stage ``dataset``), a model being written (a ``.tmp-*`` directory
  or stage ``store``) or a saved job being finished (state ``saved``), one of the four at random;
  the others come a uniformly random 0..``--kill-max-s`` (3) seconds after the ready line, so they
  land in claims, job start, health gate, parsing and training whatever the machine's speed.
  (Kills only 0..3 s after the start, tried first, never let a restarted daemon finish a job on
  the 2-core machine: start-up and the first job's start take ~3.5 s there.) Where each kill
  landed is recorded in kills.jsonl and counted in the figures.
* When the writers are done and the kills too, the last daemon runs until every dataset is in
  done/ (or, on a failure, in done/ or failed/), then gets SIGTERM and must exit 0.

Checks: every dataset in done/ exactly once (no NAME.1), failed/, incoming/, processing/ and the
staging folder empty; each NAME.result.json's sha256 equals the sha256 of the bytes written and of
done/NAME; each model name has exactly one version, made by that job (metadata.json job_id and
dataset.sha256), ``current`` points at it and it loads with opt_ds_ops.store.versions.load_model; no
``.tmp-*`` or ``.current-*`` left under models/; no job counted a crash (a daemon's SIGKILL is
never the dataset's fault); no process of any daemon session left after the final stop.
Prints the figures, exits 1 with one line per failure (and where to look) on any failure, 0 on
success. The root is removed on success unless ``--keep``; kept (and printed) on failure.

Deterministic given ``--seed``: the datasets, their names, formats, writers and ways of dropping,
the writers' gaps and the kill delays. The interleaving with the daemon is real time, so where
each kill lands differs between runs; kills.jsonl and the daemon logs (daemon-NNN.log) record it.

Usage: scripts/soak.py [--datasets 200] [--kills 100] [--writers 4] [--seed 8] [--kill-max-s 3]
                       [--startup-share 0.4] [--startup-max-s 2.5] [--event-share 0.16]
                       [--timeout-s 1800] [--stall-s 180] [--root DIR] [--keep]
"""

from __future__ import annotations

import argparse
import ctypes
import gzip
import hashlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
SMD_TRAIN = REPO / "data" / "smd" / "train" / "machine-1-2.txt.gz"
OTHER_UID = 12345  # a member of group ds-ops who is not the daemon (as in tests/daemon/test_daemon_hostile.py)
FORMATS = (".csv", ".txt.gz", ".npy")
DROP_WAYS = ("part", "tmp", "hidden", "staging")
READY_TIMEOUT_S = 120.0  # a daemon not ready this long after its start is hung (imports take seconds)
STARTUP_GUESS_S = 1.5  # start to "ready" on the 2-core machine (measured 1.3-1.5 s): paces the writers
EVENTS = ("claim", "dataset", "store", "finishing")  # what a targeted kill waits for
EVENT_WAIT_S = 10.0  # a targeted kill whose moment did not come this long after "ready" kills anyway
STOP_TIMEOUT_S = 120.0  # SIGTERM to exit: a training job writes its checkpoint first
ORPHAN_WAIT_S = 30.0  # after the final stop, processes of the daemons' sessions must be gone by then


class SoakFailure(Exception):
    """The soak cannot go on (a timeout, a hang, a daemon that will not start or stop)."""


# ---- the datasets ------------------------------------------------------------------------------

class Datasets:
    """The plan of every dataset (deterministic given the seed) and how to make its bytes."""

    def __init__(self, count: int, seed: int):
        raw = gzip.decompress(SMD_TRAIN.read_bytes()).decode("ascii")
        self.lines = [line for line in raw.splitlines() if line.strip()]
        self.matrix = np.loadtxt(io.StringIO(raw), delimiter=",", dtype=np.float64)
        n_rows, n_cols = self.matrix.shape
        rng = np.random.default_rng(seed)
        formats = [FORMATS[i % len(FORMATS)] for i in range(count)]
        rng.shuffle(formats)
        self.plans: list[dict] = []
        seen = set()
        for i in range(count):
            while True:
                rows = int(rng.integers(300, 2001))
                cols = int(rng.integers(4, n_cols + 1))
                r0 = int(rng.integers(0, n_rows - rows + 1))
                c0 = int(rng.integers(0, n_cols - cols + 1))
                if (rows, cols, r0, c0) not in seen:
                    seen.add((rows, cols, r0, c0))
                    break
            fmt = formats[i]
            plan = {"index": i, "name": f"soak{i:04d}{fmt}", "model_name": f"soak{i:04d}", "format": fmt,
                    "rows": rows, "cols": cols, "r0": r0, "c0": c0}
            if fmt == ".csv":
                plan["delimiter"] = [",", ";"][int(rng.integers(0, 2))]
                plan["header"] = bool(rng.random() < 0.3)
            elif fmt == ".txt.gz":
                plan["delimiter"] = [",", " ", "\t"][int(rng.integers(0, 3))]
                plan["header"] = False
            else:
                plan["dtype"] = ["float32", "float64"][int(rng.integers(0, 2))]
            self.plans.append(plan)

    def data(self, plan: dict) -> bytes:
        """The file's bytes: the SMD rows verbatim (text) or as an array (.npy)."""
        r0, c0, rows, cols = plan["r0"], plan["c0"], plan["rows"], plan["cols"]
        if plan["format"] == ".npy":
            buf = io.BytesIO()
            np.save(buf, np.ascontiguousarray(self.matrix[r0:r0 + rows, c0:c0 + cols], dtype=plan["dtype"]))
            return buf.getvalue()
        sep = plan["delimiter"]
        out = [sep.join(f"m{c}" for c in range(c0, c0 + cols))] if plan["header"] else []
        out += [sep.join(line.split(",")[c0:c0 + cols]) for line in self.lines[r0:r0 + rows]]
        text = ("\n".join(out) + "\n").encode("ascii")
        return gzip.compress(text, compresslevel=6, mtime=0) if plan["format"].endswith(".gz") else text


class Writers:
    """``count`` threads dropping the datasets the safe ways; records sha256 and drop time of each."""

    def __init__(self, datasets: Datasets, count: int, seed: int, incoming: Path, staging: Path, mean_gap_s: float):
        self.datasets, self.incoming, self.staging, self.mean_gap_s = datasets, incoming, staging, mean_gap_s
        order = list(range(len(datasets.plans)))
        random.Random(seed).shuffle(order)
        self.assigned = [order[w::count] for w in range(count)]
        self.seeds = [seed * 1000 + w + 1 for w in range(count)]
        self.dropped: dict[str, dict] = {}  # name -> sha256, size, way, writer, dropped_at (epoch seconds)
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(w,), name=f"writer-{w}", daemon=True)
                        for w in range(count)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def alive(self) -> bool:
        return any(t.is_alive() for t in self.threads)

    def join(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if self.alive():
            raise SoakFailure(f"writers still running after {timeout_s:.0f} s")

    def _run(self, w: int) -> None:
        rng = random.Random(self.seeds[w])
        try:
            for i in self.assigned[w]:
                gap = 0.0 if rng.random() < 0.2 else rng.uniform(0, 2 * self.mean_gap_s)  # bursts and pauses
                time.sleep(gap)
                self._drop(w, self.datasets.plans[i], rng)
        except Exception as e:  # noqa: BLE001 - reported as a soak failure
            with self._lock:
                self.errors.append(f"writer {w}: {type(e).__name__}: {e}")

    def _drop(self, w: int, plan: dict, rng: random.Random) -> None:
        name = plan["name"]
        data = self.datasets.data(plan)
        way = DROP_WAYS[rng.randrange(len(DROP_WAYS))]
        tmp = {"part": self.incoming / f"{name}.part", "tmp": self.incoming / f"{name}.tmp",
               "hidden": self.incoming / f".{name}", "staging": self.staging / name}[way]
        pieces = rng.randint(1, 3)
        cut = sorted(rng.randint(0, len(data)) for _ in range(pieces - 1))
        with open(tmp, "xb") as f:
            for a, b in zip([0] + cut, cut + [len(data)]):
                f.write(data[a:b])
                f.flush()
                time.sleep(rng.uniform(0, 0.05))
        os.chmod(tmp, 0o640)
        if os.geteuid() == 0:
            os.lchown(tmp, OTHER_UID, -1)  # as another member of the group left it
        final = self.incoming / name
        if os.path.lexists(final):
            raise RuntimeError(f"{final} exists before the drop")
        os.rename(tmp, final)
        with self._lock:
            self.dropped[name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "way": way,
                                  "writer": w, "dropped_at": time.time()}


# ---- the daemon --------------------------------------------------------------------------------

def drop_dac_capabilities() -> None:
    """preexec_fn: remove CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH and CAP_FOWNER from the bounding
    set, so that a root daemon meets file modes and owners like the service user would (as
    tests/daemon_kit.py does, and without the right to chmod another user's inode)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2, 3):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def daemon_env() -> dict:
    """This repository importable, not under systemd (plain log lines), one OpenMP thread (2 cores)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("JOURNAL_STREAM", "NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "DS_OPS_CONFIG")}
    env["PYTHONPATH"] = str(REPO)
    env["OMP_NUM_THREADS"] = "1"
    return env


class Daemon:
    """One real daemon process in its own session (so its forkserver and jobs can be found later)."""

    def __init__(self, conf: Path, logs: Path, number: int, env: dict | None = None):
        self.number = number
        self.log_path = logs / f"daemon-{number:03d}.log"
        self._log = open(self.log_path, "wb")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "opt_ds_ops.cli", "daemon", "--config", str(conf)],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO, env=env or daemon_env(),
            preexec_fn=drop_dac_capabilities if os.geteuid() == 0 else None, start_new_session=True)
        self.pid = self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def ready(self) -> bool:
        return "ds-trainer ready" in self.log()

    def wait_ready(self, timeout_s: float) -> float | None:
        """Wait for the "ds-trainer ready" line; return its monotonic time, None if the daemon exited first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.ready():
                return time.monotonic()
            if not self.alive():
                return None
            time.sleep(0.01)
        raise SoakFailure(f"daemon-{self.number:03d} not ready {timeout_s:.0f} s after its start (a hang?): "
                          f"{self.log_path}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self._log.close()

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise SoakFailure(f"daemon {self.pid} did not exit within {STOP_TIMEOUT_S:.0f} s of SIGTERM "
                              f"(log {self.log_path})") from None
        self._log.close()
        return rc


def session_processes(sessions: set[int]) -> list[tuple[int, int, str]]:
    """(pid, session, command line) of every live process whose session is one of sessions."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            sid = int(fields[3])
            if sid in sessions and fields[0] != "Z":
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                out.append((int(entry), sid, cmd))
        except (OSError, IndexError, ValueError):
            continue
    return out


# ---- the soak ----------------------------------------------------------------------------------

def write_config(root: Path, extra: tuple[str, ...] = ()) -> Path:
    """The soak's conffile (see the module docstring), with extra lines appended."""
    conf = root / "trainer.yaml"
    conf.write_text("\n".join([
        f"models_dir: {root / 'models'}",
        "device: cpu",
        "train:",
        "  epochs: 1",
        "  batch_size: 256",
        "spool:",
        f"  dir: {root / 'spool'}",
        "  settle_s: 0.2",
        "  scan_interval_s: 30.0",
        "  quiet_s: 1.0",
        *extra,
    ]) + "\n")
    return conf


def kill_everything(daemon, sessions) -> None:
    """At the end of a soak: kill the running daemon and every process left in the sessions of
    the daemons it started (only those)."""
    if daemon is not None and daemon.alive():
        daemon.kill()
    for pid, _sid, _cmd in session_processes(sessions):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def soak_root(ap: argparse.ArgumentParser, args, prefix: str) -> tuple[Path, dict[str, Path]]:
    """Return (the run's root: ``--root`` or a new temporary directory, which must be empty, mode
    0755, its spool made by :func:`make_spool`)."""
    root = Path(args.root).resolve() if args.root else Path(tempfile.mkdtemp(prefix=prefix))
    root.mkdir(parents=True, exist_ok=True)
    if any(root.iterdir()):
        ap.error(f"--root {root} is not empty")
    os.chmod(root, 0o755)
    return root, make_spool(root)


def make_spool(root: Path) -> dict[str, Path]:
    """The spool with the package's modes (debian/ds-ops.tmpfiles) and a staging folder beside it."""
    spool = root / "spool"
    spool.mkdir(mode=0o750)
    dirs = {"spool": spool, "staging": root / "staging", "models": root / "models", "logs": root / "logs"}
    for which, mode in (("incoming", 0o3770), ("processing", 0o2750), ("done", 0o2750), ("failed", 0o2750)):
        d = spool / which
        d.mkdir()
        os.chmod(d, mode)
        dirs[which] = d
    for which in ("staging", "models", "logs"):
        dirs[which].mkdir()
    if os.stat(dirs["staging"]).st_dev != os.stat(dirs["incoming"]).st_dev:
        raise SoakFailure(f"{dirs['staging']} and {dirs['incoming']} are on different file systems")
    return dirs


def snapshot(dirs: dict[str, Path], d: Daemon) -> dict:
    """Where a kill landed: ready or not, the jobs in processing/ (state, stage, files), store temporaries."""
    jobs = []
    for jd in sorted(dirs["processing"].iterdir()) if dirs["processing"].exists() else []:
        try:
            rec = json.loads((jd / "job.json").read_text())
        except (OSError, ValueError):
            rec = {}
        try:
            files = sorted(os.listdir(jd))
        except OSError:
            files = []
        jobs.append({"job_id": jd.name, "dataset": rec.get("dataset"), "state": rec.get("state"),
                     "stage": rec.get("stage"), "restarts": rec.get("restarts", 0), "files": files})
    temps = sorted(str(p.relative_to(dirs["models"])) for p in dirs["models"].glob("*/.*"))
    lines = d.log().splitlines()
    if not any("ds-trainer ready" in line for line in lines):
        where = "start-up"
    elif not jobs:
        where = "idle"
    else:
        rank = {"running": 0, "claiming": 1, "saved": 2}
        j = min(jobs, key=lambda j: rank.get(j["state"], 3))  # the job being worked on, if any
        where = {"claiming": "claim/copy", "claimed": "job starting", "saved": "finishing"}.get(
            j["state"], j["stage"] if j["state"] == "running" else str(j["state"]))
        if temps and j["state"] == "running":
            where = "store"
    try:  # the job the daemon was handling on its main loop, if it keeps that breadcrumb
        handling = (dirs["spool"] / ".handling").read_text(errors="replace").strip()[:200]
    except OSError:
        handling = None
    return {"where": where, "jobs": jobs, "handling": handling, "model_temporaries": temps, "log_tail": lines[-3:]}


def spool_event(dirs: dict[str, Path]) -> set[str]:
    """Which of EVENTS are happening now, from the job records in processing/ and the store."""
    seen = set()
    try:
        jobs = os.listdir(dirs["processing"])
    except OSError:
        return seen
    for job in jobs:
        try:
            rec = json.loads((dirs["processing"] / job / "job.json").read_bytes())
        except (OSError, ValueError):
            continue
        state = rec.get("state")
        if state == "claiming":
            seen.add("claim")
        elif state == "saved":
            seen.add("finishing")
        elif state == "running":
            if rec.get("stage") in ("dataset", "store"):
                seen.add(rec["stage"])
            try:
                if any(n.startswith(".tmp-") for n in os.listdir(dirs["models"] / str(rec.get("model_name")))):
                    seen.add("store")
            except OSError:
                pass
    return seen


def wait_event(dirs: dict[str, Path], d: Daemon, event: str, timeout_s: float) -> bool:
    """Poll every 2 ms until event happens (True), the daemon exits or timeout_s passes (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and d.alive():
        if event in spool_event(dirs):
            return True
        time.sleep(0.002)
    return False


def kill_schedule(args: argparse.Namespace) -> list[tuple[str, float]]:
    """(anchor, delay_s) of each of ``args.kills`` kills, drawn from the seed (see the module
    docstring): anchor ``start`` or ``ready`` with a random delay, or one of EVENTS."""
    rng = random.Random(args.seed * 7919 + 17)
    schedule = []
    for _ in range(args.kills):
        r = rng.random()
        if r < args.startup_share:
            schedule.append(("start", rng.uniform(0, args.startup_max_s)))
        elif r < args.startup_share + args.event_share:
            schedule.append((EVENTS[rng.randrange(len(EVENTS))], 0.0))
        else:
            schedule.append(("ready", rng.uniform(0, args.kill_max_s)))
    return schedule


def kill_phase_estimate_s(args: argparse.Namespace) -> float:
    """About how long the kills of kill_schedule(args) take on the 2-core machine (paces the writers)."""
    ready_share = 1 - args.startup_share - args.event_share
    return args.kills * (args.startup_share * args.startup_max_s / 2 + ready_share * (
        STARTUP_GUESS_S + args.kill_max_s / 2) + args.event_share * 2 * STARTUP_GUESS_S)


def peak_rss_kib(pid: int) -> int | None:
    """The process's peak resident set (VmHWM in /proc/PID/status) in KiB; None if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def timed_kill(dirs: dict[str, Path], daemon: Daemon, k: int, anchor: str, delay: float) -> dict:
    """Wait for kill k's moment (its anchor and delay from kill_schedule), SIGKILL the daemon and
    return the record of where it landed (kills.jsonl): ``died`` if the daemon had exited by itself
    first, ``peak_rss_kib`` its VmHWM just before the kill."""
    t0 = daemon.started if anchor == "start" else daemon.wait_ready(READY_TIMEOUT_S)
    hit = None
    if t0 is not None and anchor in EVENTS:
        hit = wait_event(dirs, daemon, anchor, EVENT_WAIT_S)
        delay = time.monotonic() - t0
    elif t0 is not None:
        time.sleep(max(0.0, t0 + delay - time.monotonic()))
    rss = peak_rss_kib(daemon.pid)
    died = not daemon.alive()
    since_start = time.monotonic() - daemon.started
    daemon.kill()
    rec = {"kill": k, "daemon": daemon.number, "pid": daemon.pid, "anchor": anchor, "delay_s": round(delay, 3),
           "since_start_s": round(since_start, 3), "died": died, "peak_rss_kib": rss, **snapshot(dirs, daemon)}
    if hit is not None:
        rec["event_seen"] = hit
        if hit:  # killed within ~2 ms of seeing it; the job process may have moved on since
            rec["where"], rec["state_after_kill"] = anchor, rec["where"]
    if died:
        rec["where"] = f"exited by itself ({daemon.proc.returncode})"
    return rec


def died_before_kill(dirs: dict[str, Path], daemon: Daemon, rec: dict) -> str:
    """The failure line for a daemon that exited by itself before its kill (rec from timed_kill)."""
    return (f"daemon-{daemon.number:03d} exited with {daemon.proc.returncode} before kill {rec['kill']} "
            f"({rec['delay_s']:.3f} s after its {rec['anchor']}): {dirs['logs'] / f'daemon-{daemon.number:03d}.log'}")


def utc_seconds(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc).timestamp()


def count_done(dirs: dict[str, Path]) -> tuple[int, int]:
    done = sum(1 for p in dirs["done"].iterdir() if not p.name.endswith(".result.json") and p.name[0] != ".")
    failed = sum(1 for p in dirs["failed"].iterdir() if not p.name.endswith(".error.json") and p.name[0] != ".")
    return done, failed


def check_results(dirs: dict[str, Path], plans: list[dict], dropped: dict[str, dict]) -> tuple[list[str], dict, dict]:
    """For each plan whose dataset is in done/: its result.json gives the sha256 dropped and kept,
    the plan's model name, rows and columns, and no crash. Return (failures, results by dataset
    name, figures: restarts per result, drop-to-done latencies, resumed count)."""
    fails: list[str] = []
    done_data = {p.name for p in dirs["done"].iterdir() if not p.name.startswith(".")}
    restarts, crashes, latencies, resumed = [], 0, [], 0
    results: dict[str, dict] = {}
    for plan in plans:
        name = plan["name"]
        if name not in done_data:
            continue
        try:
            res = json.loads((dirs["done"] / f"{name}.result.json").read_text())
        except (OSError, ValueError) as e:
            fails.append(f"done/{name}.result.json unreadable: {e}")
            continue
        results[name] = res
        want = dropped.get(name, {}).get("sha256")
        got = hashlib.sha256((dirs["done"] / name).read_bytes()).hexdigest()
        if not (res.get("sha256") == want == got):
            fails.append(f"{name}: sha256 written {want}, result.json {res.get('sha256')}, done/ file {got}")
        if res.get("model_name") != plan["model_name"]:
            fails.append(f"{name}: result.json model_name {res.get('model_name')!r}, expected {plan['model_name']!r}")
        if res.get("rows") != plan["rows"] or res.get("columns") != plan["cols"]:
            fails.append(f"{name}: trained on {res.get('rows')}x{res.get('columns')}, "
                         f"written {plan['rows']}x{plan['cols']}")
        restarts.append(int(res.get("restarts") or 0))
        crashes += int(res.get("crashes") or 0) > 0
        resumed += res.get("resumed_from_epoch") is not None
        if res.get("finished_at") and name in dropped:
            latencies.append(utc_seconds(res["finished_at"]) - dropped[name]["dropped_at"])
    if crashes:
        fails.append(f"{crashes} results count a job crash, but only the daemon was ever killed "
                     "(a daemon's SIGKILL was blamed on the dataset)")
    return fails, results, {"restarts": restarts, "latencies": latencies, "resumed": resumed}


def check_models(dirs: dict[str, Path], plans: list[dict], results: dict[str, dict]) -> tuple[list[str], Counter, int]:
    """For each plan: one version in models/MODEL_NAME, made by the job of its result, ``current``
    pointing at it and loading with opt_ds_ops.store.versions.load_model. Return (failures, the number of
    model names per version count, models loaded)."""
    from opt_ds_ops.store.versions import StoreError, load_model

    fails: list[str] = []
    version_counts = Counter()
    loaded = 0
    for plan in plans:
        res = results.get(plan["name"])
        name_dir = dirs["models"] / plan["model_name"]
        if not name_dir.is_dir():
            if res is not None:
                fails.append(f"{plan['name']}: no models/{plan['model_name']}/")
            continue
        versions = sorted(e.name for e in name_dir.iterdir() if not e.name.startswith(".") and e.name != "current")
        version_counts[len(versions)] += 1
        if len(versions) != 1:
            fails.append(f"models/{plan['model_name']} has {len(versions)} versions (want 1): {versions}")
        if res is None:
            continue
        matching = []
        for v in versions:
            try:
                md = json.loads((name_dir / v / "metadata.json").read_text())
            except (OSError, ValueError):
                continue
            if md.get("job_id") == res.get("job_id") and md.get("dataset", {}).get("sha256") == res.get("sha256"):
                matching.append(v)
        if len(matching) != 1:
            fails.append(f"models/{plan['model_name']}: {len(matching)} versions made by job {res.get('job_id')} "
                         f"with sha256 {str(res.get('sha256'))[:12]} (want 1) among {versions}")
        current = name_dir / "current"
        if not current.is_symlink():
            fails.append(f"models/{plan['model_name']}/current is not a symlink")
            continue
        target = os.readlink(current)
        if "/" in target or target not in versions:
            fails.append(f"models/{plan['model_name']}/current -> {target!r}, not one of its versions {versions}")
            continue
        if matching and target != matching[0]:
            fails.append(f"models/{plan['model_name']}/current -> {target}, but job {res.get('job_id')} made {matching[0]}")
        if not ((current / "model.pt").is_file() and (current / "metadata.json").is_file()):
            fails.append(f"models/{plan['model_name']}/current ({target}) lacks model.pt or metadata.json")
            continue
        try:
            load_model(str(current))
            loaded += 1
        except StoreError as e:
            fails.append(f"models/{plan['model_name']}/current does not load: {e}")
    return fails, version_counts, loaded


def check(dirs: dict[str, Path], datasets: Datasets, writers: Writers, kills: list[dict]) -> tuple[list[str], dict]:
    """Every check of the module docstring; return (failures, figures)."""
    fails: list[str] = []
    names = {p["name"] for p in datasets.plans}
    figures: dict = {}

    missing_drops = names - set(writers.dropped)
    if missing_drops:
        fails.append(f"{len(missing_drops)} datasets were never dropped: {sorted(missing_drops)[:5]}")
    shas = [v["sha256"] for v in writers.dropped.values()]
    if len(set(shas)) != len(shas):
        fails.append("two datasets have the same sha256 (the soak's own plan is wrong)")

    for which in ("done", "failed"):
        for p in sorted(p for p in dirs[which].iterdir() if p.name.startswith(".")):
            try:
                doc = json.loads(p.read_text())
                what = f"JSON of job {doc.get('job_id')} ({doc.get('dataset')})"
            except (OSError, ValueError, AttributeError):
                what = f"{p.stat().st_size} bytes"
            fails.append(f"{which}/{p.name} left behind ({what}): a write a SIGKILL cut short, never cleaned up")
    done_entries = sorted(p.name for p in dirs["done"].iterdir() if not p.name.startswith("."))
    done_data = [n for n in done_entries if not n.endswith(".result.json")]
    done_json = [n for n in done_entries if n.endswith(".result.json")]
    figures["done"] = len(done_data)
    extra = sorted(set(done_data) - names)
    if extra:
        fails.append(f"done/ holds {len(extra)} unexpected entries (duplicates?): {extra[:10]}")
    absent = sorted(names - set(done_data))
    if absent:
        fails.append(f"{len(absent)} datasets are not in done/: {absent[:10]}")
    if sorted(done_json) != sorted(f"{n}.result.json" for n in done_data):
        fails.append(f"done/ result files do not pair with its datasets: "
                     f"{sorted(set(done_json) ^ {n + '.result.json' for n in done_data})[:10]}")

    failed_entries = sorted(p.name for p in dirs["failed"].iterdir() if not p.name.startswith("."))
    figures["failed"] = len([n for n in failed_entries if not n.endswith(".error.json")])
    for n in failed_entries:
        if n.endswith(".error.json"):
            try:
                doc = json.loads((dirs["failed"] / n).read_text())
            except (OSError, ValueError):
                doc = {}
            fails.append(f"failed/{n[:-len('.error.json')]}: job {doc.get('job_id')} stage {doc.get('stage')} "
                         f"({doc.get('exception_type')}): {doc.get('reason')}")
    if failed_entries and not any(n.endswith(".error.json") for n in failed_entries):
        fails.append(f"failed/ is not empty: {failed_entries[:10]}")
    for which in ("incoming", "processing", "staging"):
        left = sorted(os.listdir(dirs[which]))
        if left:
            fails.append(f"{which}/ is not empty: {left[:10]}")

    res_fails, results, stats = check_results(dirs, datasets.plans, writers.dropped)
    fails += res_fails
    restarts, latencies, resumed = stats["restarts"], stats["latencies"], stats["resumed"]

    model_dirs = sorted(p.name for p in dirs["models"].iterdir()) if dirs["models"].exists() else []
    unknown = sorted(set(model_dirs) - {p["model_name"] for p in datasets.plans})
    if unknown:
        fails.append(f"models/ has unexpected entries: {unknown[:10]}")
    model_fails, version_counts, loaded = check_models(dirs, datasets.plans, results)
    fails += model_fails
    leftovers = sorted(str(Path(dp, n).relative_to(dirs["models"])) for dp, dns, fns in os.walk(dirs["models"])
                       for n in dns + fns if n.startswith((".tmp-", ".current-")))
    if leftovers:
        fails.append(f"{len(leftovers)} store temporaries left under models/: {leftovers[:10]}")

    figures.update({
        "model_names": len(model_dirs), "models_loaded": loaded,
        "versions_per_model": dict(sorted(version_counts.items())),
        "results_with_restarts": sum(1 for r in restarts if r > 0),
        "max_restarts_of_a_job": max(restarts, default=0),
        "results_resumed_from_checkpoint": resumed,
        "mean_drop_to_done_s": round(sum(latencies) / len(latencies), 2) if latencies else None,
        "max_drop_to_done_s": round(max(latencies), 2) if latencies else None,
        "daemon_peak_rss_mib_at_a_kill": round(max((k["peak_rss_kib"] or 0 for k in kills), default=0) / 1024),
        "kills_by_moment": dict(Counter(k["where"] for k in kills).most_common()),
        "targeted_kills_by_event": {e: f"{sum(1 for k in kills if k['anchor'] == e and k.get('event_seen'))} seen of "
                                       f"{sum(1 for k in kills if k['anchor'] == e)}" for e in EVENTS},
    })
    return fails, figures


def suspect_names(dirs: dict[str, Path], datasets: Datasets) -> list[str]:
    """Datasets in failed/, missing from done/, or with other than one model version."""
    done = {p.name for p in dirs["done"].iterdir()}
    out = []
    for plan in datasets.plans:
        name_dir = dirs["models"] / plan["model_name"]
        versions = [e for e in os.listdir(name_dir) if not e.startswith(".") and e != "current"] \
            if name_dir.is_dir() else []
        if (plan["name"] not in done or (dirs["failed"] / plan["name"]).exists() or f"{plan['name']}.1" in done
                or len(versions) != 1):
            out.append(plan["name"])
    return out


def diagnose(dirs: dict[str, Path], kills: list[dict], names: list[str]) -> None:
    """For each named dataset: its job ids, the kills that caught one of them, its lines in the daemon logs."""
    print(f"{len(names)} datasets to look at: {names[:20]}")
    for name in names[:5]:
        job_ids = set()
        docs = [p for d in ("done", "failed") for p in dirs[d].glob(f"{name}*.json")]
        docs += list(dirs["processing"].glob("*/job.json"))
        for p in docs:
            try:
                doc = json.loads(p.read_text())
            except (OSError, ValueError):
                continue
            if doc.get("dataset") == name or p.name.startswith(name):
                job_ids.add(doc.get("job_id"))
        print(f"--- {name}: job ids {sorted(j for j in job_ids if j)}")
        for k in kills:
            hit = [j for j in k["jobs"] if j["dataset"] == name or j["job_id"] in job_ids]
            if hit:
                print(f"  kill {k['kill']} {k['delay_s']:.3f} s after its {k['anchor']} (daemon-{k['daemon']:03d}): "
                      f"{k['where']}; "
                      f"{json.dumps(hit)}")
        for log in sorted(dirs["logs"].glob("daemon-*.log")):
            for line in log.read_text(errors="replace").splitlines():
                if name in line or any(j and j in line for j in job_ids):
                    print(f"  {log.name}: {line}")


def add_common_arguments(ap: argparse.ArgumentParser, *, seed: int, timeout_s: float, stall_s: float) -> None:
    """The options of the seed, the kills (kill_schedule), the time limits and the root."""
    ap.add_argument("--seed", type=int, default=seed)
    ap.add_argument("--kill-max-s", type=float, default=3.0, help="most kills: 0..this many seconds after 'ready'")
    ap.add_argument("--startup-share", type=float, default=0.4, help="this share of the kills: timed from the start")
    ap.add_argument("--startup-max-s", type=float, default=2.5, help="those: 0..this many seconds after the start")
    ap.add_argument("--event-share", type=float, default=0.16,
                    help="this share: at a claim, parse, model write or finish (polled every 2 ms)")
    ap.add_argument("--timeout-s", type=float, default=timeout_s, help="fail if the whole soak takes longer")
    ap.add_argument("--stall-s", type=float, default=stall_s, help="fail if the last daemon makes no progress this long")
    ap.add_argument("--root", help="work here (an empty or new directory) instead of a temporary one")
    ap.add_argument("--keep", action="store_true", help="keep the root even on success")


def check_common_arguments(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if min(args.startup_share, args.event_share) < 0 or args.startup_share + args.event_share > 1:
        ap.error("--startup-share and --event-share must be >= 0 and add up to at most 1")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--datasets", type=int, default=200)
    ap.add_argument("--kills", type=int, default=100)
    ap.add_argument("--writers", type=int, default=4)
    add_common_arguments(ap, seed=8, timeout_s=1800.0, stall_s=180.0)
    args = ap.parse_args(argv)
    if args.datasets < 1 or args.kills < 0 or args.writers < 1:
        ap.error("--datasets and --writers must be >= 1, --kills >= 0")
    check_common_arguments(ap, args)

    t_start = time.monotonic()
    deadline = t_start + args.timeout_s
    root, dirs = soak_root(ap, args, "ds-ops-soak-")
    conf = write_config(root)
    print(f"soak: {args.datasets} datasets, {args.kills} kills, {args.writers} writers, seed {args.seed}, "
          f"kills: {args.startup_share:.0%} 0-{args.startup_max_s:g} s after the start, {args.event_share:.0%} "
          f"targeted, the others 0-{args.kill_max_s:g} s after 'ready'; root {root}"
          f"{'' if os.geteuid() == 0 else ' (not root: the daemon keeps its capabilities, drops stay yours)'}",
          flush=True)

    datasets = Datasets(args.datasets, args.seed)
    per_writer = -(-args.datasets // args.writers)
    kill_phase_s = kill_phase_estimate_s(args)
    mean_gap_s = max(0.05, 0.8 * kill_phase_s / per_writer)  # drops spread over most of the kill phase
    writers = Writers(datasets, args.writers, args.seed, dirs["incoming"], dirs["staging"], mean_gap_s)
    schedule = kill_schedule(args)

    kills: list[dict] = []
    fails: list[str] = []
    sessions: set[int] = set()
    daemon: Daemon | None = None
    number = 0
    ok = False
    try:
        number += 1
        daemon = Daemon(conf, dirs["logs"], number)
        sessions.add(daemon.pid)
        writers.start()
        lingering_max = 0
        with open(root / "kills.jsonl", "w") as kill_log:
            for k, (anchor, delay) in enumerate(schedule, 1):
                if time.monotonic() > deadline:
                    raise SoakFailure(f"--timeout-s {args.timeout_s:.0f} exceeded during the kill phase ({k - 1} kills)")
                rec = timed_kill(dirs, daemon, k, anchor, delay)
                lingering = session_processes(sessions)  # forkservers and jobs of killed daemons
                lingering_max = max(lingering_max, len(lingering))
                rec["lingering_processes"] = len(lingering)
                if rec["died"]:
                    fails.append(died_before_kill(dirs, daemon, rec))
                kills.append(rec)
                kill_log.write(json.dumps(rec) + "\n")
                kill_log.flush()
                number += 1
                daemon = Daemon(conf, dirs["logs"], number)
                sessions.add(daemon.pid)
                if k % 10 == 0 or k == args.kills:
                    done, failed = count_done(dirs)
                    print(f"  {k} kills, {len(writers.dropped)} dropped, {done} done, {failed} failed, "
                          f"{time.monotonic() - t_start:.0f} s", flush=True)
        t_kills = time.monotonic() - t_start
        writers.join(max(0.0, deadline - time.monotonic()))
        fails += writers.errors
        t_writers = time.monotonic() - t_start
        print(f"  kill phase over after {t_kills:.0f} s, writers done after {t_writers:.0f} s; "
              f"daemon-{daemon.number:03d} drains the spool", flush=True)

        # the last daemon must have started for real (recovery run, "ready") before it is judged;
        # a SIGTERM in the first milliseconds of an interpreter, before any code of ours runs, is
        # a death by signal (systemd counts it as a clean stop), not what this soak measures
        if daemon.wait_ready(READY_TIMEOUT_S) is None:
            raise SoakFailure(f"the last daemon exited ({daemon.proc.returncode}) before it was ready: "
                              f"{daemon.log_path}")
        names = {p["name"] for p in datasets.plans}
        progress, last_change = None, time.monotonic()
        while True:
            done_names = {p.name for p in dirs["done"].iterdir()} & names
            failed_names = {p.name for p in dirs["failed"].iterdir()}
            if len(done_names | (failed_names & names)) == len(names) and not os.listdir(dirs["processing"]):
                break
            if not daemon.alive():
                raise SoakFailure(f"the last daemon exited ({daemon.proc.returncode}) with {len(done_names)} of "
                                  f"{len(names)} done: {daemon.log_path}")
            now = time.monotonic()
            state = (len(done_names), len(failed_names), tuple(sorted(os.listdir(dirs["processing"]))),
                     len(os.listdir(dirs["incoming"])))
            if state != progress:
                progress, last_change = state, now
            elif now - last_change > args.stall_s:
                raise SoakFailure(f"no progress for {args.stall_s:.0f} s: {len(done_names)} of {len(names)} done, "
                                  f"processing/ {list(state[2])}, {state[3]} in incoming/ (a hang?): {daemon.log_path}")
            if now > deadline:
                raise SoakFailure(f"--timeout-s {args.timeout_s:.0f} exceeded: {len(done_names)} of {len(names)} "
                                  f"done: {daemon.log_path}")
            time.sleep(0.25)
        rc = daemon.stop()
        if rc != 0:
            fails.append(f"the last daemon exited {rc} on SIGTERM (want 0): {daemon.log_path}")
        t_end = time.monotonic() - t_start

        gone_by = time.monotonic() + ORPHAN_WAIT_S
        while (left := session_processes(sessions)) and time.monotonic() < gone_by:
            time.sleep(0.5)
        for pid, sid, cmd in left:
            fails.append(f"process {pid} of daemon session {sid} outlived the final stop: {cmd}")

        check_fails, figures = check(dirs, datasets, writers, kills)
        fails += check_fails
        figures = {"datasets": args.datasets, "dropped": len(writers.dropped),
                   "drops_by_way": dict(sorted(Counter(v["way"] for v in writers.dropped.values()).items())),
                   "kills": len(kills), "restarts": len(kills), "daemon_starts": number,
                   "max_lingering_processes_at_a_kill": lingering_max,
                   **figures,
                   "kill_phase_s": round(t_kills, 1), "writers_s": round(t_writers, 1),
                   "drain_s": round(t_end - t_writers, 1), "wall_s": round(t_end, 1)}
        print("figures:")
        for key, value in figures.items():
            print(f"  {key}: {value}")
        (root / "summary.json").write_text(json.dumps({"args": vars(args), "figures": figures, "failures": fails},
                                                      indent=2) + "\n")
        ok = not fails
    except SoakFailure as e:
        fails.append(str(e))
    finally:
        kill_everything(daemon, sessions)

    if ok:
        print(f"soak passed in {time.monotonic() - t_start:.0f} s")
        if not args.keep:
            subprocess.run(["rm", "-rf", "--one-file-system", str(root)], check=False)
        return 0
    print(f"soak FAILED ({len(fails)} problems); root kept: {root} (daemon logs in logs/, kills in kills.jsonl)")
    for f in fails:
        print(f"  FAIL: {f}")
    suspects = suspect_names(dirs, datasets)
    if suspects:
        diagnose(dirs, kills, suspects)
    return 1


if __name__ == "__main__":
    sys.exit(main())
