"""A stand-in for nvidia-ml-py's ``pynvml`` module, replacing it at its boundary in ``sys.modules``.

The fake keeps the real module's constants and its NVMLError class hierarchy (so
``pynvml.NVMLError(3)`` is an ``NVMLError_NotSupported`` exactly as on a real machine) and swaps
only the functions that call libnvidia-ml.so.1. Each GPU is a :class:`FakeGpu`; its handle is the
object itself. ``unsupported`` makes a call raise NOT_SUPPORTED, ``failing`` makes it raise any
other NVML error, ``missing`` makes it raise FUNCTION_NOT_FOUND (an older driver), ``lost``
makes every call raise GPU_IS_LOST.

Where the figures come from (NVIDIA's public documents; no real H200 was at hand to read them):
- H200 SXM: 141 GB HBM3e, which nvidia-smi shows as 143771 MiB total; "max TDP up to 700 W"
  and "PCIe Gen5: 128 GB/s" (= x16) from the NVIDIA H200 Tensor Core GPU datasheet; compute
  capability 9.0 (Hopper) from the CUDA programming guide's table.
- H100 SXM5 80 GB: 81559 MiB as nvidia-smi shows it, 700 W, PCIe Gen5 x16 (H100 datasheet).
- Slowdown 89 degC / shutdown 92 degC: what `nvidia-smi -q` prints under "Temperature" on
  H100 SXM boards (inside the 87-90 degC slowdown range NVIDIA documents for data-centre parts).
- Idle readings: P0, about 70 W, 30 degC, 0 % utilisation, clocks-event reason GpuIdle only.
- SM clock 1980 MHz: the H100/H200 SXM maximum boost clock in public spec listings (what
  `nvidia-smi -q` shows under "Max Clocks"; not read from a real board).
- Driver 550.54.15 is an R550 production driver (the first branch listing H200), which supports
  CUDA 12.4 (NVML reports 12040); NVML version "12.550.54.15".
- V100 SXM2 16 GB (a board with page retirement instead of row remapping): 16160 MiB, 300 W,
  PCIe Gen3 x16, slowdown 87 degC / shutdown 90 degC, compute capability 7.0.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from types import SimpleNamespace

import pynvml as _real

MIB = 1024 * 1024


@dataclass
class FakeGpu:
    """One fake GPU; units as NVML returns them (bytes via MiB here, milliwatts, degC).

    ``temperature_c``, ``power_draw_mw``, ``sm_clock_mhz``, ``pstate``, ``clocks_event_mask`` and
    ``processes`` may be functions of no arguments: each query calls them (readings that change
    while a job trains; one that raises NVMLError is a query that fails)."""

    name: str = "NVIDIA H200"
    uuid: str = "GPU-4d6e1c2a-8b3f-4e57-9a10-2f6c3b8d9e01"
    bus_id: str = "00000000:18:00.0"
    compute_capability: tuple = (9, 0)
    memory_total_mib: int = 143771
    memory_used_mib: int = 1
    temperature_c: int = 30
    slowdown_c: int = 89
    shutdown_c: int = 92
    power_draw_mw: int = 70_000
    power_limit_mw: int = 700_000
    pstate: int = 0
    utilization: tuple = (0, 0)  # gpu %, memory %
    pcie: tuple = (5, 5, 16, 16)  # gen current, gen max, width current, width max
    clocks_event_mask: int = _real.nvmlClocksEventReasonGpuIdle
    sm_clock_mhz: int = 1980
    processes: list = field(default_factory=list)  # (pid, used bytes or None) of compute processes
    ecc_mode: tuple = (_real.NVML_FEATURE_ENABLED, _real.NVML_FEATURE_ENABLED)
    ecc: dict = field(default_factory=lambda: {"volatile_corrected": 0, "volatile_uncorrected": 0,
                                               "aggregate_corrected": 0, "aggregate_uncorrected": 0})
    retired_pages: tuple | None = None  # (sbe count, dbe count, pending 0/1); None: NOT_SUPPORTED (Hopper)
    remapped_rows: tuple | None = (0, 0, 0, 0)  # (correctable, uncorrectable, pending, failure)
    unsupported: set = field(default_factory=set)
    failing: dict = field(default_factory=dict)  # function name -> NVML error code
    lost: bool = False


def h200(**kw) -> FakeGpu:
    """An idle, healthy H200 SXM (figures: see the module docstring)."""
    return FakeGpu(**kw)


def h100(**kw) -> FakeGpu:
    """An idle, healthy H100 SXM5 80 GB."""
    base = dict(name="NVIDIA H100 80GB HBM3", uuid="GPU-9a1b2c3d-0e1f-4a5b-8c7d-6e5f4a3b2c1d",
                bus_id="00000000:2A:00.0", memory_total_mib=81559)
    return FakeGpu(**{**base, **kw})


def v100(**kw) -> FakeGpu:
    """An idle, healthy V100 SXM2 16 GB: retires pages, has no row remapper."""
    base = dict(name="Tesla V100-SXM2-16GB", uuid="GPU-1c2d3e4f-5a6b-4c7d-8e9f-0a1b2c3d4e5f",
                bus_id="00000000:3B:00.0", compute_capability=(7, 0), memory_total_mib=16160,
                temperature_c=35, slowdown_c=87, shutdown_c=90, power_draw_mw=42_000,
                power_limit_mw=300_000, pcie=(3, 3, 16, 16), retired_pages=(0, 0, 0), remapped_rows=None)
    return FakeGpu(**{**base, **kw})


@dataclass
class FakeNvml:
    """The host as the fake NVML reports it. ``init_error``: an NVML error code nvmlInit raises
    (12 LIBRARY_NOT_FOUND, 9 DRIVER_NOT_LOADED, 18 LIB_RM_VERSION_MISMATCH) or None."""

    gpus: list = field(default_factory=lambda: [h200()])
    driver_version: str = "550.54.15"
    nvml_version: str = "12.550.54.15"
    cuda_driver_version: int = 12040
    init_error: int | None = None
    missing: set = field(default_factory=set)  # function names this "driver" lacks
    calls: list = field(default_factory=list)

    def module(self) -> types.ModuleType:
        """Return a module object that can stand in for ``pynvml`` in ``sys.modules``."""
        mod = types.ModuleType("pynvml")
        for name in dir(_real):
            if name.startswith(("NVML_", "NVMLError", "nvmlClocks")):
                setattr(mod, name, getattr(_real, name))
        for name in dir(self):
            if name.startswith("nvml"):
                setattr(mod, name, getattr(self, name))
        return mod

    # --- the boundary ---
    def _call(self, name: str, h: FakeGpu | None, value):
        self.calls.append(name)
        if name in self.missing:
            raise _real.NVMLError(_real.NVML_ERROR_FUNCTION_NOT_FOUND)
        if h is not None:
            if h.lost:
                raise _real.NVMLError(_real.NVML_ERROR_GPU_IS_LOST)
            if name in h.unsupported:
                raise _real.NVMLError(_real.NVML_ERROR_NOT_SUPPORTED)
            if name in h.failing:
                raise _real.NVMLError(h.failing[name])
        return value() if callable(value) else value

    def nvmlInit(self):
        self.calls.append("nvmlInit")
        if self.init_error is not None:
            raise _real.NVMLError(self.init_error)

    def nvmlShutdown(self):
        self.calls.append("nvmlShutdown")

    def nvmlSystemGetDriverVersion(self):
        return self._call("nvmlSystemGetDriverVersion", None, self.driver_version)

    def nvmlSystemGetNVMLVersion(self):
        return self._call("nvmlSystemGetNVMLVersion", None, self.nvml_version)

    def nvmlSystemGetCudaDriverVersion_v2(self):
        return self._call("nvmlSystemGetCudaDriverVersion_v2", None, self.cuda_driver_version)

    def nvmlSystemGetCudaDriverVersion(self):
        return self._call("nvmlSystemGetCudaDriverVersion", None, self.cuda_driver_version)

    def nvmlDeviceGetCount(self):
        return self._call("nvmlDeviceGetCount", None, len(self.gpus))

    def nvmlDeviceGetHandleByIndex(self, index):
        if not 0 <= index < len(self.gpus):
            raise _real.NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
        return self._call("nvmlDeviceGetHandleByIndex", self.gpus[index], self.gpus[index])

    def nvmlDeviceGetHandleByUUID(self, uuid):
        uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
        found = [g for g in self.gpus if g.uuid == uuid]
        if not found:
            raise _real.NVMLError(_real.NVML_ERROR_NOT_FOUND)
        return self._call("nvmlDeviceGetHandleByUUID", found[0], found[0])

    def nvmlDeviceGetClockInfo(self, h, clock_type):
        return self._call("nvmlDeviceGetClockInfo", h, h.sm_clock_mhz if clock_type == _real.NVML_CLOCK_SM else 2619)

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return self._call("nvmlDeviceGetComputeRunningProcesses", h, lambda: [
            SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in (h.processes() if callable(h.processes)
                                                                            else h.processes)])

    def nvmlDeviceGetName(self, h):
        return self._call("nvmlDeviceGetName", h, h.name)

    def nvmlDeviceGetUUID(self, h):
        return self._call("nvmlDeviceGetUUID", h, h.uuid)

    def nvmlDeviceGetPciInfo(self, h):
        # The real c_nvmlPciInfo_t's busId is a c_char array: bytes, not str.
        return self._call("nvmlDeviceGetPciInfo", h, SimpleNamespace(busId=h.bus_id.encode()))

    def nvmlDeviceGetCudaComputeCapability(self, h):
        return self._call("nvmlDeviceGetCudaComputeCapability", h, h.compute_capability)

    def nvmlDeviceGetMemoryInfo(self, h, version=None):
        total, used = h.memory_total_mib * MIB, h.memory_used_mib * MIB
        return self._call("nvmlDeviceGetMemoryInfo", h, SimpleNamespace(total=total, used=used, free=total - used))

    def nvmlDeviceGetUtilizationRates(self, h):
        gpu, mem = h.utilization
        return self._call("nvmlDeviceGetUtilizationRates", h, SimpleNamespace(gpu=gpu, memory=mem))

    def nvmlDeviceGetTemperatureV(self, h, sensor, version=None):
        return self._call("nvmlDeviceGetTemperatureV", h, h.temperature_c)

    def nvmlDeviceGetTemperature(self, h, sensor):
        return self._call("nvmlDeviceGetTemperature", h, h.temperature_c)

    def nvmlDeviceGetTemperatureThreshold(self, h, threshold):
        value = {_real.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: h.slowdown_c,
                 _real.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN: h.shutdown_c}[threshold]
        return self._call("nvmlDeviceGetTemperatureThreshold", h, value)

    def nvmlDeviceGetPowerUsage(self, h):
        return self._call("nvmlDeviceGetPowerUsage", h, h.power_draw_mw)

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        return self._call("nvmlDeviceGetEnforcedPowerLimit", h, h.power_limit_mw)

    def nvmlDeviceGetPowerManagementLimit(self, h):
        return self._call("nvmlDeviceGetPowerManagementLimit", h, h.power_limit_mw)

    def nvmlDeviceGetPerformanceState(self, h):
        return self._call("nvmlDeviceGetPerformanceState", h, h.pstate)

    def nvmlDeviceGetPowerState(self, h):
        return self._call("nvmlDeviceGetPowerState", h, h.pstate)

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h):
        return self._call("nvmlDeviceGetCurrPcieLinkGeneration", h, h.pcie[0])

    def nvmlDeviceGetGpuMaxPcieLinkGeneration(self, h):
        return self._call("nvmlDeviceGetGpuMaxPcieLinkGeneration", h, h.pcie[1])

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):
        return self._call("nvmlDeviceGetMaxPcieLinkGeneration", h, h.pcie[1])

    def nvmlDeviceGetCurrPcieLinkWidth(self, h):
        return self._call("nvmlDeviceGetCurrPcieLinkWidth", h, h.pcie[2])

    def nvmlDeviceGetMaxPcieLinkWidth(self, h):
        return self._call("nvmlDeviceGetMaxPcieLinkWidth", h, h.pcie[3])

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return self._call("nvmlDeviceGetCurrentClocksEventReasons", h, h.clocks_event_mask)

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h):
        return self._call("nvmlDeviceGetCurrentClocksThrottleReasons", h, h.clocks_event_mask)

    def nvmlDeviceGetEccMode(self, h):
        return self._call("nvmlDeviceGetEccMode", h, list(h.ecc_mode))

    def nvmlDeviceGetTotalEccErrors(self, h, error_type, counter_type):
        kind = "corrected" if error_type == _real.NVML_MEMORY_ERROR_TYPE_CORRECTED else "uncorrected"
        scope = "volatile" if counter_type == _real.NVML_VOLATILE_ECC else "aggregate"
        return self._call("nvmlDeviceGetTotalEccErrors", h, h.ecc[f"{scope}_{kind}"])

    def nvmlDeviceGetRetiredPages(self, h, cause):
        if h.retired_pages is None:
            raise _real.NVMLError(_real.NVML_ERROR_NOT_SUPPORTED)
        n = h.retired_pages[0 if cause == _real.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS else 1]
        return self._call("nvmlDeviceGetRetiredPages", h, [0x1000 * (i + 1) for i in range(n)])

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h):
        if h.retired_pages is None:
            raise _real.NVMLError(_real.NVML_ERROR_NOT_SUPPORTED)
        return self._call("nvmlDeviceGetRetiredPagesPendingStatus", h, h.retired_pages[2])

    def nvmlDeviceGetRemappedRows(self, h):
        if h.remapped_rows is None:
            raise _real.NVMLError(_real.NVML_ERROR_NOT_SUPPORTED)
        return self._call("nvmlDeviceGetRemappedRows", h, tuple(h.remapped_rows))


def install(monkeypatch, fake: FakeNvml) -> FakeNvml:
    """Put ``fake`` in ``sys.modules['pynvml']`` for one test (monkeypatch undoes it); return it."""
    monkeypatch.setitem(sys.modules, "pynvml", fake.module())
    return fake
