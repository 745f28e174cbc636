"""What a hostile or clumsy member of group ds-ops can drop into incoming/.

One test per way a member can get it wrong. The daemon runs as the unit's user would: as root without
CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH, so a file or directory another user owns is as closed to it
as to the ds-ops account; the spool has the package's modes (incoming/ 3770). Each test ends with
a good dataset dropped afterwards becoming a model while the daemon is still alive.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, SMD_TRAIN, run_cli
import daemon_kit
from daemon_kit import (
    Daemon, base_env, copy_smd, done_names, drop_dac_capabilities, failed_names,
    job_record, read_json, spool_dir, versions, write_config,
)

OTHER_UID = 12345  # a member of group ds-ops who is not the daemon
AS_SERVICE = drop_dac_capabilities if os.geteuid() == 0 else None


def sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def service(tmp_path, env=None, **cfg):
    """A real daemon on tmp_path, as the service user, incoming/ with the package's mode 3770."""
    return daemon_kit.service(tmp_path, AS_SERVICE, env=env, **cfg)


def as_other_user(path: Path) -> Path:
    """Give path to another member of the group (as a drop by that user would leave it)."""
    if os.geteuid() == 0:
        os.lchown(path, OTHER_UID, os.getgid())
    return path


def drop(incoming: Path, name: str, data: bytes) -> Path:
    """Drop data the safe way: write NAME.part, then rename."""
    part = incoming / f"{name}.part"
    part.write_bytes(data)
    as_other_user(part)
    os.rename(part, incoming / name)
    return incoming / name


def then_a_good_dataset_is_trained(d: Daemon, tmp_path, name: str = "good.txt.gz") -> dict:
    drop(spool_dir(tmp_path, "incoming"), name, SMD_TRAIN.read_bytes())
    d.wait_until(lambda: name in done_names(tmp_path), f"{name} to become a model")
    result = read_json(spool_dir(tmp_path, "done") / f"{name}.result.json")
    assert os.path.isfile(os.path.join(result["model_dir"], "model.pt"))
    return result


# ---- row 1: a directory -------------------------------------------------------------------------

def test_row1_a_directory_dropped_by_a_group_member_is_reported_and_left(tmp_path):
    with service(tmp_path) as d:
        incoming = spool_dir(tmp_path, "incoming")
        (incoming / "adir").mkdir(mode=0o755)  # umask 022: the daemon cannot write into it
        as_other_user(incoming / "adir")
        (incoming / "adir.csv").mkdir(mode=0o755)
        as_other_user(incoming / "adir.csv")
        d.wait_until(lambda: "incoming/adir.csv is a directory" in d.log(), "the directory to be reported")
        then_a_good_dataset_is_trained(d, tmp_path)
        assert (incoming / "adir").is_dir() and (incoming / "adir.csv").is_dir()
        assert d.log().count("incoming/adir.csv is a directory") == 1  # reported once, not in a loop
    st = json.loads(run_cli("status", "--config", str(tmp_path / "trainer.yaml"), "--json").stdout)
    assert {"name": "adir", "kind": "a directory"} in st["ignored"]


# ---- row 2: a FIFO named like a sidecar ----------------------------------------------------------

def test_row2_a_fifo_named_like_a_sidecar_then_a_bad_file_of_that_name(tmp_path):
    with service(tmp_path) as d:
        incoming = spool_dir(tmp_path, "incoming")
        os.mkfifo(incoming / "v.error.json")
        as_other_user(incoming / "v.error.json")
        drop(incoming, "v", b"not a dataset\n")
        d.wait_until(lambda: failed_names(tmp_path) == {"v"}, "v to fail")
        err = read_json(spool_dir(tmp_path, "failed") / "v.error.json")
        assert err["stage"] == "dataset" and "unknown dataset format" in err["reason"]
        then_a_good_dataset_is_trained(d, tmp_path)
    r = subprocess.run([sys.executable, "-m", "opt_ds_ops.cli", "status", "--config", str(tmp_path / "trainer.yaml")],
                       capture_output=True, text=True, timeout=60, cwd=REPO, env=base_env())
    assert r.returncode == 0 and "ignored v.error.json: a FIFO" in r.stdout


