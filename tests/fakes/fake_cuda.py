"""Make the CPU build of torch report CUDA GPUs, for tests of the device decision without a GPU.

Patches only the ``torch.cuda`` queries the health gate and :mod:`opt_ds_ops.health.device` ask
(is_available, device_count, current_device, is_bf16_supported, get_device_name,
get_device_properties) and ``torch.version.cuda``. :func:`fake_cuda` alone cannot run a kernel:
tests that use only it must not train on the "cuda" device they get. :func:`fake_cuda_runtime`
adds a CUDA runtime that runs on the CPU, with faults (error, hang, NaN, out of memory), for the
CUDA smoke test and the placement of a dataset on the GPU.
"""

from __future__ import annotations

import threading
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


class FakeCudaRuntime:
    """What :func:`fake_cuda_runtime` installed: ``fault`` and the calls it saw.

    ``fault``: None (CUDA works), ``"error"`` (torch.cuda.synchronize raises the illegal memory
    access CUDA reports asynchronously, Xid 13/31), ``"hang"`` (synchronize blocks until
    ``release`` is set; the test's teardown sets it), ``"nan"`` (every tensor copied to the GPU
    arrives as NaN: corrupt memory), ``"oom"`` (copies to the GPU of ``oom_min_bytes`` or more raise
    torch.OutOfMemoryError, as when another tenant holds the memory). ``free_bytes``/``total_bytes``
    are what torch.cuda.mem_get_info answers (``free_bytes`` may be a function: called per query). ``calls``: names of the CUDA calls made, in order.
    """

    def __init__(self, fault: str | None, free_bytes: int, total_bytes: int, oom_min_bytes: int):
        self.fault, self.free_bytes, self.total_bytes, self.oom_min_bytes = fault, free_bytes, total_bytes, oom_min_bytes
        self.release = threading.Event()
        self.calls: list[str] = []
        self.pinned = 0


def _is_cuda(a) -> bool:
    return (isinstance(a, torch.device) and a.type == "cuda") or (isinstance(a, str) and a.startswith("cuda"))


def fake_cuda_runtime(monkeypatch, fault: str | None = None, free_bytes: int = 140 * 1024**3,
                      total_bytes: int = 143771 * 1024**2, oom_min_bytes: int = 0) -> FakeCudaRuntime:
    """Let the CPU build of torch run "CUDA" work on the CPU, with an optional fault (see
    :class:`FakeCudaRuntime`). Use with :func:`fake_cuda` (which makes torch see the GPUs).

    Replaced at torch's boundary: ``Tensor.to`` (a CUDA device becomes the CPU; the fault applies),
    ``Tensor.pin_memory`` (a copy; the CPU build has no pinned allocator), ``torch.empty``,
    ``torch.zeros`` and ``torch.tensor`` (``device=cuda`` becomes the CPU, ``pin_memory=True`` is
    dropped), ``torch.autocast`` and ``torch.amp.GradScaler`` (device type cuda runs as cpu),
    ``torch.cuda.set_device``, ``torch.cuda.synchronize`` and ``torch.cuda.mem_get_info``: enough
    for the smoke test and for :func:`opt_ds_ops.training.fit.train` to run on "cuda:0". Other factories
    (``torch.ones(device="cuda")``, ...) are not covered.
    """
    rt = FakeCudaRuntime(fault, free_bytes, total_bytes, oom_min_bytes)
    monkeypatch.setattr(torch.version, "cuda", torch.version.cuda or "12.4")
    real_to, real_autocast, real_scaler = torch.Tensor.to, torch.autocast, torch.amp.GradScaler

    def to(self, *args, **kw):
        cuda = any(_is_cuda(a) for a in args) or _is_cuda(kw.get("device"))
        if cuda:
            rt.calls.append("to")
            nbytes = self.element_size() * self.nelement()
            if rt.fault == "oom" and nbytes >= rt.oom_min_bytes:
                raise torch.OutOfMemoryError(
                    f"CUDA out of memory. Tried to allocate {nbytes / 1024**2:.2f} MiB. GPU 0 has a total capacity "
                    f"of {rt.total_bytes / 1024**3:.2f} GiB.")
            args = tuple("cpu" if _is_cuda(a) else a for a in args)
            if "device" in kw:
                kw["device"] = "cpu"
        out = real_to(self, *args, **kw)
        if cuda and rt.fault == "nan" and out.is_floating_point():
            out = out.detach().clone().fill_(float("nan")).requires_grad_(self.requires_grad)
        return out

    def pin_memory(self, *a, **k):
        rt.calls.append("pin_memory")
        rt.pinned += 1
        return self.clone()

    def synchronize(device=None):
        rt.calls.append("synchronize")
        if rt.fault == "error":
            raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered\n"
                                         "CUDA kernel errors might be asynchronously reported at some other API call")
        if rt.fault == "hang":
            rt.release.wait()

    def factory(real):
        def make(*args, **kw):
            if _is_cuda(kw.get("device")):
                kw["device"] = "cpu"
            if kw.get("pin_memory"):
                rt.calls.append("pin_memory")
                kw["pin_memory"] = False
            return real(*args, **kw)
        return make

    for name in ("empty", "zeros", "tensor"):
        monkeypatch.setattr(torch, name, factory(getattr(torch, name)))
    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch, "autocast", lambda device_type, *a, **k: real_autocast(
        "cpu" if device_type == "cuda" else device_type, *a, **k))
    monkeypatch.setattr(torch.amp, "GradScaler", lambda device="cuda", *a, **k: real_scaler(
        "cpu" if device == "cuda" else device, *a, **k))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: rt.calls.append("set_device"))
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (
        rt.free_bytes() if callable(rt.free_bytes) else rt.free_bytes, rt.total_bytes))
    return rt
