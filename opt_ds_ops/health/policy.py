"""Where health is judged: NVML readings -> findings -> verdicts -> the gate's decision for a job.

Given the configuration, :func:`gate_job` reads the driver and every GPU (:mod:`opt_ds_ops.health.nvml`)
and torch's view of CUDA, judges them, picks the device and AMP dtype for the job and applies
``health.on_fail``. The daemon calls it at start and before each job; ``ds-ops train`` before its
job; ``ds-ops doctor`` on demand. Its ``report`` (JSON types only) goes into metadata.json.

Findings and their sources. Each finding is one line with a level, ``warn`` or ``fail``; a GPU's
verdict is the worst of its findings (``ok`` if none). The defaults follow NVIDIA DCGM's health
watches (``dcgmHealthSet`` with DCGM_HEALTH_WATCH_MEM, _THERMAL, _POWER, _PCIE; failure codes from
dcgm_errors.h; the retired-page limits from dcgm_gpu_hardware_limits.h, checked against DCGM's
public source).

- volatile uncorrected (double-bit) ECC errors > 0 -> fail (DCGM_FR_VOLATILE_DBE_DETECTED)
- row remapping failed -> fail (DCGM_FR_ROW_REMAP_FAILURE; the kernel logs it as Xid 64)
- a row remap pending -> warn, reset the GPU to apply it (DCGM_FR_PENDING_ROW_REMAP)
- retired pages >= ``health.retired_pages_fail`` (63, DCGM_LIMIT_MAX_RETIRED_PAGES) -> fail;
  >= ``health.retired_pages_warn`` (15, DCGM_LIMIT_MAX_RETIRED_PAGES_SOFT_LIMIT) -> warn;
  pages pending retirement -> warn (DCGM_FR_PENDING_PAGE_RETIREMENTS)
- temperature within ``health.temp_margin_c`` (5 degC, a ds-ops choice: DCGM's thermal watch
  only reports throttling after the fact) of the slowdown threshold -> warn, of the shutdown
  threshold -> fail
- clocks-event reasons HwSlowdown, HwThermalSlowdown, SwThermalSlowdown, HwPowerBrakeSlowdown
  active -> warn (DCGM_FR_CLOCK_THROTTLE_THERMAL / _POWER). SwPowerCap, GpuIdle, SyncBoost and
  the clock settings are normal operation and only reported.
- PCIe link narrower than its maximum width -> warn (DCGM diagnostic's PCIe link check). A lower
  link *generation* is not judged: idle GPUs drop the generation to save power.
- free memory below what the job needs -> fail for that job
- GPU lost (fallen off the bus, Xid 79) or needing a reset -> fail; any other NVML error on a
  query -> warn. NOT_SUPPORTED is "n/a" and never a finding.

Host findings: no NVML library / driver not loaded -> "no NVIDIA driver" (warn under
``device: auto``, the job runs on the CPU; fail when cuda was asked for); driver/library version
mismatch -> fail, "reboot required" (warn under ``device: cpu``); torch's CUDA major version above
the driver's -> fail, its minor version above -> warn (CUDA minor-version compatibility); torch a
CPU build or unable to initialise CUDA while NVML sees GPUs -> warn; torch's GPU count differing
from NVML's -> warn, unless ``CUDA_VISIBLE_DEVICES`` names exactly the GPUs torch sees (how the
daemon gives a job its GPU).

CUDA smoke test (:mod:`opt_ds_ops.health.smoke`), after the decision, only when the job would run on a
CUDA GPU: a CUDA error, a timeout (``health.smoke_timeout_s``) or a non-finite result is a ``fail``
finding (check ``cuda``) on that GPU with the error text, and the decision is made again without
it: another healthy GPU, or ``health.on_fail``. Nothing touches CUDA when no GPU is planned. After
a sticky CUDA error (an illegal memory access) the process's CUDA state may stay broken, so the
next GPU's smoke test in that process can fail too; ``health.on_fail`` then decides.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone

import torch

from ..config.conffile import Config
from . import nvml
from .device import DeviceError, DevicePlan, plan_device
from .findings import LEVELS, THROTTLE_WARN, Finding, _num, judge_gpu, verdict_of  # noqa: F401 - THROTTLE_WARN re-exported
from .nvml import NA, GpuReading, HostReading
from .smoke import SmokeResult, smoke_test


@dataclass
class GateDecision:
    """The health gate's answer for one job.

    ``action``: "run" (train on ``plan``), "defer" (leave queued, retry after health.retry_s) or
    "refuse" (move to failed/ with ``reason``). ``report`` is JSON-able and goes into metadata.json.
    """

    action: str
    plan: DevicePlan | None
    reason: str = ""
    report: dict = field(default_factory=dict)


@dataclass
class TorchView:
    """What torch sees: its version, the CUDA version it was built with (None: a CPU build),
    whether CUDA initialises, how many GPUs, their UUIDs, and CUDA_VISIBLE_DEVICES if set."""

    version: str
    cuda_version: str | None
    available: bool
    device_count: int
    uuids: list[str]
    visible_devices: str | None


def read_torch() -> TorchView:
    """Return torch's view of CUDA (initialises CUDA on a GPU machine; never raises)."""
    available = bool(torch.cuda.is_available())
    count = torch.cuda.device_count() if available else 0
    uuids = []
    for i in range(count):
        try:
            uuids.append(str(getattr(torch.cuda.get_device_properties(i), "uuid", "")))
        except (RuntimeError, AssertionError):
            uuids.append("")
    # str(): torch.__version__ is a TorchVersion, which the daemon (no torch) could not unpickle from a job
    return TorchView(str(torch.__version__), torch.version.cuda, available, count, uuids,
                     os.environ.get("CUDA_VISIBLE_DEVICES"))


