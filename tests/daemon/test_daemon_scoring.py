"""The scoring spool, end to end in real daemon processes (opt_ds_ops.daemon.scoreslot).

The daemon runs as the unit's user would (daemon_kit.as_service_user: root without CAP_CHOWN,
CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER); score/ and incoming/ have the package's mode
3770 and members ALICE and BOB drop files (chowned to them). The journal is captured at the
systemd-python boundary inside the daemon process (as tests/observe/test_journal.py does).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, SMD_TRAIN
from daemon_kit import (
    START_TIMEOUT_S, Daemon, as_service_user, base_env, done_names, failed_names, prom_samples, read_json, spool_dir,
    write_config,
)
from opt_ds_ops.observe.journal import MESSAGE_IDS

ALICE, BOB = 12345, 12346
METRICS = [f"metric_{i:02d}" for i in range(38)]  # dataset.metric_names: alerts name them
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as other uids")

CAPTURE = """
import json, os, sys
import systemd.journal
out = open(os.environ["JOURNAL_CAPTURE"], "a")
def send(MESSAGE, **fields):
    out.write(json.dumps(dict(fields, MESSAGE=MESSAGE)) + "\\n")
    out.flush()
systemd.journal.send = send
from opt_ds_ops.cli import main
sys.exit(main(sys.argv[1:]))
"""
EVENT = {v: k for k, v in MESSAGE_IDS.items()}


def config(root: Path, *scoring: str, train_keys: tuple[str, ...] = ()) -> Path:
    """A conffile for root with metric names, the results under root/scores (``scoring``: more keys
    of that section) and the metrics in root/prom."""
    return write_config(root, train_keys=train_keys, extra=["dataset:", f"  metric_names: [{', '.join(METRICS)}]", "scoring:",
                                     f"  results_dir: {root / 'scores'}", *scoring, "metrics:",
                                     f"  textfile_dir: {root / 'prom'}"])


def start(root: Path, *extra: str, train_keys: tuple[str, ...] = ()) -> Daemon:
    """Start a real daemon as the service user with its journal captured in root/journal.jsonl
    (appended to) and wait until it is ready; incoming/ and score/ get the package's mode 3770."""
    (root / "prom").mkdir(exist_ok=True)
    conf = config(root, *extra, train_keys=train_keys)
    env = base_env(JOURNAL_STREAM="8:1", JOURNAL_CAPTURE=str(root / "journal.jsonl"))
    d = Daemon(conf, env=env, preexec_fn=as_service_user,
               argv=[sys.executable, "-c", CAPTURE, "daemon", "--config", str(conf)])
    d.conf = conf
    ready = events(root).count("daemon-started") + 1
    try:
        d.wait_until(lambda: events(root).count("daemon-started") >= ready, "the daemon to be ready", START_TIMEOUT_S)
    except BaseException:
        d.kill()
        raise
    for which in ("incoming", "score"):
        os.chmod(spool_dir(root, which), 0o3770)
    return d


@contextlib.contextmanager
def service(root: Path, *extra: str, train_keys: tuple[str, ...] = ()):
    """:func:`start`; asserts at the end that the same process still serves and stops with 0."""
    d = start(root, *extra, train_keys=train_keys)
    try:
        yield d
        assert d.alive(), d.log()
        rc, _ = d.stop()
        assert rc == 0, d.log()
    finally:
        d.kill()


def journal(root: Path) -> list[dict]:
    path = root / "journal.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def events(root: Path) -> list[str]:
    return [EVENT.get(e.get("MESSAGE_ID"), "?") for e in journal(root)]


def drop(directory: Path, name: str, data: bytes, uid: int = ALICE, mode: int = 0o640) -> Path:
    """Drop data as member uid the safe way: NAME.part, chown, chmod, rename."""
    part = directory / f"{name}.part"
    part.write_bytes(data)
    os.chown(part, uid, os.getgid())
    os.chmod(part, mode)
    os.rename(part, directory / name)
    return directory / name


