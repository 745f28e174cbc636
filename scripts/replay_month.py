#!/usr/bin/env python3
"""A month of one real server's telemetry, replayed through the real daemon with retraining on
(docs/retraining.md, "A month, replayed"): what a new operator sees in ``ds-ops status``, ``ds-ops models`` and
the journal, and whether the retraining kept its promises.

* A temporary root holds a conffile (device cpu; scoring on; ``retrain.every`` on, by default
  ``2.5d`` of the data's clock, see below; ``retrain.window`` ``7d`` of the data's clock; the stopping rule
  and the promotion gate as shipped, ``train.max_steps`` capped only where ``--max-steps`` says),
  the spool and the model store. As root the daemon runs without CAP_DAC_OVERRIDE,
  CAP_DAC_READ_SEARCH and CAP_FOWNER, as scripts/soak.py starts it.
* The first ``--train-days`` (7) of a machine's train period are dropped in incoming/ as
  ``MACHINE.csv`` with an ISO time column from 2025-11-01T00:00:00Z: any corpus in SMD's layout
  (``--corpus``: train/, test/, test_label/), SMD by default (one row a minute, 38 metrics), ASD
  with ``--period-s 300`` (one row every 5 minutes, 19 metrics).
* The rest of the train period and the whole test period follow as chunks of ``--chunk-hours``
  (12) into score/, each written under ``.part`` and renamed in, one at a time (the next once the
  daemon has scored the last and any retraining it made due has ended: the data's clock decides
  which version scores each chunk, so the same code replayed twice gives the same figures),
  paced at ``--day-s`` (8) wall seconds per day of data.
  ``retrain.every`` counts the data's clock where the rows have times (opt_ds_ops/daemon/retrainer.py:
  from the newest row a version was made from to a scored file's last row), so the replay
  retrains as a live server would, however fast it is fed.
* At the end (the queue empty, the last retraining finished) it prints ``ds-ops status``,
  ``ds-ops models list``, the daemon's journal lines about retraining and promotion (its
  ``incident-opened``, ``incident-escalated`` and ``incident-closed`` lines counted, the longest
  incidents shown), and a
  summary: chunks, rows scored, retrains, promotions, refusals with the gate's figures, and the
  segments flagged in the test period against its labelled ones, then the figures an operator
  lives with over it, from the daemon's incidents (what pages: opt_ds_ops/scoring/incidents.py,
  the conffile's ``scoring.incident_*`` as shipped): pages (incidents), false pages a day
  (incidents touching no labelled row), labelled segments paged (an incident *opened* inside one
  or at most an hour before it: its ``incident-opened`` event's row), the share of normal rows in
  an incident (from its first to its last flagged row: rows.csv's ``incident`` column), retrains
  promoted; as :func:`opt_ds_ops.scoring.incidents.operator_figures` computes them.

Checks (exit 1, one line per failure): ``current`` names one whole version after every chunk and
at the end; every version directory loads (opt_ds_ops.store.versions.load_model) and no ``.tmp-*`` is
left; the history file reads back, in time order, within the window; every retraining's
``excluded.held_back`` is the newest tenth of the history it was given (its copy in done/) and
its ``excluded`` record is what the flags of the older rows say, those
flags are the ones the scoring results gave the same rows, no row it trained on lies in or
within the margin of a flagged segment (the bytes it trained on, metadata dataset.sha256, are the
older rows outside them, none of the held-back tenth; a segment kept as a change of regime
excepted, counted),
and it names its metrics as the first version does;
no chunk failed; the daemon stops with 0 on SIGTERM.

    python3 scripts/replay_month.py                    # the whole month (about 5-7 minutes, 2 cores)
    python3 scripts/replay_month.py --days 3 --every 1d --max-steps 300   # a small one (the test)
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# A year before the rounds: every row's time lies before the replay's wall clock. The daemon takes a
# version's data end no later than its training's end (a clock glitch's far-future rows must not
# stop retrain.every), so rows dated after the replay ran made its retraining schedule, and so its
# figures, depend on the day it ran (2026-11-01 put ASD's last weeks in the future).
START = datetime(2025, 11, 1, tzinfo=timezone.utc).timestamp()
PERIOD_S = 60  # SMD: one row a minute (--period-s: ASD has 300)
READY_TIMEOUT_S = 120.0
JOB_TIMEOUT_S = 300.0
# the daemon's incident lines (opt_ds_ops/daemon/scoreslot.py): "NAME: warning incident 3 opened at row ...",
# "NAME: incident 3 is critical at row ..." (escalated), "NAME: critical incident 3 closed: ..."
INCIDENT_LINE = re.compile(r": (?:warning |critical )?incident \d+ (opened|closed|is critical)\b")
JOURNAL_WORDS = ("retraining queued", "model saved", "not promoted", "held by", "series", "failed", "pruned", "suspect",
                 "reset", "change of regime at")


class ReplayFailure(RuntimeError):
    pass


def smd_dir(arg: str | None) -> Path:
    """The corpus folder in SMD's layout (train/, test/, test_label/): --corpus (or --smd), else
    ../shared/data/smd if present, else the bundled data/smd."""
    if arg:
        return Path(arg)
    shared = REPO.parent / "shared" / "data" / "smd"
    return shared if (shared / "train").is_dir() else REPO / "data" / "smd"


def load_machine(smd: Path, machine: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Return (train rows, test rows, test labels (bool)) of one SMD machine."""
    train = np.loadtxt(smd / "train" / f"{machine}.txt.gz", delimiter=",")
    test = np.loadtxt(smd / "test" / f"{machine}.txt.gz", delimiter=",")
    labels = smd / "test_label"
    lab = next(p for p in (labels / f"{machine}.txt", labels / f"{machine}.txt.gz") if p.exists())
    return train, test, np.loadtxt(lab, dtype=int).astype(bool)


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def write_csv(path: Path, rows: np.ndarray, first_row: int, period_s: float = PERIOD_S) -> None:
    """rows as CSV with a header ``time,m0..m(D-1)``, row i at START + period_s (first_row + i) s;
    written under path.part and renamed to path (as docs/operating.md says a drop should be)."""
    part = path.with_name(path.name + ".part")
    with open(part, "w") as f:
        f.write("time," + ",".join(f"m{i}" for i in range(rows.shape[1])) + "\n")
        for i, r in enumerate(rows):
            f.write(iso(START + period_s * (first_row + i)) + "," + ",".join(f"{v:.6g}" for v in r) + "\n")
    os.rename(part, path)