def _major_minor(v: str) -> tuple[int, int]:
    major, _, rest = str(v).partition(".")
    return int(major), int(rest.split(".")[0] or 0)


def judge_host(host: HostReading, tv: TorchView, device_spec: str) -> list[Finding]:
    """Given the host reading, torch's view and the configured device, return the host findings.

    A missing GPU is a warn under ``device: auto`` (the job runs on the CPU), a fail when a CUDA
    device was asked for, and no finding at all under ``device: cpu`` or ``mps``. A broken driver
    (version mismatch, NVML error) is a fail, or a warn under ``device: cpu`` or ``mps``.
    """
    wants_cuda = device_spec.startswith("cuda")
    no_gpu_level = "fail" if wants_cuda else "warn"
    broken_level = "warn" if device_spec in ("cpu", "mps") else "fail"  # the job does not need the GPU
    if host.status == "version_mismatch":
        return [Finding(broken_level, "driver", "reboot required: the NVIDIA driver's library and kernel module "
                                                f"versions differ (NVML: {host.detail}), usually after a driver upgrade")]
    if host.status == "error":
        return [Finding(broken_level, "driver", f"NVML failed: {host.detail}")]
    if device_spec in ("cpu", "mps"):
        return []
    if host.status == "no_library":
        return [Finding(no_gpu_level, "driver", f"no NVIDIA driver: libnvidia-ml.so.1 was not found ({host.detail})")]
    if host.status == "no_driver":
        return [Finding(no_gpu_level, "driver", f"no NVIDIA driver loaded ({host.detail}): the nvidia kernel "
                                                "module is not loaded")]
    if not host.gpus:
        return [Finding(no_gpu_level, "driver", f"the NVIDIA driver {host.driver_version} sees no GPU")]
    n = len(host.gpus)
    if tv.cuda_version is None:
        return [Finding(no_gpu_level, "torch", f"torch {tv.version} is a CPU build: it cannot use the {n} GPU(s)")]
    out = []
    if _num(host.cuda_driver_version):
        (tmaj, tmin), (dmaj, dmin) = _major_minor(tv.cuda_version), _major_minor(host.cuda_driver_version)
        if tmaj > dmaj:
            return [Finding("fail", "torch", f"torch is built with CUDA {tv.cuda_version} but driver "
                                             f"{host.driver_version} supports CUDA {host.cuda_driver_version} at most")]
        if tmaj == dmaj and tmin > dmin:
            out.append(Finding("warn", "torch", f"torch is built with CUDA {tv.cuda_version}, newer than the driver's "
                                                f"CUDA {host.cuda_driver_version} (minor-version compatibility only)"))
    if not tv.available:
        out.append(Finding(no_gpu_level, "torch", f"torch {tv.version} (CUDA {tv.cuda_version}) cannot initialise CUDA"))
    elif tv.device_count != n and not _limited_as_named(tv):
        why = f" (CUDA_VISIBLE_DEVICES={tv.visible_devices})" if tv.visible_devices is not None else ""
        out.append(Finding("warn", "torch", f"torch sees {tv.device_count} GPU(s), NVML sees {n}{why}"))
    return out


