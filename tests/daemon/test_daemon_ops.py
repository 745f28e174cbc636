"""What an operator runs around the daemon, against real daemon processes and real
files: Prometheus textfile metrics, keep_versions pruning after jobs, retention of done/, requeue
of a fixed dataset, a later success clearing "latest failed", the liveness and epoch shown by
``ds-ops status``, a reload that says what changed, ``check-config``, ``status`` with a broken
conffile."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import REPO, SMD_TRAIN, run_cli
from daemon_kit import (Daemon, copy_smd, done_names, failed_names, prom_samples, run_until, spool_dir, versions,
                        write_config)
from opt_ds_ops.observe.metrics import METRIC_NAMES

NAME_RULE = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")  # Prometheus's metric name rule


def started(d: Daemon) -> None:
    d.wait_until(lambda: "ds-trainer ready" in d.log(), "the daemon to be ready", timeout_s=120)


def smd_without_rows(dest, n: int) -> None:
    """Write the bundled SMD file less its first n rows to dest (gzip): other bytes, the same model."""
    import gzip

    lines = gzip.decompress(SMD_TRAIN.read_bytes()).splitlines(keepends=True)
    dest.write_bytes(gzip.compress(b"".join(lines[n:]), mtime=0))


def test_metrics_pruning_and_retention_after_real_jobs(tmp_path):
    prom = tmp_path / "node-exporter"
    prom.mkdir()
    smd_bytes = SMD_TRAIN.stat().st_size
    conf = write_config(tmp_path, extra=[
        f"  done_max_bytes: {smd_bytes + 20000}",  # done/ holds one SMD file with its JSON, not two
        "store:", "  keep_versions: 2", "metrics:", f"  textfile_dir: {prom}"])
    d = Daemon(conf)
    try:
        started(d)
        for n in range(1, 4):  # the same model three times, from three files (the same bytes train once)
            smd_without_rows(spool_dir(tmp_path, "incoming") / "m.txt.gz", n)
            d.wait_until(lambda: f"{n} versions" if len(versions(tmp_path, "m")) == min(n, 2) and
                         (prom / "ds_ops.prom").exists() and
                         prom_samples(prom / "ds_ops.prom").get(("ds_ops_jobs_finished_total", (("result", "done"),))) == n
                         else None, f"job {n} and its metrics")
        (spool_dir(tmp_path, "incoming") / "bad.csv").write_text("1,2\n")
        d.wait_until(lambda: failed_names(tmp_path) == {"bad.csv"}, "the bad file")
        d.wait_until(lambda: prom_samples(prom / "ds_ops.prom").get(("ds_ops_jobs_finished_total", (("result", "failed"),)))
                     == 1, "the failure in the metrics")
        assert d.stop()[0] == 0
    finally:
        d.kill()
    log = d.log()
    assert f"Prometheus metrics: {prom / 'ds_ops.prom'}" in log
    assert log.count("removed: the model keeps its newest 2 versions") == 1
    assert len(versions(tmp_path, "m")) == 2
    for v in versions(tmp_path, "m"):  # report.png beside each version the job saved
        assert (tmp_path / "models" / "m" / v / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert done_names(tmp_path) == {"m.txt.gz"}, "done/ keeps only what fits done_max_bytes"
    last = json.loads((spool_dir(tmp_path, "done") / "m.txt.gz.result.json").read_text())
    assert last["version"] == versions(tmp_path, "m")[-1], "the newest one stays"
    assert log.count("past the retention of done/") == 2
    got = prom_samples(prom / "ds_ops.prom")
    names = {name for name, _ in got}
    families = {f.name for f in text_string_to_metric_families((prom / "ds_ops.prom").read_text())}
    assert all(NAME_RULE.match(n) for n in names)
    counters = {f + "_total" for f in families}  # the parser names a counter's family without _total
    assert families | counters >= set(METRIC_NAMES) - {"ds_ops_gpu_health"}  # no GPU here: no health samples
    assert got[("ds_ops_model_versions", (("model", "m"),))] == 2
    assert got[("ds_ops_model_threshold", (("model", "m"),))] > 0
    assert 0 < got[("ds_ops_model_age_seconds", (("model", "m"),))] < 3600
    assert got[("ds_ops_job_running", ())] == 0 and got[("ds_ops_queued_datasets", ())] == 0
    assert got[("ds_ops_last_training_samples_per_second", ())] > 0
    assert got[("ds_ops_last_failure_timestamp_seconds", ())] >= got[("ds_ops_last_success_timestamp_seconds", ())]
    assert [k for k in got if k[0] == "ds_ops_build_info"][0][1][2] == ("version", "0.1.0")
    assert oct((prom / "ds_ops.prom").stat().st_mode & 0o777) == "0o644"
    assert sorted(os.listdir(prom)) == ["ds_ops.prom"], "no temporary file is left beside it"


def test_the_same_bytes_dropped_again_are_noticed_and_not_trained_twice(tmp_path):
    conf = write_config(tmp_path)
    incoming = spool_dir(tmp_path, "incoming")
    d = Daemon(conf)
    try:
        started(d)
        copy_smd(incoming / "m.txt.gz")
        d.wait_until(lambda: done_names(tmp_path) == {"m.txt.gz"}, "the first job")
        (v1,) = versions(tmp_path, "m")
        copy_smd(incoming / "m.txt.gz")  # the same bytes again
        d.wait_until(lambda: "not trained again" in d.log() and not any(spool_dir(tmp_path, "processing").iterdir()),
                     "the duplicate noticed")
        write_config(tmp_path, epochs=2)  # another train: configuration: the same bytes train again
        d.proc.send_signal(signal.SIGHUP)
        d.wait_until(lambda: "configuration reloaded" in d.log(), "the reload")
        copy_smd(incoming / "m.txt.gz")
        d.wait_until(lambda: len(versions(tmp_path, "m")) == 2 and not any(spool_dir(tmp_path, "processing").iterdir()),
                     "a version of the new configuration")
        assert d.stop()[0] == 0
    finally:
        d.kill()
    sha = json.loads((spool_dir(tmp_path, "done") / "m.txt.gz.result.json").read_text())["sha256"]
    line = [x for x in d.log().splitlines() if "not trained again" in x]
    assert len(line) == 1 and line[0].endswith(
        f"notice: m.txt.gz: the same bytes (sha256 {sha[:12]}), dataset options and train: configuration as "
        f"{tmp_path / 'models' / 'm' / v1} (trained from m.txt.gz at "
        f"{json.loads((tmp_path / 'models' / 'm' / v1 / 'metadata.json').read_text())['ended_at']}); not trained "
        "again; dataset in done/m.txt.gz.1 (its result says duplicate_of). To train it again, change train: or "
        "the sidecar, or remove that version (ds-ops models rm)")
    # nothing dropped is lost: the duplicate is in done/ with a result that names the version it repeats
    assert done_names(tmp_path) == {"m.txt.gz", "m.txt.gz.1", "m.txt.gz.2"}
    dup = json.loads((spool_dir(tmp_path, "done") / "m.txt.gz.1.result.json").read_text())
    assert dup["duplicate_of"] == str(tmp_path / "models" / "m" / v1) and dup["sha256"] == sha
    assert "duplicate_of" not in json.loads((spool_dir(tmp_path, "done") / "m.txt.gz.2.result.json").read_text())
    assert failed_names(tmp_path) == set()


@pytest.mark.recovery
def test_the_last_results_survive_a_restart_for_staleness_alerts(tmp_path):
    prom = tmp_path / "node-exporter"
    prom.mkdir()
    conf = write_config(tmp_path, extra=["metrics:", f"  textfile_dir: {prom}"])
    last = [name for name in METRIC_NAMES if name.startswith("ds_ops_last_") and "scored" not in name]
    d = Daemon(conf)
    try:
        started(d)
        copy_smd(spool_dir(tmp_path, "incoming") / "m.txt.gz")
        (spool_dir(tmp_path, "incoming") / "bad.csv").write_text("1,2\n")
        d.wait_until(lambda: all((n, ()) in prom_samples(prom / "ds_ops.prom") for n in last) or None,
                     "a success and a failure in the metrics", timeout_s=120)
        assert d.stop()[0] == 0
    finally:
        d.kill()
    before = prom_samples(prom / "ds_ops.prom")
    d = Daemon(conf)  # a restart: no job since
    try:
        started(d)
        d.wait_until(lambda: prom_samples(prom / "ds_ops.prom")[("ds_ops_daemon_start_time_seconds", ())]
                     > before[("ds_ops_daemon_start_time_seconds", ())] or None, "the new daemon's metrics")
        after = prom_samples(prom / "ds_ops.prom")
        assert d.stop()[0] == 0
    finally:
        d.kill()
    assert len(last) == 5 and {n: after.get((n, ())) for n in last} == {n: before[(n, ())] for n in last}
    assert after[("ds_ops_jobs_finished_total", (("result", "done"),))] == 0  # counters count since the start


def test_metrics_are_off_with_one_line_when_the_directory_is_absent(tmp_path):
    conf = write_config(tmp_path, extra=["metrics:", f"  textfile_dir: {tmp_path / 'absent'}"])
    d = Daemon(conf)
    try:
        started(d)
        copy_smd(spool_dir(tmp_path, "incoming") / "m.txt.gz")
        d.wait_until(lambda: done_names(tmp_path) == {"m.txt.gz"}, "the job")
        assert d.stop()[0] == 0
    finally:
        d.kill()
    assert d.log().count("Prometheus metrics off:") == 1
    assert f"{tmp_path / 'absent'} does not exist" in d.log()
    assert not (tmp_path / "absent").exists()


def test_requeue_after_a_fix_trains_it_and_a_later_success_clears_latest_failed(tmp_path, smd_rows):
    conf = write_config(tmp_path)
    incoming = spool_dir(tmp_path, "incoming")
    d = Daemon(conf)
    try:
        started(d)
        (incoming / "fixme.yaml").write_text("name: fixed-model\n")
        (incoming / "fixme.csv").write_text("1,2\n")
        (incoming / "again.csv").write_text("3\n")
        d.wait_until(lambda: failed_names(tmp_path) == {"fixme.csv", "fixme.csv.sidecar.yaml", "again.csv"},
                     "both failures (one with its sidecar)", timeout_s=60)
        st = json.loads(run_cli("status", "--config", str(conf), "--json").stdout)
        assert {f["dataset"] for f in st["recent_failed"]} == {"fixme.csv", "again.csv"}
        np.savetxt(spool_dir(tmp_path, "failed") / "fixme.csv", smd_rows[:3000], delimiter=",", fmt="%.6f")
        r = run_cli("requeue", "fixme.csv", "--config", str(conf))
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == ("failed/fixme.csv -> incoming/fixme.csv with its sidecar fixme.yaml; "
                                    "the daemon takes it next")
        d.wait_until(lambda: done_names(tmp_path) == {"fixme.csv", "fixme.csv.sidecar.yaml"}, "the requeued dataset",
                     timeout_s=60)
        np.savetxt(incoming / "again.csv", smd_rows[:3000], delimiter=",", fmt="%.6f")  # dropped again, fixed
        d.wait_until(lambda: "again.csv" in done_names(tmp_path), "the fixed drop", timeout_s=60)
        assert d.stop()[0] == 0
    finally:
        d.kill()
    assert versions(tmp_path, "fixed-model"), "the sidecar came back with it"
    assert failed_names(tmp_path) == {"again.csv"}
    r = run_cli("status", "--config", str(conf), "--json")
    st = json.loads(r.stdout)
    assert st["recent_failed"] == [] and (st["failed_count"], st["failed_open"]) == (1, 0)
    r = run_cli("status", "--config", str(conf))
    assert "latest failed" not in r.stdout
    for last in ([], ["--last", "0"]):  # the headline counts what needs an operator, past --last too
        r = run_cli("status", "--config", str(conf), *last)
        assert r.stdout.splitlines()[0].endswith("2 done, 0 failed (1 more in failed/, trained since)"), r.stdout
    r = run_cli("requeue", "nope.csv", "--config", str(conf))
    assert r.returncode == 1
    assert r.stderr.strip() == "ds-ops: error: failed/nope.csv does not exist (ds-ops status lists the latest failures)"


def test_status_shows_the_running_job_alive_with_its_epoch_and_time_left(tmp_path):
    conf = write_config(tmp_path, epochs=400, batch_size=64)
    d = Daemon(conf)
    try:
        started(d)
        copy_smd(spool_dir(tmp_path, "incoming") / "long.txt.gz")

        def at_epoch_2():
            r = run_cli("status", "--config", str(conf), "--json")
            jobs = json.loads(r.stdout)["processing"] if r.returncode == 0 else []
            return jobs and jobs[0].get("epoch", 0) >= 2 and jobs[0]
        job = d.wait_until(at_epoch_2, "epoch 2 of the long job", poll_s=1)
        assert job["daemon_alive"] is True and job["pid_start"] and job["time_left_s"] > 0
        r = run_cli("status", "--config", str(conf))
        assert re.search(r"long\.txt\.gz  job \S+: training epoch \d+/400 loss [0-9.e-]+, about \d+ s left on cpu, "
                         rf"daemon pid {d.proc.pid}", r.stdout), r.stdout
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait(30)
        r = run_cli("status", "--config", str(conf))
        assert "daemon not running it now" in r.stdout
    finally:
        d.kill()


def test_a_reload_says_what_changed_and_check_config_refuses_a_broken_conffile(tmp_path):
    conf = write_config(tmp_path, epochs=1)
    d = Daemon(conf)
    try:
        started(d)
        write_config(tmp_path, epochs=3, extra=["metrics:", f"  textfile_dir: {tmp_path}"])
        r = run_cli("check-config", "--config", str(conf))
        assert (r.returncode, r.stdout.splitlines()[0]) == (0, f"{conf}: ok")
        d.proc.send_signal(signal.SIGHUP)
        d.wait_until(lambda: "configuration reloaded" in d.log(), "the reload")
        assert d.stop()[0] == 0
    finally:
        d.kill()
    assert (f"configuration reloaded from {conf} (metrics.textfile_dir stays '/var/lib/prometheus/node-exporter' "
            "until a restart): train.epochs 1 -> 3\n") in d.log()
    conf.write_text(conf.read_text().replace("epochs: 3", "epochs: twenty"))
    r = run_cli("check-config", "--config", str(conf))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    line = conf.read_text().splitlines().index("  epochs: twenty") + 1  # the README promises line and column
    assert r.stderr.strip() == (f"ds-ops: error: {conf}: line {line}, column 3: key 'train.epochs' must be an integer "
                                ">= 1 (int), got 'twenty'")


def test_requeue_takes_the_model_name_as_every_other_command_does(tmp_path):
    failed, incoming = spool_dir(tmp_path, "failed"), spool_dir(tmp_path, "incoming")
    for d in (failed, incoming, spool_dir(tmp_path, "score")):
        d.mkdir(parents=True)

    def failure(name: str, dropped: str, sidecar: str | None = None) -> None:  # as the daemon leaves them
        (failed / name).write_text("1,2\n")
        (failed / f"{name}.error.json").write_text(json.dumps({"job_id": "j", "dataset": dropped, "stage": "dataset"}))
        if sidecar is not None:
            (failed / f"{name}.sidecar.yaml").write_text(sidecar)

    failure("machine-1-2.txt.gz", "machine-1-2.txt.gz")
    failure("bad.csv", "bad.csv", "name: disk-latency\n")
    failure("twice.csv", "twice.csv")
    failure("twice.csv.1", "twice.csv")
    spool = ["--spool-dir", str(tmp_path / "spool")]
    r = run_cli("requeue", "machine-1-2", *spool)  # the stem, as ds-ops models and score take it
    assert (r.returncode, r.stdout.strip()) == (0, "failed/machine-1-2.txt.gz -> incoming/machine-1-2.txt.gz; "
                                                   "the daemon takes it next"), r.stderr
    r = run_cli("requeue", "disk-latency", *spool)  # the name its sidecar gave the model
    assert (r.returncode, r.stdout.strip()) == (0, "failed/bad.csv -> incoming/bad.csv with its sidecar bad.yaml; "
                                                   "the daemon takes it next"), r.stderr
    r = run_cli("requeue", "twice", *spool)
    assert (r.returncode, r.stderr.strip()) == (1, "ds-ops: error: 2 files in failed/ are of model twice: twice.csv, "
                                                   "twice.csv.1; requeue one by its file name")
    r = run_cli("requeue", "twice.csv.1", *spool)  # the file name still works
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(incoming)) == ["bad.csv", "bad.yaml", "machine-1-2.txt.gz", "twice.csv"]
    assert sorted(os.listdir(failed)) == ["twice.csv", "twice.csv.error.json"]
    # the store's spelling of a name finds it; another uploader's sidecar names no model of this file
    failure("spaced.csv", "spaced.csv", "name: Disk Latency\n")
    failure("mallory.csv", "mallory.csv", "name: gpu01\n")
    os.chown(failed / "mallory.csv.sidecar.yaml", 12345, 12345)
    r = run_cli("requeue", "Disk_Latency", *spool)
    assert r.returncode == 0 and "failed/spaced.csv -> incoming/spaced.csv" in r.stdout, r.stderr
    r = run_cli("requeue", "gpu01", *spool)
    assert r.returncode == 1 and "failed/gpu01 does not exist" in r.stderr, r.stderr


def test_status_works_with_a_broken_conffile(tmp_path):
    conf = write_config(tmp_path, extra=["bogus_key: 1"])
    spool_dir(tmp_path, "incoming").mkdir(parents=True)
    (spool_dir(tmp_path, "incoming") / "waiting.csv").write_text("1,2\n3,4\n")
    r = run_cli("status", "--config", str(conf))
    assert r.returncode == 0, r.stderr
    assert "queued  waiting.csv" in r.stdout and f"spool {tmp_path / 'spool'}:" in r.stdout
    line = conf.read_text().splitlines().index("bogus_key: 1") + 1
    assert r.stderr.startswith(f"ds-ops: warning: {conf}: line {line}, column 1: unknown key 'bogus_key'")


def test_status_follow_prints_again_until_interrupted(tmp_path):
    import subprocess
    import sys

    from conftest import REPO
    from daemon_kit import base_env

    spool_dir(tmp_path, "incoming").mkdir(parents=True)
    p = subprocess.Popen([sys.executable, "-m", "opt_ds_ops.cli", "status", "--spool-dir", str(tmp_path / "spool"),
                          "--json", "--follow", "--interval", "0.2"], cwd=REPO, env=base_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = json.loads(p.stdout.readline())
        (spool_dir(tmp_path, "incoming") / "new.csv").write_text("1,2\n3,4\n")
        while "new.csv" not in (doc := json.loads(p.stdout.readline()))["queue"]:
            pass
    finally:
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=30)  # drains stdout too: a full pipe never holds its exit
    assert first["queue"] == [] and doc["queue"] == ["new.csv"]
    assert p.returncode == 130 and err.strip() == "ds-ops: interrupted"


def test_a_metrics_write_that_fails_is_reported_once_per_reason(tmp_path):
    from opt_ds_ops.observe.metrics import MetricsWriter

    prom = tmp_path / "prom"
    prom.mkdir()
    m = MetricsWriter(str(prom), str(tmp_path / "models"))
    assert m.enabled and m.write() is None and (prom / "ds_ops.prom").exists()
    (prom / "ds_ops.prom").unlink()
    prom.rmdir()  # node-exporter removed while the daemon runs
    first = m.write()
    assert first.startswith(f"cannot write {prom / 'ds_ops.prom'}: ") and "No such file or directory" in first
    assert m.write() == ""  # the same reason again: nothing new to log
    prom.mkdir()
    assert m.write() is None and (prom / "ds_ops.prom").exists()


KILLED_METRICS_WRITE = """
import os, sys, time
from opt_ds_ops.observe.metrics import MetricsWriter

def stall(fd):  # the write is killed here: its temporary file written, not yet renamed
    print("writing", flush=True)
    time.sleep(60)

os.fsync = stall
MetricsWriter(sys.argv[1], sys.argv[2]).write()
"""


@pytest.mark.recovery
def test_a_metrics_write_killed_before_its_rename_leaves_nothing_after_the_next_start(tmp_path):
    prom = tmp_path / "prom"
    prom.mkdir()
    (prom / ".tmp-apt.prom").write_text("# another collector's write in progress\n")
    p = subprocess.Popen([sys.executable, "-c", KILLED_METRICS_WRITE, str(prom), str(tmp_path / "models")],
                         stdout=subprocess.PIPE, text=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert p.stdout.readline().strip() == "writing"
    p.kill()
    p.wait(30)
    assert len(os.listdir(prom)) == 2  # the killed write's temporary file beside the other collector's
    conf = write_config(tmp_path, extra=["metrics:", f"  textfile_dir: {prom}"])
    run_until(conf, lambda: (prom / "ds_ops.prom").exists(), "the first metrics write")
    assert sorted(os.listdir(prom)) == [".tmp-apt.prom", "ds_ops.prom"]
