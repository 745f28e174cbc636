"""Real export shapes through the daemon's spool: every export shape gives what ``ds-ops train`` gives.

One daemon (as the service user) takes every case of tests/export_cases.py, a sidecar, a pair of
file names that clean up to one model name and a gzip that inflates past spool.max_dataset_bytes.
"""

from __future__ import annotations

import json
import os

from daemon_kit import done_names, failed_names, read_json, spool_dir
from export_cases import CASES, gzip_bomb
from test_daemon_hostile import drop, service

SIDECAR_CSV = "".join(f"2024/05/18 12:00:{i % 60:02d}.{i:03d}, NVIDIA H200, {40 + i % 7}, P{i % 2}\n" for i in range(120))
COLLIDING = "".join(f"{i % 7},{i % 5}\n" for i in range(200)).encode()


def test_every_export_shape_through_the_spool(tmp_path):
    with service(tmp_path, max_dataset_bytes=1_000_000) as d:
        incoming = spool_dir(tmp_path, "incoming")
        drop(incoming, "nvsmi.yaml", b"exclude_columns: [2, 4]\nname: gpu-telemetry\n")  # the sidecar first
        drop(incoming, "nvsmi.csv", SIDECAR_CSV.encode())
        drop(incoming, "typo.yaml", b"exclude_column: [2]\n")
        drop(incoming, "typo.csv", SIDECAR_CSV.encode())
        drop(incoming, "bomb.csv.gz", gzip_bomb())
        drop(incoming, "gpu nöde 1.csv", COLLIDING)
        for _, name, content, _ in CASES:
            drop(incoming, name, content())
        expected = {name for _, name, _, _ in CASES} | {"nvsmi.csv", "typo.csv", "bomb.csv.gz", "gpu nöde 1.csv"}
        d.wait_until(lambda: done_names(tmp_path) | failed_names(tmp_path) >= expected, "every drop to finish",
                     timeout_s=600)
        drop(incoming, "gpu_nüde_1.csv", COLLIDING)  # after its namesake's model exists
        d.wait_until(lambda: "gpu_nüde_1.csv" in failed_names(tmp_path), "the colliding name to be refused")
        assert d.alive()
    done, failed = spool_dir(tmp_path, "done"), spool_dir(tmp_path, "failed")
    for _, name, _, expect in CASES:
        if expect[0] == "refused":
            err = read_json(failed / f"{name}.error.json")
            assert err["stage"] == "dataset" and expect[1] in err["reason"], err
            continue
        result = read_json(done / f"{name}.result.json")
        md = json.loads(open(os.path.join(result["model_dir"], "metadata.json")).read())
        assert md["dataset"]["columns"] == expect[1], (name, md["dataset"])
        if expect[2] is not None:
            expect[2]({"time": md["dataset"]["time"], "header": md["dataset"]["header"],
                       "left_out": md["dataset"]["left_out"]})
    side = read_json(done / "nvsmi.csv.result.json")
    assert side["model_dir"].startswith(str(tmp_path / "models" / "gpu-telemetry"))
    assert (done / "nvsmi.csv.sidecar.yaml").read_bytes().startswith(b"exclude_columns")
    assert not (incoming / "nvsmi.yaml").exists()
    typo = read_json(failed / "typo.csv.error.json")
    assert typo["stage"] == "dataset" and "typo.yaml: unknown key 'exclude_column'" in typo["reason"]
    assert (failed / "typo.csv.sidecar.yaml").exists()
    bomb = read_json(failed / "bomb.csv.gz.error.json")
    assert "more than 1000000 bytes of text after decompression" in bomb["reason"]
    clash = read_json(failed / "gpu_nüde_1.csv.error.json")
    assert clash["stage"] == "dataset" and "already the model of another dataset, 'gpu nöde 1.csv'" in clash["reason"]


def test_a_csv_and_a_parquet_over_the_job_budget_train_streamed_from_the_jobs_own_npy(tmp_path):
    """Under a 100 kB matrix budget a 20,000-row CSV and a Parquet of 4 row groups are
    converted into a .npy in their job's directory while read, trained from it, and leave nothing
    behind: no job directory, no conversion in the store."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(3)
    x = rng.normal(size=(20_000, 4)) * [1, 10, 100, 1] + [0, 1e6, 50, 0]
    text = "time,a,b,c,d\n" + "".join(f"{1.7e9 + 10 * i:.0f}," + ",".join(f"{v:.6f}" for v in r) + "\n"
                                      for i, r in enumerate(x))
    pq.write_table(pa.table({f"m{i}": x[:, i] for i in range(4)}), tmp_path / "fleet.parquet", row_group_size=5000)
    with service(tmp_path, extra=["job:", "  max_matrix_bytes: 100000"]) as d:
        incoming = spool_dir(tmp_path, "incoming")
        drop(incoming, "fleet.csv", text.encode())
        drop(incoming, "fleet2.parquet", (tmp_path / "fleet.parquet").read_bytes())
        d.wait_until(lambda: done_names(tmp_path) | failed_names(tmp_path) >= {"fleet.csv", "fleet2.parquet"},
                     "both to finish", timeout_s=300)
    assert failed_names(tmp_path) == set(), d.log()
    for name in ("fleet.csv", "fleet2.parquet"):
        result = read_json(spool_dir(tmp_path, "done") / f"{name}.result.json")
        md = json.loads(open(os.path.join(result["model_dir"], "metadata.json")).read())
        assert md["data_placement"] == "streamed" and md["dataset"]["rows"] == 20_000, md["data_placement"]
        assert md["dataset"]["columns"] == 4
        note = next(n for n in md["dataset"]["notes"] if "over job.max_matrix_bytes (100,000)" in n)
        assert f" into {spool_dir(tmp_path, 'processing')}/" in note and note.endswith("/converted.npy and streamed from there (removed after training)")
    assert os.listdir(spool_dir(tmp_path, "processing")) == []
    assert not [n for n in os.listdir(tmp_path / "models") if n.startswith(".")]
