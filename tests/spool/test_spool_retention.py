"""Retention of done/ and failed/ by age and bytes, and requeue from failed/, on real spool files."""

from __future__ import annotations

import json
import os
import time

import pytest

from opt_ds_ops.spool import DONE, FAILED, INCOMING, SpoolError, prune_retention, requeue


def finished(spool, dest: str, name: str, size: int, age_days: float, *, sidecar: bool = False) -> None:
    """Put a finished dataset of size bytes into dest with its JSON, finished age_days ago."""
    suffix = ".result.json" if dest == DONE else ".error.json"
    with open(spool.path(dest, name), "wb") as f:
        f.write(b"1" * size)
    if sidecar:
        with open(spool.path(dest, name + ".sidecar.yaml"), "w") as f:
            f.write("name: x\n")
    doc = spool.path(dest, name + suffix)
    with open(doc, "w") as f:
        json.dump({"job_id": name, "dataset": name, "dataset_file": name, "failed_at": "2026-01-01T00:00:00.000000Z"}, f)
    t = time.time() - age_days * 86400
    os.utime(doc, (t, t))


def test_done_older_than_max_age_goes_with_its_json_and_sidecar(spool):
    finished(spool, DONE, "old.csv", 10, 40, sidecar=True)
    finished(spool, DONE, "new.csv", 10, 1)
    assert prune_retention(spool, DONE, 30, 0) == ["old.csv"]
    assert sorted(os.listdir(spool.dir(DONE))) == ["new.csv", "new.csv.result.json"]
    assert prune_retention(spool, DONE, 0, 0) == []  # both rules off


def test_failed_beyond_max_bytes_loses_its_oldest_first(spool):
    for i, name in enumerate(["a.csv", "b.csv", "c.csv"]):
        finished(spool, FAILED, name, 1000, 3 - i)
    entry_bytes = sum(os.stat(spool.path(FAILED, n)).st_blocks * 512 for n in ("c.csv", "c.csv.error.json"))
    assert prune_retention(spool, FAILED, 0, 2 * entry_bytes) == ["a.csv"]
    assert sorted(os.listdir(spool.dir(FAILED))) == ["b.csv", "b.csv.error.json", "c.csv", "c.csv.error.json"]


def test_requeue_puts_the_sidecar_then_the_dataset_back_and_refuses_a_clash(spool):
    finished(spool, FAILED, "m.csv", 10, 0, sidecar=True)
    out = requeue(spool, "m.csv")
    assert (out["dataset"], out["sidecar"]) == ("m.csv", "m.yaml")
    assert sorted(os.listdir(spool.dir(INCOMING))) == ["m.csv", "m.yaml"]
    assert os.listdir(spool.dir(FAILED)) == []
    finished(spool, FAILED, "m.csv", 10, 0)
    with pytest.raises(SpoolError, match="incoming/m.csv exists already"):
        requeue(spool, "m.csv")
    assert os.path.exists(spool.path(FAILED, "m.csv"))
    for bad in ("../x", ".hidden", "nope.csv"):
        with pytest.raises(SpoolError):
            requeue(spool, bad)


def _finish(spool, dest: str, name: str, doc: dict, *, sidecar: bool = False) -> str:
    """Claim incoming/name and finish it into dest as the daemon does (with a sidecar copy if asked)."""
    from opt_ds_ops import spool as sp

    with open(spool.path(INCOMING, name), "wb") as f:
        f.write(b"1,2\n3,4\n")
    c = sp.claim(spool, name, 10**6)
    assert c.outcome == "claimed"
    if sidecar:
        with open(spool.job_path(c.job_id, sp.SIDECAR_FILE), "w") as f:
            f.write("name: x\n")
    return sp.finish(spool, c.job_id, c.record, dest, dict(doc, job_id=c.job_id))


@pytest.mark.parametrize("name", ["big.csv", "b" * 250 + ".csv"])  # the second's JSON name is cut and hashed
def test_a_result_json_over_1_mib_does_not_keep_its_dataset_in_done_forever(spool, name):
    _finish(spool, DONE, name, {"history": [{"epoch": i, "train_loss": 0.5} for i in range(40_000)]}, sidecar=True)
    assert max(os.path.getsize(spool.path(DONE, n)) for n in os.listdir(spool.dir(DONE))) > 1 << 20
    assert prune_retention(spool, DONE, 30, 0, now=time.time() + 40 * 86400) == [name]
    assert os.listdir(spool.dir(DONE)) == []