def write_config(root: Path, args, before: bool = False) -> Path:
    """The replay's conffile: its own paths and a quick spool; ``retrain.every`` and ``window`` from
    the options unless ``--shipped`` (then the shipped defaults); ``--set SECTION.KEY=VALUE`` last;
    with ``before``, ``--before-set``'s items after them (``trainer-before.yaml``)."""
    sections: dict[str, dict[str, str]] = {
        "spool": {"dir": str(root / "spool"), "settle_s": "0.2", "scan_interval_s": "1", "quiet_s": "0.5"},
        "scoring": {"results_dir": str(root / "scores")}, "retrain": {}, "train": {}}
    if not args.shipped:
        sections["retrain"].update(every=f'"{args.every}"', window=args.window)
    if args.max_steps:
        sections["train"]["max_steps"] = str(args.max_steps)
    for item in (args.set or []) + (args.before_set or [] if before else []):
        key, _, value = item.partition("=")
        section, _, leaf = key.partition(".")
        if not section or not leaf or not _:
            raise SystemExit(f"--set {item!r}: want SECTION.KEY=VALUE")
        sections.setdefault(section, {})[leaf] = value
    lines = [f"models_dir: {root / 'models'}", "device: cpu"]
    for section, keys in sections.items():
        if keys:
            lines += [f"{section}:"] + [f"  {k}: {v}" for k, v in keys.items()]
    conf = root / ("trainer-before.yaml" if before else "trainer.yaml")
    conf.write_text("\n".join(lines) + "\n")
    return conf


