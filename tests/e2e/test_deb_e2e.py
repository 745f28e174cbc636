"""End-to-end: the built ds-ops .deb in a real Debian 12 booted with systemd 252 (``make e2e``).

One container per run; the tests run in file order and each builds on the previous one, in the
order of docs/INSTALL.md: offline install, the unit enabled and active with its resource limits,
ds-trainer-nvidia.service before it (skipped without nvidia-modprobe, never in the way), a dataset
dropped by a member of group ds-ops becomes a model and a journal record, a bad file goes to
failed/ (``journalctl -x`` explains it with the package's message catalog), a directory and a FIFO
in incoming/ are reported and left alone, restart and SIGKILL are survived, purge leaves nothing
behind. Needs root; the .deb comes from DS_OPS_DEB.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from nspawn import Container, cached_rootfs
from opt_ds_ops.observe.journal import MESSAGE_IDS

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
UNIT = "ds-trainer.service"
NVIDIA_UNIT = "ds-trainer-nvidia.service"   # nvidia-modprobe before each start of UNIT
MEMORY_MAX_PERCENT = 75                  # the unit's MemoryMax=75% (of the RAM systemd sees)
TASKS_MAX = 4096
SPOOL = "/var/spool/ds-ops"
MODELS = "/var/models"
DATASET = "machine-1-2.txt.gz"          # bundled real SMD data, bound read-only at /srv/smd
MODEL = "machine-1-2"
USER = "alice"                           # a member of group ds-ops, not root
BIG = f"/home/{USER}/big.txt.gz"
TRAIN_TIMEOUT_S = 300
JOURNAL_FIELDS = ("DS_DATASET", "DS_EPOCH", "DS_LOSS", "DS_MODEL_DIR")
UPGRADE_DIR = REPO / "build/e2e/upgrade"


@pytest.fixture(scope="module")
def deb() -> Path:
    """The .deb under test (make e2e passes the one make deb built)."""
    if os.geteuid() != 0:
        pytest.fail("the end-to-end test boots a container: run it as root")
    path = Path(os.environ.get("DS_OPS_DEB", "")).resolve()
    if not path.is_file():
        pytest.fail(f"DS_OPS_DEB={os.environ.get('DS_OPS_DEB')!r} is not a built .deb (make deb)")
    return path


@pytest.fixture(scope="module")
def box(deb):
    """A booted Debian 12 container with the .deb's directory at /srv/debs, SMD at /srv/smd and
    UPGRADE_DIR (for the next version's .deb) at /srv/upgrade."""
    tarball = cached_rootfs(deb)
    shutil.rmtree(UPGRADE_DIR, ignore_errors=True)
    UPGRADE_DIR.mkdir(parents=True)
    c = Container(tarball, {deb.parent: "/srv/debs", REPO / "data/smd/train": "/srv/smd", UPGRADE_DIR: "/srv/upgrade"},
                  log_dir=REPO / "build/e2e")
    print(f"container {c.name}: extracted in {c.timings['extract_s']:.1f} s, booted in {c.timings['boot_s']:.1f} s")
    yield c
    c.save_journal()
    c.stop()
    shutil.rmtree(UPGRADE_DIR, ignore_errors=True)


def show(box: Container, prop: str, unit: str = UNIT) -> str:
    """Return one property of the unit (systemctl show -p PROP --value)."""
    return box.run(["systemctl", "show", "-p", prop, "--value", unit]).stdout.strip()


def journal(box: Container, *matches: str) -> list[dict]:
    """Return the unit's journal entries (journalctl -o json), optionally filtered by FIELD=value."""
    out = box.run(["journalctl", "-u", UNIT, "-o", "json", "--no-pager", *matches]).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def catalog_entry(event: str) -> list[str]:
    """Return the lines of event's entry in debian/ds-ops.catalog (the package installs it in
    /usr/lib/systemd/catalog/), as journalctl -x prints them before the placeholders are filled."""
    text = (REPO / "debian/ds-ops.catalog").read_text(encoding="utf-8")
    m = re.search(rf"^-- {MESSAGE_IDS[event]}\n(.*?)(?=^-- [0-9a-f]{{32}}|\Z)", text, re.M | re.S)
    assert m, f"no catalog entry for {event}"
    return [line for line in m.group(1).strip().splitlines() if not line.startswith(("#", ";"))]


def drop(box: Container, source: str, name: str) -> None:
    """As USER, put source into incoming/ the documented way: write a .part file, then rename."""
    box.run(f"cp {source} {SPOOL}/incoming/{name}.part && mv {SPOOL}/incoming/{name}.part {SPOOL}/incoming/{name}",
            user=USER)


def versions(box: Container, model: str) -> list[str]:
    """Return the model's version directories (no hidden temporaries, no 'current')."""
    r = box.run(["ls", "-1", f"{MODELS}/{model}"], check=False)
    return sorted(v for v in r.stdout.split() if v != "current" and not v.startswith("."))


def wait_model(box: Container, model: str, count: int) -> None:
    """Wait until the model has count versions and current/ points at a complete one."""
    box.wait_for(f"test -f {MODELS}/{model}/current/model.pt && test -f {MODELS}/{model}/current/metadata.json "
                 f"&& test $(ls -1 {MODELS}/{model} | grep -v -e '^current$' -e '^\\.' | wc -l) -ge {count}",
                 TRAIN_TIMEOUT_S, f"version {count} of model {model}")


def make_big_dataset(box: Container) -> None:
    """As USER, write BIG: the SMD file 8 times over (190k rows), so a job takes seconds, not one."""
    box.run(f"for i in 1 2 3 4 5 6 7 8; do zcat /srv/smd/{DATASET}; done | gzip -1 > {BIG}", user=USER)


def job_dir_of(name: str) -> str:
    """Return a shell expression for the job directory (processing/<job id>/) of dataset name."""
    return (f"$(dirname \"$(grep -l -F '\"dataset\": \"{name}\"' {SPOOL}/processing/*/job.json "
            f"2>/dev/null | head -n1)\")")


def wait_training(box: Container, name: str) -> dict:
    """Wait until the job of dataset name runs in its training stage (its record in
    processing/<job id>/job.json says so); return that record."""
    r = box.wait_for(f"d={job_dir_of(name)}; grep -q '\"state\": \"running\"' \"$d/job.json\" && "
                     f"grep -q '\"stage\": \"training\"' \"$d/job.json\" && cat \"$d/job.json\"", 120,
                     f"the job of {name} to train", interval_s=0.1)
    return json.loads(r.stdout)


def unit_processes(box: Container) -> dict[int, dict]:
    """Return {pid: /proc/PID/status fields} for every process in the unit's control group (read
    from /proc/PID/cgroup: this container may have the legacy cgroup hierarchy or the unified one)."""
    pattern = show(box, "ControlGroup").replace(".", "[.]")     # /system[.]slice/ds-trainer[.]service
    out = box.run(f"for f in $(grep -l -E ':{pattern}$' /proc/[0-9]*/cgroup 2>/dev/null); do p=${{f#/proc/}}; "
                  f"p=${{p%/cgroup}}; echo \"PID $p\"; cat /proc/$p/status 2>/dev/null; done").stdout
    procs: dict[int, dict] = {}
    current: dict = {}
    for line in out.splitlines():
        if line.startswith("PID "):
            current = procs.setdefault(int(line.split()[1]), {})
        elif ":" in line:
            key, value = line.split(":", 1)
            current[key] = value.strip()
    return {pid: fields for pid, fields in procs.items() if fields}


def assert_nothing_lost(box: Container, models: list[str]) -> None:
    """Each model has exactly one version; incoming/ and processing/ are empty; no hidden leftovers."""
    for model in models:
        assert len(versions(box, model)) == 1, (model, versions(box, model))
        listing = box.run(["ls", "-A", f"{MODELS}/{model}"]).stdout.split()
        store_own = {".current.log", ".lock", ".operator.json"}  # the store's record and lock, not leftovers
        assert sorted(e for e in listing if e not in store_own) == sorted(versions(box, model) + ["current"]), listing
    box.wait_for(f"test -z \"$(find {SPOOL}/incoming {SPOOL}/processing -mindepth 1)\"", 10,
                 "empty incoming/ and processing/")
    assert box.run(["ls", f"{SPOOL}/done"]).stdout.split().count(DATASET) == 1


def test_installs_offline_with_apt(box, deb):
    box.run(["test", "!", "-e", "/usr/sbin/policy-rc.d"])
    assert box.run(["ls", "/sys/class/net"]).stdout.split() == ["lo"], "the container must have no network"
    started = time.monotonic()
    box.run(f"cd /srv/debs && apt-get install -y -q --no-install-recommends ./{deb.name}", timeout=900)
    print(f"apt install: {time.monotonic() - started:.1f} s")
    assert box.run(["dpkg-query", "-W", "-f", "${Status}", "ds-ops"]).stdout == "install ok installed"


def test_runs_debians_python(box):
    assert box.run(["readlink", "-f", "/opt/ds-ops/bin/python3"]).stdout.strip().startswith("/usr/bin/python3")
    assert box.run(["head", "-n1", "/opt/ds-ops/bin/ds-ops"]).stdout.strip() == "#!/opt/ds-ops/bin/python"
    out = box.run(["ds-ops", "--version"]).stdout
    assert out.startswith("ds-ops "), out


def test_account_and_directories(box):
    assert box.run(["getent", "passwd", "ds-ops"]).stdout.split(":")[6].strip() == "/usr/sbin/nologin"
    box.run(["getent", "group", "ds-ops"])
    stat = {line.split()[0]: line.split()[1:] for line in box.run(
        ["stat", "-c", "%n %a %U %G", SPOOL, *(f"{SPOOL}/{d}" for d in ("incoming", "score", "processing", "done",
                                                                          "failed")),
         MODELS, "/etc/ds-ops/trainer.yaml", "/opt/ds-ops", "/var/lib/ds-ops/scores"]).stdout.splitlines()}
    assert stat[SPOOL] == ["750", "ds-ops", "ds-ops"]
    assert stat[f"{SPOOL}/incoming"] == stat[f"{SPOOL}/score"] == ["3770", "ds-ops", "ds-ops"]  # score/ as incoming/
    assert stat["/var/lib/ds-ops/scores"] == ["2750", "ds-ops", "ds-ops"]
    box.run(["test", "-f", "/usr/share/doc/ds-ops/examples/ds-ops.rules.yml"])
    # the puller's account: its own uid, a member of group ds-ops; its unit shipped disabled, valid
    assert box.run(["getent", "passwd", "ds-pull"]).stdout.split(":")[6].strip() == "/usr/sbin/nologin"
    assert "ds-ops" in box.run(["id", "-nG", "ds-pull"]).stdout.split()
    box.run(["ds-ops", "check-config", "--source", "/usr/share/doc/ds-ops/examples/node-exporter.source.yaml"])
    verify = box.run(["systemd-analyze", "verify", "ds-pull@node.service"], check=False)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert box.run(["systemctl", "is-enabled", "ds-pull@node.service"], check=False).stdout.strip() != "enabled"
    for d in ("processing", "done", "failed"):
        assert stat[f"{SPOOL}/{d}"] == ["2750", "ds-ops", "ds-ops"]
    assert stat[MODELS] == ["2750", "ds-ops", "ds-ops"]
    assert stat["/etc/ds-ops/trainer.yaml"] == ["644", "root", "root"]
    assert stat["/opt/ds-ops"] == ["755", "root", "root"]
    world_writable = box.run(["find", "/opt/ds-ops", "/etc/ds-ops", SPOOL, MODELS, "/usr/bin/ds-ops",
                              "!", "-type", "l", "-perm", "-o+w"]).stdout
    assert world_writable == ""
    conffiles = box.run(["cat", "/var/lib/dpkg/info/ds-ops.conffiles"]).stdout.split()
    assert conffiles == ["/etc/ds-ops/trainer.yaml"]


def test_unit_enabled_active_and_verified(box):
    assert box.run(["systemctl", "is-enabled", UNIT]).stdout.strip() == "enabled"
    assert box.run(["systemctl", "is-active", UNIT], check=False).stdout.strip() == "active", \
        box.run(["systemctl", "status", "--no-pager", UNIT], check=False).stdout
    assert show(box, "User") == "ds-ops"
    for unit in (UNIT, NVIDIA_UNIT):
        r = box.run(["systemd-analyze", "verify", unit], check=False)
        assert (r.returncode, r.stderr) == (0, ""), (unit, r.stderr)
    # ds-trainer-nvidia.service comes first; without nvidia-modprobe (no NVIDIA driver in this
    # container) it is skipped, not failed, and ds-trainer started all the same (checked above)
    assert NVIDIA_UNIT in show(box, "Wants").split() and NVIDIA_UNIT in show(box, "After").split()
    box.run(["test", "!", "-e", "/usr/bin/nvidia-modprobe"])
    assert show(box, "ConditionResult", NVIDIA_UNIT) == "no"
    assert show(box, "ActiveState", NVIDIA_UNIT) == "inactive"


def test_security_exposure_at_most_1(box):
    out = box.run(["systemd-analyze", "security", "--no-pager", UNIT], check=False).stdout
    score = float(re.search(r"Overall exposure level for \S+: (\d+\.\d+)", out).group(1))
    print(f"systemd-analyze security {UNIT}: {score}")
    assert score <= 1.0  # exposure stays <= 1.0 (0.7 measured since PrivateUsers= was dropped, 0.5 before)


def test_unit_limits_memory_and_tasks(box):
    out = box.run(["systemctl", "show", "-p", "MemoryMax,TasksMax", UNIT]).stdout
    print(f"systemctl show -p MemoryMax,TasksMax {UNIT}: {out.split()}")
    props = dict(line.split("=", 1) for line in out.split())
    assert props["TasksMax"] == str(TASKS_MAX), props
    # MemoryMax=75% is turned into bytes of the RAM systemd sees (MemTotal here: no memory limit on
    # the container), rounded to a page
    ram = 1024 * int(box.run("awk '/^MemTotal:/ {print $2}' /proc/meminfo").stdout)
    assert abs(int(props["MemoryMax"]) - ram * MEMORY_MAX_PERCENT // 100) <= 1 << 20, (props, ram)
    assert show(box, "OOMPolicy") == "continue"     # an OOM-killed job is the job's crash, not the unit's


def test_nvidia_modprobe_runs_as_root_before_each_start_and_its_failure_is_harmless(box):
    """A stand-in /usr/bin/nvidia-modprobe logs its uid and arguments and fails, as the real one
    does on a machine without an NVIDIA GPU: ds-trainer-nvidia.service runs it as root before
    ds-trainer starts, and ds-trainer starts all the same; without it again, it is skipped."""
    fake, log = "/usr/bin/nvidia-modprobe", "/run/ds-ops-e2e-nvidia-modprobe.log"
    box.run(f"cat > {fake} && chmod 755 {fake}", input=f'#!/bin/sh\necho "$(id -u) $*" >> {log}\nexit 1\n')
    try:
        box.run(["systemctl", "restart", UNIT], timeout=300)
        assert box.run(["systemctl", "is-active", UNIT], check=False).stdout.strip() == "active"
        calls = box.run(["cat", log]).stdout.splitlines()
        # root; nvidia.ko and nvidiactl, then (no GPU in /proc/driver/nvidia/gpus here) nvidia-uvm
        assert calls == ["0 -c=255", "0 -u -c=0"], calls
        assert show(box, "ConditionResult", NVIDIA_UNIT) == "yes"
        assert show(box, "Result", NVIDIA_UNIT) == "success"          # '-': failures are ignored
        done = int(show(box, "InactiveEnterTimestampMonotonic", NVIDIA_UNIT))
        assert 0 < done <= int(show(box, "ExecMainStartTimestampMonotonic")), "not finished before ds-trainer"
    finally:
        box.run(["rm", "-f", fake, log])
    box.run(["systemctl", "restart", UNIT], timeout=300)
    assert box.run(["systemctl", "is-active", UNIT], check=False).stdout.strip() == "active"
    assert show(box, "ConditionResult", NVIDIA_UNIT) == "no"


def test_group_member_drops_a_dataset_and_a_model_appears(box):
    box.run(["useradd", "--create-home", USER])                  # an existing user ...
    box.run(["usermod", "-aG", "ds-ops", USER])                  # ... joins group ds-ops (docs/INSTALL.md)
    # the shipped plateau rule as installed (docs/detection-protocol.md, round 2): at most 600 steps,
    # about 28 epochs of machine-1-2's 21 steps at batch 1024, seconds here
    box.run(f"grep -q '^  max_steps: 600$' {CONF}")
    started = time.monotonic()
    drop(box, f"/srv/smd/{DATASET}", DATASET)
    wait_model(box, MODEL, 1)
    print(f"dataset dropped -> model: {time.monotonic() - started:.1f} s")
    box.wait_for(f"test -f {SPOOL}/done/{DATASET} && test -f {SPOOL}/done/{DATASET}.result.json", 30,
                 "the dataset and its result in done/")
    # members of group ds-ops can read the model and the results, without being root
    box.run(f"cat {MODELS}/{MODEL}/current/metadata.json {SPOOL}/done/{DATASET}.result.json >/dev/null", user=USER)
    status = json.loads(box.run(["ds-ops", "status", "--json"], user=USER).stdout)
    assert status["done_count"] == 1 and status["failed_count"] == 0, status
    box.wait_for(f"test -z \"$(find {SPOOL}/incoming {SPOOL}/processing -mindepth 1)\"", 10, "empty incoming/ and processing/")


def test_journal_has_the_jobs_structured_fields(box):
    seen: dict[str, str] = {}
    deadline = time.monotonic() + 30       # journald writes asynchronously
    while time.monotonic() < deadline and len(seen) < len(JOURNAL_FIELDS):
        for entry in journal(box, f"DS_DATASET={MODEL}"):
            assert entry["_SYSTEMD_UNIT"] == UNIT
            assert entry["_TRANSPORT"] == "journal", entry
            seen.update({k: entry[k] for k in JOURNAL_FIELDS if k in entry})
        time.sleep(0.5)
    assert set(seen) == set(JOURNAL_FIELDS), seen
    assert seen["DS_MODEL_DIR"].startswith(f"{MODELS}/{MODEL}/")
    assert float(seen["DS_LOSS"]) >= 0
    stages = {e.get("DS_STAGE") for e in journal(box, f"DS_DATASET={MODEL}")}
    assert {"claimed", "training", "saved"} <= stages, stages
    epochs = [e for e in journal(box, f"DS_DATASET={MODEL}", "DS_STAGE=training") if "DS_EPOCH" in e]
    # the plateau rule (trainer.yaml: stopping: plateau, min_steps 100, patience 6 evaluations of 25 steps: at
    # least 175 steps, 8 epochs of SMD's 21): one line for each of the first 10 epochs (or all of them),
    # then at most one a second, none per batch
    assert len(epochs) >= 8 and len({e["DS_EPOCH"] for e in epochs}) == len(epochs)


def test_a_reload_to_the_seeds_five_epochs_applies_to_the_next_jobs(box):
    # the rest of this file trains the seed's 5 epochs (stopping: epochs): its tests count epochs
    box.run(f"sed -i 's/^  stopping: plateau$/  stopping: epochs/; s/^  epochs: 1000$/  epochs: 5/' {CONF}")
    box.run(["systemctl", "reload", UNIT])
    box.wait_for(f"journalctl -u {UNIT} --no-pager | grep -F 'configuration reloaded' | grep -q -F \"train.stopping 'plateau' -> 'epochs'\"",
                 30, "the reload to say the stopping rule changed")


def test_bad_file_goes_to_failed_and_the_unit_stays_active(box):
    pid = show(box, "MainPID")
    box.run("printf 'not,a,number\\nfoo,bar,baz\\n' > /tmp/garbage.csv", user=USER)
    drop(box, "/tmp/garbage.csv", "garbage.csv")
    box.wait_for(f"test -f {SPOOL}/failed/garbage.csv", 60, "garbage.csv in failed/")
    box.wait_for(f"test -f {SPOOL}/failed/garbage.csv.error.json", 30, "the error report in failed/")
    error = json.loads(box.run(["cat", f"{SPOOL}/failed/garbage.csv.error.json"], user=USER).stdout)
    assert error["stage"] and error["reason"], error
    assert box.run(["systemctl", "is-active", UNIT], check=False).stdout.strip() == "active"
    assert show(box, "MainPID") == pid
    # journalctl -x: the catalog's job-failed text, its @DS_...@ filled with this job's fields (the
    # database was built by systemd's dpkg trigger on /usr/lib/systemd/catalog at install)
    entry = catalog_entry("job-failed")
    subject = next(line for line in entry if line.startswith("Subject: "))
    box.wait_for(f"journalctl -x -u {UNIT} --no-pager | grep -q -F {shlex.quote(subject)}", 30,
                 "the job-failed catalog text in journalctl -x")
    fields = {"DS_DATASET_FILE": "garbage.csv", "DS_DATASET": "garbage", "DS_JOB_ID": error["job_id"],
              "DS_FAILED_STAGE": error["stage"], "DS_STAGE": "failed", "DS_REASON": error["reason"]}
    filled = [re.sub(r"@([A-Z0-9_]+)@", lambda m: fields[m.group(1)], line) for line in entry if "@" in line]
    assert filled, entry
    out = box.run(["journalctl", "-x", "-u", UNIT, "--no-pager"]).stdout
    missing = [line for line in filled if line not in out]
    assert not missing, (missing, [line for line in out.splitlines() if "garbage.csv" in line])


EXPORTS = r"""
import numpy as np, pyarrow as pa, pyarrow.parquet as pq
rng = np.random.default_rng(0)
rows = rng.random((600, 2))
with open("/tmp/grafana.csv", "w") as f:
    f.write('"Time","node_load1","host"\n')
    for i, r in enumerate(rows):
        f.write(f"{1716000000000 + 60000 * i},{r[0]:.4f},gpu1\n")
stamps = pa.array(np.datetime64("2024-05-18T00:00:00", "ms") + np.arange(600) * np.timedelta64(60, "s"),
                  type=pa.timestamp("ms", tz="UTC"))
pq.write_table(pa.table({"ts": stamps, "cpu": rows[:, 0], "mem": rows[:, 1]}), "/tmp/node.parquet")
"""


def test_exports_with_a_time_column_and_a_sidecar_train_in_the_installed_package(box):
    """A Grafana CSV (epoch-ms Time column, a text column left out by its sidecar) and a Parquet file
    written with the package's own pyarrow: the time column is the index, never a feature."""
    box.run(["/opt/ds-ops/bin/python", "-c", EXPORTS], user=USER)
    box.run("printf 'name: grafana-node\\nexclude_columns: [host]\\n' > /tmp/grafana.yaml", user=USER)
    drop(box, "/tmp/grafana.yaml", "grafana.yaml")  # the sidecar first
    drop(box, "/tmp/grafana.csv", "grafana.csv")
    drop(box, "/tmp/node.parquet", "node.parquet")
    wait_model(box, "grafana-node", 1)
    wait_model(box, "node", 1)
    grafana = json.loads(box.run(["cat", f"{MODELS}/grafana-node/current/metadata.json"], user=USER).stdout)
    assert grafana["dataset"]["header"] == ["node_load1"], grafana["dataset"]
    assert grafana["dataset"]["time"]["kind"] == "epoch_ms" and grafana["dataset"]["time"]["median_step_s"] == 60
    node = json.loads(box.run(["cat", f"{MODELS}/node/current/metadata.json"], user=USER).stdout)
    assert node["dataset"]["header"] == ["cpu", "mem"] and node["dataset"]["time"]["kind"] == "timestamp"
    box.wait_for(f"test -f {SPOOL}/done/grafana.csv.sidecar.yaml", 30, "the sidecar beside its dataset in done/")


def test_a_directory_and_a_fifo_in_incoming_are_reported_and_left_alone(box):
    """As alice: a directory and a FIFO named like an error report, then a bad file 'v', then a
    good dataset. The unit stays up; the entries stay where they are, reported once each; status
    does not hang on the FIFO; v fails with its report; the good dataset trains in its job process."""
    pid = show(box, "MainPID")
    inc = f"{SPOOL}/incoming"
    created = time.monotonic()
    box.run(f"umask 022 && mkdir {inc}/somedir && mkfifo {inc}/v.error.json", user=USER)
    box.run(f"printf 'not a dataset\\n' > /home/{USER}/v", user=USER)
    drop(box, f"/home/{USER}/v", "v")
    box.wait_for(f"test -f {SPOOL}/failed/v && test -f {SPOOL}/failed/v.error.json", 60, "v and v.error.json in failed/")
    error = json.loads(box.run(["cat", f"{SPOOL}/failed/v.error.json"], user=USER).stdout)
    assert error["dataset_file"] == "v" and error["stage"] and error["reason"], error
    assert box.run(["systemctl", "is-active", UNIT], check=False).stdout.strip() == "active"
    assert show(box, "MainPID") == pid
    box.run(["test", "-d", f"{inc}/somedir"])
    box.run(["test", "-p", f"{inc}/v.error.json"])
    reports = ("incoming/somedir is a directory", "incoming/v.error.json is a FIFO")
    box.wait_for(" && ".join(f"journalctl -u {UNIT} -o cat | grep -q -F '{r}'" for r in reports), 30,
                 "the directory and the FIFO reported in the journal")

    started = time.monotonic()
    text = box.run(["ds-ops", "status"], user=USER, timeout=60).stdout
    took = time.monotonic() - started
    print(f"ds-ops status as {USER}: {took:.1f} s\n{text}")
    assert took < 15, f"ds-ops status took {took:.1f} s"
    assert "  ignored somedir: a directory, not a regular file (left in incoming/)" in text.splitlines(), text
    assert "  ignored v.error.json: a FIFO (named pipe), not a regular file (left in incoming/)" in text.splitlines(), text
    status = json.loads(box.run(["ds-ops", "status", "--json"], user=USER, timeout=60).stdout)
    assert status["ignored"] == [{"name": "somedir", "kind": "a directory"},
                                 {"name": "v.error.json", "kind": "a FIFO (named pipe)"}], status
    assert status["queue"] == [], status

    drop(box, f"/srv/smd/{DATASET}", "after-hostile.txt.gz")
    wait_model(box, "after-hostile", 1)
    box.wait_for(f"test -f {SPOOL}/done/after-hostile.txt.gz.result.json", 30, "after-hostile's result in done/")
    deadline = time.monotonic() + 30       # journald writes asynchronously
    while True:
        epochs = [e for e in journal(box, "DS_DATASET=after-hostile", "DS_STAGE=training") if "DS_EPOCH" in e]
        if len(epochs) == 5 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert [e["DS_EPOCH"] for e in epochs] == ["1", "2", "3", "4", "5"], epochs
    assert re.match(r"after-hostile\.txt\.gz: epoch 5/5 loss=\d", epochs[-1]["MESSAGE"]), epochs[-1]

    # still there, still reported once each, past a rescan of incoming/ (spool.scan_interval_s: 30)
    time.sleep(max(0.0, created + 32 - time.monotonic()))
    box.run(["test", "-d", f"{inc}/somedir"])
    box.run(["test", "-p", f"{inc}/v.error.json"])
    log = box.run(["journalctl", "-u", UNIT, "-o", "cat", "--no-pager"]).stdout
    assert [log.count(r) for r in reports] == [1, 1], [line for line in log.splitlines() if "incoming/" in line]
    assert show(box, "MainPID") == pid
    box.run(f"rmdir {inc}/somedir && rm {inc}/v.error.json", user=USER)   # alice tidies up her entries


def test_restart_during_a_job_resumes_it_from_its_checkpoint(box):
    make_big_dataset(box)
    pid = show(box, "MainPID")
    drop(box, BIG, "restarted.txt.gz")
    record = wait_training(box, "restarted.txt.gz")
    # the job trains in a process of its own, inside the unit and its sandbox
    procs = unit_processes(box)
    job = procs.get(record["job_pid"])
    assert job is not None and record["job_pid"] != int(pid), (record, sorted(procs))
    uid = box.run(["id", "-u", "ds-ops"]).stdout.strip()
    assert job["Uid"].split()[0] == uid and job["NoNewPrivs"] == "1" and job["Seccomp"] == "2", job
    assert int(job["CapBnd"], 16) == 0, job
    threads = sum(int(p["Threads"]) for p in procs.values())
    print(f"unit during a job: {len(procs)} processes, {threads} threads, {os.cpu_count()} CPUs: "
          + ", ".join(f"{p['Name']}={p['Threads']}" for p in procs.values()))
    assert threads < TASKS_MAX
    box.run(["systemctl", "restart", UNIT], timeout=300)       # SIGTERM: checkpoint, exit 0, start
    assert box.run(["systemctl", "is-active", UNIT], check=False).stdout.strip() == "active"
    assert show(box, "MainPID") != pid
    assert show(box, "Result") == "success"
    wait_model(box, "restarted", 1)
    box.wait_for(f"test -f {SPOOL}/done/restarted.txt.gz.result.json", 30, "the restarted job's result in done/")
    result = json.loads(box.run(["cat", f"{SPOOL}/done/restarted.txt.gz.result.json"]).stdout)
    # KillMode=mixed: SIGTERM reached the daemon alone, the job wrote its checkpoint; no crash
    assert result["resumed_from_epoch"] is not None and result["crashes"] == 0, result
    ids = {e["MESSAGE_ID"] for e in journal(box, "DS_DATASET=restarted")}
    assert {MESSAGE_IDS["job-interrupted"], MESSAGE_IDS["job-resumed"], MESSAGE_IDS["job-saved"]} <= ids
    assert_nothing_lost(box, ["machine-1-2", "restarted"])


def test_sigkill_during_a_job_is_survived(box):
    restarts = int(show(box, "NRestarts"))
    pid = show(box, "MainPID")
    drop(box, BIG, "killed.txt.gz")
    record = wait_training(box, "killed.txt.gz")
    box.run(["systemctl", "kill", "--signal=SIGSTOP", UNIT])    # freeze the daemon and its job, check, kill
    assert box.run(["test", "-f", f"{SPOOL}/processing/{record['job_id']}/job.json"], check=False).returncode == 0 \
        and versions(box, "killed") == [], "the job finished before the SIGKILL: nothing was tested"
    box.run(["kill", "-KILL", pid])
    box.wait_for(f"test $(systemctl show -p NRestarts --value {UNIT}) -gt {restarts} && systemctl is-active -q {UNIT}",
                 120, "Restart=on-failure to bring the unit back")
    assert show(box, "MainPID") != pid
    wait_model(box, "killed", 1)
    box.wait_for(f"test -f {SPOOL}/done/killed.txt.gz.result.json", 30, "the killed job's result in done/")
    result = json.loads(box.run(["cat", f"{SPOOL}/done/killed.txt.gz.result.json"]).stdout)
    # the daemon's death counts against no dataset: a restart of the job, not a crash of it
    assert (result["restarts"], result["crashes"]) == (1, 0), result
    assert_nothing_lost(box, ["machine-1-2", "restarted", "killed"])


def next_version(deb: Path, suffix: str = "+e2e1") -> Path:
    """Return a copy of deb as a next version (VERSION+suffix), repacked in UPGRADE_DIR."""
    tree = UPGRADE_DIR / "tree"
    subprocess.run(["dpkg-deb", "--raw-extract", str(deb), str(tree)], check=True)
    control = tree / "DEBIAN/control"
    version = re.search(r"^Version: (\S+)$", control.read_text(), re.M).group(1)
    control.write_text(re.sub(r"^Version: .*$", f"Version: {version}{suffix}", control.read_text(), flags=re.M))
    out = UPGRADE_DIR / deb.name.replace(f"_{version}_", f"_{version}{suffix}_")
    subprocess.run(["dpkg-deb", "--root-owner-group", "-Zgzip", "-z1", "--build", str(tree), str(out)],
                   check=True, capture_output=True)
    shutil.rmtree(tree)
    return out


def test_upgrade_keeps_the_conffile_edit_models_and_account(box, deb):
    conf = "/etc/ds-ops/trainer.yaml"
    box.run(f"sed -i 's/^  scan_interval_s: .*/  scan_interval_s: 20.0/' {conf} && grep -q 'scan_interval_s: 20.0' {conf}")
    box.run(["systemctl", "reload", UNIT])                      # SIGHUP: the daemon re-reads it
    box.wait_for(f"journalctl -u ds-trainer -o cat MESSAGE_ID={MESSAGE_IDS['config-reloaded']} | grep -q .", 30,
                 "the configuration to be reloaded")
    uid = box.run(["id", "-u", "ds-ops"]).stdout
    pid = show(box, "MainPID")
    new = next_version(deb)
    box.run(f"cd /srv/upgrade && apt-get install -y -q ./{new.name}", timeout=900, input="")  # no conffile prompt
    assert box.run(["dpkg-query", "-W", "-f", "${Version}", "ds-ops"]).stdout.endswith("+e2e1")
    box.run(["grep", "-q", "scan_interval_s: 20.0", conf])      # the admin's edit survives
    assert box.run(["systemctl", "is-active", UNIT], check=False).stdout.strip() == "active"
    assert show(box, "MainPID") != pid                           # restarted on the new code
    assert box.run(["id", "-u", "ds-ops"]).stdout == uid
    assert_nothing_lost(box, ["machine-1-2", "restarted", "killed"])
    drop(box, f"/srv/smd/{DATASET}", "after-upgrade.txt.gz")
    wait_model(box, "after-upgrade", 1)


# ---- what an operator expects around the daemon, the first hour tried from the docs ----
# (run by `make e2e`, which boots the container)

TEXTFILE_DIR = "/var/lib/prometheus/node-exporter"
READ_PROM = r"""
import sys
from prometheus_client.parser import text_string_to_metric_families
for family in text_string_to_metric_families(open(sys.argv[1]).read()):
    for s in family.samples:
        print(s.name, ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())), s.value)
"""
READ_PNG = r"""
import sys
from PIL import Image
with Image.open(sys.argv[1]) as im:
    im.verify()
with Image.open(sys.argv[1]) as im:
    im.load()
    print(im.format, im.size[0], im.size[1])
"""


def test_metrics_catalog_text_and_report_png_after_a_job(box):
    # node_exporter's textfile directory, writable by the daemon's user (docs/INSTALL.md); the unit's
    # ReadWritePaths=-... binds it only when it exists at start, so restart after creating it
    box.run(["install", "-d", "-o", "ds-ops", "-g", "ds-ops", "-m", "0755", TEXTFILE_DIR])
    box.run(["systemctl", "restart", UNIT], timeout=300)
    drop(box, f"/srv/smd/{DATASET}", "metrics.txt.gz")
    wait_model(box, "metrics", 1)
    box.wait_for(f"grep -qF 'ds_ops_model_threshold{{model=\"metrics\"}}' {TEXTFILE_DIR}/ds_ops.prom", 60,
                 "the job in ds_ops.prom")
    out = box.run(["/opt/ds-ops/bin/python", "-c", READ_PROM, f"{TEXTFILE_DIR}/ds_ops.prom"], user=USER).stdout
    got = {" ".join(line.split()[:-1]): float(line.split()[-1]) for line in out.splitlines()}
    assert got["ds_ops_jobs_finished_total result=done"] >= 1, out
    assert got["ds_ops_model_threshold model=metrics"] > 0 and got["ds_ops_job_running"] == 0, out
    assert box.run(["stat", "-c", "%a", f"{TEXTFILE_DIR}/ds_ops.prom"]).stdout.strip() == "644"
    # journalctl -x: the job-saved catalog text
    subject = next(line for line in catalog_entry("job-saved") if line.startswith("Subject: "))
    box.wait_for(f"journalctl -x -u {UNIT} --no-pager | grep -q -F {shlex.quote(subject)}", 30,
                 "the job-saved catalog text in journalctl -x")
    png = box.run(["/opt/ds-ops/bin/python", "-c", READ_PNG, f"{MODELS}/metrics/current/report.png"], user=USER)
    fmt, width, height = png.stdout.split()
    assert fmt == "PNG" and int(width) > 800 and int(height) > 300, png.stdout


def test_first_hour_requeue_status_reload_models_rm_and_retention(box):
    conf = "/etc/ds-ops/trainer.yaml"
    # requeue a fixed dataset: a group member may not, root may; a later success clears "latest failed"
    box.run(f"zcat /srv/smd/{DATASET} | head -n 3000 > {SPOOL}/failed/garbage.csv")
    r = box.run(["ds-ops", "requeue", "garbage.csv"], user=USER, check=False)
    assert r.returncode == 1 and "sudo ds-ops requeue NAME" in r.stderr, r.stderr
    box.run(["ds-ops", "requeue", "garbage.csv"])
    wait_model(box, "garbage", 1)
    box.wait_for(f"test -f {SPOOL}/done/garbage.csv.result.json", 30, "the requeued dataset in done/")
    status = json.loads(box.run(["ds-ops", "status", "--json"], user=USER).stdout)
    assert [f for f in status["recent_failed"] if f["dataset"] == "garbage.csv"] == [], status["recent_failed"]
    # a reload with a broken conffile fails, the daemon keeps running, status still works
    box.run(f"cp {conf} /root/trainer.yaml.good && sed -i 's/^  epochs: 5/  epochs: twenty/' {conf}")
    pid = show(box, "MainPID")
    r = box.run(["systemctl", "reload", UNIT], check=False)
    assert r.returncode != 0, r.stdout + r.stderr
    assert box.run(["systemctl", "is-active", UNIT], check=False).stdout.strip() == "active"
    assert show(box, "MainPID") == pid
    r = box.run(["ds-ops", "status"], user=USER, check=False)
    assert r.returncode == 0 and "key 'train.epochs' must be an integer" in r.stderr, r.stderr
    box.run(f"cp /root/trainer.yaml.good {conf}")
    # status shows the running job alive, with its epoch (liveness by pid and its start time); 40
    # epochs so the job outlasts a few `ds-ops status` runs
    box.run(f"sed -i 's/^  epochs: 5$/  epochs: 40/' {conf} && grep -q '^  epochs: 40$' {conf}")
    box.run(["systemctl", "reload", UNIT])
    drop(box, BIG, "alive.txt.gz")
    wait_training(box, "alive.txt.gz")
    r = box.wait_for("ds-ops status | grep -E 'alive.txt.gz  job .*: training epoch [0-9]+/40 .*daemon pid'", 120,
                     "status to show the running job's epoch", interval_s=0.5)
    assert "daemon not running it now" not in r.stdout
    wait_model(box, "alive", 1)
    box.run(f"cp /root/trainer.yaml.good {conf}")
    box.run(["systemctl", "reload", UNIT])
    # retention: done/ keeps what is younger than a second, after the next job
    box.run(f"cp /root/trainer.yaml.good {conf} && sed -i 's/^  done_max_age_days: .*/  done_max_age_days: 0.00001/' "
            f"{conf}")
    box.run(["systemctl", "reload", UNIT])
    box.wait_for(f"journalctl -u {UNIT} --no-pager | grep -q -F 'spool.done_max_age_days 30.0 -> 1e-05'", 30,
                 "the reload to say what changed")
    drop(box, f"/srv/smd/{DATASET}", "retention.txt.gz")
    wait_model(box, "retention", 1)
    box.wait_for(f"test ! -e {SPOOL}/done/garbage.csv", 60, "done/ pruned by age")
    assert "retention.txt.gz" in box.run(["ls", f"{SPOOL}/done"]).stdout.split()
    box.run(f"cp /root/trainer.yaml.good {conf}")
    box.run(["systemctl", "reload", UNIT])
    # models rm: a whole model goes; a group member may not remove one
    r = box.run(["ds-ops", "models", "rm", "garbage"], user=USER, check=False)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    box.run(["ds-ops", "models", "rm", "garbage"])
    box.run(["test", "!", "-e", f"{MODELS}/garbage"])
    models = json.loads(box.run(["ds-ops", "models", "--json"], user=USER).stdout)["models"]
    assert "garbage" not in {m["name"] for m in models} and "alive" in {m["name"] for m in models}


# ---- budgets that add up, a sandbox that says what it refuses, packaging ----

GIB = 1024**3
CONF = "/etc/ds-ops/trainer.yaml"
DROP_IN = "/etc/systemd/system/ds-trainer.service.d/loopback.conf"
LOOPBACK_DROP_IN = "[Service]\nRestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK\nIPAddressAllow=localhost\n"


def unit_time(box: Container, prop: str) -> float:
    """Return a timestamp property of the unit (InactiveEnterTimestamp, ...) as seconds since the epoch."""
    text = box.run(["systemctl", "show", "--timestamp=us+utc", "-p", prop, "--value", UNIT]).stdout.strip()
    return datetime.strptime(text, "%a %Y-%m-%d %H:%M:%S.%f UTC").replace(tzinfo=timezone.utc).timestamp()


def test_the_start_up_line_and_check_config_give_the_memory_per_job_process(box):
    box.run(["systemctl", "restart", UNIT], timeout=300)
    pid = show(box, "MainPID")
    box.wait_for(f"journalctl -u {UNIT} -o cat _PID={pid} MESSAGE_ID={MESSAGE_IDS['daemon-started']} | grep -q .", 60,
                 "the start-up line")
    line = journal(box, f"_PID={pid}", f"MESSAGE_ID={MESSAGE_IDS['daemon-started']}")[-1]["MESSAGE"]
    m = re.search(r"memory per job process (\d+\.\d+) GiB \(job\.memory_max", line)
    assert m, line
    print(f"start-up line: {m.group(0)}")
    # one job at a time here (no GPU): job.memory_max (50 %) fits MemoryMax=75 % less the daemon's GiB
    assert float(m.group(1)) * GIB <= int(show(box, "MemoryMax")) - GIB, (line, show(box, "MemoryMax"))
    box.run(["systemctl", "reload", UNIT])                     # ExecReload= runs check-config in the unit
    box.wait_for(f"journalctl -u {UNIT} --no-pager | grep -q -F {shlex.quote(m.group(0))}", 30,
                 "check-config's budget line in the journal")


def test_distributed_min_bytes_is_refused_under_the_shipped_unit_and_trains_on_two_ranks_with_the_drop_in(box):
    """Before: the unit's RestrictAddressFamilies=AF_UNIX made torchrun's TCP store fail and every
    dataset over distributed_min_bytes failed in its training stage. With train.input_differences
    (true as shipped) the daemon trains such a dataset in one process: a distributed run reads single
    rows (tests/daemon/test_daemon_distributed.py), so the admin sets it false here."""
    box.run(f"cp {CONF} /root/trainer.yaml.before-ddp && sed -i -e 's/^  distributed_min_bytes: 0$/  "
            f"distributed_min_bytes: 1000/' -e 's/^  distributed_nproc: auto$/  distributed_nproc: 2/' "
            f"-e 's/^  input_differences: true$/  input_differences: false/' {CONF} "
            f"&& grep -q '^  distributed_min_bytes: 1000$' {CONF} && grep -q '^  input_differences: false$' {CONF}")
    try:
        pid = show(box, "MainPID")
        r = box.run(["systemctl", "reload", UNIT], check=False)    # check-config, in the unit's sandbox, refuses
        assert r.returncode != 0 and show(box, "MainPID") == pid, r.stdout + r.stderr
        refusal = ("daemon.distributed_min_bytes is set (1000 bytes), but torchrun's ranks need TCP on loopback and "
                   "here socket(AF_INET) failed: Address family not supported by protocol")
        box.wait_for(f"journalctl -u {UNIT} --no-pager | grep -q -F {shlex.quote(refusal)}", 30,
                     "check-config's refusal in the journal")
        # a start with it: the daemon turns the feature off, says why, and a large dataset trains in one process
        box.run(["systemctl", "restart", UNIT], timeout=300)
        pid = show(box, "MainPID")
        box.wait_for(f"journalctl -u {UNIT} -o cat _PID={pid} MESSAGE_ID={MESSAGE_IDS['feature-refused']} "
                     f"| grep -q -F {shlex.quote(refusal)}", 60, "the daemon's feature-refused event")
        drop(box, f"/srv/smd/{DATASET}", "refused.txt.gz")
        wait_model(box, "refused", 1)
        box.wait_for(f"test -f {SPOOL}/done/refused.txt.gz.result.json", 30, "refused.txt.gz in done/")
        assert json.loads(box.run(["cat", f"{SPOOL}/done/refused.txt.gz.result.json"]).stdout)["distributed"] is None
        # the documented drop-in (docs/operating.md): loopback only, and torchrun's ranks train
        box.run(f"mkdir -p {os.path.dirname(DROP_IN)} && printf '{LOOPBACK_DROP_IN}' > {DROP_IN} && "
                "systemctl daemon-reload")
        box.run(["systemctl", "restart", UNIT], timeout=300)
        pid = show(box, "MainPID")
        box.run(["systemctl", "reload", UNIT])                       # check-config passes in the sandbox now
        assert journal(box, f"_PID={pid}", f"MESSAGE_ID={MESSAGE_IDS['feature-refused']}") == []
        drop(box, f"/srv/smd/{DATASET}", "ranks.txt.gz")
        wait_model(box, "ranks", 1)
        box.wait_for(f"test -f {SPOOL}/done/ranks.txt.gz.result.json", 30, "ranks.txt.gz in done/")
        result = json.loads(box.run(["cat", f"{SPOOL}/done/ranks.txt.gz.result.json"]).stdout)
        assert result["distributed"] == {"world_size": 2, "backend": "gloo"}, result
    finally:
        box.run(f"rm -f {DROP_IN} && cp /root/trainer.yaml.before-ddp {CONF} && systemctl daemon-reload")
        box.run(["systemctl", "restart", UNIT], timeout=300)


def test_upgrade_stops_the_daemon_before_dpkg_replaces_opt_under_a_running_job(box, deb):
    """Before: dh_installsystemd's default restarted the unit after the unpack, so a running job
    ran on with /opt/ds-ops replaced under it (late imports of the new code, or of half-written files)."""
    new = next_version(deb, "+e2e2")
    box.run(f"cp {CONF} /root/trainer.yaml.before-upgrade && sed -i 's/^  epochs: 5$/  epochs: 40/' {CONF} && grep -q '^  epochs: 40$' {CONF}")
    box.run(["systemctl", "reload", UNIT])          # 40 epochs: the job outlasts apt's preparations
    try:
        drop(box, BIG, "upgraded.txt.gz")
        wait_training(box, "upgraded.txt.gz")
        box.run(f"cd /srv/upgrade && apt-get install -y -q ./{new.name}", timeout=900, input="")
    finally:
        box.run(f"cp /root/trainer.yaml.before-upgrade {CONF}")
    assert box.run(["dpkg-query", "-W", "-f", "${Version}", "ds-ops"]).stdout.endswith("+e2e2")
    assert box.run(["systemctl", "is-active", UNIT], check=False).stdout.strip() == "active"
    stopped = unit_time(box, "InactiveEnterTimestamp")
    code = "/opt/ds-ops/lib/python3.11/site-packages/opt_ds_ops/daemon/service.py"
    unpacked = float(box.run(["/opt/ds-ops/bin/python", "-c", f"import os; print(os.stat({code!r}).st_ctime)"]).stdout)
    print(f"upgrade: the daemon stopped {unpacked - stopped:.2f} s before dpkg unpacked {code}")
    assert stopped < unpacked < unit_time(box, "ExecMainStartTimestamp"), (stopped, unpacked)
    wait_model(box, "upgraded", 1)
    box.wait_for(f"test -f {SPOOL}/done/upgraded.txt.gz.result.json", 60, "the job's result in done/")
    result = json.loads(box.run(["cat", f"{SPOOL}/done/upgraded.txt.gz.result.json"]).stdout)
    # stopped by SIGTERM before the unpack: a checkpoint, resumed on the new code, no crash
    assert result["resumed_from_epoch"] is not None and result["crashes"] == 0, result
    ids = {e["MESSAGE_ID"] for e in journal(box, "DS_DATASET=upgraded")}
    assert {MESSAGE_IDS["job-interrupted"], MESSAGE_IDS["job-resumed"]} <= ids
    box.run(["systemctl", "reload", UNIT])          # back to the conffile's 5 epochs


def test_purge_leaves_no_unit_user_conffile_or_spool(box):
    # the metrics file (and a killed write's temporary, owned by ds-ops) go with the package;
    # another writer's file in node_exporter's directory stays
    box.run(["test", "-f", f"{TEXTFILE_DIR}/ds_ops.prom"])
    box.run(f"install -o ds-ops -m 0644 /dev/null {TEXTFILE_DIR}/.ds_ops.prom.tmp-ds-ops && "
            f"install -o root -m 0644 /dev/null {TEXTFILE_DIR}/.tmp-other")
    box.run(["apt-get", "purge", "-y", "-q", "ds-ops"], timeout=600)
    box.run(["test", "!", "-e", f"{TEXTFILE_DIR}/ds_ops.prom", "-a", "!", "-e", f"{TEXTFILE_DIR}/.ds_ops.prom.tmp-ds-ops"])
    box.run(["test", "-e", f"{TEXTFILE_DIR}/.tmp-other"])
    assert box.run(["dpkg-query", "-W", "-f", "${Status}", "ds-ops"], check=False).stdout \
        in ("", "unknown ok not-installed")
    assert box.run(["systemctl", "is-active", UNIT], check=False).stdout.strip() != "active"
    r = box.run(["systemctl", "is-enabled", UNIT], check=False)
    assert r.returncode != 0 and "enabled" not in r.stdout.split()
    for path in ("/lib/systemd/system/ds-trainer.service", f"/lib/systemd/system/{NVIDIA_UNIT}",
                 "/lib/systemd/system/ds-pull@.service",
                 "/etc/systemd/system/multi-user.target.wants/ds-trainer.service",
                 "/etc/ds-ops", SPOOL, "/var/lib/ds-ops", "/opt/ds-ops", "/usr/bin/ds-ops", "/usr/lib/sysusers.d/ds-ops.conf",
                 "/usr/lib/tmpfiles.d/ds-ops.conf", "/usr/lib/systemd/catalog/ds-ops.catalog"):
        box.run(["test", "!", "-e", path, "-a", "!", "-L", path])
    assert box.run(["getent", "passwd", "ds-ops"], check=False).returncode == 2
    assert box.run(["getent", "passwd", "ds-pull"], check=False).returncode == 2
    assert box.run(["getent", "group", "ds-ops"], check=False).returncode == 2
    # the trained models are the user's data: kept, closed to all but root (see docs/INSTALL.md)
    assert box.run(["stat", "-c", "%a %U:%G", MODELS]).stdout.strip() == "700 root:root"
    box.run(["test", "-f", f"{MODELS}/{MODEL}/current/model.pt"])


def test_reinstall_after_purge_leaves_the_kept_model_store_root_only_until_the_admin_hands_it_back(box, deb):
    """Before: the tmpfiles line (type d) re-moded the kept /var/models to ds-ops:ds-ops 2750 at
    install and at every boot, reopening the old models to a new account and group."""
    r = box.run(f"cd /srv/debs && apt-get install -y -q --no-install-recommends ./{deb.name}", timeout=900)
    assert "/var/models was kept by a purge and is root-only" in r.stdout + r.stderr, r.stdout + r.stderr
    assert box.run(["stat", "-c", "%a %U:%G", MODELS]).stdout.strip() == "700 root:root"
    box.run(["systemd-tmpfiles", "--create", "ds-ops.conf"])          # as at every boot
    assert box.run(["stat", "-c", "%a %U:%G", MODELS]).stdout.strip() == "700 root:root"
    # the admin hands it back, as the note says; the old models are served again
    box.run(f"chown -R ds-ops:ds-ops {MODELS} && chmod 2750 {MODELS}")
    box.run(f"systemctl reset-failed {UNIT}; systemctl restart {UNIT}", timeout=300)
    assert box.run(["systemctl", "is-active", UNIT], check=False).stdout.strip() == "active"
    models = json.loads(box.run(["ds-ops", "models", "--json"]).stdout)["models"]
    assert MODEL in {m["name"] for m in models}, models