def _limited_as_named(tv: TorchView) -> bool:
    """True when CUDA_VISIBLE_DEVICES names exactly the GPUs torch sees (the daemon gives each job
    one GPU this way, ``daemon.max_jobs``): torch seeing fewer GPUs than NVML is then what was asked for."""
    names = [v for v in (tv.visible_devices or "").split(",") if v.strip()]
    return bool(names) and len(names) == tv.device_count


def _torch_index(g: GpuReading, i: int, host: HostReading, tv: TorchView) -> int | None:
    """Return the torch CUDA index of NVML GPU i (matched by UUID; by position when torch gives no
    UUIDs and both see the same number of GPUs), or None if torch cannot use it."""
    def norm(u) -> str:
        u = str(u).lower()
        return u[4:] if u.startswith("gpu-") else u

    if any(tv.uuids) and g.uuid != NA:
        matches = [k for k, u in enumerate(tv.uuids) if u and norm(u) == norm(g.uuid)]
        return matches[0] if matches else None
    return i if tv.available and tv.device_count == len(host.gpus) and tv.visible_devices is None else None


def health_report(cfg: Config, host: HostReading, tv: TorchView, need_bytes: int | None = None) -> dict:
    """Given readings, return the report (JSON types): host and torch facts, host ``findings``,
    one entry per GPU with its readings, ``torch_index``, ``verdict`` and ``findings``, and the
    overall ``verdict`` (the worst of all)."""
    host_findings = judge_host(host, tv, cfg.device)
    gpus, levels = [], [verdict_of(host_findings)]
    for i, g in enumerate(host.gpus):
        found = judge_gpu(g, cfg.health, need_bytes)
        gpus.append({**g.as_dict(), "torch_index": _torch_index(g, i, host, tv), "verdict": verdict_of(found),
                     "findings": [asdict(f) for f in found]})
        levels.append(verdict_of(found))
    return {
        "checked_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "verdict": max(levels, key=LEVELS.__getitem__),
        "host": {k: v for k, v in host.as_dict().items() if k != "gpus"},
        "torch": asdict(tv),
        "findings": [asdict(f) for f in host_findings],
        "gpus": gpus,
        "need_bytes": need_bytes,
        "on_fail": cfg.health.on_fail,
    }


def _lines(findings: list[dict], level: str | None = None) -> list[str]:
    return [f"{f['check']}: {f['message']}" for f in findings if level is None or f["level"] == level]


def decide(cfg: Config, report: dict) -> GateDecision:
    """Given the configuration and a :func:`health_report`, return the GateDecision for a job.

    ``device: cpu|mps`` runs there whatever the GPUs say. Otherwise the job gets the healthiest
    GPU torch can use (ok before warn, then the lowest index; only GPU N under ``cuda:N``). With
    none usable: under ``device: auto`` and nothing failed (no GPU here at all) it runs on the CPU;
    else ``health.on_fail`` decides: ``cpu`` runs on the CPU, ``defer`` and ``refuse`` return that
    action with the reason. A device or AMP request the machine cannot meet (DeviceError) is refused.
    """
    hc, spec = cfg.health, cfg.device
    host_fails = _lines(report["findings"], "fail")
    try:
        if spec in ("cpu", "mps"):
            return _run(report, plan_device(spec, cfg.amp, reason=f"device: {spec} configured"))
        usable = [g for g in report["gpus"] if g["verdict"] != "fail" and g["torch_index"] is not None]
        if spec.startswith("cuda:"):
            usable = [g for g in usable if g["torch_index"] == int(spec[5:])]
        if usable and not host_fails:
            g = min(usable, key=lambda g: (LEVELS[g["verdict"]], g["index"]))
            warns = "; ".join(_lines(report["findings"]) + _lines(g["findings"]))
            reason = f"GPU {g['index']} {g['name']}: {g['verdict']}" + (f" ({warns})" if warns else "")
            return _run(report, plan_device(f"cuda:{g['torch_index']}", cfg.amp, reason=reason, tf32=cfg.tf32))
        gpu_fails = [f"GPU {g['index']} {line}" for g in report["gpus"] for line in _lines(g["findings"], "fail")]
        if spec == "auto" and not host_fails and not gpu_fails:
            return _run(report, plan_device("auto", cfg.amp, reason="device: auto and no usable CUDA GPU"))
        why = "; ".join(host_fails + gpu_fails) or f"no usable GPU for device: {spec}"
        if hc.on_fail == "cpu":
            return _run(report, plan_device("cpu", cfg.amp, reason=f"health.on_fail=cpu: {why}"))
        if hc.on_fail == "defer":
            return _stop(report, "defer", f"{why}; retry in {hc.retry_s:g} s (health.on_fail=defer)")
        return _stop(report, "refuse", f"{why} (health.on_fail=refuse)")
    except DeviceError as e:
        return _stop(report, "refuse", str(e))


