"""scripts/gpu-check.sh on a machine without a GPU: valid bash, and a clean stop after the doctor."""

from __future__ import annotations

import os
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
