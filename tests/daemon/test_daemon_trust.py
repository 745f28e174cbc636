"""Nothing a member of group ds-ops drops can stop the service, or fail or redirect
another member's dataset.

The daemon runs as the unit's user would: as root without CAP_CHOWN, CAP_DAC_OVERRIDE,
CAP_DAC_READ_SEARCH and CAP_FOWNER (daemon_kit.as_service_user), so another uid's inode is as
closed to it as to the ds-ops account; incoming/ has the package's mode 3770. Members are the
uids ALICE and BOB (files chowned to them, as their drops would leave them). Each test ends with
the same daemon process still serving.
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import time
from pathlib import Path

import pytest

from conftest import SMD_TRAIN
import daemon_kit
from daemon_kit import (
    START_TIMEOUT_S, Daemon, as_service_user, done_names, failed_names, read_json, spool_dir, versions,
    write_config,
)

ALICE, BOB = 12345, 12346
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as other uids")


def service(tmp_path, **cfg):
    """A real daemon on tmp_path as the service user (no CAP_CHOWN/DAC/FOWNER)."""
    return daemon_kit.service(tmp_path, as_service_user, **cfg)


def drop(incoming: Path, name: str, data: bytes, uid: int, mode: int = 0o640) -> Path:
    """Drop data as member uid the safe way: NAME.part, chown, chmod, rename."""
    part = incoming / f"{name}.part"
    part.write_bytes(data)
    os.chown(part, uid, os.getgid())
    os.chmod(part, mode)
    os.rename(part, incoming / name)
    return incoming / name


def good(d: Daemon, tmp_path, name: str, uid: int = ALICE, done_as: str | None = None,
         data: bytes | None = None) -> dict:
    """Drop a real SMD training file (or ``data``) as uid and wait for its model (done/``done_as``,
    default NAME); return its result.json."""
    done_as = done_as or name
    drop(spool_dir(tmp_path, "incoming"), name, SMD_TRAIN.read_bytes() if data is None else data, uid)
    d.wait_until(lambda: done_as in done_names(tmp_path), f"{done_as} to become a model")
    return read_json(spool_dir(tmp_path, "done") / f"{done_as}.result.json")


def error_of(tmp_path, name: str) -> dict:
    return read_json(spool_dir(tmp_path, "failed") / f"{name}.error.json")


# ---- row 1: a sidecar the YAML parser chokes on ----------------------------------------------------

def test_row1_sidecars_that_crash_a_parser_fail_their_own_job_and_the_daemon_serves_on(tmp_path):
    """Mixed key types made sorted() raise TypeError and deep nesting RecursionError in the daemon's
    own process (it exited 1 and died again at every restart): now only the job process parses."""
    with service(tmp_path) as d:
        incoming = spool_dir(tmp_path, "incoming")
        pid = d.proc.pid
        drop(incoming, "mixed.yaml", b"1: a\nfoo: b\n", ALICE)
        drop(incoming, "mixed.txt.gz", SMD_TRAIN.read_bytes(), ALICE)
        drop(incoming, "deep.yaml", b"[" * 20000, ALICE)
        drop(incoming, "deep.txt.gz", SMD_TRAIN.read_bytes(), ALICE)
        d.wait_until(lambda: {"mixed.txt.gz", "deep.txt.gz"} <= failed_names(tmp_path), "both to fail")
        for name in ("mixed.txt.gz", "deep.txt.gz"):
            err = error_of(tmp_path, name)
            assert err["stage"] == "dataset" and "sidecar" in err["reason"], err
        assert (spool_dir(tmp_path, "failed") / "mixed.txt.gz.sidecar.yaml").read_bytes() == b"1: a\nfoo: b\n"
        good(d, tmp_path, "after.txt.gz")
        assert d.proc.pid == pid and "intake paused" not in d.log()


# ---- row 2: refusing a file the daemon cannot own ----------------------------------------------------

def test_row2_foreign_0600_and_oversized_files_are_refused_without_pausing_intake(tmp_path):
    """chmod of failed/NAME raised EPERM on another uid's inode (no CAP_FOWNER): the job stayed
    'claiming' and intake paused with doubling back-off for everyone."""
    limit = 64 << 20
    with service(tmp_path, max_dataset_bytes=limit) as d:
        incoming = spool_dir(tmp_path, "incoming")
        drop(incoming, "secret.csv", b"1,2\n3,4\n" * 100, BOB, mode=0o600)
        with open(incoming / "huge.csv.part", "wb") as f:
            f.truncate(limit + 1)  # sparse, over spool.max_dataset_bytes
        os.chown(incoming / "huge.csv.part", BOB, os.getgid())
        os.rename(incoming / "huge.csv.part", incoming / "huge.csv")
        d.wait_until(lambda: {"secret.csv", "huge.csv"} <= failed_names(tmp_path), "both to be refused")
        assert "unreadable: permission denied" in error_of(tmp_path, "secret.csv")["reason"]
        assert "larger than spool.max_dataset_bytes" in error_of(tmp_path, "huge.csv")["reason"]
        failed = spool_dir(tmp_path, "failed")
        assert (failed / "secret.csv").stat().st_uid == BOB  # the user's own inode, moved aside, not re-moded
        good(d, tmp_path, "after.txt.gz")
        d.wait_until(lambda: not list(spool_dir(tmp_path, "processing").iterdir()), "processing/ to be empty")
        assert "intake paused" not in d.log()


# ---- row 7: squatted sidecars and model names ----------------------------------------------------------

def test_row7_a_squatted_sidecar_neither_applies_nor_fails_and_is_moved_aside(tmp_path):
    """Bob's incoming/alice.yaml applied to Alice's alice.csv (columns, name:) or failed it, and
    she could not remove it (sticky bit)."""
    with service(tmp_path) as d:
        incoming = spool_dir(tmp_path, "incoming")
        drop(incoming, "alice.yaml", b"name: bobs_model\ncolumns: [1, 2]\n", BOB)
        (incoming / "carol.yaml").mkdir()
        os.chown(incoming / "carol.yaml", BOB, os.getgid())
        res = good(d, tmp_path, "alice.txt.gz")
        assert res["model_name"] == "alice" and res["columns"] == 38  # Bob's options did not apply
        err = error_of(tmp_path, "alice.yaml")
        assert err["exception_type"] == "SidecarForeign" and f"uid {BOB}" in err["reason"], err
        assert "sidecar-refused" in d.log() or "a sidecar applies only to a dataset of the same uploader" in d.log()
        res = good(d, tmp_path, "carol.txt.gz")  # Bob's directory of that name does not fail Carol's dataset
        assert res["model_name"] == "carol" and (incoming / "carol.yaml").is_dir()
        drop(incoming, "own.yaml", b"name: alice_named\n", ALICE)  # her own sidecar still applies
        assert good(d, tmp_path, "own.txt.gz")["model_name"] == "alice_named"


def test_row7_a_model_name_belongs_to_the_uid_that_first_trained_it(tmp_path):
    """Any member could publish a new ``current`` for any model name, by file name or sidecar."""
    with service(tmp_path) as d:
        incoming = spool_dir(tmp_path, "incoming")
        first = good(d, tmp_path, "gpu01.txt.gz", uid=ALICE)
        drop(incoming, "gpu01.txt.gz", SMD_TRAIN.read_bytes(), BOB)  # by file name
        drop(incoming, "mine.yaml", b"name: gpu01\n", BOB)  # by a sidecar's name:
        drop(incoming, "mine.txt.gz", SMD_TRAIN.read_bytes(), BOB)
        d.wait_until(lambda: {"gpu01.txt.gz", "mine.txt.gz"} <= failed_names(tmp_path), "Bob's two to fail")
        for name in ("gpu01.txt.gz", "mine.txt.gz"):
            assert f"belongs to uid {ALICE}" in error_of(tmp_path, name)["reason"]
        assert versions(tmp_path, "gpu01") == [os.path.basename(first["model_dir"])]
        newer = gzip.compress(gzip.decompress(SMD_TRAIN.read_bytes()).split(b"\n", 1)[1])  # other bytes: a new version
        again = good(d, tmp_path, "gpu01.txt.gz", uid=ALICE, done_as="gpu01.txt.gz.1", data=newer)  # hers: current
        assert again["version"] != first["version"]
        md = json.loads((tmp_path / "models" / "gpu01" / "current" / "metadata.json").read_text())
        assert md["uploader_uid"] == ALICE


# ---- row 8: a file held open by a reader ---------------------------------------------------------------

def test_row8_a_dataset_another_member_keeps_open_is_claimed_after_quiet_s(tmp_path):
    """The watcher's open count never reset while a reader held the file: it was never claimed."""
    with service(tmp_path, settle_s=3.0, quiet_s=2.0, scan_interval_s=1.0) as d:
        path = spool_dir(tmp_path, "incoming") / "held.txt.gz"
        path.write_bytes(SMD_TRAIN.read_bytes())  # Alice copies it in place (closed after writing: settle_s)
        with open(path, "rb") as held:  # within settle_s Bob opens Alice's dataset, and keeps it open
            os.chown(path, ALICE, os.getgid())
            held.read(10)
            d.wait_until(lambda: "held.txt.gz" in done_names(tmp_path), "held.txt.gz to be trained", timeout_s=120)