def _run(report: dict, plan: DevicePlan) -> GateDecision:
    gpu = next(({"index": g["index"], "uuid": g["uuid"]} for g in report.get("gpus", [])
                if plan.device.type == "cuda" and g["torch_index"] == plan.device.index), None)
    report["decision"] = {"action": "run", "device": str(plan.device), "amp_dtype": plan.amp_name, "reason": plan.reason,
                          "tf32": plan.tf32, "float32_matmul_precision": plan.matmul_precision, "gpu": gpu}
    return GateDecision("run", plan, plan.reason, report)


def _stop(report: dict, action: str, reason: str) -> GateDecision:
    report["decision"] = {"action": action, "device": None, "amp_dtype": None, "reason": reason}
    return GateDecision(action, None, reason, report)


def gate_job(cfg: Config, need_bytes: int | None = None, smoke: bool = True) -> GateDecision:
    """Given the configuration and the bytes a job needs on the device (None: not judged), read
    NVML and torch, judge them and return the GateDecision (see :func:`decide`), after the CUDA
    smoke test on the chosen GPU unless ``smoke`` is False (see :func:`with_smoke_test`); never
    raises for a GPU's or the driver's sake."""
    decision = decide(cfg, health_report(cfg, nvml.read_host(), read_torch(), need_bytes))
    return with_smoke_test(cfg, decision) if smoke else decision


def with_smoke_test(cfg: Config, decision: GateDecision, run=smoke_test) -> GateDecision:
    """Given a decision, run the CUDA smoke test (``run(plan, timeout_s) -> SmokeResult``) on its
    GPU if it runs on CUDA; return it unchanged if the test passed (or no GPU is planned), else
    the decision made again with that GPU failed (finding ``cuda``, level fail), which tests the
    next GPU or applies ``health.on_fail``. The report keeps every result in ``smoke_tests``
    (``[]``: none ran) and the verdict is raised to fail for a failed one."""
    report = decision.report
    report.setdefault("smoke_tests", [])
    while decision.action == "run" and decision.plan is not None and decision.plan.device.type == "cuda":
        result: SmokeResult = run(decision.plan, cfg.health.smoke_timeout_s)
        report["smoke_tests"].append(result.as_dict())
        if result.ok:
            return decision
        index = decision.plan.device.index
        gpu = next((g for g in report["gpus"] if g["torch_index"] == index), None)
        if gpu is None:  # not a GPU of the report (cannot happen: decide picks from them); stop here
            return _stop(report, "refuse", f"CUDA smoke test on {decision.plan.device} failed: {result.error}")
        gpu["findings"].append(asdict(Finding("fail", "cuda", f"CUDA smoke test failed: {result.error}")))
        gpu["verdict"] = report["verdict"] = "fail"
        decision = decide(cfg, report)
    return decision


def summary_line(decision: GateDecision) -> str:
    """Return one line for a log or a terminal: verdict, action, device, and the first findings."""
    r = decision.report
    lines = _lines(r.get("findings", [])) + [f"GPU {g['index']} {line}" for g in r.get("gpus", [])
                                             for line in _lines(g["findings"])]
    where = f"{decision.plan.device} amp={decision.plan.amp_name}" if decision.plan else decision.action
    return f"health {r.get('verdict', '?')}: {'; '.join(lines) or 'all checks passed'} -> {where}"
