"""GPU and driver readings through NVML (nvidia-ml-py, imported as ``pynvml``): no judgement here.

Given nothing, :func:`read_host` initialises NVML, reads the driver and every GPU, shuts NVML
down and returns a :class:`HostReading`. Judging the readings is :mod:`opt_ds_ops.health.policy`'s job.

Every query runs on its own: NVML_ERROR_NOT_SUPPORTED (or a call this driver or this
nvidia-ml-py lacks) makes that one field ``"n/a"`` (:data:`NA`) and is never an error; any other
NVML error also makes the field ``"n/a"`` and is recorded in the GPU's ``errors`` (field -> NVML's
words). NVML_ERROR_GPU_IS_LOST (the GPU fell off the bus, the case the kernel logs as Xid 79) and
NVML_ERROR_RESET_REQUIRED stop the reading of that GPU and are kept in ``lost``.

``pynvml`` is imported when :func:`read_host` runs, not at module import, so tests can put a fake
module into ``sys.modules['pynvml']`` (see tests/fakes/fake_pynvml.py) and a machine without
nvidia-ml-py still gets a clean "no NVIDIA library" reading.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import Any

NA = "n/a"

# Clocks-event (throttle) reason bits, named as NVML's constants name them (nvmlClocksEventReason*,
# pynvml.py of nvidia-ml-py 13.615; the same bits as the older nvmlClocksThrottleReason*). These
# are the reasons `nvidia-smi -q` lists under "Clocks Event Reasons".
CLOCKS_EVENT_REASONS = {
    0x0001: "GpuIdle",
    0x0002: "ApplicationsClocksSetting",
    0x0004: "SwPowerCap",
    0x0008: "HwSlowdown",
    0x0010: "SyncBoost",
    0x0020: "SwThermalSlowdown",
    0x0040: "HwThermalSlowdown",
    0x0080: "HwPowerBrakeSlowdown",
    0x0100: "DisplayClockSetting",
    0x0200: "BoardLimit",
    0x0400: "Reliability",
}

# NVML init failures that mean "this host has no usable NVIDIA GPU", by NVML error code
# (NVML_ERROR_LIBRARY_NOT_FOUND = 12, NVML_ERROR_DRIVER_NOT_LOADED = 9, NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18).
INIT_STATUS = {12: "no_library", 9: "no_driver", 18: "version_mismatch"}

_MIB = 1024 * 1024


@dataclass
class GpuReading:
    """One GPU as NVML sees it. Each value is a number/string, or ``"n/a"`` where not supported.

    Units are in the names: ``*_mib`` MiB (2**20 bytes), ``*_c`` degrees Celsius, ``*_w`` watts,
    ``*_pct`` percent. ``pstate`` is ``"P0"`` (fastest) .. ``"P15"``. ``pcie_gen_*``/``pcie_width_*``
    are the PCIe link generation (1..6) and lane count (x1..x16), current and maximum.
    ``clocks_event_reasons`` is the list of active reason names (see CLOCKS_EVENT_REASONS),
    ``clocks_event_mask`` the raw bitmask. ``ecc_*`` are counts of corrected (single-bit) and
    uncorrected (double-bit) errors, volatile (since the driver loaded) and aggregate (lifetime).
    ``retired_pages_*`` (page retirement, pre-A100 boards) and ``remapped_rows_*`` (row remapping,
    A100 and later) are the two memory-repair mechanisms; a board supports one of them.
    ``errors``: field -> NVML error text for failed queries other than NOT_SUPPORTED.
    ``lost``: NVML's words when the GPU is lost or needs a reset; the other fields are then partial.
    """

    index: int
    name: Any = NA
    uuid: Any = NA
    pci_bus_id: Any = NA
    compute_capability: Any = NA
    memory_total_mib: Any = NA
    memory_used_mib: Any = NA
    memory_free_mib: Any = NA
    temperature_c: Any = NA
    temp_slowdown_c: Any = NA
    temp_shutdown_c: Any = NA
    power_draw_w: Any = NA
    power_limit_w: Any = NA
    pstate: Any = NA
    utilization_gpu_pct: Any = NA
    utilization_memory_pct: Any = NA
    pcie_gen_current: Any = NA
    pcie_gen_max: Any = NA
    pcie_width_current: Any = NA
    pcie_width_max: Any = NA
    clocks_event_mask: Any = NA
    clocks_event_reasons: Any = NA
    ecc_mode: Any = NA
    ecc_mode_pending: Any = NA
    ecc_volatile_corrected: Any = NA
    ecc_volatile_uncorrected: Any = NA
    ecc_aggregate_corrected: Any = NA
    ecc_aggregate_uncorrected: Any = NA
    retired_pages_sbe: Any = NA
    retired_pages_dbe: Any = NA
    retired_pages_pending: Any = NA
    remapped_rows_correctable: Any = NA
    remapped_rows_uncorrectable: Any = NA
    remapped_rows_pending: Any = NA
    remapped_rows_failure: Any = NA
    errors: dict = field(default_factory=dict)
    lost: str = ""

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class HostReading:
    """The host: NVML ``status`` and versions, and one :class:`GpuReading` per GPU.

    ``status``: ``ok``; ``no_library`` (libnvidia-ml.so.1 or nvidia-ml-py missing); ``no_driver``
    (the kernel module is not loaded); ``version_mismatch`` (the user-space library and the loaded
    kernel module differ, typically after a driver upgrade without a reboot); ``error`` (any other
    NVML failure, text in ``detail``). ``cuda_driver_version`` is the newest CUDA version the
    driver supports, as ``"12.4"``.
    """

    status: str
    detail: str = ""
    driver_version: Any = NA
    nvml_version: Any = NA
    cuda_driver_version: Any = NA
    gpus: list[GpuReading] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {**{k: v for k, v in dataclasses.asdict(self).items() if k != "gpus"},
                "gpus": [g.as_dict() for g in self.gpus]}


class _GpuLost(Exception):
    """Internal: a query answered GPU_IS_LOST or RESET_REQUIRED; stop reading this GPU."""


def decode_clocks_event_reasons(mask: int) -> list[str]:
    """Given a clocks-event (throttle) reason bitmask, return the active reasons' names.

    Unknown bits appear as ``"Unknown(0x...)"``; 0 (nvmlClocksEventReasonNone) is the empty list.
    """
    names = [name for bit, name in CLOCKS_EVENT_REASONS.items() if mask & bit]
    unknown = mask & ~sum(CLOCKS_EVENT_REASONS)
    if unknown:
        names.append(f"Unknown(0x{unknown:x})")
    return names


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class _Reader:
    """Runs NVML queries one at a time for one GPU, turning NOT_SUPPORTED into ``"n/a"``."""

    def __init__(self, nv, errors: dict):
        self.nv = nv
        self.errors = errors
        self._absent = (nv.NVMLError_NotSupported, nv.NVMLError_FunctionNotFound)
        self._lost = (nv.NVMLError_GpuIsLost, nv.NVMLError_ResetRequired)

    def first(self, fld: str, calls: list[tuple[str, tuple]]) -> Any:
        """Return the result of the first call this driver and nvidia-ml-py have; NA if none.

        ``calls`` is ``[(function name, args), ...]``, newest API first, so a renamed call
        (nvmlDeviceGetCurrentClocksEventReasons, formerly ...ClocksThrottleReasons) still reads
        on an older driver. Raises _GpuLost for GPU_IS_LOST / RESET_REQUIRED.
        """
        for name, args in calls:
            fn = getattr(self.nv, name, None)
            if fn is None:
                continue
            try:
                return fn(*args)
            except self.nv.NVMLError_FunctionNotFound:
                continue
            except self._absent:
                return NA
            except self._lost as e:
                raise _GpuLost(f"{e} (during {name})") from e
            except self.nv.NVMLError as e:
                self.errors[fld] = str(e)
                return NA
        return NA

    def one(self, fld: str, name: str, *args) -> Any:
        return self.first(fld, [(name, args)])


def _read_gpu(nv, index: int) -> GpuReading:
    """Given the pynvml module and a GPU index, return its :class:`GpuReading` (never raises NVMLError)."""
    g = GpuReading(index=index)
    r = _Reader(nv, g.errors)
    try:
        try:
            h = nv.nvmlDeviceGetHandleByIndex(index)
        except (nv.NVMLError_GpuIsLost, nv.NVMLError_ResetRequired) as e:
            raise _GpuLost(str(e)) from e
        except nv.NVMLError as e:
            g.lost = f"cannot open GPU {index}: {e}"
            return g
        _read_identity(nv, r, g, h)
        _read_memory(nv, r, g, h)
        _read_thermal_power(nv, r, g, h)
        _read_pcie(nv, r, g, h)
        mask = r.first("clocks_event_reasons", [("nvmlDeviceGetCurrentClocksEventReasons", (h,)),
                                                 ("nvmlDeviceGetCurrentClocksThrottleReasons", (h,))])
        g.clocks_event_mask = mask
        g.clocks_event_reasons = decode_clocks_event_reasons(mask) if mask != NA else NA
        _read_ecc(nv, r, g, h)
        _read_memory_repair(nv, r, g, h)
    except _GpuLost as e:
        g.lost = str(e)
    return g


def _read_identity(nv, r: _Reader, g: GpuReading, h) -> None:
    g.name = _text(r.one("name", "nvmlDeviceGetName", h))
    g.uuid = _text(r.one("uuid", "nvmlDeviceGetUUID", h))
    pci = r.one("pci_bus_id", "nvmlDeviceGetPciInfo", h)
    g.pci_bus_id = NA if pci == NA else _text(pci.busId)
    cc = r.one("compute_capability", "nvmlDeviceGetCudaComputeCapability", h)
    g.compute_capability = NA if cc == NA else f"{cc[0]}.{cc[1]}"


def _read_memory(nv, r: _Reader, g: GpuReading, h) -> None:
    mem = r.one("memory", "nvmlDeviceGetMemoryInfo", h)
    if mem != NA:
        g.memory_total_mib = int(mem.total) // _MIB
        g.memory_used_mib = int(mem.used) // _MIB
        g.memory_free_mib = int(mem.free) // _MIB
    util = r.one("utilization", "nvmlDeviceGetUtilizationRates", h)
    if util != NA:
        g.utilization_gpu_pct, g.utilization_memory_pct = int(util.gpu), int(util.memory)


def _read_thermal_power(nv, r: _Reader, g: GpuReading, h) -> None:
    g.temperature_c = r.first("temperature_c", [("nvmlDeviceGetTemperatureV", (h, nv.NVML_TEMPERATURE_GPU)),
                                                 ("nvmlDeviceGetTemperature", (h, nv.NVML_TEMPERATURE_GPU))])
    g.temp_slowdown_c = r.one("temp_slowdown_c", "nvmlDeviceGetTemperatureThreshold", h,
                              nv.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)
    g.temp_shutdown_c = r.one("temp_shutdown_c", "nvmlDeviceGetTemperatureThreshold", h,
                              nv.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN)
    draw_mw = r.one("power_draw_w", "nvmlDeviceGetPowerUsage", h)
    g.power_draw_w = NA if draw_mw == NA else round(draw_mw / 1000, 1)
    limit_mw = r.first("power_limit_w", [("nvmlDeviceGetEnforcedPowerLimit", (h,)),
                                         ("nvmlDeviceGetPowerManagementLimit", (h,))])
    g.power_limit_w = NA if limit_mw == NA else round(limit_mw / 1000, 1)
    p = r.first("pstate", [("nvmlDeviceGetPerformanceState", (h,)), ("nvmlDeviceGetPowerState", (h,))])
    g.pstate = NA if p == NA or p == nv.NVML_PSTATE_UNKNOWN else f"P{p}"


def _read_pcie(nv, r: _Reader, g: GpuReading, h) -> None:
    g.pcie_gen_current = r.one("pcie_gen_current", "nvmlDeviceGetCurrPcieLinkGeneration", h)
    # The GPU's own maximum generation first; the older call reports the GPU/slot combination.
    g.pcie_gen_max = r.first("pcie_gen_max", [("nvmlDeviceGetGpuMaxPcieLinkGeneration", (h,)),
                                              ("nvmlDeviceGetMaxPcieLinkGeneration", (h,))])
    g.pcie_width_current = r.one("pcie_width_current", "nvmlDeviceGetCurrPcieLinkWidth", h)
    g.pcie_width_max = r.one("pcie_width_max", "nvmlDeviceGetMaxPcieLinkWidth", h)


def _read_ecc(nv, r: _Reader, g: GpuReading, h) -> None:
    mode = r.one("ecc_mode", "nvmlDeviceGetEccMode", h)
    if mode != NA:
        g.ecc_mode, g.ecc_mode_pending = (("Enabled" if m == nv.NVML_FEATURE_ENABLED else "Disabled") for m in mode)
    if g.ecc_mode != "Enabled":
        return  # NVML counts ECC errors only while ECC is on; the counters stay "n/a"
    for fld, etype, counter in (
        ("ecc_volatile_corrected", nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC),
        ("ecc_volatile_uncorrected", nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC),
        ("ecc_aggregate_corrected", nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_AGGREGATE_ECC),
        ("ecc_aggregate_uncorrected", nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_AGGREGATE_ECC),
    ):
        setattr(g, fld, r.one(fld, "nvmlDeviceGetTotalEccErrors", h, etype, counter))


def _read_memory_repair(nv, r: _Reader, g: GpuReading, h) -> None:
    sbe = r.one("retired_pages_sbe", "nvmlDeviceGetRetiredPages", h,
                nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)
    dbe = r.one("retired_pages_dbe", "nvmlDeviceGetRetiredPages", h,
                nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
    g.retired_pages_sbe = NA if sbe == NA else len(sbe)
    g.retired_pages_dbe = NA if dbe == NA else len(dbe)
    pending = r.one("retired_pages_pending", "nvmlDeviceGetRetiredPagesPendingStatus", h)
    g.retired_pages_pending = NA if pending == NA else bool(pending)
    rows = r.one("remapped_rows", "nvmlDeviceGetRemappedRows", h)
    if rows != NA:
        corr, unc, pend, fail = rows
        g.remapped_rows_correctable, g.remapped_rows_uncorrectable = int(corr), int(unc)
        g.remapped_rows_pending, g.remapped_rows_failure = bool(pend), bool(fail)


def _cuda_version(v: Any) -> Any:
    """NVML's CUDA driver version integer (12040) as ``"12.4"``."""
    return NA if v == NA else f"{v // 1000}.{(v % 1000) // 10}"