# ---- row 9: a SIGKILL between the sidecar's rename and the record --------------------------------------

def test_row9_recovery_keeps_a_sidecar_renamed_in_before_the_record_named_it(tmp_path):
    """The state a SIGKILL left between take_sidecar's rename and its record write: recovery
    dropped the sidecar silently and the job trained with default columns and name."""
    from opt_ds_ops.spool import JOB_FILE, SIDECAR_SOURCE, new_job_id, open_spool, write_json

    spool = open_spool(str(tmp_path / "spool"))
    job_id = new_job_id()
    jdir = Path(spool.job_dir(job_id))
    jdir.mkdir(mode=0o750)
    (jdir / "dataset.txt.gz").write_bytes(SMD_TRAIN.read_bytes())
    (jdir / SIDECAR_SOURCE).write_bytes(b"name: from_sidecar\n")
    write_json(str(jdir / JOB_FILE), {"job_id": job_id, "dataset": "k.txt.gz", "state": "claimed",
                                      "data_file": "dataset.txt.gz", "size_bytes": SMD_TRAIN.stat().st_size,
                                      "claimed_at": "2026-12-01T00:00:00.000000Z"})
    with service(tmp_path) as d:
        d.wait_until(lambda: "k.txt.gz" in done_names(tmp_path), "the recovered job to finish")
        assert read_json(spool_dir(tmp_path, "done") / "k.txt.gz.result.json")["model_name"] == "from_sidecar"


