#!/usr/bin/env python3
"""Puller soak: hosts pulled from a real Prometheus through a real daemon while ``ds-ops pull`` is
SIGKILLed at random points and a member of the group plants names and takes model names.

Everything is real: Debian's ``prometheus`` serving SMD rows backfilled with ``promtool`` as
``--hosts`` hosts (tests/prometheus_kit.py), one ``python -m opt_ds_ops.cli daemon`` on a temporary
root, and ``--pulls`` runs of ``ds-ops pull SOURCE --once --now T`` (the clock advanced by the
source's ``score_every``, 5 minutes, each run), each its own process, as the puller's own uid.

* The hosts' rows are 12 hours of a steady stretch of the bundled SMD machine-1-2 (3 of its
  metrics, a small offset per host), then the same rows backwards and forwards again; host ``h1``
  has an anomaly: 20 rows shifted by 8 standard deviations, 60 % of the way into the pulls. The first pull trains every host from its last 12 hours (train_window).
* ``--kill-share`` (0.5) of the pulls are SIGKILLed: half of them aimed at the moment a drop has
  been made and the state not yet saved (the soak watches score/ and incoming/ for a new file of
  the puller's uid every millisecond and kills at once: the next pull drops those rows again, with
  more), the others a uniformly random 0..``--kill-max-s`` (0.3) seconds after the start. The next pull runs at
  the next clock (the killed pull's rows come with it).
* A member of the group (another uid, as root; the same uid otherwise, and then no name is
  "taken") plants, before every pull, the names a puller with predictable names would use next
  (``MODEL.STAMP.yaml`` and ``.csv``-less sidecars in score/, ``MODEL.train-STAMP.yaml`` in
  incoming/, every host's, for the next steps), and a sidecar without its CSV named as the
  puller's own are (a 16-hex token), dated 5 minutes back, and takes model names: ``tk:9100``'s model
  ``tk_9100`` is trained by the member before the first pull, and ``late:9100``'s (a host that
  appears a third of the way in) just before it appears.

Checks: every host of the puller's is scored exactly once over every step from its training's
end to the last pull's end (rows.csv's times, over all its results: none twice, none missing);
the anomaly is paged once (its rows lie in exactly one incident, whose opening the daemon's log
says once); no series was reset (a re-dropped chunk's
rows are recognised, not scored again); the taken hosts are blocked in the puller's state, named
with the member's uid in the pull log, and counted by ``ds_ops_pull_hosts{state="blocked"}``, and
no file of the puller's names their models; every planted file is still there, unchanged; a
sidecar a kill left without its CSV is removed by a later pull (once a minute old: the soak
dates the sidecars of a killed pull ``score_every`` back, as the time between pulls would); score/,
incoming/ and processing/ are empty of the puller's files at the end; the daemon exits 0 on SIGTERM.

Prints the figures (kills per kind, drops made again, rows per host, incidents) and exits 1 with
one line per failure on any failure, 0 on success. The root is removed on success unless ``--keep``.

Usage: scripts/pull_soak.py [--pulls 200] [--hosts 3] [--seed 5] [--kill-share 0.5]
                            [--kill-max-s 0.3] [--timeout-s 1800] [--root DIR] [--keep]
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
import json
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from alert_soak import csv_bytes, drop, write_config  # noqa: E402
from soak import OTHER_UID, READY_TIMEOUT_S, REPO, SMD_TRAIN, Daemon, SoakFailure, daemon_env, kill_everything, make_spool  # noqa: E402

PULLER_UID = 12347  # the puller's own uid (ds-pull in the package), a member of the spool's group
STEP_S, EVERY_S = 60, 300  # the source's step and score_every
TRAIN_WINDOW_S = 12 * 3600
TRAIN_ROWS = slice(3000, 6000)  # a steady stretch of machine-1-2 (as scripts/alert_soak.py): its first 12 hours
COLUMNS = (0, 9, 12)  # three of its metrics
SHIFTED, SHIFT_SD = 20, 8.0
T0 = 1_790_000_000 // 86400 * 86400.0  # the history's first step
ANOMALY_HOST, TAKEN_HOST, LATE_HOST = "h1:9100", "tk:9100", "late:9100"
SOURCE = f"""prometheus: {{url}}
step: 1m
train_window: 12h
min_history: 6h
score_every: 5m
delay: 0s
catch_up: 1d
series:
  - name: a
    query: soak_a
  - name: b
    query: soak_b
  - name: c
    query: soak_c
