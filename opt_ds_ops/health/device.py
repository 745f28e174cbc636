"""Device and automatic-mixed-precision decision: which torch device a job gets and which autocast dtype.

Policy (``device: auto``): cuda -> mps -> cpu. AMP (``amp: auto``): bf16 autocast on a CUDA GPU
that supports it (compute capability >= 8.0), else fp16 autocast with GradScaler on CUDA; plain
fp32 on the CPU and MPS, because bf16 autocast measured 4.4x slower than fp32 on the 2-core AVX2
build machines (see README). Explicit ``bf16``/``fp16``/``off`` are honoured on any device.

TF32 (``tf32: true``): with AMP off on a CUDA GPU of compute capability >= 8.0 (Ampere and later,
the GPUs whose tensor cores have TF32), fp32 matmuls may run as TF32
(``torch.set_float32_matmul_precision("high")``: 10-bit mantissa, fp32 range). The default is
``false``, PyTorch's own default since 1.12 ("highest"): amp off is chosen for full fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "off": None}


class DeviceError(ValueError):
    """A requested device or AMP mode that this machine cannot provide."""


@dataclass(frozen=True)
class DevicePlan:
    """What a job runs on: ``device`` (torch.device) and ``amp_dtype`` (None = fp32, no autocast).

    ``use_grad_scaler`` is True exactly for float16 autocast (GradScaler guards fp16 gradients
    from underflow; bf16 has fp32's exponent range and needs none).
    """

    device: torch.device
    amp_dtype: torch.dtype | None
    reason: str = ""
    tf32: bool = False

    @property
    def matmul_precision(self) -> str:
        """``torch.set_float32_matmul_precision``'s argument for this job: ``high`` (TF32) or ``highest``."""
        return "high" if self.tf32 else "highest"

    @property
    def use_grad_scaler(self) -> bool:
        return self.amp_dtype == torch.float16

    @property
    def amp_name(self) -> str:
        return {torch.bfloat16: "bf16", torch.float16: "fp16", None: "off"}[self.amp_dtype]

    def describe(self) -> str:
        tf32 = " tf32=on" if self.tf32 else ""
        return f"{self.device} amp={self.amp_name}{tf32}" + (f" ({self.reason})" if self.reason else "")


def resolve_device(spec: str) -> torch.device:
    """Given ``auto|cpu|mps|cuda|cuda:N``, return the torch.device to use.

    Raises DeviceError if a named device is not available (no CUDA, index out of range, no MPS).
    """
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    dev = torch.device(spec)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device '{spec}' requested but torch sees no CUDA GPU (torch {torch.__version__})")
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise DeviceError(f"device '{spec}' requested but only {torch.cuda.device_count()} CUDA GPU(s) exist")
        return torch.device("cuda", index)
    if dev.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise DeviceError("device 'mps' requested but MPS is not available")
    return dev


def resolve_amp(spec: str, device: torch.device) -> torch.dtype | None:
    """Given ``auto|bf16|fp16|off`` and a device, return the autocast dtype (None = fp32).

    Raises DeviceError for a dtype the device's autocast does not support (fp16 on the CPU
    works with torch >= 2.3; bf16 on a CUDA GPU without bf16 support is refused).
    """
    if spec == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return None
    dtype = AMP_DTYPES[spec]
    if dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise DeviceError(f"amp 'bf16' requested but {torch.cuda.get_device_name(device)} has no bf16 support")
    return dtype


def has_tf32(device: torch.device) -> bool:
    """Return True if device is a CUDA GPU with TF32 tensor cores (compute capability >= 8.0)."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).major >= 8


def plan_device(device_spec: str, amp_spec: str, reason: str = "", tf32: bool = False) -> DevicePlan:
    """Return the :class:`DevicePlan` for the configured device, AMP and TF32 specs; TF32 is on
    only where it applies (amp off on a GPU with TF32, see the module). Raises DeviceError."""
    device = resolve_device(device_spec)
    amp_dtype = resolve_amp(amp_spec, device)
    return DevicePlan(device=device, amp_dtype=amp_dtype, reason=reason,
                      tf32=bool(tf32) and amp_dtype is None and has_tf32(device))
