"""Device and AMP decision on this CPU-only machine."""

from __future__ import annotations

import pytest
import torch

from opt_ds_ops.device import DeviceError, plan_device, resolve_amp, resolve_device


def test_auto_picks_the_cpu_and_fp32_without_a_gpu():
    plan = plan_device("auto", "auto")
    assert plan.device == torch.device("cpu")
    assert plan.amp_dtype is None and plan.amp_name == "off" and not plan.use_grad_scaler


def test_explicit_amp_is_honoured_and_fp16_brings_the_grad_scaler():
    assert resolve_amp("bf16", torch.device("cpu")) == torch.bfloat16
    plan = plan_device("cpu", "fp16")
    assert plan.amp_dtype == torch.float16 and plan.use_grad_scaler


@pytest.mark.parametrize("spec", ["cuda", "cuda:1"])
def test_a_missing_cuda_device_is_a_clear_error(spec):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(DeviceError, match="torch sees no CUDA GPU"):
        resolve_device(spec)
