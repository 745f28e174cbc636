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
    json_bytes = os.path.getsize(spool.path(FAILED, "c.csv.error.json"))
    assert prune_retention(spool, FAILED, 0, 2 * (1000 + json_bytes)) == ["a.csv"]
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
