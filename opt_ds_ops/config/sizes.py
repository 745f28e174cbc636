"""Sizes and memory of the job processes: the ``MemoryMax=``-like sizes of the conffile
(``8G``, ``50%``), the machine's RAM and a process's data segment, which ``RLIMIT_DATA`` counts."""

from __future__ import annotations

import os


def size_ok(v: str) -> bool:
    try:
        parse_size(v, 1 << 40)
    except ValueError:
        return False
    return True


def parse_size(value: str, total: int) -> int:
    """Return a size in bytes from ``"8589934592"``, ``"8G"`` (K/M/G/T, powers of 1024) or ``"50%"`` of total.

    The forms systemd's ``MemoryMax=`` takes. Raises ValueError for anything else or a size <= 0.
    """
    text = str(value).strip()
    units = {"K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
    try:
        if text.endswith("%"):
            pct = float(text[:-1])
            if not 0 < pct <= 100:
                raise ValueError
            size = int(total * pct / 100)
        elif text[-1:].upper() in units:
            size = int(float(text[:-1]) * units[text[-1].upper()])
        else:
            size = int(text)
    except (ValueError, IndexError, OverflowError):  # OverflowError: inf or 1e400 of a unit
        raise ValueError(f"not a size: {value!r}") from None
    if size <= 0:
        raise ValueError(f"not a size > 0: {value!r}")
    return size


def mem_total_bytes() -> int:
    """Return the machine's RAM (bytes) from ``os.sysconf`` (MemTotal)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# What a job process holds before any dataset (bytes of RLIMIT_DATA, i.e. VmData): torch, numpy,
# pyarrow and ds-ops imported and one small training run, measured 365 MiB with torch 2.13 CPU. The
# least a job's base is taken to be; a job measures its own (:func:`data_segment_bytes`), which is
# larger with a CUDA build of torch: 1.35 GB after ``import torch`` (2.11+cu130, NVIDIA H200
# machine), 1.41 GB once CUDA is initialised.
JOB_BASE_BYTES = 400 * 1024**2

# Keep this much GPU memory free beyond the dataset tensors (bytes): activations, optimizer, CUDA context.
GPU_HEADROOM_BYTES = 512 * 1024**2


def data_segment_bytes() -> int:
    """Return this process's data segment (``VmData`` of /proc/self/status, bytes): what counts
    against ``RLIMIT_DATA``; 0 where it cannot be read."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmData:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0