# ---- row 10: the claim copy feeds the watchdog -----------------------------------------------------------

def test_row10_the_claim_copy_reports_progress_for_every_chunk(tmp_path):
    """The claim's copy and sha256 of a big file ran on the main loop without a watchdog ping."""
    from opt_ds_ops.spool import COPY_CHUNK, INCOMING, claim, open_spool

    spool = open_spool(str(tmp_path / "spool"))
    with open(spool.path(INCOMING, "big.csv"), "wb") as f:
        f.truncate(8 * COPY_CHUNK + 5)
    calls = []
    c = claim(spool, "big.csv", 1 << 40, on_job=calls.append, progress=lambda: calls.append("ping"))
    assert c.outcome == "claimed" and calls[0] == c.job_id and calls.count("ping") == 9


# ---- one boundary per job, and quarantine -------------------------------------------------------------

def test_an_exception_handling_one_job_fails_that_job_and_the_loop_goes_on(tmp_path):
    """A record the daemon cannot handle (a list where the dataset name goes) raised in the main
    loop and stopped the daemon at every start; now it is that job's failure, with a traceback."""
    from opt_ds_ops.spool import JOB_FILE, new_job_id, open_spool, write_json

    spool = open_spool(str(tmp_path / "spool"))
    job_id = new_job_id()
    jdir = Path(spool.job_dir(job_id))
    jdir.mkdir(mode=0o750)
    (jdir / "dataset.csv").write_bytes(b"1,2\n")
    write_json(str(jdir / JOB_FILE), {"job_id": job_id, "dataset": ["not", "a", "name"], "state": "claimed",
                                      "data_file": "dataset.csv"})
    with service(tmp_path) as d:
        good(d, tmp_path, "after.txt.gz")
        log = d.log()
        assert f"job {job_id}: " in log and "Traceback (most recent call last)" in log