def train(d: Daemon, root: Path, model: str = "m") -> None:
    drop(spool_dir(root, "incoming"), f"{model}.txt.gz", SMD_TRAIN.read_bytes())
    d.wait_until(lambda: f"{model}.txt.gz" in done_names(root), f"model {model} to be trained")


def csv_bytes(rows: np.ndarray) -> bytes:
    return "".join(",".join(f"{v:.6g}" for v in r) + "\n" for r in rows).encode()


def chunk(d: Daemon, root: Path, name: str, rows: np.ndarray, model: str = "m", uid: int = ALICE) -> None:
    """Drop rows as score/NAME.csv with a sidecar naming the model (the sidecar first)."""
    score = spool_dir(root, "score")
    drop(score, f"{name}.yaml", f"model: {model}\n".encode(), uid)
    drop(score, f"{name}.csv", csv_bytes(rows), uid)


def results(root: Path, model: str = "m") -> list[dict]:
    """The summaries of model's result directories, in the order they were written."""
    mdir = root / "scores" / model
    if not mdir.exists():
        return []
    return [read_json(p / "summary.json") for p in sorted(mdir.iterdir()) if p.is_dir() and not p.name.startswith(".")]


def smd(n: int, start: int = 0) -> np.ndarray:
    return np.loadtxt(SMD_TRAIN, delimiter=",", dtype=np.float32)[start:start + n]


