#!/usr/bin/env python3
"""Alert soak: every anomaly is said in the journal exactly once while the daemon is SIGKILLed.

Everything is real: ``python -m opt_ds_ops.cli daemon`` processes on a temporary root, a model
trained from the bundled SMD machine-1-2, chunks dropped into score/ the safe way (``.part``, then
renamed; as root, each given to another member of the group), real SIGKILLs.

* A model ``m`` is trained from SMD rows 3000..6000 (a steady stretch) dropped in incoming/.
* Then ``--chunks`` chunks of 140 rows each are scored against it, one at a time: 60 normal rows
  of the same machine, 20 rows shifted by 8 standard deviations (an anomaly the model flags),
  60 normal rows, so each chunk opens one anomaly and closes it.
* The daemon is SIGKILLed once per chunk, at a point drawn at random: ``--targeted-share`` (0.5)
  of the kills are aimed at the moment alerts used to be lost, between the scoring job's results
  (the model's ``state.json``, which marks the chunk scored) and the daemon's journal entries: the
  soak polls ``state.json`` every millisecond and kills as soon as it changes; the others come a
  uniformly random 0..``--kill-max-s`` (0.8) seconds after the drop (a claim, the job's start, the
  scoring, the report). A new daemon is started at once and the chunk must end scored.

Checks: at least 90 % of the chunks opened an anomaly (the rest joined one still open); every
``anomaly-started`` the scoring results list (each chunk's ``summary.json``) is in
the daemon logs exactly once, and no other; the same for ``anomaly-ended``; every chunk scored
once (no result directory of a job twice); processing/ and score/ empty at the end; the last
daemon exits 0 on SIGTERM. The daemon logs are the journal's plain lines (not under systemd); the
entries are the same ``EventLog.event`` calls that go to journald under the unit.

Prints the figures (kills per kind, where each landed, entries per chunk) and exits 1 with one
line per failure on any failure, 0 on success. The root is removed on success unless ``--keep``.

Usage: scripts/alert_soak.py [--chunks 50] [--seed 3] [--targeted-share 0.5] [--kill-max-s 0.8]
                             [--timeout-s 900] [--root DIR] [--keep]
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import random
import re
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak import OTHER_UID, READY_TIMEOUT_S, SMD_TRAIN, Daemon, SoakFailure, kill_everything, make_spool  # noqa: E402

ROWS_NORMAL, ROWS_SHIFTED = 60, 20
SHIFT_SD = 8.0
TRAIN_ROWS = slice(3000, 6000)  # a steady stretch of machine-1-2: the model flags none of it
STARTED = re.compile(r"\bm: anomaly started at row (\d+)\b")
ENDED = re.compile(r"\bm: anomaly ended at row (\d+)\b")


def write_config(root: Path) -> Path:
    conf = root / "trainer.yaml"
    conf.write_text("\n".join([
        f"models_dir: {root / 'models'}",
        "device: cpu",
        "spool:",
        f"  dir: {root / 'spool'}",
        "  settle_s: 0.1",
        "  scan_interval_s: 30.0",
        "  quiet_s: 0.5",
        "scoring:",
        f"  results_dir: {root / 'scores'}",
    ]) + "\n")
    return conf


def drop(directory: Path, name: str, data: bytes) -> None:
    """Write NAME.part, give it to another member (as root), rename it to NAME."""
    part = directory / f"{name}.part"
    part.write_bytes(data)
    os.chmod(part, 0o640)
    if os.geteuid() == 0:
        os.lchown(part, OTHER_UID, -1)
    os.rename(part, directory / name)


def csv_bytes(rows: np.ndarray) -> bytes:
    buf = io.StringIO()
    np.savetxt(buf, rows, delimiter=",", fmt="%.6f")
    return buf.getvalue().encode("ascii")


def chunks(matrix: np.ndarray, count: int, rng: np.random.Generator) -> list[np.ndarray]:
    """``count`` chunks of normal, shifted and normal rows taken from the model's training rows."""
    sd = matrix[TRAIN_ROWS].std(axis=0) + 1e-3
    out = []
    for _ in range(count):
        start = int(rng.integers(TRAIN_ROWS.start, TRAIN_ROWS.stop - 2 * ROWS_NORMAL - ROWS_SHIFTED))
        rows = matrix[start:start + 2 * ROWS_NORMAL + ROWS_SHIFTED].copy()
        rows[ROWS_NORMAL:ROWS_NORMAL + ROWS_SHIFTED] += SHIFT_SD * sd
        out.append(rows)
    return out


def logs_text(logs: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted(logs.glob("daemon-*.log")))


def scored_jobs(scores: Path) -> list[dict]:
    """The summaries of every result directory of model m (one per scored job)."""
    out = []
    for p in sorted((scores / "m").glob("*/summary.json")) if (scores / "m").is_dir() else []:
        out.append(json.loads(p.read_text()))
    return out


def state_mtime(scores: Path) -> int:
    try:
        return os.stat(scores / "m" / "state.json").st_mtime_ns
    except FileNotFoundError:
        return 0