@pytest.mark.recovery
def test_a_job_the_daemon_died_handling_twice_in_a_row_is_quarantined(tmp_path):
    """SIGKILL the daemon twice while it copies the same claim (as an OOM kill or the watchdog
    would): the third start moves it to failed/ instead of handling it again."""
    big = 3 << 30
    conf = write_config(tmp_path, max_dataset_bytes=big + 1)
    incoming = spool_dir(tmp_path, "incoming")
    processing = spool_dir(tmp_path, "processing")

    left: set[int] = set()  # the change time of the copy the first kill left: the second must be a new copy

    def copying() -> bool:
        return any(p.stat().st_size > 0 and p.stat().st_ctime_ns not in left for p in processing.glob("*/dataset.csv"))

    for attempt in range(2):
        d = Daemon(conf, preexec_fn=as_service_user)
        try:
            d.wait_until(lambda: incoming.is_dir(), "the spool", timeout_s=START_TIMEOUT_S)
            if attempt == 0:
                os.chmod(incoming, 0o3770)
                part = incoming / "slow.csv.part"
                with open(part, "wb") as f:
                    f.truncate(big)  # sparse: 3 GiB to read, hash and write
                    for at in range(0, big, 1 << 20):  # a byte in every copy chunk: the claim writes each one
                        f.seek(at)                     # (a chunk of zeros it skips, holes staying holes)
                        f.write(b"x")
                os.chown(part, ALICE, os.getgid())
                os.rename(part, incoming / "slow.csv")
            d.wait_until(copying, "the claim's copy to be under way", timeout_s=START_TIMEOUT_S)
            d.proc.send_signal(signal.SIGKILL)
            d.proc.wait(30)
        finally:
            d.kill()
        for p in processing.glob("*/dataset.csv"):
            assert p.stat().st_size < big, "the copy finished before the kill; the test needs a bigger file"
            left.add(p.stat().st_ctime_ns)
    with service(tmp_path, max_dataset_bytes=big + 1) as d:
        d.wait_until(lambda: "slow.csv" in failed_names(tmp_path), "the quarantine")
        err = error_of(tmp_path, "slow.csv")
        assert err["exception_type"] == "Quarantined" and "died 2 times in a row" in err["reason"], err
        assert (spool_dir(tmp_path, "failed") / "slow.csv").stat().st_size == big  # the user's bytes, kept
        good(d, tmp_path, "after.txt.gz")


# ---- found by the hostile review and the new user's trial ----------------------------------------------

