"""scripts/gpu-check.sh on a machine without a GPU: valid bash, a clean stop after the doctor, and
the dry run (GPU_CHECK_DEVICE=cpu: every step on the CPU, 1-2 minutes on 2 cores) with its table.

The two dry runs are marked ``gpu_check``: `make gpu-check-dry` runs them (CI's gpu-check-dry
stage), `make test` deselects them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import REPO

SCRIPT = REPO / "scripts" / "gpu-check.sh"


def test_gpu_check_is_valid_bash():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the script runs the whole check")
def test_gpu_check_without_cuda_runs_the_doctor_then_stops_with_a_clear_message(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, GPU_CHECK_OUT=str(tmp_path))
    env.pop("GPU_CHECK_DEVICE", None)
    p = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert p.returncode == 3, p.stderr
    assert "no NVIDIA driver" in p.stdout and "a job would get: device cpu" in p.stdout
    assert "torch sees no CUDA GPU" in p.stderr and "Traceback" not in p.stderr
    assert (tmp_path / "doctor.json").is_file() and (tmp_path / "doctor.rc").read_text().strip() == "1"


def _dry_run(tmp_path, **extra):
    env = dict(os.environ, PYTHON=sys.executable, GPU_CHECK_OUT=str(tmp_path), GPU_CHECK_DEVICE="cpu",
               OMP_NUM_THREADS="1", **extra)
    # a hang guard only, above the sum of the steps' own limits (1,530 s at scale 1) times the dry run's scale
    scale = int(os.environ.get("GPU_CHECK_TIMEOUT_SCALE", "5"))
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=1530 * scale + 300)


@pytest.mark.gpu_check
def test_gpu_check_dry_run_on_the_cpu_passes_every_step_and_prints_one_table(tmp_path):
    p = _dry_run(tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    table = p.stdout[p.stdout.index("== summary"):].splitlines()
    assert table[1].split()[:3] == ["check", "status", "device"]
    rows = [line for line in table[2:] if line.strip() and not line.startswith("18 of")]
    status = dict(re.match(r"(.+?)\s{2,}(\S+)", line).groups() for line in rows)  # check -> status
    assert [k for k, v in status.items() if v == "ok"] == [
        "doctor", "smoke bf16", "smoke fp16", "train defaults-machine-1-2-bf16-eager",
        "train defaults-machine-1-2-bf16-graphs", "train defaults-machine-1-2-fp16-eager",
        "train defaults-machine-1-2-fp16-graphs", "train machine-1-2-bf16", "train machine-1-2-fp16",
        "train synthetic-bf16", "train synthetic-fp16", "train synthetic-streamed-bf16", "bench seed loop", "bench ds-ops eager",
        "train fleet stacked", "daemon job", "step tests"], table
    assert status["unit job"] in ("skipped", "ok")  # skipped unless systemd is PID 1 with ds-trainer running
    assert "18 of 18 checks passed or were skipped" in p.stdout and "Traceback" not in p.stderr
    smoke = json.loads((tmp_path / "smoke-fp16.json").read_text())
    assert smoke["ok"] and smoke["device"] == "cpu" and smoke["amp_dtype"] == "fp16"


@pytest.mark.gpu_check
def test_gpu_check_exits_1_naming_the_steps_that_failed(tmp_path):
    p = _dry_run(tmp_path, GPU_CHECK_ROWS="1")  # a 1-row synthetic file cannot be trained on
    assert p.returncode == 1, p.stdout + p.stderr
    assert "15 of 18 checks passed or were skipped; FAILED: train synthetic-bf16, train synthetic-fp16, train synthetic-streamed-bf16" in p.stdout