def read_host() -> HostReading:
    """Initialise NVML, read the driver and every GPU, shut NVML down; return the HostReading.

    Never raises for NVML's sake: a missing library, an unloaded driver or a version mismatch is
    the reading's ``status``; a failure on one GPU stays in that GPU's reading.
    """
    try:
        nv = importlib.import_module("pynvml")
    except ImportError as e:
        return HostReading(status="no_library", detail=f"nvidia-ml-py (pynvml) is not installed: {e}")
    try:
        nv.nvmlInit()
    except nv.NVMLError as e:
        return HostReading(status=INIT_STATUS.get(getattr(e, "value", None), "error"), detail=str(e))
    try:
        host = HostReading(status="ok")
        r = _Reader(nv, {})
        try:
            host.driver_version = _text(r.one("driver_version", "nvmlSystemGetDriverVersion"))
            host.nvml_version = _text(r.one("nvml_version", "nvmlSystemGetNVMLVersion"))
            host.cuda_driver_version = _cuda_version(r.first("cuda_driver_version", [
                ("nvmlSystemGetCudaDriverVersion_v2", ()), ("nvmlSystemGetCudaDriverVersion", ())]))
            count = nv.nvmlDeviceGetCount()
        except (_GpuLost, nv.NVMLError) as e:
            return HostReading(status="error", detail=f"NVML cannot list the GPUs: {e}",
                               driver_version=host.driver_version, nvml_version=host.nvml_version)
        host.gpus = [_read_gpu(nv, i) for i in range(count)]
        return host
    finally:
        try:
            nv.nvmlShutdown()
        except nv.NVMLError:
            pass
