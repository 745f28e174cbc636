#!/usr/bin/env python3
"""Alert soak: every incident is said in the journal exactly once while the daemon is SIGKILLed.

Everything is real: ``python -m opt_ds_ops.cli daemon`` processes on a temporary root, a model
trained from the bundled SMD machine-1-2, chunks dropped into score/ the safe way (``.part``, then
renamed; as root, each given to another member of the group), real SIGKILLs.

* A model ``m`` is trained from SMD rows 3000..6000 (a steady stretch) dropped in incoming/.
* Then ``--chunks`` chunks of 280 rows each are scored against it, one at a time: 150 normal rows
  of the same machine, 20 rows shifted by 8 standard deviations (an anomaly the model flags),
  110 normal rows, so each chunk opens one incident (opt_ds_ops/scoring/incidents.py).
* The alarm budget and retraining are off in the soak's conffile (``scoring.alarm_budget_per_day:
  0``, ``retrain.every: ""``, ``retrain.drift_rate: 0``): at five incidents a day the shipped budget
  would raise the threshold after a few chunks, and a retraining would change the model mid-soak.
* The incident rule is round 4's (shipped until round 15), pinned in the soak's conffile: ``incident_open_window_s:
  0`` (one flagged row opens an incident) and ``incident_quiet_s: 1800``, that is 30 rows of the
  model's sample period (``train.sample_period_s: 60``, pinned too: the chunks have no time
  column). The layout of a chunk follows from it: the scores of the shifted rows stay over the
  threshold some 100 rows past the shift (the score's smoothing; up to ~230 rows for some
  windows), so an incident closes only ~130 rows after its shift, that is a little into the next
  chunk (the 110 rows after a shift are fewer) and well before that chunk's own shift (the 150
  rows before it are more). So most incidents are carried open from one chunk to the next in
  ``state.json``, across the kills, and their ``incident-closed`` is in the next chunk's results,
  before the ``incident-opened`` of that chunk's own; the last chunk's incident stays open. (With
  the old 140-row chunks, 60 + 20 + 60, flagged runs less than 30 rows apart would merge into a
  few incidents that span many chunks.)
* The daemon is SIGKILLed once per chunk, at a point drawn at random: ``--targeted-share`` (0.5)
  of the kills are aimed at the moment alerts used to be lost, between the scoring job's results
  (the model's ``state.json``, which marks the chunk scored) and the daemon's journal entries: the
  soak polls ``state.json`` every millisecond and kills as soon as it changes; the others come a
  uniformly random 0..``--kill-max-s`` (0.8) seconds after the drop (a claim, the job's start, the
  scoring, the report). A new daemon is started at once and the chunk must end scored.

Checks: at least 90 % of the chunks opened an incident (the rest joined one still open: a window
whose own rows the model flags long after the shift); every
``incident-opened`` the scoring results list (each chunk's ``summary.json``), by incident id and
row, is in the daemon logs exactly once, and no other; the same for ``incident-escalated`` (a
warning that became critical: rare here, the shift makes most incidents open critical) and
``incident-closed``; every chunk scored
once (no result directory of a job twice); processing/ and score/ empty at the end; the last
daemon exits 0 on SIGTERM. The daemon logs are the journal's plain lines (not under systemd); the
entries are the same ``EventLog.event`` calls that go to journald under the unit.

Prints the figures (kills per kind, where each landed, entries per chunk, incidents closed in a
later chunk than they opened) and exits 1 with one
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

ROWS_BEFORE, ROWS_SHIFTED, ROWS_AFTER = 150, 20, 110  # see the docstring: the incident rule's quiet spell
SHIFT_SD = 8.0
TRAIN_ROWS = slice(3000, 6000)  # a steady stretch of machine-1-2: the model flags none of it
PERIOD_S = 60  # the model's sample period (train.sample_period_s, pinned in the conffile): the chunks have no time
QUIET_S = 1800  # scoring.incident_quiet_s as shipped (etc/ds-ops/trainer.yaml): 30 rows at PERIOD_S
# the daemon's plain journal lines (opt_ds_ops/daemon/scoreslot.py): (incident id, row) of each entry
OPENED = re.compile(r"\bm: (?:warning|critical) incident (\d+) opened at row (\d+)\b")
CLOSED = re.compile(r"\bm: (?:warning|critical) incident (\d+) closed(?: \(the series was reset\))?: "
                    r"its last flagged row was row (\d+)\b")
ESCALATED = re.compile(r"\bm: incident (\d+) is critical at row (\d+)\b")  # a warning that became critical
KINDS = (("incident-opened", OPENED), ("incident-escalated", ESCALATED), ("incident-closed", CLOSED))


def write_config(root: Path, period_s: int | None = PERIOD_S, extra: tuple[str, ...] = ()) -> Path:
    """The conffile of a soak that scores (this one's, scripts/pull_soak.py's): the shipped incident
    rule, no alarm budget, no retraining; ``period_s``: ``train.sample_period_s`` (None: the rows'
    time column gives it), ``extra``: lines appended."""
    conf = root / "trainer.yaml"
    conf.write_text("\n".join([
        f"models_dir: {root / 'models'}",
        "device: cpu",
        "spool:",
        f"  dir: {root / 'spool'}",
        "  settle_s: 0.1",
        "  scan_interval_s: 30.0",
        "  quiet_s: 0.5",
        *(["train:", f"  sample_period_s: {period_s}"] if period_s is not None else []),
        "scoring:",
        f"  results_dir: {root / 'scores'}",
        "  incident_open_window_s: 0",
        f"  incident_quiet_s: {QUIET_S}",
        # the soak checks that entries are said once, not what the threshold should be: the
        # shipped alarm budget would raise the threshold once the chunks' 5 incidents a day are
        # seen (so later chunks open none), and a retraining would change the model mid-soak
        "  alarm_budget_per_day: 0",
        "retrain:",
        '  every: ""',
        "  drift_rate: 0",
        *extra,
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
    size = ROWS_BEFORE + ROWS_SHIFTED + ROWS_AFTER
    out = []
    for _ in range(count):
        start = int(rng.integers(TRAIN_ROWS.start, TRAIN_ROWS.stop - size))
        rows = matrix[start:start + size].copy()
        rows[ROWS_BEFORE:ROWS_BEFORE + ROWS_SHIFTED] += SHIFT_SD * sd
        out.append(rows)
    return out


def said(text: str, pattern: re.Pattern) -> Counter:
    """(incident id, row) -> how many times the logs say it."""
    return Counter((int(i), int(r)) for i, r in pattern.findall(text))


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
            said0 = sum(len(pattern.findall(daemon.log())) for _, pattern in KINDS)
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
                     "between the results and the journal"
                     if sum(len(pattern.findall(daemon.log())) for _, pattern in KINDS) == said0
                     else "after the journal entry")
            landed[f"{kind}: {where}"] += 1
            daemon = start()
            wait(lambda: len(scored_jobs(scores)) > scored_before and not any(dirs["processing"].iterdir())
                 and not any(score.iterdir()), f"chunk {i + 1} to be scored", 120, daemon)
        text = logs_text(logs)
        summaries = scored_jobs(scores)
        events = [(s["job_id"], e) for s in sorted(summaries, key=lambda s: s.get("first_row") or 0)
                  for e in s.get("events") or []]
        want = {what: Counter((e["incident"], e["row"]) for _, e in events if e["event"] == what) for what, _ in KINDS}
        got = {what: said(text, pattern) for what, pattern in KINDS}
        opened_in = {e["incident"]: job for job, e in events if e["event"] == "incident-opened"}
        later = sum(1 for job, e in events if e["event"] == "incident-closed" and opened_in.get(e["incident"]) != job)
        jobs = Counter(s["job_id"] for s in summaries)
        if len(summaries) != args.chunks or any(n > 1 for n in jobs.values()):
            fails.append(f"{len(summaries)} scored results for {args.chunks} chunks (a job scored twice: "
                         f"{[j for j, n in jobs.items() if n > 1]})")
        opening = len(set(opened_in.values()))
        if opening < 0.9 * args.chunks:  # a chunk whose shift joins an incident still open opens none
            fails.append(f"only {opening} of {args.chunks} chunks opened an incident: too few to check")
        for what, _ in KINDS:
            lost = sorted(set(want[what]) - set(got[what]))
            twice = sorted(r for r, n in got[what].items() if n > 1)
            extra = sorted(set(got[what]) - set(want[what]))
            if lost or twice or extra:
                fails.append(f"{what}: {len(lost)} never said ((incident, row) {lost[:10]}), {len(twice)} said more "
                             f"than once ({twice[:10]}), {len(extra)} not in any result ({extra[:10]})")
        left = [p.name for p in list(dirs["processing"].iterdir()) + list(score.iterdir())]
        if left:
            fails.append(f"left in processing/ or score/: {left}")
        rc = daemon.stop()
        daemon = None
        if rc != 0:
            fails.append(f"the last daemon exited {rc} on SIGTERM")
        print(f"kills: {dict(sorted(landed.items()))}")
        print("; ".join(f"{what}: {sum(got[what].values())} said for {len(want[what])} in the results"
                        for what, _ in KINDS) + f"; {opening} of {args.chunks} chunks opened an incident, {later} incidents closed in a later chunk's "
              f"results than the one that opened it; {number} daemons started")
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