def test_chunks_are_scored_in_order_and_alert_in_the_journal_prometheus_and_status(tmp_path):
    rows = smd(3000, 1000)
    spike = rows.copy()
    spike[1200:1300, 5] += 40.0  # one metric far outside anything seen in training: one warning incident
    # The score of levels alone (before round 10): the differences score (shipped) halves a lone metric's
    # level term and does not page this one (docs/scoring.md, "One metric alone"); the pipeline is under test.
    with service(tmp_path, train_keys=("input_differences: false", "score_window: 30")) as d:
        train(d, tmp_path)
        for i in range(3):
            chunk(d, tmp_path, f"c{i}", spike[i * 1000:(i + 1) * 1000])
        d.wait_until(lambda: len(results(tmp_path)) == 3 and "scored" in events(tmp_path)
                     and events(tmp_path).count("scored") == 3, "three chunks scored")
        status = subprocess.run([sys.executable, "-m", "opt_ds_ops.cli", "status", "--config", str(d.conf)],
                                capture_output=True, text=True, env=base_env(), cwd=REPO, timeout=120)
        status_json = subprocess.run([sys.executable, "-m", "opt_ds_ops.cli", "status", "--json", "--config",
                                      str(d.conf)], capture_output=True, text=True, env=base_env(), cwd=REPO,
                                     timeout=120)
    got = results(tmp_path)
    assert [s["source"] for s in got] == ["c0.csv", "c1.csv", "c2.csv"]  # claim order
    assert [s["first_row"] for s in got] == [0, 1000, 2000]  # one series across files
    state = read_json(tmp_path / "scores" / "m" / "state.json")
    assert state["rows_scored"] == 3000 and state["incidents"] == 1 and state["incident"]["open"] is None
    # nothing of the scored files is kept: not in score/, processing/, done/ (only the training file)
    assert sorted(os.listdir(spool_dir(tmp_path, "score"))) == []
    assert os.listdir(spool_dir(tmp_path, "processing")) == []
    assert done_names(tmp_path) == {"m.txt.gz"} and failed_names(tmp_path) == set()
    entries = journal(tmp_path)
    (started,) = [e for e in entries if EVENT[e["MESSAGE_ID"]] == "incident-opened"]
    (ended,) = [e for e in entries if EVENT[e["MESSAGE_ID"]] == "incident-closed"]
    # one metric of 38 far out: the mean score stays under twice the threshold, a warning throughout
    assert started["PRIORITY"] == ended["PRIORITY"] == "4"
    assert started["DS_SEVERITY"] == ended["DS_SEVERITY"] == "warning" and started["DS_INCIDENT"] == "1"
    assert float(ended["DS_PEAK_SCORE"]) < 2 * float(started["DS_THRESHOLD"])
    assert started["DS_MODEL"] == "m" and 1200 <= int(started["DS_ROW"]) < 1300 and started["DS_VERSION"]
    assert "metric_05" in started["DS_TOP_METRICS"] and "metric_05" in started["MESSAGE"]
    assert float(started["DS_SCORE"]) > float(started["DS_THRESHOLD"])
    assert 1299 <= int(ended["DS_ROW"]) < 1400 and float(ended["DS_PEAK_SCORE"]) >= float(started["DS_SCORE"])
    assert ended["DS_REASON"] == "recovered" and ended["DS_STARTED_ROW"] == started["DS_STARTED_ROW"]
    # journalctl -p warning: exactly the incident (and problems: none here)
    assert [EVENT[e["MESSAGE_ID"]] for e in entries if int(e["PRIORITY"]) <= 4] == ["incident-opened", "incident-closed"]
    scored = [e for e in entries if EVENT[e["MESSAGE_ID"]] == "scored"]
    assert [e["PRIORITY"] for e in scored] == ["6"] * 3 and [e["DS_ROWS"] for e in scored] == ["1000"] * 3
    m = prom_samples(tmp_path / "prom" / "ds_ops.prom")
    model = (("model", "m"),)
    assert m[("ds_ops_scored_rows_total", model)] == 3000
    assert m[("ds_ops_incidents_total", model)] == 1
    assert m[("ds_ops_flagged_rows_total", model)] == state["rows_flagged"] > 0
    assert m[("ds_ops_incident_open", model)] == m[("ds_ops_incident_critical", model)] == 0
    assert m[("ds_ops_score_threshold", model)] == pytest.approx(state["threshold"])
    assert m[("ds_ops_score_last", model)] == pytest.approx(state["last_score"])
    assert time.time() - 600 < m[("ds_ops_last_scored_timestamp_seconds", model)] <= time.time()
    assert not [k for k in m if k[0] == "ds_ops_incident_top_metric_share"]  # no open incident: no sample
    assert status.returncode == 0, status.stderr
    (line,) = [x for x in status.stdout.splitlines() if x.startswith("  m ")]
    assert "3000 rows scored" in line and "1 incident, 0 critical)" in line and "no open incident" in line, status.stdout
    assert "score/: 0 queued" in status.stdout
    st = json.loads(status_json.stdout)
    assert st["scoring"]["m"]["rows_total"] == 3000 and st["score_queue"] == []


@pytest.mark.recovery
def test_an_open_incident_shows_its_top_metrics_and_counters_survive_a_restart(tmp_path):
    rows = smd(1000, 1000)
    rows[900:, 7] += 40.0  # the file ends inside the incident: it stays open
    with service(tmp_path) as d:
        train(d, tmp_path)
        chunk(d, tmp_path, "open", rows)
        d.wait_until(lambda: "scored" in events(tmp_path), "the chunk scored")
    m = prom_samples(tmp_path / "prom" / "ds_ops.prom")
    model = (("model", "m"),)
    assert m[("ds_ops_incident_open", model)] == m[("ds_ops_incident_critical", model)] == 1
    tops = {k: v for k, v in m.items() if k[0] == "ds_ops_incident_top_metric_share"}
    assert 1 <= len(tops) <= 3
    assert dict(next(k for k in tops if ("rank", "1") in k[1])[1])["metric"] == "metric_07"
    (tmp_path / "prom" / "ds_ops.prom").unlink()
    with service(tmp_path) as d:  # a new daemon: the counters come back from state.json
        d.wait_until(lambda: (tmp_path / "prom" / "ds_ops.prom").exists(), "the metrics written")
        again = prom_samples(tmp_path / "prom" / "ds_ops.prom")
        status = subprocess.run([sys.executable, "-m", "opt_ds_ops.cli", "status", "--config", str(d.conf)],
                                capture_output=True, text=True, env=base_env(), cwd=REPO, timeout=120)
    assert again[("ds_ops_scored_rows_total", model)] == 1000
    assert again[("ds_ops_incident_open", model)] == 1
    assert again[("ds_ops_flagged_rows_total", model)] == m[("ds_ops_flagged_rows_total", model)] > 0
    (line,) = [x for x in status.stdout.splitlines() if x.startswith("  m ")]
    assert "CRITICAL INCIDENT OPEN" in line and "metric_07" in line, status.stdout
    # `journalctl -p crit` lists the critical incident once: opened critical, or escalated from a warning
    crit = [EVENT[e["MESSAGE_ID"]] for e in journal(tmp_path) if int(e["PRIORITY"]) <= 2]
    assert crit in (["incident-opened"], ["incident-escalated"]), crit
    assert m[("ds_ops_critical_incidents_total", model)] == again[("ds_ops_critical_incidents_total", model)] == 1