# ---- row 3: small files that inflate ---------------------------------------------------------------

def _inflating(stage: Path) -> dict[str, bytes]:
    import torch

    out = {}
    buf = io.BytesIO()
    torch.save(torch.zeros(1, 1).expand(400_000, 1000), buf)  # stride 0: 1.6 GB as float32, a few KB on disk
    out["stride0.pt"] = buf.getvalue()
    member = io.BytesIO()
    np.lib.format.write_array_header_1_0(member, {"descr": "<f4", "fortran_order": False, "shape": (2_000_000, 64)})
    z = io.BytesIO()
    with zipfile.ZipFile(z, "w", zipfile.ZIP_DEFLATED) as zf:
        with zf.open("x.npy", "w", force_zip64=True) as f:
            f.write(member.getvalue())
            zero = bytes(1 << 20)
            for _ in range(512):  # 512 MiB of zeros, about 0.5 MB deflated
                f.write(zero)
    out["zeros.npz"] = z.getvalue()
    gz = io.BytesIO()
    with gzip.GzipFile(fileobj=gz, mode="wb", compresslevel=9) as f:
        line = b"0,0,0,0\n" * 4096
        for _ in range(64 * 1024 * 1024 // len(line)):  # 64 MiB of text
            f.write(line)
    out["zeros.csv.gz"] = gz.getvalue()
    npy = io.BytesIO()
    np.save(npy, np.zeros((4, 2_000_000), np.int8))
    out["wide.npy"] = npy.getvalue()
    out["wide.csv"] = (",".join(["1"] * 1_000_000) + "\n") * 2
    out["wide.csv"] = out["wide.csv"].encode()
    return out


def test_row3_small_files_that_inflate_are_refused_by_the_budgets_without_hurting_the_daemon(tmp_path):
    budgets = ["job:", "  memory_max: 1G", "  max_decompressed_bytes: 16777216", "  max_columns: 4096",
               "  max_matrix_bytes: 67108864"]
    with service(tmp_path, extra=budgets) as d:
        incoming = spool_dir(tmp_path, "incoming")
        files = _inflating(tmp_path)
        for name, data in files.items():
            drop(incoming, name, data)
        d.wait_until(lambda: failed_names(tmp_path) == set(files), "every inflating file in failed/", timeout_s=300)
        for name in files:
            err = read_json(spool_dir(tmp_path, "failed") / f"{name}.error.json")
            assert err["stage"] == "dataset", (name, err)
            assert "job.max_" in err["reason"] or "job.memory_max" in err["reason"], (name, err["reason"])
        result = then_a_good_dataset_is_trained(d, tmp_path)
        assert result["columns"] == 38
    assert not (tmp_path / "models" / "stride0").exists()


# ---- row 4: writers that pause, a copy in progress at start-up ----------------------------------------

def test_row4_a_writer_pausing_longer_than_the_rescan_interval_is_not_claimed_early(tmp_path):
    with service(tmp_path, settle_s=0.2, scan_interval_s=0.3, quiet_s=0.5) as d:
        path = spool_dir(tmp_path, "incoming") / "paused.txt.gz"
        data = SMD_TRAIN.read_bytes()
        with open(path, "wb") as f:
            for i in range(4):
                f.write(data[i * len(data) // 4:(i + 1) * len(data) // 4])
                f.flush()
                time.sleep(1.5)  # 5x the rescan interval, 3x quiet_s, with the file open
                assert job_record(tmp_path, "paused.txt.gz") is None and "paused.txt.gz" not in done_names(tmp_path)
        d.wait_until(lambda: "paused.txt.gz" in done_names(tmp_path), "the complete file")
        result = read_json(spool_dir(tmp_path, "done") / "paused.txt.gz.result.json")
        assert result["sha256"] == sha256(SMD_TRAIN) == sha256(spool_dir(tmp_path, "done") / "paused.txt.gz")
        then_a_good_dataset_is_trained(d, tmp_path)


def test_row4_a_copy_in_progress_when_the_daemon_starts_is_taken_only_when_complete(tmp_path):
    incoming = spool_dir(tmp_path, "incoming")
    incoming.mkdir(parents=True)
    data = SMD_TRAIN.read_bytes()
    stop = threading.Event()

    def writer():
        with open(incoming / "copying.txt.gz", "wb") as f:
            for i in range(40):  # keeps writing through the daemon's start-up, 0.2 s apart
                f.write(data[i * len(data) // 40:(i + 1) * len(data) // 40])
                f.flush()
                time.sleep(0.2)
        stop.set()

    t = threading.Thread(target=writer)
    t.start()
    try:
        with service(tmp_path, quiet_s=1.0) as d:
            d.wait_until(lambda: "copying.txt.gz" in done_names(tmp_path), "the complete copy")
            assert stop.is_set()
            assert sha256(spool_dir(tmp_path, "done") / "copying.txt.gz") == sha256(SMD_TRAIN)
            then_a_good_dataset_is_trained(d, tmp_path)
    finally:
        t.join()


# ---- row 5: the owner rewrites the file after the claim ------------------------------------------------

@pytest.mark.parametrize("fmt", ["npy", "txt.gz"])
def test_row5_truncating_or_rewriting_after_the_claim_changes_nothing(tmp_path, fmt):
    """The owner writes the file outside incoming/, keeps an fd, moves it in (a rename: taken at once,
    no open was seen in incoming/), and truncates and rewrites it while the job trains."""
    rows = np.loadtxt(SMD_TRAIN, delimiter=",", dtype=np.float32)
    if fmt == "npy":
        buf = io.BytesIO()
        np.save(buf, rows)
        data = buf.getvalue()
    else:
        data = SMD_TRAIN.read_bytes()
    name = f"owned.{fmt}"
    with service(tmp_path, epochs=30, batch_size=256) as d:
        incoming = spool_dir(tmp_path, "incoming")
        staged = tmp_path / name
        fd = os.open(staged, os.O_RDWR | os.O_CREAT, 0o640)
        os.write(fd, data)
        os.rename(staged, incoming / name)  # the owner keeps the fd
        d.wait_until(lambda: (r := job_record(tmp_path, name)) and r.get("epoch"), "training to start")
        os.ftruncate(fd, 0)  # would SIGBUS a memory map of the user's inode
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, b"rewritten\n")
        os.close(fd)
        d.wait_until(lambda: name in done_names(tmp_path), "the job")
        result = read_json(spool_dir(tmp_path, "done") / f"{name}.result.json")
        assert result["sha256"] == hashlib.sha256(data).hexdigest() == sha256(spool_dir(tmp_path, "done") / name)
        assert result["rows"] == rows.shape[0] and result["crashes"] == 0
        then_a_good_dataset_is_trained(d, tmp_path)


# ---- row 6: the daemon killed, a full disk, SIGTERM while parsing, NVML hanging -----------------------------

@pytest.mark.recovery
def test_row6_sigkills_of_the_daemon_never_count_against_the_dataset(tmp_path):
    conf = write_config(tmp_path, epochs=40, batch_size=256, max_crashes=1)
    spool_dir(tmp_path, "incoming").mkdir(parents=True)
    copy_smd(spool_dir(tmp_path, "incoming") / "m.txt.gz")
    seen = set()
    for kill in range(3):  # more than max_crashes
        d = Daemon(conf, preexec_fn=AS_SERVICE)
        try:
            rec = d.wait_until(lambda: (r := job_record(tmp_path, "m.txt.gz")) and r.get("state") == "running"
                               and r.get("job_pid") not in seen and r.get("epoch", 0) >= 1 and r,
                               f"training before kill {kill + 1}")
            seen.add(rec["job_pid"])
            d.proc.kill()
            d.proc.wait(30)
        finally:
            d.kill()
    with service(tmp_path, epochs=40, batch_size=256, max_crashes=1) as d:
        d.wait_until(lambda: "m.txt.gz" in done_names(tmp_path), "the job after three SIGKILLs", timeout_s=600)
        result = read_json(spool_dir(tmp_path, "done") / "m.txt.gz.result.json")
        assert result["crashes"] == 0 and result["restarts"] == 3
        assert failed_names(tmp_path) == set() and len(versions(tmp_path, "m")) == 1
        then_a_good_dataset_is_trained(d, tmp_path)


@pytest.fixture
def tiny_models_fs(tmp_path):
    """A 1 MiB tmpfs for the model store: a real ENOSPC (root only)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "models"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_row6_a_full_model_store_pauses_intake_and_counts_against_no_dataset(tmp_path, tiny_models_fs):
    filler = tiny_models_fs / "filler"
    with open(filler, "wb") as f:  # fill the file system
        with contextlib.suppress(OSError):
            while True:
                f.write(bytes(64 * 1024))
                f.flush()
    with service(tmp_path) as d:
        drop(spool_dir(tmp_path, "incoming"), "m.txt.gz", SMD_TRAIN.read_bytes())
        d.wait_until(lambda: "intake paused" in d.log(), "the pause", timeout_s=120)
        assert "No space left on device" in d.log()
        assert failed_names(tmp_path) == set() and job_record(tmp_path, "m.txt.gz") is not None
        filler.unlink()
        d.wait_until(lambda: "m.txt.gz" in done_names(tmp_path), "the job after space came back", timeout_s=120)
        result = read_json(spool_dir(tmp_path, "done") / "m.txt.gz.result.json")
        assert result["crashes"] == 0
        then_a_good_dataset_is_trained(d, tmp_path)
    leftovers = [p for p in tiny_models_fs.rglob(".tmp-*")]
    assert leftovers == []  # row 11: a failed save leaves no temporary directory


@pytest.mark.recovery
def test_row6_sigterm_during_a_long_parse_stops_at_once(tmp_path):
    conf = write_config(tmp_path)
    incoming = spool_dir(tmp_path, "incoming")
    incoming.mkdir(parents=True)
    # 400,000 rows of 38 columns, ~130 MB of text: seconds to parse (4,000 rows written 100 times:
    # the parse reads every byte as it would distinct rows, and the text is made in a second, not 20)
    block = io.StringIO()
    np.savetxt(block, np.random.default_rng(0).normal(size=(4_000, 38)).astype(np.float32), delimiter=",", fmt="%.7g")
    (incoming / "big.csv.part").write_text(block.getvalue() * 100)
    os.rename(incoming / "big.csv.part", incoming / "big.csv")
    d = Daemon(conf, preexec_fn=AS_SERVICE)
    try:
        d.wait_until(lambda: (r := job_record(tmp_path, "big.csv")) and r.get("stage") == "dataset", "the parse")
        rc, seconds = d.stop(signal.SIGTERM)
    finally:
        d.kill()
    print(f"\nSIGTERM during a parse: exit {rc} after {seconds:.2f} s")
    record = job_record(tmp_path, "big.csv")
    print(f"record: state {record.get('state')}, stage {record.get('stage')}")
    # the parse was stopped, not waited for: the job ends interrupted in its dataset stage (a stop that
    # waited would see it train first). No timing: the stop took 1-2 s idle, 7.0 s beside a CPU hog
    # (the 5 s bound this test had failed there); 60 s only tells a hang
    assert rc == 0 and seconds < 60
    assert record["state"] == "interrupted" and record.get("stage") == "dataset", record
    with service(tmp_path) as d:
        d.wait_until(lambda: "big.csv" in done_names(tmp_path), "the parse after the restart", timeout_s=600)
        then_a_good_dataset_is_trained(d, tmp_path)


def test_row6_an_nvml_call_that_hangs_defers_the_job_and_the_daemon_keeps_serving(tmp_path):
    fake = tmp_path / "fake-nvml"
    fake.mkdir()
    (fake / "pynvml.py").write_text(
        "import os, time\n"
        "class NVMLError(Exception):\n    value = None\n"
        "def nvmlInit():\n"
        f"    calls = {str(tmp_path / 'nvml-calls')!r}\n"
        "    with open(calls, 'a') as f:\n"
        "        f.write('x')\n"
        "    if os.path.getsize(calls) <= 2:  # the daemon's start-up check and the first job's gate\n"
        "        time.sleep(3600)  # a driver call that never returns\n"
        "    raise NVMLError('NVML Shared Library Not Found')\n"
    )
    env = base_env(PYTHONPATH=f"{fake}:{REPO}")
    extra = ["health:", "  retry_s: 1", "job:", "  health_timeout_s: 2"]
    with service(tmp_path, env=env, extra=extra) as d:
        t0 = time.monotonic()
        d.wait_until(lambda: "ds-trainer ready" in d.log(), "ready")
        drop(spool_dir(tmp_path, "incoming"), "m.txt.gz", SMD_TRAIN.read_bytes())
        d.wait_until(lambda: "m.txt.gz" in done_names(tmp_path), "the job after the hung health check")
        assert "health check did not answer within 2 s (a hung NVML call?); jobs run it again" in d.log()
        assert "deferred for 1 s: the health check did not answer within 2 s" in d.log()
        assert time.monotonic() - t0 < 120
        then_a_good_dataset_is_trained(d, tmp_path)


# ---- row 11: leftovers ------------------------------------------------------------------------------

def test_row11_empty_drops_leave_nothing_behind(tmp_path):
    with service(tmp_path) as d:
        incoming = spool_dir(tmp_path, "incoming")
        for i in range(50):
            drop(incoming, f"empty-{i}.csv", b"")
        d.wait_until(lambda: d.log().count("an empty file (0 bytes); removed") == 50, "the empty drops")
        then_a_good_dataset_is_trained(d, tmp_path)
        # done/ shows the dataset before finish() removes its job directory; the job-saved line comes after
        d.wait_until(lambda: "good.txt.gz: model saved to" in d.log(), "the good job's end")
        assert failed_names(tmp_path) == set() and sorted(os.listdir(spool_dir(tmp_path, "failed"))) == []
        assert os.listdir(spool_dir(tmp_path, "processing")) == []


def test_row3_a_job_past_its_memory_limit_fails_in_its_stage_and_the_daemon_lives(tmp_path):
    """job.memory_max is the job process's RLIMIT_DATA: training a 228 MB matrix under 600M fails
    as out of memory in stage training, with the limit named; the daemon never notices."""
    extra = ["job:", "  memory_max: 600M", "  max_matrix_bytes: 1073741824"]
    with service(tmp_path, extra=extra) as d:
        staged = tmp_path / "big.npy"
        np.save(staged, np.random.default_rng(0).normal(size=(1_500_000, 38)).astype(np.float32))
        os.rename(staged, spool_dir(tmp_path, "incoming") / "big.npy")
        d.wait_until(lambda: failed_names(tmp_path) == {"big.npy"}, "the job to fail", timeout_s=300)
        err = read_json(spool_dir(tmp_path, "failed") / "big.npy.error.json")
        assert err["stage"] == "training" and "out of memory" in err["reason"], err
        assert "job.memory_max = 600M" in err["reason"]
        then_a_good_dataset_is_trained(d, tmp_path)