def test_prune_failed_counts_a_dataset_with_its_sidecar_once(spool):
    from opt_ds_ops.spool import prune_failed

    for i in range(3):
        _finish(spool, FAILED, f"bad-{i}.csv", {"reason": "x"}, sidecar=True)
        for n in os.listdir(spool.dir(FAILED)):
            if n.startswith(f"bad-{i}.csv"):
                os.utime(spool.path(FAILED, n), ns=(i * 10**9, i * 10**9))
    assert prune_failed(spool, 3) == []  # 3 datasets, 9 files
    assert prune_failed(spool, 2) == ["bad-0.csv"]
    assert sorted(os.listdir(spool.dir(FAILED))) == sorted(
        f"bad-{i}.csv{s}" for i in (1, 2) for s in ("", ".error.json", ".sidecar.yaml"))


def test_a_member_whose_drops_fail_by_the_score_ages_out_only_their_own_failures(spool):
    """Member B's 20 failures, their files dated 2100, come after member A's 3: with max_failed 10,
    B's 13 oldest go and A's 3 stay. Before, failed/ was ordered by the files' mtime, which B set:
    A's failures went first, and each new failure of A's went right after it failed."""
    from opt_ds_ops.spool import prune_failed

    a = [_finish(spool, FAILED, f"a-{i}.csv", {"reason": "x", "uploader_uid": 1001}) for i in range(3)]
    b = [_finish(spool, FAILED, f"b-{i:02d}.csv", {"reason": "x", "uploader_uid": 1002}) for i in range(20)]
    year_2100 = 4_102_444_800 * 10**9
    for name in b:
        os.utime(spool.path(FAILED, name), ns=(year_2100, year_2100))  # kept from the member's file
    removed = prune_failed(spool, 10)
    print(f"\nremoved {len(removed)}: {removed[0]} .. {removed[-1]}")
    assert removed == b[:13]
    assert all(os.path.exists(spool.path(FAILED, n)) for n in a + b[13:])
    later = _finish(spool, FAILED, "a-3.csv", {"reason": "x", "uploader_uid": 1001})  # A's next failure stays
    assert prune_failed(spool, 10) == [b[13]] and os.path.exists(spool.path(FAILED, later))


def test_a_members_file_named_like_an_error_json_names_no_other_entry_to_remove(spool):
    """A member drops ``bogus.error.json`` whose text says ``dataset_file: victim.csv``, dated 1970:
    refused, it lands in failed/ with a JSON of its own. Before, retention read it as the JSON of
    victim.csv (another member's failure, a day old) and removed victim.csv as 56 years old."""
    finished(spool, FAILED, "victim.csv", 1000, 1)
    with open(spool.path(FAILED, "bogus.error.json"), "w") as f:
        json.dump({"job_id": "x", "dataset_file": "victim.csv"}, f)
    os.utime(spool.path(FAILED, "bogus.error.json"), (0, 0))
    with open(spool.path(FAILED, "bogus.error.json.error.json"), "w") as f:
        json.dump({"job_id": "j2", "dataset": "bogus", "dataset_file": "bogus.error.json"}, f)
    assert prune_retention(spool, FAILED, 30, 0) == []
    assert "victim.csv" in os.listdir(spool.dir(FAILED))
    # a JSON's text never points at another name: the daemon's JSON of a dataset is always NAME.error.json
    with open(spool.path(FAILED, "other.csv.error.json"), "w") as f:
        json.dump({"job_id": "j3", "dataset_file": "victim.csv"}, f)
    os.utime(spool.path(FAILED, "other.csv.error.json"), (0, 0))
    assert prune_retention(spool, FAILED, 30, 0) == ["other.csv.error.json"]  # its own name only (no other.csv)
    assert "victim.csv" in os.listdir(spool.dir(FAILED))


def test_the_byte_budget_counts_the_space_taken_so_a_sparse_file_pushes_out_no_one(spool):
    """A 1 GiB hole (``truncate -s``, kept sparse by the claim) counted 1 GiB of spool.max_failed_bytes
    and pushed the other members' failures out; it takes a few KiB."""
    finished(spool, FAILED, "victim.csv", 1000, 2)
    finished(spool, FAILED, "sparse.csv", 0, 1)
    with open(spool.path(FAILED, "sparse.csv"), "wb") as f:
        f.truncate(1 << 30)
    assert prune_retention(spool, FAILED, 0, 1 << 20) == []
    assert "victim.csv" in os.listdir(spool.dir(FAILED))
