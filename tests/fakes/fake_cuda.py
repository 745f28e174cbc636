"""Make the CPU build of torch report CUDA GPUs, for tests of the device decision without a GPU.

Patches only the ``torch.cuda`` queries the health gate and :mod:`opt_ds_ops.device` ask
(is_available, device_count, current_device, is_bf16_supported, get_device_name,
get_device_properties) and ``torch.version.cuda``. Nothing here can run a kernel: tests that use
it must not train on the "cuda" device they get.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch


def fake_cuda(monkeypatch, gpus: list, cuda_version: str | None = "12.4", bf16: bool = True) -> None:
    """Make torch see ``gpus`` (FakeGpu objects: name, uuid) as CUDA devices 0..n-1.

    ``cuda_version`` is what torch says it was built with (None: a CPU build, no GPU visible).
    """
    n = len(gpus) if cuda_version is not None else 0

    def props(i):
        if not 0 <= i < n:
            raise AssertionError("Invalid device id")
        g = gpus[i]
        # torch's _CudaDeviceProperties.uuid prints without the "GPU-" prefix NVML uses.
        return SimpleNamespace(name=g.name, uuid=g.uuid.removeprefix("GPU-"), major=g.compute_capability[0],
                               minor=g.compute_capability[1], total_memory=g.memory_total_mib * 1024 * 1024)

    monkeypatch.setattr(torch.version, "cuda", cuda_version)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: props(getattr(d, "index", d) or 0).name)