def wait(cond, what: str, timeout_s: float, daemon: Daemon | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        if daemon is not None and not daemon.alive():
            raise SoakFailure(f"the daemon exited while waiting for {what}: {daemon.log_path}")
        time.sleep(0.02)
    raise SoakFailure(f"{what}: not within {timeout_s:.0f} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=50)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--targeted-share", type=float, default=0.5)
    ap.add_argument("--kill-max-s", type=float, default=0.8)
    ap.add_argument("--timeout-s", type=float, default=900.0)
    ap.add_argument("--root")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args(argv)
    if args.chunks < 1 or not 0 <= args.targeted_share <= 1:
        ap.error("--chunks must be >= 1 and --targeted-share in 0..1")
    import tempfile

    root = Path(args.root).resolve() if args.root else Path(tempfile.mkdtemp(prefix="ds-ops-alert-soak-"))
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o755)
    dirs = make_spool(root)
    score = dirs["spool"] / "score"
    score.mkdir()
    os.chmod(score, 0o3770)
    conf, scores, logs = write_config(root), root / "scores", dirs["logs"]
    rng, pick = np.random.default_rng(args.seed), random.Random(args.seed)
    matrix = np.loadtxt(io.BytesIO(gzip.decompress(SMD_TRAIN.read_bytes())), delimiter=",", dtype=np.float64)
    plan = chunks(matrix, args.chunks, rng)
    deadline = time.monotonic() + args.timeout_s
    print(f"alert soak: {args.chunks} chunks, one SIGKILL each ({args.targeted_share:.0%} aimed between the "
          f"results and the journal), seed {args.seed}; root {root}", flush=True)
    sessions: set[int] = set()
    daemon, number, landed, fails = None, 0, Counter(), []

    def start() -> Daemon:
        nonlocal number
        number += 1
        d = Daemon(conf, logs, number)
        sessions.add(d.pid)
        if d.wait_ready(READY_TIMEOUT_S) is None:
            raise SoakFailure(f"daemon-{number:03d} exited before it was ready: {d.log_path}")
        return d

    try:
        daemon = start()
        drop(dirs["incoming"], "m.csv", csv_bytes(matrix[TRAIN_ROWS]))
        wait(lambda: (dirs["models"] / "m" / "current").exists(), "the model m", 300, daemon)
        for i, rows in enumerate(plan):
            if time.monotonic() > deadline:
                raise SoakFailure(f"--timeout-s {args.timeout_s:.0f} exceeded after {i} chunks")
            before, scored_before = state_mtime(scores), len(scored_jobs(scores))
            targeted = pick.random() < args.targeted_share
            said0 = len(STARTED.findall(daemon.log()))
            drop(score, "m.csv", csv_bytes(rows))
            if targeted:  # the moment the job's results say it is scored: before the daemon has said anything
                limit = time.monotonic() + 30
                while state_mtime(scores) == before and time.monotonic() < limit:
                    time.sleep(0.001)
            else:
                time.sleep(pick.uniform(0, args.kill_max_s))
            daemon.kill()
            kind = "targeted" if targeted else "random"
            where = ("before the results" if state_mtime(scores) == before else
                     "between the results and the journal" if len(STARTED.findall(daemon.log())) == said0
                     else "after the journal entry")
            landed[f"{kind}: {where}"] += 1
            daemon = start()
            wait(lambda: len(scored_jobs(scores)) > scored_before and not any(dirs["processing"].iterdir())
                 and not any(score.iterdir()), f"chunk {i + 1} to be scored", 120, daemon)
        text = logs_text(logs)
        summaries = scored_jobs(scores)
        want_started = Counter(e["row"] for s in summaries for e in s.get("events") or []
                               if e["event"] == "anomaly-started")
        want_ended = Counter(e["row"] for s in summaries for e in s.get("events") or [] if e["event"] == "anomaly-ended")
        got_started = Counter(int(r) for r in STARTED.findall(text))
        got_ended = Counter(int(r) for r in ENDED.findall(text))
        jobs = Counter(s["job_id"] for s in summaries)
        if len(summaries) != args.chunks or any(n > 1 for n in jobs.values()):
            fails.append(f"{len(summaries)} scored results for {args.chunks} chunks (a job scored twice: "
                         f"{[j for j, n in jobs.items() if n > 1]})")
        if len(want_started) < 0.9 * args.chunks:  # a chunk whose shift joins an anomaly still open opens none
            fails.append(f"only {len(want_started)} of {args.chunks} chunks opened an anomaly: too few to check")
        for what, want, got in (("anomaly-started", want_started, got_started), ("anomaly-ended", want_ended, got_ended)):
            lost = sorted(set(want) - set(got))
            twice = sorted(r for r, n in got.items() if n > 1)
            extra = sorted(set(got) - set(want))
            if lost or twice or extra:
                fails.append(f"{what}: {len(lost)} never said (rows {lost[:10]}), {len(twice)} said more than once "
                             f"(rows {twice[:10]}), {len(extra)} not in any result (rows {extra[:10]})")
        left = [p.name for p in list(dirs["processing"].iterdir()) + list(score.iterdir())]
        if left:
            fails.append(f"left in processing/ or score/: {left}")
        rc = daemon.stop()
        daemon = None
        if rc != 0:
            fails.append(f"the last daemon exited {rc} on SIGTERM")
        print(f"kills: {dict(sorted(landed.items()))}")
        print(f"anomaly-started: {sum(got_started.values())} said for {len(want_started)} in the results; "
              f"anomaly-ended: {sum(got_ended.values())} said for {len(want_ended)}; {number} daemons started")
    except SoakFailure as e:
        fails.append(str(e))
    finally:
        kill_everything(daemon, sessions)
    for f in fails:
        print(f"FAIL: {f}")
    if fails or args.keep:
        print(f"root kept: {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    print("alert soak: " + ("FAILED" if fails else "ok"))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