def drop_dac_capabilities() -> None:
    """preexec_fn: a root daemon without CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2, 3):
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def env() -> dict:
    """This repository importable, not under systemd (plain log lines), one OpenMP thread."""
    e = {k: v for k, v in os.environ.items()
         if k not in ("JOURNAL_STREAM", "NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "DS_OPS_CONFIG")}
    e["PYTHONPATH"] = str(REPO)
    e["OMP_NUM_THREADS"] = "1"
    return e


def cli(conf: Path, *argv: str) -> str:
    r = subprocess.run([sys.executable, "-m", "opt_ds_ops.cli", *argv[:1], "--config", str(conf), *argv[1:]],
                       cwd=REPO, env=env(), capture_output=True, text=True, timeout=120)
    return r.stdout + (f"[exit {r.returncode}] {r.stderr}" if r.returncode else "")


class Daemon:
    def __init__(self, conf: Path):
        self.log_path = conf.parent / "daemon.log"
        self._log = open(self.log_path, "ab")  # a daemon started again (--before-set) goes on in the same log
        self.proc = subprocess.Popen([sys.executable, "-m", "opt_ds_ops.cli", "daemon", "--config", str(conf)],
                                     stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO,
                                     env=env(), preexec_fn=drop_dac_capabilities if os.geteuid() == 0 else None,
                                     start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait(self, predicate, what: str, timeout_s: float = JOB_TIMEOUT_S):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            v = predicate()
            if v:
                return v
            if self.proc.poll() is not None:
                raise ReplayFailure(f"the daemon exited ({self.proc.returncode}) before {what}: {self.log_path}")
            time.sleep(0.05)
        raise ReplayFailure(f"timed out after {timeout_s:.0f} s waiting for {what}: {self.log_path}")

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(120)
        self._log.close()
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        self._log.close()


# ---- what the store, the results and the history say ------------------------------------------

def version_dirs(name_dir: Path) -> list[str]:
    return sorted(p.name for p in name_dir.iterdir() if not p.name.startswith(".") and p.name not in ("current",)
                  and p.is_dir()) if name_dir.is_dir() else []


def check_current(name_dir: Path, failures: list[str], when: str) -> None:
    from opt_ds_ops.store.versions import current_version

    cur = current_version(str(name_dir))
    if cur is None or not (name_dir / cur / "metadata.json").is_file():
        failures.append(f"{when}: current of {name_dir} is {cur!r}, not one whole version")


def result_flags(results: Path) -> dict[int, bool]:
    """Every scored row's flag by its time (epoch seconds), from the results' rows.csv files."""
    flags = {}
    for d in sorted(p for p in results.iterdir() if p.is_dir() and not p.name.startswith(".")):
        with open(d / "rows.csv", newline="") as f:
            for r in csv.DictReader(f):
                t = datetime.strptime(r["time"][:19], "%Y-%m-%dT%H:%M:%S").replace(tzinfo=timezone.utc).timestamp()
                flags[int(t)] = r["anomaly"] == "1"
    return flags


def _epoch(iso_time: str) -> int:
    """Epoch seconds of an ISO 8601 UTC time of the results (rows.csv, summary.json)."""
    return int(datetime.strptime(iso_time[:19], "%Y-%m-%dT%H:%M:%S").replace(tzinfo=timezone.utc).timestamp())


def result_incidents(results: Path) -> dict[int, dict]:
    """Every incident of the series by id, from the results (epoch seconds): ``start`` and
    ``end``, its first and last flagged rows (the rows.csv rows whose ``incident`` column names
    it: its first flagged row up to its last, with the unflagged rows between them, as far as the
    chunk that wrote each knew; its ``incident-opened`` event's ``started_time`` too), ``opened``
    (the row that opened it: that event's ``time``, else its first row's) and ``severity`` (the
    last said)."""
    out: dict[int, dict] = {}

    def of(k: int) -> dict:
        return out.setdefault(k, {"start": None, "end": None, "opened": None, "severity": None})

    for d in sorted(p for p in results.iterdir() if p.is_dir() and not p.name.startswith(".")):
        with open(d / "rows.csv", newline="") as f:
            for r in csv.DictReader(f):
                if r.get("incident"):
                    inc, t = of(int(r["incident"])), _epoch(r["time"])
                    inc["start"] = t if inc["start"] is None else min(inc["start"], t)
                    inc["end"] = t if inc["end"] is None else max(inc["end"], t)
        try:
            events = json.loads((d / "summary.json").read_text()).get("events") or []
        except (OSError, ValueError):
            events = []
        for e in events:
            if (e.get("event") not in ("incident-opened", "incident-escalated", "incident-closed")
                    or not isinstance(e.get("incident"), int)):
                continue
            inc = of(e["incident"])
            if e["event"] == "incident-opened" and e.get("time"):
                inc["opened"] = _epoch(e["time"])
                if e.get("started_time"):
                    t = _epoch(e["started_time"])
                    inc["start"] = t if inc["start"] is None else min(inc["start"], t)
            inc["severity"] = e.get("severity") or inc["severity"]
    for inc in out.values():
        if inc["opened"] is None:  # its event left out of a summary (more than MAX_EVENTS in one chunk)
            inc["opened"] = inc["start"]
    return {k: v for k, v in out.items() if v["start"] is not None and v["end"] is not None}


def incidents_in(incidents: dict[int, dict], first_time: float, n: int, period_s: float) -> list[dict]:
    """The incidents over n rows from first_time, period_s apart, as
    :func:`opt_ds_ops.scoring.incidents.incidents_of` gives them (rows of that stretch: ``start``
    and ``end`` clipped to it, ``opened`` not: one opened before it is not a page of it)."""
    out = []
    for inc in incidents.values():
        a, b, o = (int(round((inc[k] - first_time) / period_s)) for k in ("start", "end", "opened"))
        if b < 0 or a >= n:
            continue
        out.append({"start": max(a, 0), "end": min(b, n - 1), "opened": o, "severity": inc["severity"], "open": False})
    return sorted(out, key=lambda x: x["start"])


def normal_rows_mask(flags: np.ndarray, margin: int, max_rows: int) -> tuple[np.ndarray, int, int]:
    """Written apart from opt_ds_ops.lifecycle.retrain_data: (the rows a retraining may train on: none of a
    flagged run of at most max_rows rows (0: any) nor margin rows either side; runs, runs kept)."""
    keep, i, n, runs, kept = np.ones(flags.size, dtype=bool), 0, flags.size, 0, 0
    while i < n:
        if not flags[i]:
            i += 1
            continue
        j = i
        while j < n and flags[j]:
            j += 1
        runs += 1
        if max_rows and j - i > max_rows:
            kept += 1
        else:
            keep[max(0, i - margin) : j + margin] = False
        i = j
    return keep, runs, kept


def check_retrain(md: dict, history_copy: Path | None, flags_by_time: dict, margin: int, max_rows: int,
                  failures: list[str]) -> dict:
    """Check one retrained version against the history copy it was given: its flags are those the
    scoring results gave, its ``excluded`` record adds up, and the bytes it trained on
    (metadata ``dataset.sha256``) are the history's rows without the flagged runs and their margin."""
    import hashlib
    import io

    from opt_ds_ops.lifecycle.history import read_history

    v, ex = md["version"], md.get("excluded") or {}
    if history_copy is None:
        failures.append(f"{v}: no copy of the history it trained on in done/")
        return {}
    h = read_history(str(history_copy))
    given = [flags_by_time.get(int(t)) for t in h.times]
    if None in given or not np.array_equal(np.array(given, dtype=bool), h.flags):
        failures.append(f"{v}: the history's flags are not those the scoring results gave the same rows")
    regime = (md.get("retrain") or {}).get("regime")
    if isinstance(regime, dict):  # a change of regime's retraining: the rows before it moved to its levels
        from opt_ds_ops.lifecycle.retrain_data import rebased_history

        h, _ = rebased_history(h, regime)
    n = h.flags.size
    cut = n - min(max(1, int(round(n * 0.1))), n - 2)  # the newest tenth is held back for the gate, before the cut
    held = ex.get("held_back") or {}
    if (held.get("from_row"), held.get("to_row"), held.get("flagged_by_current")) != (cut, n, int(h.flags[cut:].sum())):
        failures.append(f"{v}: held_back says rows {held.get('from_row')}..{held.get('to_row')} "
                        f"({held.get('flagged_by_current')} flagged); its history: {cut}..{n} ({int(h.flags[cut:].sum())})")
    keep, runs, kept = normal_rows_mask(h.flags[:cut], margin, max_rows)
    left = int((~keep).sum())
    if (ex.get("rows_in"), ex.get("rows_left_out"), ex.get("segments")) != (cut, left, runs):
        failures.append(f"{v}: excluded says {ex.get('rows_in')} in, {ex.get('rows_left_out')} left out, "
                        f"{ex.get('segments')} segments; its history before the held-back rows: {cut}, {left}, {runs}")
    buf = io.BytesIO()
    np.save(buf, h.rows()[:cut][keep], allow_pickle=False)
    if hashlib.sha256(buf.getvalue()).hexdigest() != (md.get("dataset") or {}).get("sha256"):
        failures.append(f"{v}: the rows it trained on are not the history's rows outside its flagged runs "
                        "and its held-back rows")
    return {"rows_in": cut, "left_out": left, "segments": runs, "kept_as_regime": kept,
            "trained_flagged": int(h.flags[:cut][keep].sum()), "held_back": n - cut,
            "held_flagged": int(h.flags[cut:].sum())}


def history_copies(done: Path) -> dict[str, Path]:
    """job id -> done/ copy of the history a retraining job trained on (from NAME.result.json)."""
    out = {}
    for p in done.glob("*.result.json"):
        doc = json.loads(p.read_text())
        data = p.with_name(p.name[: -len(".result.json")])
        if ".history.npz" in data.name and data.exists():
            out[doc.get("job_id")] = data
    return out


def operator_figures(incidents: list[dict], labels: np.ndarray, period_s: float) -> dict:
    """What an operator lives with over a labelled period, from its incidents (``start``,
    ``opened``, ``end``: rows of the period, :func:`incidents_in`) and labels (n,), by
    :func:`opt_ds_ops.scoring.incidents.operator_figures`: ``pages`` (incidents: each opens with an
    incident-opened entry), ``false_pages`` (incidents that touch no labelled row) and
    ``false_pages_per_day``, ``labelled`` segments and ``paged`` (an incident *opens* inside the
    segment or at most an hour before it: a segment inside an incident that opened earlier pages
    nobody), ``normal_in_alarm`` (the share of unlabelled rows inside an incident, from its first
    to its last flagged row), ``days``."""
    from opt_ds_ops.scoring.incidents import operator_figures as figures

    labels = np.asarray(labels).astype(bool)
    f = figures(incidents, labels, period_s)
    days = labels.shape[0] * period_s / 86400
    segments = f["segments"]
    paged = int(round(f["paged"] * segments)) if segments else 0
    return {"days": round(days, 2), "pages": f["pages"], "false_pages": f["false_pages"],
            "false_pages_per_day": round(f["false_per_day"], 3) if days else None, "labelled": segments,
            "paged": paged, "paged_share": round(paged / segments, 4) if segments else None,
            "normal_in_alarm": round(f["normal_in_alarm"], 4) if (~labels).any() else None}


def segments_vs_labels(flags: np.ndarray, labels: np.ndarray) -> dict:
    """Event-level figures: labelled segments touched by a flagged row, flagged segments touching none."""
    from opt_ds_ops.model.threshold import segments

    fs, fe = segments(flags)
    ls, le = segments(labels)
    hit = sum(bool(flags[s:e].any()) for s, e in zip(ls, le))
    false = sum(not labels[s:e].any() for s, e in zip(fs, fe))
    return {"labelled": int(ls.size), "labelled_hit": int(hit), "flagged": int(fs.size), "flagged_false": int(false),
            "rows_flagged": int(flags.sum()), "rows_labelled": int(labels.sum()),
            "rows_flagged_labelled": int((flags & labels).sum())}


# ---- the replay ----------------------------------------------------------------------------------

def replay(args, root: Path) -> tuple[dict, list[str]]:
    from opt_ds_ops.lifecycle.history import HISTORY_FILE, read_history
    from opt_ds_ops.store.versions import current_version, load_model, read_metadata

    failures: list[str] = []
    name = args.machine
    train, test, labels = load_machine(smd_dir(args.smd), name)
    rows = np.concatenate([train, test])
    period, per_day = args.period_s, 86400 / args.period_s
    n0 = int(args.train_days * per_day)
    per_chunk = int(args.chunk_hours * 3600 / period)
    end = rows.shape[0] if not args.days else min(rows.shape[0], n0 + int(args.days * per_day))
    conf = write_config(root, args)
    spool, name_dir, results = root / "spool", root / "models" / name, root / "scores" / name
    print(f"replay of {name}: {n0} rows ({args.train_days:g} days) to train, then rows {n0}..{end} "
          f"({(end - n0) / per_day:.1f} days, {train.shape[0] - n0 if end > train.shape[0] else end - n0} of train, "
          f"{max(0, end - train.shape[0])} of test) in chunks of {per_chunk} rows; {args.day_s:g} s a day; "
          + ("retraining as shipped" if args.shipped else
             f"retrain.every {args.every} (the data's clock), window {args.window}")
          + "".join(f", {x}" for x in args.set or []) + f"; root {root}"
          + (f"; the first model trained before an upgrade, with {', '.join(args.before_set)}" if args.before_set
             else ""), flush=True)
    t_start = time.monotonic()
    d = Daemon(write_config(root, args, before=True) if args.before_set else conf)
    try:
        d.wait(lambda: "ds-trainer ready" in d.log(), "the daemon to be ready", READY_TIMEOUT_S)
        write_csv(spool / "incoming" / f"{name}.csv", rows[:n0], 0, period)
        d.wait(lambda: current_version(str(name_dir)), "the first model")
        print(f"first model {current_version(str(name_dir))} after {time.monotonic() - t_start:.0f} s", flush=True)
        if args.before_set:  # the upgrade: the daemon stopped, started again on the new conffile
            d.wait(lambda: not any((spool / "processing").iterdir()), "the first model's job to end")
            if (rc := d.stop()) != 0:
                failures.append(f"the daemon exited {rc} on SIGTERM before the upgrade: {d.log_path}")
            d = Daemon(conf)
            d.wait(lambda: d.log().count("ds-trainer ready") >= 2, "the upgraded daemon to be ready", READY_TIMEOUT_S)
        chunks, t0 = 0, time.monotonic()
        for a in range(n0, end, per_chunk):
            b = min(a + per_chunk, end)
            scored = d.log().count(" scored with version ")
            write_csv(spool / "score" / f"{name}.csv", rows[a:b], a, period)
            d.wait(lambda: d.log().count(" scored with version ") > scored or "failed in stage" in d.log(),
                   f"chunk {chunks + 1} to be scored")
            # the data's clock decides, not the wall's: a retraining this chunk made due ends before
            # the next chunk is dropped (processing/ empties once the scoring job is discarded, after
            # the daemon queued any retraining), so two replays of the same code score every chunk
            # with the same version and give the same figures
            d.wait(lambda: not any((spool / "processing").iterdir()) or "failed in stage" in d.log(),
                   f"the jobs of chunk {chunks + 1} to end")
            chunks += 1
            check_current(name_dir, failures, f"after chunk {chunks}")
            time.sleep(max(0.0, t0 + chunks * args.day_s * (b - a) / per_day - time.monotonic()))
        d.wait(lambda: not any((spool / "processing").iterdir()) and not any((spool / "score").iterdir()),
               "the last jobs to end")
        replay_s = time.monotonic() - t0
        status, models = cli(conf, "status"), cli(conf, "models", "list")
        rc = d.stop()
        if rc != 0:
            failures.append(f"the daemon exited {rc} on SIGTERM: {d.log_path}")
    finally:
        d.kill()
    log = d.log()
    if "failed in stage" in log:
        failures.append("a job failed: " + next(x for x in log.splitlines() if "failed in stage" in x))
    if any((spool / "failed").iterdir()):
        failures.append(f"files in failed/: {sorted(p.name for p in (spool / 'failed').iterdir())}")

    # the store: one current, whole versions
    check_current(name_dir, failures, "at the end")
    leftovers = [p.name for p in name_dir.iterdir() if p.name.startswith(".tmp-")]
    if leftovers:
        failures.append(f"half-written versions left in {name_dir}: {leftovers}")
    mds = []
    for v in version_dirs(name_dir):
        try:
            load_model(str(name_dir / v))
            md = read_metadata(str(name_dir / v))
            mds.append(md)
        except Exception as e:  # any fault of a version directory is a failure here, named
            failures.append(f"version {v} does not load: {e}")
    # the history: reads back, in order, within the window
    h = read_history(str(results / HISTORY_FILE))
    if h is None or h.values.shape[0] != h.flags.shape[0] or np.any(np.diff(h.times) <= 0):
        failures.append(f"the history {results / HISTORY_FILE} is missing or not in time order")
    elif h.times[-1] - h.times[0] > 7 * 86400 and args.window == "7d" and not args.shipped:
        failures.append(f"the history spans {(h.times[-1] - h.times[0]) / 86400:.2f} days, over its window 7d")
    # every retraining against the flags its history had
    flags_by_time = result_flags(results)
    copies = history_copies(spool / "done")
    retrains = []
    from opt_ds_ops.config.conffile import load_config

    rcfg = load_config(str(conf)).retrain
    for md in mds:
        if not md.get("retrain"):
            continue
        fig = check_retrain(md, copies.get(md.get("job_id")), flags_by_time, rcfg.exclude_margin,
                            rcfg.exclude_max_rows, failures)
        if md.get("metric_names") != mds[0].get("metric_names"):
            failures.append(f"{md['version']}: metric names {str(md.get('metric_names'))[:60]}, the first version's "
                            f"{str(mds[0].get('metric_names'))[:60]}")
        gate = md.get("promotion") or {}
        retrains.append(dict(fig, version=md["version"], trigger=md["retrain"].get("trigger"),
                             promoted=gate.get("failed") is None and not md.get("not_current"),
                             failed=gate.get("failed"), reason=gate.get("reason"),
                             challenger=(gate.get("challenger") or {}).get("flagged_share"),
                             champion=(gate.get("champion") or {}).get("flagged_share"),
                             of_normal=(gate.get("challenger") or {}).get("flagged_share_of_normal"),
                             design=gate.get("design_rate"), rows_gate=gate.get("rows"),
                             seeded_factor=((gate.get("challenger") or {}).get("seeded") or {}).get("factor")))
    # the test period's flags, and the daemon's incidents, against its labels
    test_from = train.shape[0]
    times = START + period * np.arange(test_from, end)
    flagged = np.array([flags_by_time.get(int(t), False) for t in times], dtype=bool)
    events = segments_vs_labels(flagged, labels[: max(0, end - test_from)]) if end > test_from else {}
    if events:
        incidents = incidents_in(result_incidents(results), START + period * test_from, end - test_from, period)
        events["operator"] = operator_figures(incidents, labels[: end - test_from], period)
    figures = {"machine": name, "chunks": chunks, "rows_scored": int(end - n0), "replay_s": round(replay_s, 1),
               "total_s": round(time.monotonic() - t_start, 1), "versions": len(mds), "retrains": retrains,
               "current": current_version(str(name_dir)), "test_period": events,
               "history_rows": int(h.values.shape[0]) if h is not None else None,
               "regime_changes": sum(1 for x in log.splitlines() if ": change of regime at " in x)}
    print_report(status, models, log, figures)
    return figures, failures


def print_report(status: str, models: str, log: str, figures: dict) -> None:
    print("\n$ ds-ops status\n" + status.rstrip())
    print("\n$ ds-ops models list\n" + models.rstrip())
    print("\n$ journal (the daemon's lines about retraining and promotion; the incidents counted, the longest shown)")
    lines = log.splitlines()
    for line in lines:
        if any(w in line for w in JOURNAL_WORDS) and not INCIDENT_LINE.search(line):
            print("  " + line[:700])
    kinds = [m.group(1) for x in lines if (m := INCIDENT_LINE.search(x))]
    closed = [x for x in lines if (m := INCIDENT_LINE.search(x)) and m.group(1) == "closed"]
    print(f"  ... {kinds.count('opened')} incident-opened, {kinds.count('is critical')} incident-escalated and "
          f"{len(closed)} incident-closed lines; the 5 longest:")
    for line in sorted(closed, key=lambda x: -int(x.split(" after ")[1].split()[0]))[:5]:
        print("  " + line[:700])
    r = figures["retrains"]
    promoted = [x for x in r if x["promoted"]]
    print(f"\nsummary: {figures['chunks']} chunks, {figures['rows_scored']} rows scored in {figures['replay_s']:.0f} s "
          f"({figures['total_s']:.0f} s in all); {len(r)} retrains, {len(promoted)} promoted, "
          f"{len(r) - len(promoted)} refused; current {figures['current']}; history {figures['history_rows']} rows")
    for x in r:
        verdict = "promoted" if x["promoted"] else f"refused ({x['failed']})"
        share = (f"flags {x['challenger']:.2%} vs champion {x['champion']:.2%} of {x['rows_gate']} held-back rows "
                 f"({x.get('held_flagged')} flagged by the champion when scored), {x.get('of_normal') or 0:.2%} of "
                 f"those the champion did not flag (design {x['design']:.2%})" if isinstance(x.get("challenger"), float)
                 and isinstance(x.get("champion"), float) and x["failed"] in (None, "flagged-vs-champion",
                                                                            "flagged-most", "flagged-vs-design")
                 else str(x.get("reason")))
        trained = x.get("rows_in", 0) - x.get("left_out", 0)
        if isinstance(x.get("seeded_factor"), float):
            share += f"; its budget seeded at {x['seeded_factor']:.3g} times its threshold"
        print(f"  {x['version']} ({x['trigger']}): {verdict}: {share}; trained on {trained}"
              f" of the {x.get('rows_in')} older history rows ({x.get('left_out')} left out, {x.get('segments')} flagged "
              f"segments, {x.get('kept_as_regime')} kept as a change of regime)")
    e = figures["test_period"]
    if e:
        print(f"  test period: {e['flagged']} segments flagged, {e['flagged_false']} of them outside every labelled "
              f"one; {e['labelled_hit']} of {e['labelled']} labelled segments flagged; rows: {e['rows_flagged']} "
              f"flagged, {e['rows_labelled']} labelled, {e['rows_flagged_labelled']} both")
        o = e["operator"]
        print(f"  as an operator lives it, over {o['days']} days: {o['pages']} incidents paged, {o['false_pages']} "
              f"false ({o['false_pages_per_day']} a day); {o['paged']} of {o['labelled']} labelled segments paged (an "
              f"incident opening in it or up to an hour before); {o['normal_in_alarm']:.1%} of normal rows in an "
              f"incident; "
              f"{sum(1 for x in figures['retrains'] if x['promoted'])} of {len(figures['retrains'])} retrains promoted")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--machine", default="machine-1-2", help="machine or entity of the corpus (default machine-1-2)")
    p.add_argument("--corpus", "--smd", dest="smd",
                   help="a corpus in SMD's layout: SMD, or ASD with --period-s 300 (default ../shared/data/smd "
                        "if present, else data/smd)")
    p.add_argument("--period-s", type=float, default=PERIOD_S, help="seconds between rows (60: SMD; 300: ASD)")
    p.add_argument("--train-days", type=float, default=7.0, help="days of the train period to train on first (7)")
    p.add_argument("--chunk-hours", type=float, default=12.0, help="hours of data per scored chunk (12)")
    p.add_argument("--days", type=float, default=0.0, help="replay only this many days after the training (0: all)")
    p.add_argument("--day-s", type=float, default=8.0, help="wall seconds per day of data, at least (8)")
    p.add_argument("--every", default="2.5d", help="retrain.every (the data's clock; default 2.5d)")
    p.add_argument("--window", default="7d", help="retrain.window (default 7d of the data's clock)")
    p.add_argument("--max-steps", type=int, default=0, help="train.max_steps (0: as shipped)")
    p.add_argument("--shipped", action="store_true",
                   help="retraining as shipped (retrain.every, window, drift_rate, ...), not --every/--window")
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE",
                   help="a conffile key for the replay, e.g. scoring.regime_after_s=0 (repeatable)")
    p.add_argument("--before-set", action="append", metavar="SECTION.KEY=VALUE",
                   help="a conffile key of the package before an upgrade: the first model is trained with it, "
                        "then the daemon is stopped and started again without it (repeatable)")
    p.add_argument("--root", help="work in this folder (kept) instead of a temporary one")
    p.add_argument("--keep", action="store_true", help="keep the temporary root")
    p.add_argument("--json", help="write the figures to this file")
    args = p.parse_args(argv)
    root = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="ds-ops-replay-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        figures, failures = replay(args, root)
    except ReplayFailure as e:
        figures, failures = {}, [str(e)]
    if args.json:
        Path(args.json).write_text(json.dumps({"figures": figures, "failures": failures}, indent=1))
    if failures:
        print("\nFAILED:\n" + "\n".join(f"  {f}" for f in failures) + f"\n(root kept: {root})")
        return 1
    print("\ninvariants hold: one current after every chunk, whole versions, the history intact, "
          "no retraining trained on a flagged segment")
    if not (args.root or args.keep):
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
