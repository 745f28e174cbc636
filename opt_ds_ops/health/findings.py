"""One GPU's NVML reading judged: its findings and verdict, without torch.

The rules and their sources are :mod:`opt_ds_ops.health.policy`'s, which adds the host's and
torch's findings and the gate's decision, and re-exports these names. They live apart so that the
daemon, whose process never imports torch (its jobs get it from the forkserver), can judge its GPUs
between jobs (:mod:`opt_ds_ops.daemon.slots`) and a job's throttling (:mod:`.gpustats`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config.conffile import HealthConfig
from .nvml import NA, GpuReading

LEVELS = {"ok": 0, "warn": 1, "fail": 2}
THROTTLE_WARN = ("HwSlowdown", "HwThermalSlowdown", "SwThermalSlowdown", "HwPowerBrakeSlowdown")
_MIB = 1024 * 1024


@dataclass(frozen=True)
class Finding:
    """One line of a verdict: ``level`` warn|fail, ``check`` (ecc, temperature, ...), ``message``."""

    level: str
    check: str
    message: str

    def line(self) -> str:
        return f"{self.check}: {self.message}"


def verdict_of(findings: list[Finding]) -> str:
    """Return ``ok``, ``warn`` or ``fail``: the worst level among the findings."""
    return max((f.level for f in findings), key=LEVELS.__getitem__, default="ok")


def _num(v) -> bool:
    return v != NA and v is not None


def judge_gpu(g: GpuReading, hc: HealthConfig, need_bytes: int | None = None) -> list[Finding]:
    """Given one GPU's reading, the health thresholds and the bytes a job needs on the GPU (or
    None), return the findings (empty = ok). Fields that are "n/a" are skipped."""
    out: list[Finding] = []
    if g.lost:
        out.append(Finding("fail", "gpu", f"GPU unusable: {g.lost} (fallen off the bus is Xid 79); reset or reboot"))
    if _num(g.ecc_volatile_uncorrected) and g.ecc_volatile_uncorrected > 0:
        out.append(Finding("fail", "ecc", f"{g.ecc_volatile_uncorrected} uncorrected (double-bit) ECC errors "
                                          "since the driver loaded"))
    if g.remapped_rows_failure is True:
        out.append(Finding("fail", "remapped_rows", "row remapping failed: the memory cannot be repaired (Xid 64)"))
    if g.remapped_rows_pending is True:
        out.append(Finding("warn", "remapped_rows", "a row remap is pending: reset the GPU or reboot to apply it"))
    if _num(g.retired_pages_sbe) and _num(g.retired_pages_dbe):
        pages = g.retired_pages_sbe + g.retired_pages_dbe
        if pages >= hc.retired_pages_fail:
            out.append(Finding("fail", "retired_pages", f"{pages} retired pages >= limit {hc.retired_pages_fail}"))
        elif pages >= hc.retired_pages_warn:
            out.append(Finding("warn", "retired_pages", f"{pages} retired pages >= soft limit {hc.retired_pages_warn}"))
    if g.retired_pages_pending is True:
        out.append(Finding("warn", "retired_pages", "pages pending retirement: reset the GPU or reboot to retire them"))
    out += _judge_thermal(g, hc)
    if isinstance(g.clocks_event_reasons, list):
        active = [r for r in g.clocks_event_reasons if r in THROTTLE_WARN]
        if active:
            out.append(Finding("warn", "throttle", f"clocks held back by {', '.join(active)}"))
    if _num(g.pcie_width_current) and _num(g.pcie_width_max) and g.pcie_width_current < g.pcie_width_max:
        out.append(Finding("warn", "pcie", f"PCIe link runs at x{g.pcie_width_current} of x{g.pcie_width_max} lanes"))
    if need_bytes and _num(g.memory_free_mib) and g.memory_free_mib * _MIB < need_bytes:
        out.append(Finding("fail", "memory", f"{g.memory_free_mib} MiB free, the job needs "
                                             f"{-(-need_bytes // _MIB)} MiB"))
    if g.errors:
        out.append(Finding("warn", "nvml", "NVML could not read " +
                           ", ".join(f"{k} ({v})" for k, v in sorted(g.errors.items()))))
    return out


def _judge_thermal(g: GpuReading, hc: HealthConfig) -> list[Finding]:
    if not _num(g.temperature_c):
        return []
    t, m = g.temperature_c, hc.temp_margin_c
    if _num(g.temp_shutdown_c) and t >= g.temp_shutdown_c - m:
        return [Finding("fail", "temperature", f"{t} °C is within {m} °C of the shutdown threshold {g.temp_shutdown_c} °C")]
    if _num(g.temp_slowdown_c) and t >= g.temp_slowdown_c - m:
        return [Finding("warn", "temperature", f"{t} °C is within {m} °C of the slowdown threshold {g.temp_slowdown_c} °C")]
    return []
