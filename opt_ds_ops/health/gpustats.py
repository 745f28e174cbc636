"""GPU readings while a job trains: the job's GPU read through NVML once per epoch.

Given the health report a job runs under, :func:`sampler_for` returns a :class:`GpuSampler` for
the GPU the gate chose (``report["decision"]["gpu"]``), or None when the job does not run on a
CUDA GPU. :meth:`GpuSampler.read` returns one reading, the fields ``nvidia-smi
--query-gpu=temperature.gpu,power.draw,clocks.sm,memory.used,utilization.gpu,pstate,
clocks_event_reasons.active`` would print, plus the memory this process holds on the GPU
(``nvidia-smi --query-compute-apps=pid,used_memory``):

- ``temperature_c`` (°C), ``power_draw_w`` (W), ``sm_clock_mhz`` (MHz), ``memory_used_mib``
  (MiB used on the GPU by every process), ``process_memory_mib`` (MiB held by this process;
  "n/a" where NVML cannot see it, e.g. in another PID namespace), ``utilization_gpu_pct`` (%,
  over NVML's last sample period), ``pstate`` ("P0".."P15"), ``clocks_event_reasons`` (the active
  throttle reasons' names, :data:`opt_ds_ops.health.nvml.CLOCKS_EVENT_REASONS`);
- ``throttle_started``: the thermal or power slowdowns (:data:`opt_ds_ops.health.findings.THROTTLE_WARN`:
  HwSlowdown, HwThermalSlowdown, SwThermalSlowdown, HwPowerBrakeSlowdown) active now and not at the
  previous reading (the first one compares with the reading taken when the sampler opened, at the
  job's start). SwPowerCap is the normal state of a GPU at full load and is only reported.
- ``errors``: field -> NVML's words for a query that failed; ``error``: why there is no reading
  at all (NVML gone, the GPU lost: Xid 79).

NVML failing mid-job never fails the job: nothing here raises, a failed query is "n/a".
"""

from __future__ import annotations

import importlib
import os

from .nvml import NA, _GpuLost, _Reader, _text, decode_clocks_event_reasons
from .findings import THROTTLE_WARN

_MIB = 1024 * 1024


def sampler_for(report: dict | None) -> GpuSampler | None:
    """Given the health report a job runs under, return an opened GpuSampler for the GPU its
    decision chose, or None when the decision names no GPU (the CPU, MPS, a refused job)."""
    gpu = ((report or {}).get("decision") or {}).get("gpu")
    if not gpu:
        return None
    sampler = GpuSampler(int(gpu["index"]), gpu.get("uuid"))
    sampler.open()
    return sampler


