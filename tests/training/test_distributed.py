"""``ds-ops train --nproc N``: DistributedDataParallel under torchrun, as CI runs it: 2 CPU
ranks on gloo. The stored model equals a single-process run's within float tolerance; a failure of
the launch or of one rank is one ``ds-ops: error:`` line, no model, no process left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import yaml

from conftest import CLI_QUICK_CONFIG, REPO, run_cli
from opt_ds_ops.config.conffile import load_config
from opt_ds_ops.training.distributed import ddp_batch_bounds, run_ranks, shard
from opt_ds_ops.training.fit import TrainingError, batch_bounds


def _payload(models, name: str) -> dict:
    return torch.load(models / name / "current" / "model.pt", map_location="cpu", weights_only=True)


@pytest.fixture
def odd_smd_csv(tmp_path, smd_rows):
    """5,999 real SMD rows: 5,399 training rows, so the last batch (1,303 rows) splits 652 + 651."""
    path = tmp_path / "machine-odd.csv"
    np.savetxt(path, smd_rows[:5999], delimiter=",", fmt="%.6f")
    return path


def _levels_alone_conf(tmp_path, train: dict | None = None):
    """A conffile of tests/cli-quick.yaml's training (or of ``train``) with input_differences false:
    levels alone, what a distributed run reads, so the one-process run compared with it reads the
    same (the equivalence of the two is under test, not the model's input)."""
    raw = yaml.safe_load(CLI_QUICK_CONFIG.read_text()) if train is None else {"train": dict(train)}
    raw["train"]["input_differences"] = False
    conf = tmp_path / "levels-alone.yaml"
    conf.write_text(yaml.safe_dump(raw))
    return conf


def test_train_nproc_2_stores_the_model_one_process_stores(tmp_path, odd_smd_csv):
    one, two = tmp_path / "one", tmp_path / "two"
    conf = _levels_alone_conf(tmp_path)  # levels alone: one process against two, not the input, is under test
    p1 = run_cli("train", str(odd_smd_csv), "--config", str(conf), "--models-dir", str(one), "--epochs", "3",
                 "--device", "cpu")
    p2 = run_cli("train", str(odd_smd_csv), "--config", str(conf), "--models-dir", str(two), "--epochs", "3",
                 "--device", "cpu", "--nproc", "2")
    assert p1.returncode == 0, p1.stderr
    assert p2.returncode == 0, p2.stderr
    assert [ln.split()[1] for ln in p2.stdout.splitlines() if ln.startswith("epoch ")] == ["1/3", "2/3", "3/3"]
    assert "2 processes" in p2.stdout.splitlines()[0] and p2.stdout.splitlines()[-1].startswith("model: ")
    a, b = _payload(one, "machine-odd"), _payload(two, "machine-odd")
    np.testing.assert_allclose(b["scaler_mean"].numpy(), a["scaler_mean"].numpy(), rtol=1e-12, atol=1e-9)
    np.testing.assert_allclose(b["scaler_std"].numpy(), a["scaler_std"].numpy(), rtol=1e-6)
    assert abs(b["threshold"] - a["threshold"]) <= 0.01 * a["threshold"]
    # every feature within 1 %, plus a tenth of the error floor (0.01) for scales near the floor;
    # docs/architecture.md, "Several processes, one model": two single-process runs that differ only in torch's
    # thread count differ by up to 2.9 % on a feature, so 1 % alone is below float reproducibility
    ea, eb = a["error_scale"].numpy().astype(np.float64), b["error_scale"].numpy().astype(np.float64)
    assert np.all(np.abs(eb - ea) <= 0.01 * ea + 1e-3), (np.abs(eb - ea) / ea).max()
    assert np.linalg.norm(eb - ea) <= 0.01 * np.linalg.norm(ea)
    md1 = json.loads((one / "machine-odd" / "current" / "metadata.json").read_text())
    md2 = json.loads((two / "machine-odd" / "current" / "metadata.json").read_text())
    assert md1["distributed"] is None and md2["distributed"] == {"world_size": 2, "backend": "gloo"}
    assert (md2["rows_train"], md2["rows_val"]) == (md1["rows_train"], md1["rows_val"]) == (5399, 600)
    assert abs(md2["final_train_loss"] - md1["final_train_loss"]) <= 0.01 * md1["final_train_loss"]


def test_train_nproc_2_runs_the_plateau_rule_of_one_process_like_every_rank(tmp_path, odd_smd_csv):
    conf = tmp_path / "plateau.yaml"  # an evaluation every 3 steps, each after the first fails a 90 % gain
    conf.write_text("train:\n  patience: 1\n  min_delta: 0.9\n  min_steps: 0\n  batch_size: 2048\n"
                    "  eval_every_steps: 3\n")  # 3 steps an epoch: the second evaluation stops after epoch 2
    models = tmp_path / "m"
    p = run_cli("train", str(odd_smd_csv), "--config", str(conf), "--models-dir", str(models), "--epochs", "6",
                "--device", "cpu", "--nproc", "2")
    assert p.returncode == 0, p.stderr
    md = json.loads((models / "machine-odd" / "current" / "metadata.json").read_text())
    assert md["distributed"] == {"world_size": 2, "backend": "gloo"} and md["epochs"] == 2
    # the shipped default reads differences (this conffile leaves it), which a distributed run cannot:
    # it reads each metric's level alone, and its version's metadata and notes say so
    assert load_config(str(conf)).train.input_differences is True
    assert md["input_differences"] is False and (md["input_window"], md["window_error"]) == (1, "last")
    assert any(n.startswith("reads each metric's level alone") and "distributed run (2 processes)" in n
               for n in md["dataset"]["notes"]), md["dataset"]["notes"]
    stop = md["stopping"]
    assert (stop["reason"], stop["evaluated"], stop["steps"], stop["evaluations"]) == ("plateau", "every_steps", 6, 2)
    assert stop["best_val_loss"] == pytest.approx(min(h["val_loss"] for h in md["history"]), rel=1e-6)
    # final_val_loss: the published model's (the best evaluated epoch's); last_epoch_val_loss: the last epoch's
    assert md["final_val_loss"] == pytest.approx(stop["best_val_loss"], rel=1e-5)
    assert md["last_epoch_val_loss"] == md["history"][-1]["val_loss"]
    assert "stopped: plateau after 6 steps" in p.stdout


def test_train_nproc_2_stops_mid_epoch_at_the_step_one_process_stops(tmp_path, odd_smd_csv):
    """The ranks evaluate the rule every eval_every_steps steps on the rows one process evaluates, so
    they stop at its step, mid-epoch too (6 steps an epoch, an evaluation every 4)."""
    # levels alone: the rule's step in one process and in two is under test, not the model's input
    conf = _levels_alone_conf(tmp_path, dict(patience=2, min_delta=0.05, min_steps=0, eval_every_steps=4))
    one, two = tmp_path / "one", tmp_path / "two"
    p1 = run_cli("train", str(odd_smd_csv), "--config", str(conf), "--models-dir", str(one), "--device", "cpu")
    p2 = run_cli("train", str(odd_smd_csv), "--config", str(conf), "--models-dir", str(two), "--device", "cpu",
                 "--nproc", "2")
    assert p1.returncode == 0, p1.stderr
    assert p2.returncode == 0, p2.stderr
    s1, s2 = (json.loads((m / "machine-odd" / "current" / "metadata.json").read_text())["stopping"] for m in (one, two))
    assert s1["reason"] == "plateau" and s1["steps"] % 6, s1  # the rule stops it, mid-epoch
    assert (s2["reason"], s2["steps"], s2["best_step"], s2["evaluated"]) == \
        (s1["reason"], s1["steps"], s1["best_step"], "every_steps")
    assert s2["best_val_loss"] == pytest.approx(s1["best_val_loss"], rel=1e-3)


def test_train_nproc_with_too_few_rows_for_the_ranks_fails_and_saves_nothing(tmp_path):
    data = tmp_path / "tiny.csv"
    data.write_text("1,2\n3,4\n5,7\n")  # 2 training rows, 1 validation row: 1 per rank
    p = run_cli("train", str(data), "--models-dir", str(tmp_path / "models"), "--device", "cpu", "--nproc", "2")
    assert p.returncode == 1
    assert p.stderr.strip() == (f"ds-ops: error: {data}: 2 training rows cannot give each of 2 processes 2 rows "
                                "(BatchNorm1d's minimum); use a smaller --nproc")
    assert not (tmp_path / "models" / "tiny").exists()


def test_train_nproc_beyond_the_cpus_is_refused_before_training(tmp_path, small_smd_csv):
    n = (os.cpu_count() or 1) + 1
    p = run_cli("train", str(small_smd_csv), "--models-dir", str(tmp_path), "--device", "cpu", "--nproc", str(n))
    assert p.returncode == 1
    assert p.stderr.strip().endswith(f"--nproc {n}: more processes than this machine's {os.cpu_count()} CPUs")
    assert not (tmp_path / "machine-small").exists()


def test_train_nproc_0_is_a_usage_error(tmp_path, small_smd_csv):
    p = run_cli("train", str(small_smd_csv), "--models-dir", str(tmp_path), "--nproc", "0")
    assert p.returncode == 2 and "--nproc: must be an integer >= 1, got '0'" in p.stderr


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    pids.append(int(pid))
        except OSError:
            continue
    return pids


def _failed_launch(tmp_path, monkeypatch, module: str) -> str:
    """Run two ranks of tests/MODULE.py, which fail; return the launcher's TrainingError, once no
    rank outlives the launch."""
    monkeypatch.setenv("PYTHONPATH", str(REPO / "tests"))
    out = tmp_path / "run"
    out.mkdir()
    with pytest.raises(TrainingError) as e:
        run_ranks(2, ["--dir", str(out)], str(out), None, module=module)
    assert _processes_mentioning(str(out)) == []
    return str(e.value)


def test_a_failing_rank_is_named_and_no_rank_outlives_the_launch(tmp_path, monkeypatch):
    assert _failed_launch(tmp_path, monkeypatch, "ddp_rank_fails") == \
        "distributed training failed on rank 1 of 2: ValueError: the disk of rank 1 is on fire"


@pytest.mark.recovery
def test_a_rank_killed_without_an_error_of_its_own_is_named_from_torchruns_summary(tmp_path, monkeypatch):
    assert _failed_launch(tmp_path, monkeypatch, "ddp_rank_killed") == \
        "distributed training failed (torchrun exit code 1): rank 1 ended with exit code -9 (SIGKILL)"


@pytest.mark.parametrize("faulthandler", ["0", "1"])  # on, Python adds "Fatal Python error: Aborted" after them
def test_a_rank_that_aborts_is_named_with_what_it_said_as_it_aborted(tmp_path, monkeypatch, faulthandler):
    monkeypatch.setenv("DS_OPS_TEST_RANK_DEATH", "abort")
    monkeypatch.setenv("PYTHONFAULTHANDLER", faulthandler) if faulthandler == "1" else monkeypatch.delenv(
        "PYTHONFAULTHANDLER", raising=False)
    assert _failed_launch(tmp_path, monkeypatch, "ddp_rank_killed") == (
        "distributed training failed (torchrun exit code 1): rank 1 ended with exit code -6 (SIGABRT); "
        "terminate called after throwing an instance of 'gloo::IoException'; "
        "what():  [gloo/transport/tcp/pair.cc:598] Connection closed by peer [127.0.0.1]:4242")


def test_the_first_abort_is_reported_with_its_own_what_line():
    from opt_ds_ops.training.distributed import _abort_words

    first, second = ("terminate called after throwing an instance of 'gloo::EnforceNotMet'",
                     "terminate called after throwing an instance of 'gloo::IoException'")
    assert _abort_words([first, second, "what():  enforce fail", "what():  closed by peer"]) == [first]
    assert _abort_words(["noise", first, "what():  enforce fail", "terminate called recursively",
                         "Fatal Python error: Aborted"]) == [first, "what():  enforce fail"]
    assert _abort_words(["Fatal Python error: Aborted"]) == ["Fatal Python error: Aborted"]
    assert _abort_words(["Fatal Python error: Segmentation fault", "Fatal Python error: Aborted"]) == \
        ["Fatal Python error: Segmentation fault"]
    assert _abort_words(["Traceback (most recent call last):", "ValueError: x"]) == []


@pytest.mark.parametrize("sig, code, last_words", [(signal.SIGINT, 130, "ds-ops: interrupted"),
                                                    (signal.SIGTERM, 1, "stopped by SIGTERM")])
@pytest.mark.recovery
def test_a_stopped_train_nproc_leaves_no_rank_and_no_temporary_files(tmp_path, smd_rows, sig, code, last_words):
    data = tmp_path / "long.npy"
    np.save(data, smd_rows)
    scratch = tmp_path / "scratch"  # TMPDIR: the launcher's private directory is made in it
    scratch.mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO), TMPDIR=str(scratch))
    env.pop("DS_OPS_CONFIG", None)
    proc = subprocess.Popen([sys.executable, "-m", "opt_ds_ops.cli", "train", str(data), "--models-dir",
                             str(tmp_path / "models"), "--device", "cpu", "--epochs", "1000", "--nproc", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    for line in proc.stdout:
        if line.startswith("epoch 1/1000"):
            break
    proc.send_signal(sig)
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == code and err.strip().endswith(last_words), err
    assert _processes_mentioning(str(scratch)) == [] and os.listdir(scratch) == []
    assert not (tmp_path / "models" / "long").exists()


LAUNCHER = """
import sys
import numpy as np
from opt_ds_ops.config.conffile import TrainConfig
from opt_ds_ops.health.device import plan_device
from opt_ds_ops.training.distributed import train_distributed

data = np.load(sys.argv[1])
# levels alone (input_differences false), as a job passes a distributed run its config: the matrix copy is under test
train_distributed(data, TrainConfig(epochs=int(sys.argv[3]), input_differences=False), plan_device("cpu", "off"), 2,
                  work_dir=sys.argv[2], on_epoch=lambda s: print("epoch", s.epoch, flush=True))
"""


def _sigkill_a_distributed_job(tmp_path, smd_rows):
    """Run train_distributed in a process of its own, as the daemon's job process does (its matrix
    copy in the job's directory, work_dir), and SIGKILL that process in epoch 2 (the OOM killer, a
    stalled job); return (work_dir, the pids of torchrun and its ranks just before the kill)."""
    np.save(tmp_path / "long.npy", smd_rows)
    work = tmp_path / "job"
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path / "long.npy"), str(work), "1000"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.stdout.readline().split() == ["epoch", "1"]
    running = _processes_mentioning(str(work))
    proc.kill()
    proc.wait(30)
    return work, running


def _gone(pids_of, timeout_s: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := pids_of()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.mark.recovery
def test_torchrun_and_its_ranks_die_with_a_sigkilled_job_process(tmp_path):
    work = tmp_path / "job"
    work.mkdir()
    launcher = ("import sys; from opt_ds_ops.training.distributed import run_ranks; "
                "run_ranks(2, ['--dir', sys.argv[1]], sys.argv[1], None, module='ddp_sleeps')")
    proc = subprocess.Popen([sys.executable, "-c", launcher, str(work)], cwd=REPO, stderr=subprocess.DEVNULL,
                            env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")])))
    deadline = time.monotonic() + 120
    while len(_processes_mentioning(str(work))) < 4 and time.monotonic() < deadline:  # job, torchrun, 2 ranks
        time.sleep(0.2)
    assert len(_processes_mentioning(str(work))) == 4
    proc.kill()
    proc.wait(30)
    assert _gone(lambda: _processes_mentioning(str(work)), timeout_s=10) == []  # the ranks sleep 60 s


@pytest.mark.recovery
def test_the_next_attempt_removes_the_matrix_copy_a_sigkilled_attempt_left(tmp_path, smd_rows):
    work, _ = _sigkill_a_distributed_job(tmp_path, smd_rows)
    _gone(lambda: _processes_mentioning(str(work)))
    assert [n for n in os.listdir(work) if n.startswith("ds-ops-ddp-")]  # the killed attempt's data.npy
    again = subprocess.run([sys.executable, "-c", LAUNCHER, str(tmp_path / "long.npy"), str(work), "1"],
                           capture_output=True, text=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                           timeout=300)
    assert again.returncode == 0, again.stderr
    assert os.listdir(work) == []


def test_gloo_batchnorm_of_two_ranks_equals_one_batchnorm_over_both_parts(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(REPO / "tests"))
    out = tmp_path / "run"
    out.mkdir()
    run_ranks(2, ["--dir", str(out)], str(out), None, module="ddp_sync_bn")
    diffs = json.loads((out / "diffs.json").read_text())
    assert diffs["output"] < 1e-5 and diffs["input_grad"] < 1e-5, diffs
    assert diffs["weight_grad"] < 1e-5 and diffs["bias_grad"] < 1e-5, diffs  # relative
    assert diffs["running_mean"] < 1e-6 and diffs["running_var"] < 1e-5, diffs
    assert diffs["ranks_agree"] == 0.0


def test_shards_cover_the_rows_in_order_with_sizes_within_one():
    for n in (0, 1, 5, 6, 1303):
        for world in (1, 2, 3, 4):
            parts = [shard(n, r, world) for r in range(world)]
            assert parts[0][0] == 0 and parts[-1][1] == n
            assert all(parts[i][1] == parts[i + 1][0] for i in range(world - 1))
            sizes = [e - s for s, e in parts]
            assert max(sizes) - min(sizes) <= 1


def test_ddp_batches_give_every_rank_two_rows_and_equal_batch_bounds_on_one_process():
    for n in (2, 3, 4097, 4100, 5399):
        assert ddp_batch_bounds(n, 2048, 1) == batch_bounds(n, 2048)
    assert ddp_batch_bounds(4099, 2048, 2) == [(0, 2048), (2048, 4099)]  # a 3-row last batch joins
    assert ddp_batch_bounds(4100, 2048, 2) == [(0, 2048), (2048, 4096), (4096, 4100)]
    with pytest.raises(TrainingError, match="3 training rows cannot give each of 2 processes 2 rows"):
        ddp_batch_bounds(3, 2048, 2)
    with pytest.raises(TrainingError, match="batch_size 3 cannot give each of 2 processes 2 rows"):
        ddp_batch_bounds(5, 3, 2)