def test_a_lease_on_a_squatted_sidecar_does_not_fail_the_uploaders_dataset(tmp_path):
    """Bob's write lease on his incoming/alice.yaml made the daemon's O_NONBLOCK open raise EAGAIN
    while it moved the file aside: that exception failed Alice's dataset."""
    import fcntl

    with service(tmp_path) as d:
        incoming = spool_dir(tmp_path, "incoming")
        side = drop(incoming, "alice.yaml", b"name: bobs\n", BOB)
        old = signal.signal(signal.SIGIO, signal.SIG_IGN)  # the lease-break notice would end this process
        fd = os.open(side, os.O_RDWR)
        try:
            fcntl.fcntl(fd, 1024, fcntl.F_WRLCK)  # F_SETLEASE: any owner may take one, no capability needed
            res = good(d, tmp_path, "alice.txt.gz")
        finally:
            os.close(fd)
            signal.signal(signal.SIGIO, old)
        assert res["model_name"] == "alice"
        assert "alice.txt.gz" not in failed_names(tmp_path)


def test_a_hard_link_to_another_members_file_is_refused(tmp_path):
    """Bob hard-linked Alice's group-writable .part into incoming/ under her model's name: it
    trained as hers (the inode's owner) and moved her current."""
    with service(tmp_path) as d:
        incoming = spool_dir(tmp_path, "incoming")
        hers = incoming / "alice.txt.gz.part"  # still being written by Alice, mode 0664 under umask 002
        hers.write_bytes(SMD_TRAIN.read_bytes())
        os.chown(hers, ALICE, os.getgid())
        os.chmod(hers, 0o664)
        os.link(hers, incoming / "alice.txt.gz")  # what Bob can do in the setgid, sticky incoming/
        d.wait_until(lambda: "alice.txt.gz" in failed_names(tmp_path), "the link to be refused")
        assert "hard links" in error_of(tmp_path, "alice.txt.gz")["reason"]
        assert not (tmp_path / "models" / "alice").exists()


def test_a_renamed_part_file_that_a_reader_holds_open_is_ready_after_quiet_s(spool):
    """A read-only open of a .part before its rename was carried over as a writer's: the renamed
    dataset waited for as long as the reader kept it open."""
    from opt_ds_ops.spool import INCOMING
    from opt_ds_ops.spool.watcher import IncomingWatcher

    w = IncomingWatcher(spool.dir(INCOMING), settle_s=0.1, quiet_s=0.3, rescan_s=30.0)
    w.start()
    try:
        part = spool.path(INCOMING, "r.csv.part")
        with open(part, "wb") as f:
            f.write(b"1,2\n3,4\n")
        with open(part, "rb"):  # Bob reads Alice's .part and keeps it open
            os.rename(part, spool.path(INCOMING, "r.csv"))
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and w.ready() != ["r.csv"]:
                w.tick()
                time.sleep(0.05)
            assert w.ready() == ["r.csv"]
    finally:
        w.stop()


def test_a_dataset_name_of_255_bytes_is_claimed(spool):
    """take_sidecar looked for NAME.yaml beyond NAME_MAX: ENAMETOOLONG failed a valid dataset."""
    from opt_ds_ops.spool import INCOMING, claim

    name = "y" * 251 + ".csv"
    with open(spool.path(INCOMING, name), "wb") as f:
        f.write(b"1,2\n3,4\n")
    assert claim(spool, name, 1 << 20).outcome == "claimed"


def test_a_file_is_put_back_under_a_name_no_member_can_have_taken(spool):
    """With NAME and NAME.returned-1..99 taken by another member, put-back gave up and the job
    directory was removed with the user's file in it."""
    from opt_ds_ops.spool import INCOMING, SOURCE_FILE, new_job_id
    from opt_ds_ops.spool.claiming import _give_back

    for n in [""] + [f".returned-{i}" for i in range(1, 100)]:
        Path(spool.path(INCOMING, "v.csv" + n)).write_bytes(b"bob\n")
    job_id = new_job_id()
    jdir = Path(spool.job_dir(job_id))
    jdir.mkdir()
    (jdir / SOURCE_FILE).write_bytes(b"alice's data\n")
    back = _give_back(spool, str(jdir), "v.csv")
    assert back == f"v.csv.returned-{job_id}"
    assert Path(spool.path(INCOMING, back)).read_bytes() == b"alice's data\n" and not jdir.exists()