class GpuSampler:
    """NVML kept initialised for one job's GPU (``index``: NVML's index; ``uuid`` preferred to
    find it, as indices can differ from CUDA's). Call :meth:`open`, :meth:`read` per epoch, :meth:`close`."""

    def __init__(self, index: int, uuid: str | None = None, pid: int | None = None):
        self.index, self.uuid, self.pid = index, uuid, pid if pid is not None else os.getpid()
        self.nv = None
        self.handle = None
        self.error = ""
        self._throttle: set[str] = set()

    def open(self) -> None:
        """Initialise NVML and find the GPU; take the throttle baseline. Never raises (``error`` says why not)."""
        try:
            nv = importlib.import_module("pynvml")
        except ImportError as e:
            self.error = f"nvidia-ml-py (pynvml) is not installed: {e}"
            return
        try:
            nv.nvmlInit()
        except nv.NVMLError as e:
            self.error = f"NVML did not initialise: {e}"
            return
        self.nv = nv
        try:
            if self.uuid and self.uuid != NA and hasattr(nv, "nvmlDeviceGetHandleByUUID"):
                self.handle = nv.nvmlDeviceGetHandleByUUID(self.uuid)
            else:
                self.handle = nv.nvmlDeviceGetHandleByIndex(self.index)
        except nv.NVMLError as e:
            self.error = f"NVML cannot open GPU {self.index}: {e}"
            return
        reasons = self.read().get("clocks_event_reasons")
        self._throttle = set(reasons) & set(THROTTLE_WARN) if isinstance(reasons, list) else set()

    def read(self) -> dict:
        """Return one reading of the GPU (see the module for the fields). Never raises."""
        if self.handle is None:
            return {"index": self.index, "error": self.error or "NVML is not open"}
        nv, h, errors = self.nv, self.handle, {}
        r = _Reader(nv, errors)
        out: dict = {"index": self.index}
        try:
            out["temperature_c"] = r.first("temperature_c", [("nvmlDeviceGetTemperatureV", (h, nv.NVML_TEMPERATURE_GPU)),
                                                             ("nvmlDeviceGetTemperature", (h, nv.NVML_TEMPERATURE_GPU))])
            mw = r.one("power_draw_w", "nvmlDeviceGetPowerUsage", h)
            out["power_draw_w"] = NA if mw == NA else round(mw / 1000, 1)
            out["sm_clock_mhz"] = r.one("sm_clock_mhz", "nvmlDeviceGetClockInfo", h, nv.NVML_CLOCK_SM)
            mem = r.one("memory_used_mib", "nvmlDeviceGetMemoryInfo", h)
            out["memory_used_mib"] = NA if mem == NA else int(mem.used) // _MIB
            procs = r.one("process_memory_mib", "nvmlDeviceGetComputeRunningProcesses", h)
            mine = [p.usedGpuMemory for p in procs if p.pid == self.pid] if procs != NA else []
            out["process_memory_mib"] = sum(int(b) for b in mine if b is not None) // _MIB if mine else NA
            util = r.one("utilization_gpu_pct", "nvmlDeviceGetUtilizationRates", h)
            out["utilization_gpu_pct"] = NA if util == NA else int(util.gpu)
            p = r.first("pstate", [("nvmlDeviceGetPerformanceState", (h,)), ("nvmlDeviceGetPowerState", (h,))])
            out["pstate"] = NA if p == NA or p == nv.NVML_PSTATE_UNKNOWN else f"P{p}"
            mask = r.first("clocks_event_reasons", [("nvmlDeviceGetCurrentClocksEventReasons", (h,)),
                                                     ("nvmlDeviceGetCurrentClocksThrottleReasons", (h,))])
            reasons = decode_clocks_event_reasons(mask) if mask != NA else NA
        except _GpuLost as e:
            return {"index": self.index, "error": f"GPU lost: {e}"}
        except Exception as e:  # noqa: BLE001 - a reading must never fail the job
            return {"index": self.index, "error": f"NVML reading failed: {type(e).__name__}: {_text(e)}"}
        out["clocks_event_reasons"] = reasons
        now = set(reasons) & set(THROTTLE_WARN) if isinstance(reasons, list) else set()
        out["throttle_started"] = sorted(now - self._throttle, key=THROTTLE_WARN.index)
        if isinstance(reasons, list):
            self._throttle = now
        if errors:
            out["errors"] = errors
        return out

    def close(self) -> None:
        """Shut NVML down (its init is reference-counted); never raises."""
        if self.nv is not None:
            try:
                self.nv.nvmlShutdown()
            except Exception:  # noqa: BLE001
                pass
            self.nv, self.handle = None, None


# What each thermal/power slowdown means, in the words of NVML's nvmlClocksEventReason* docs.
THROTTLE_WORDS = {
    "HwSlowdown": "hardware slowdown (HW Slowdown: temperature, power brake or the power supply)",
    "HwThermalSlowdown": "hardware thermal slowdown (the GPU or its memory is too hot)",
    "SwThermalSlowdown": "software thermal slowdown (the driver holds clocks down to keep the GPU "
                         "below its maximum operating temperature)",
    "HwPowerBrakeSlowdown": "hardware power brake slowdown (an external power brake, e.g. the power supply)",
}


def throttle_words(names: list[str]) -> str:
    """Return throttle reasons decoded for a person: ``HwThermalSlowdown (hardware thermal ...)``."""
    return "; ".join(f"{n} ({THROTTLE_WORDS[n]})" if n in THROTTLE_WORDS else n for n in names)


def field(reading: dict | None, key: str):
    """Return a reading's value for a journal field: None (left out) where missing or "n/a";
    ``clocks_event_reasons`` as ``SwPowerCap,HwThermalSlowdown`` or ``none``."""
    value = (reading or {}).get(key)
    if value is None or value == NA:
        return None
    if isinstance(value, list):
        return ",".join(value) or "none"
    return value