"""
OPENED = re.compile(r"\b(\S+): (?:warning|critical) incident (\d+) opened at row (\d+)\b")
RESET = re.compile(r"series (?:was reset|starts again)|time went backwards")


def history(hosts: list[str], pulls: int) -> tuple[str, dict, float, float]:
    """(OpenMetrics text of every host, {host: (times, values)}, the anomaly's first time, the first
    pull's clock). ``late`` answers from a third of the pulls on."""
    from prometheus_kit import openmetrics

    matrix = np.loadtxt(io.BytesIO(gzip.decompress(SMD_TRAIN.read_bytes())), delimiter=",", dtype=np.float64)
    first_pull = T0 + TRAIN_WINDOW_S
    steps = int((TRAIN_WINDOW_S + (pulls + 2) * EVERY_S) / STEP_S) + 1
    # the training window's rows, then the same rows backwards and forwards again: a host's normal
    # rows after its training are rows its model has seen (SMD's own shifts later in the file would
    # open incidents of their own, and the anomaly could join one)
    window = matrix[TRAIN_ROWS.start:TRAIN_ROWS.start + TRAIN_WINDOW_S // STEP_S + 1][:, COLUMNS]
    cycle = np.concatenate([window, window[-2:0:-1]])
    stretch = cycle[np.arange(steps) % len(cycle)]
    sd = window.std(axis=0) + 1e-3
    anomaly = first_pull + int(pulls * 0.6) * EVERY_S + 2 * STEP_S
    late_from = first_pull + (pulls // 3) * EVERY_S - TRAIN_WINDOW_S / 2  # min_history (6 h) a third of the way in
    fam = {f"soak_{k}": ("gauge", {}) for k in "abc"}
    truth = {}
    for k, host in enumerate(hosts):
        times = T0 + STEP_S * np.arange(steps)
        values = stretch[:steps] + 0.01 * k
        if host == ANOMALY_HOST:
            at = int((anomaly - T0) / STEP_S)
            values[at:at + SHIFTED] += SHIFT_SD * sd
        if host == LATE_HOST:
            keep = times >= late_from
            times, values = times[keep], values[keep]
        for j, key in enumerate("abc"):
            fam[f"soak_{key}"][1][host] = [(float(t), float(v)) for t, v in zip(times, values[:, j])]
        truth[host] = (times, values)
    return openmetrics(fam), truth, anomaly, first_pull


def as_member(path: Path, data: bytes, uid: int) -> None:
    """Write path as the member would: created new (O_EXCL: an existing file is left alone), 0640."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
    except FileExistsError:
        return
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    if os.geteuid() == 0:
        os.lchown(path, uid, -1)


def stamp(t: float) -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(t))


class Member:
    """The hostile member: plants predictable names, takes model names (its planted files kept to check)."""

    def __init__(self, spool: Path, uid: int):
        self.spool, self.uid = spool, uid
        self.planted: dict[Path, bytes] = {}

    def plant(self, models: list[str], now: float) -> None:
        for model in models:
            for k in range(1, 4):  # the next steps' chunk names, and a training file's
                t = now + k * STEP_S
                for path, data in ((self.spool / "score" / f"{model}.{stamp(t)}.yaml", f"model: {model}\n".encode()),
                                   (self.spool / "incoming" / f"{model}.train-{stamp(now + k * EVERY_S)}.yaml",
                                    f"name: {model}\n".encode())):
                    if path not in self.planted:
                        as_member(path, data, self.uid)
                        self.planted[path] = data
            # a lone sidecar named as the puller's own are, 5 minutes old: the puller's sweep of
            # the sidecars its killed drops leave must not take a member's
            lone = self.spool / "score" / f"{model}.{stamp(now)}.{secrets.token_hex(8)}.yaml"
            as_member(lone, f"model: {model}\n".encode(), self.uid)
            os.utime(lone, (time.time() - EVERY_S, time.time() - EVERY_S))
            self.planted[lone] = f"model: {model}\n".encode()

    def take(self, model: str, rows: np.ndarray) -> None:
        """Train ``model`` first: a training file and its sidecar dropped the safe way (NAME.part, renamed)."""
        assert self.uid == OTHER_UID  # the uid scripts/alert_soak.py's drop gives its files
        drop(self.spool / "incoming", f"{model}.member.yaml", f"name: {model}\n".encode())
        drop(self.spool / "incoming", f"{model}.member.csv", csv_bytes(rows))


class PullRun:
    """One ``ds-ops pull --once --now T`` as the puller's uid, its output appended to the pull log."""

    def __init__(self, args: list[str], log: Path, uid: int | None):
        self.log = open(log, "ab")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO,
                                     env=daemon_env(), **({"user": uid, "group": 0, "extra_groups": []} if uid else {}))

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout_s)
        finally:
            self.log.close()


def own_files(spool: Path, uid: int) -> set[str]:
    """The puller's visible files in score/ and incoming/ (its drops)."""
    out = set()
    for which in ("score", "incoming"):
        try:
            with os.scandir(spool / which) as it:
                for e in it:
                    if not e.name.startswith(".") and e.stat(follow_symlinks=False).st_uid == uid:
                        out.add(f"{which}/{e.name}")
        except OSError:
            pass
    return out


def run_pulls(args, root: Path, dirs: dict, member: Member, truth: dict, first_pull: float) -> dict:
    """The pulls, with the kills and the member's moves. Returns the figures."""
    spool = dirs["spool"]
    uid = PULLER_UID if os.geteuid() == 0 else None
    pull_uid = uid if uid is not None else os.geteuid()
    cmd = [sys.executable, "-m", "opt_ds_ops.cli", "pull", str(root / "node.yaml"), "--config", str(root / "trainer.yaml"),
           "--state-dir", str(root / "pullstate"), "--once", "--now"]
    pick = random.Random(args.seed)
    kills, rcs, durations = Counter(), Counter(), []
    hosts_models = [h.replace(":", "_") for h in truth]
    late_take = args.pulls // 3 - 3  # late:9100 has its 6 h (min_history) at pull pulls // 3
    for i in range(args.pulls):
        now = first_pull + i * EVERY_S
        member.plant(hosts_models, now)
        if i == late_take and uid is not None:  # before late:9100 has min_history: the member trains its name first
            member.take("late_9100", truth[LATE_HOST][1][:400])
            wait_for(lambda: (dirs["models"] / "late_9100" / "current").exists(), "the member's late_9100", 300)
        kill = 0 < i < args.pulls - 1 and pick.random() < args.kill_share  # the last pull ends the soak: not killed
        aimed = kill and pick.random() < 0.5
        before = own_files(spool, pull_uid) if aimed else set()
        t0, wall = time.monotonic(), time.time()
        run = PullRun(cmd + [repr(now)], dirs["logs"] / "pull.log", uid)
        if kill and aimed:  # the moment a drop is made and the state not yet saved
            deadline = t0 + 10
            while run.proc.poll() is None and time.monotonic() < deadline:
                if any(f.endswith(".csv") for f in own_files(spool, pull_uid) - before):  # a drop's data is in place
                    run.proc.send_signal(signal.SIGKILL)
                    break
                time.sleep(0.001)
        elif kill:
            try:
                run.proc.wait(pick.uniform(0, args.kill_max_s))
            except subprocess.TimeoutExpired:
                run.proc.send_signal(signal.SIGKILL)
        rc = run.wait(120)
        if rc == -signal.SIGKILL:
            kills["aimed after a drop" if aimed else "at random"] += 1
        elif kill:
            kills["exited before its kill"] += 1
        else:
            durations.append(time.monotonic() - t0)
        rcs[rc] += 1
        if rc == -signal.SIGKILL:  # the soak's pulls are seconds apart, not score_every: its drops age as they would
            own = own_files(spool, pull_uid)
            for f in own:
                if f.endswith(".yaml") and f[:-5] + ".csv" not in own:
                    try:
                        os.utime(spool / f, (wall - EVERY_S, wall - EVERY_S))
                    except FileNotFoundError:  # claimed with its CSV meanwhile
                        pass
        if rc not in (0, -signal.SIGKILL):
            raise SoakFailure(f"pull {i} at {now:.0f} exited {rc}: {dirs['logs'] / 'pull.log'}")
        if i == 0:  # the first versions, before the kills begin
            wait_for(lambda: all((dirs["models"] / m / "current").exists() for m in hosts_models
                                 if m not in ("tk_9100", "late_9100")), "every host's first version", 600)
    return {"kills": dict(kills), "exit statuses": {str(k): v for k, v in rcs.items()},
            "pull s (median, unkilled)": round(float(np.median(durations)), 2) if durations else None,
            "last end": first_pull + (args.pulls - 1) * EVERY_S}


def wait_for(cond, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise SoakFailure(f"{what}: not within {timeout_s:.0f} s")


def results(scores: Path, model: str) -> list[dict]:
    """Every rows.csv row of model's results, in result order."""
    out = []
    for p in sorted((scores / model).glob("*/rows.csv")) if (scores / model).is_dir() else []:
        with open(p, newline="") as f:
            out += list(csv.DictReader(f))
    return out


def epoch(iso: str) -> float:
    import calendar

    return float(calendar.timegm(time.strptime(iso[:19], "%Y-%m-%dT%H:%M:%S")))


def check(args, root: Path, dirs: dict, member: Member, truth: dict, anomaly: float, figures: dict, taken: bool) -> list[str]:
    fails = []
    state = json.loads((root / "pullstate" / "node.json").read_text())["hosts"]
    log = (dirs["logs"] / "pull.log").read_text(errors="replace")
    daemon_log = "".join(p.read_text(errors="replace") for p in sorted(dirs["logs"].glob("daemon-*.log")))
    end = figures["last end"]
    scores = root / "scores"
    figures["rows scored"] = {}
    for host in truth:
        model = host.replace(":", "_")
        entry = state.get(host) or {}
        if taken and host in (TAKEN_HOST, LATE_HOST):
            if not entry.get("blocked") or f"uid {OTHER_UID}" not in entry["blocked"]:
                fails.append(f"{host}: not blocked by the member's model in the puller's state: {entry}")
            if f"host {host} is not modelled: its model name {model} belongs to uid {OTHER_UID}" not in log:
                fails.append(f"{host}: the pull log never says it is not modelled, naming uid {OTHER_UID}")
            if any(model in line for line in log.splitlines() if "to incoming/ to train model" in line):
                fails.append(f"{host}: the puller dropped a training file for the member's model {model}")
            continue
        if entry.get("scored_until") != end:
            fails.append(f"{host}: scored until {entry.get('scored_until')}, the last pull's end is {end}")
        trained_at = entry.get("trained_at")
        rows = results(scores, model)
        times = [epoch(r["time"]) for r in rows]
        twice = [t for t, n in Counter(times).items() if n > 1]
        if twice:
            fails.append(f"{host}: {len(twice)} time(s) scored more than once, the first {stamp(min(twice))}")
        want = set(np.arange(trained_at + STEP_S, end + STEP_S / 2, STEP_S).tolist()) if trained_at else set()
        lost = want - set(times)
        if lost:
            fails.append(f"{host}: {len(lost)} step(s) never scored, the first {stamp(min(lost))}")
        figures["rows scored"][host] = len(times)
        if RESET.search("\n".join(line for line in daemon_log.splitlines() if f"{model}:" in line) or ""):
            fails.append(f"{host}: the daemon reset its series (a chunk's rows taken as new): see the daemon log")
        if host == ANOMALY_HOST:
            ids = {r["incident"] for r in rows if anomaly <= epoch(r["time"]) < anomaly + SHIFTED * STEP_S and r["incident"]}
            opened = [(m, int(i), int(row)) for m, i, row in OPENED.findall(daemon_log) if m == model]
            figures["incidents opened on the anomaly host (any cause)"] = len({i for _, i, _ in opened})
            if len(ids) != 1:
                fails.append(f"{host}: the anomaly's rows lie in {len(ids)} incident(s) {sorted(ids)}, not one")
            else:
                (inc,) = ids
                first = min(int(r["row"]) for r in rows if r["incident"] == inc)
                said = Counter(i for _, i, _ in opened)[int(inc)]
                if said != 1:
                    fails.append(f"{host}: incident {inc}'s opening is said {said} time(s) in the daemon log")
                start = [epoch(r["time"]) for r in rows if r["incident"] == inc and int(r["row"]) == first]
                figures["the anomaly's incident opened (minutes after its first row)"] = \
                    round((start[0] - anomaly) / 60) if start else None
    if taken:
        prom = (root / "metrics" / "ds_ops_pull_node.prom").read_text() if (root / "metrics" / "ds_ops_pull_node.prom").exists() else ""
        if not re.search(r'ds_ops_pull_hosts\{[^}]*state="blocked"[^}]*\} 2(\.0)?\b', prom):
            fails.append(f'ds_ops_pull_hosts{{state="blocked"}} is not 2: {[l for l in prom.splitlines() if "pull_hosts" in l]}')
    changed = [str(p) for p, data in member.planted.items() if not p.exists() or p.read_bytes() != data]
    if changed:
        fails.append(f"{len(changed)} planted file(s) gone or changed, the first {changed[0]}")
    figures["planted files"] = len(member.planted)
    pull_uid = PULLER_UID if os.geteuid() == 0 else os.geteuid()
    own = own_files(dirs["spool"], pull_uid)
    left = sorted(f for f in own if f.endswith(".csv"))
    lone = [f for f in own if f.endswith(".yaml") and f[:-5] + ".csv" not in own]
    swept = sum(int(n) for n in re.findall(r"node: removed (\d+) sidecar\(s\) of this puller's", log))
    figures["sidecars a killed drop left without their CSV, removed by a later pull"] = swept
    if lone:
        fails.append(f"{len(lone)} sidecar(s) of the puller's without their CSV outlived the last pull, the first {lone[0]}")
    if left or any(dirs["processing"].iterdir()):
        fails.append(f"left in the spool: {left[:3]} {sorted(p.name for p in dirs['processing'].iterdir())[:3]}")
    return fails


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pulls", type=int, default=200)
    ap.add_argument("--hosts", type=int, default=3, help="hosts of the puller's (h0, h1 with the anomaly, ...)")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--kill-share", type=float, default=0.5)
    ap.add_argument("--kill-max-s", type=float, default=0.3)  # a pull takes 0.27 s (median, 2 cores)
    ap.add_argument("--timeout-s", type=float, default=1800.0)
    ap.add_argument("--root")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args(argv)
    if args.pulls < 10 or args.hosts < 2 or not 0 <= args.kill_share <= 1:
        ap.error("--pulls must be >= 10, --hosts >= 2 and --kill-share in 0..1")
    from prometheus_kit import PrometheusServer

    root = Path(args.root).resolve() if args.root else Path(tempfile.mkdtemp(prefix="ds-ops-pull-soak-"))
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o755)
    dirs = make_spool(root)
    score = dirs["spool"] / "score"
    score.mkdir()
    os.chmod(score, 0o3770)
    taken = os.geteuid() == 0
    for d in ("pullstate", "metrics"):
        (root / d).mkdir()
        if taken:
            os.chown(root / d, PULLER_UID, 0)
    if taken:
        os.chmod(root / "metrics", 0o775)
    hosts = [f"h{i}:9100" for i in range(args.hosts)] + ([TAKEN_HOST, LATE_HOST] if taken else [])
    text, truth, anomaly, first_pull = history(hosts, args.pulls)
    (root / "prometheus").mkdir()
    prom = PrometheusServer(root / "prometheus", text).start()
    (root / "node.yaml").write_text(SOURCE.format(url=prom.url))
    conf = write_config(root, period_s=None, extra=("metrics:", f"  textfile_dir: {root / 'metrics'}"))
    member = Member(dirs["spool"], OTHER_UID)
    daemon, sessions, fails = None, set(), []
    started = time.monotonic()
    try:
        daemon = Daemon(conf, dirs["logs"], 0)
        sessions.add(daemon.pid)
        if daemon.wait_ready(READY_TIMEOUT_S) is None:
            raise SoakFailure(f"the daemon exited before ready: {daemon.log_path}")
        if taken:  # the member trains tk:9100's model name before the puller's first pull
            member.take("tk_9100", truth[TAKEN_HOST][1][:400])
            wait_for(lambda: (dirs["models"] / "tk_9100" / "current").exists(), "the member's tk_9100", 300)
        figures = run_pulls(args, root, dirs, member, truth, first_pull)
        pull_uid = PULLER_UID if taken else os.geteuid()
        wait_for(lambda: not [f for f in own_files(dirs["spool"], pull_uid) if f.endswith(".csv")]
                 and not any(dirs["processing"].iterdir()), "the daemon to score every chunk", args.timeout_s)
        rc = daemon.stop()
        if rc != 0:
            fails.append(f"the daemon exited {rc} on SIGTERM")
        fails += check(args, root, dirs, member, {h: truth[h] for h in hosts}, anomaly, figures, taken)
    except SoakFailure as e:
        fails.append(str(e))
        figures = {}
    finally:
        kill_everything(daemon, sessions)
        prom.stop()
    figures["seconds"] = round(time.monotonic() - started)
    print(f"pull soak: {args.pulls} pulls of {len(hosts)} hosts (seed {args.seed}); "
          f"{'member uid ' + str(OTHER_UID) if taken else 'not root: no member uid, no name taken'}")
    for k, v in figures.items():
        print(f"  {k}: {v}")
    for f in fails:
        print(f"FAIL: {f}")
    if fails:
        print(f"kept for inspection: {root}")
        return 1
    print("pull soak passed")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