def test_a_file_for_a_model_without_current_is_refused_to_failed_and_the_daemon_serves_on(tmp_path):
    with service(tmp_path) as d:
        pid = d.proc.pid
        drop(spool_dir(tmp_path, "score"), "nomodel.csv", b"1,2\n3,4\n")
        d.wait_until(lambda: "nomodel.csv" in failed_names(tmp_path), "the file refused")
        err = read_json(spool_dir(tmp_path, "failed") / "nomodel.csv.error.json")
        assert "has no current version" in err["reason"] and err["stage"], err
        assert err["drop"] == "score" and err["uploader_uid"] == ALICE
        drop(spool_dir(tmp_path, "score"), "again.csv", b"1,2\n")
        d.wait_until(lambda: "again.csv" in failed_names(tmp_path), "a second one refused")
        assert d.proc.pid == pid and "intake paused" not in d.log()
        r = subprocess.run([sys.executable, "-m", "opt_ds_ops.cli", "requeue", "again.csv", "--config", str(d.conf)],
                           capture_output=True, text=True, env=base_env(), cwd=REPO, timeout=120)
        assert r.returncode == 0 and "-> score/again.csv" in r.stdout, r.stdout + r.stderr  # back to score/, not training
        d.wait_until(lambda: "again.csv" in failed_names(tmp_path), "the requeued file refused again")
        assert not (tmp_path / "models").exists() or not os.listdir(tmp_path / "models")
    failed = [e for e in journal(tmp_path) if EVENT[e["MESSAGE_ID"]] == "job-failed"]
    assert len(failed) == 3 and all(e["PRIORITY"] == "3" for e in failed)


def test_hostile_entries_in_score_are_handled_as_in_incoming(tmp_path):
    score = spool_dir(tmp_path, "score")
    with service(tmp_path) as d:
        pid = d.proc.pid
        drop(score, "secret.csv", b"1,2\n", uid=BOB, mode=0o600)  # not readable by the service
        os.mkfifo(score / "pipe.csv")
        elsewhere = tmp_path / "bob-owns-this.csv"
        elsewhere.write_bytes(b"1,2\n")
        os.chown(elsewhere, BOB, os.getgid())
        os.link(elsewhere, score / "linked.csv")
        d.wait_until(lambda: {"secret.csv", "linked.csv"} <= failed_names(tmp_path), "both refused")
        d.wait_until(lambda: "pipe.csv" in d.log() or any("pipe.csv" in e["MESSAGE"] for e in journal(tmp_path)),
                     "the FIFO reported")
        assert "unreadable" in read_json(spool_dir(tmp_path, "failed") / "secret.csv.error.json")["reason"]
        assert "hard links" in read_json(spool_dir(tmp_path, "failed") / "linked.csv.error.json")["reason"]
        assert (score / "pipe.csv").exists() and elsewhere.read_bytes() == b"1,2\n"
        drop(score, "squat.yaml", b"model: bobs\n", uid=BOB)  # BOB's sidecar for ALICE's file: never applied
        drop(score, "squat.csv", b"1,2\n", uid=ALICE)
        d.wait_until(lambda: {"squat.yaml", "squat.csv"} <= failed_names(tmp_path), "the squatted pair refused")
        side = read_json(spool_dir(tmp_path, "failed") / "squat.yaml.error.json")
        assert "score/squat.yaml belongs to" in side["reason"] and side["drop"] == "score"
        reason = read_json(spool_dir(tmp_path, "failed") / "squat.csv.error.json")["reason"]
        print(f"\nALICE's chunk: {reason}")
        # neither BOB's model nor its file name's (before: "model squat has no current version", or scored by a
        # model of that name): it fails saying why, and ALICE drops it again with a sidecar of her own
        assert "score/squat.yaml belongs to another member" in reason and "not scored under its file name" in reason
        assert d.proc.pid == pid
    (ignored,) = [e for e in journal(tmp_path) if EVENT[e["MESSAGE_ID"]] == "entry-ignored"]
    assert "score/pipe.csv is a FIFO" in ignored["MESSAGE"] and ignored["PRIORITY"] == "4"


@pytest.mark.recovery
def test_a_daemon_killed_while_scoring_scores_the_file_again_once(tmp_path):
    rows = np.tile(smd(2000, 0), (15, 1))  # 30,000 rows: long enough to be killed while it is scored
    d = start(tmp_path)
    try:
        train(d, tmp_path)
        chunk(d, tmp_path, "big", rows)

        def scoring() -> bool:
            for job in spool_dir(tmp_path, "processing").iterdir():
                with contextlib.suppress(OSError, ValueError):
                    r = read_json(job / "job.json")
                    if r.get("kind") == "score" and r.get("state") == "running":
                        return True
            return False

        d.wait_until(scoring, "the file being scored", poll_s=0.01)
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait(30)
    finally:
        d.kill()
    assert not results(tmp_path), "killed before its results were written"
    with service(tmp_path) as d:
        d.wait_until(lambda: len(results(tmp_path)) == 1 and not os.listdir(spool_dir(tmp_path, "processing")),
                     "the file scored after the restart")
        chunk(d, tmp_path, "next", smd(100, 0))
        # the job's end, not its result: the result directory is in place before state.json is replaced,
        # and a stop between the two leaves the old state for the restart to redo (scoring/job.py)
        d.wait_until(lambda: len(results(tmp_path)) == 2 and not os.listdir(spool_dir(tmp_path, "processing")),
                     "the next chunk scored")
    (big, after) = results(tmp_path)
    assert (big["source"], big["rows"], big["first_row"]) == ("big.csv", 30000, 0)
    assert after["first_row"] == 30000  # the series advanced once, not twice
    assert read_json(tmp_path / "scores" / "m" / "state.json")["rows_scored"] == 30100
    assert not [p for p in (tmp_path / "scores" / "m").iterdir() if p.name.startswith(".")], "no half result"


def test_results_past_their_retention_are_removed_but_the_newest_and_state_json_stay(tmp_path):
    with service(tmp_path, "  results_max_bytes: 1") as d:
        train(d, tmp_path)
        for i in range(3):
            chunk(d, tmp_path, f"r{i}", smd(200, 200 * i))
            d.wait_until(lambda i=i: events(tmp_path).count("scored") == i + 1, f"chunk {i} scored")
        d.wait_until(lambda: events(tmp_path).count("results-pruned") == 2, "two results pruned")
    left = [p.name for p in (tmp_path / "scores" / "m").iterdir()]
    assert "state.json" in left and "history.npz" in left and len(left) == 3  # the history is bounded apart
    assert results(tmp_path)[0]["source"] == "r2.csv"
    pruned = [e for e in journal(tmp_path) if EVENT[e["MESSAGE_ID"]] == "results-pruned"]
    assert all(e["DS_RESULTS"].startswith("m/") and e["PRIORITY"] == "6" for e in pruned)
