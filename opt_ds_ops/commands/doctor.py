"""``ds-ops doctor``: GPU and driver health on demand, and the device a job would get now.

Prints a table like ``nvidia-smi --query-gpu=...`` (one row per GPU), each GPU's verdict with one
line per finding, the CUDA smoke test's result and time (:mod:`opt_ds_ops.health.smoke`; only when the
job would run on a CUDA GPU; ``--no-smoke`` skips it), and the device, AMP dtype and TF32 setting
the health gate would give a job now. ``--json`` prints the health report (the one metadata.json
stores) plus ``exit_code``.

Exit codes: 0 ok; 1 warn (this includes "no NVIDIA driver, the CPU is the device" under
``device: auto``); 2 fail, or no device per ``health.on_fail`` (defer/refuse). A configuration
error is 1 with a message, as for every ds-ops command.
"""

from __future__ import annotations

import json

from ..config.conffile import DEFAULT_CONFIG_PATH
from ..health.nvml import NA
from ..health.policy import LEVELS, gate_job
from . import load_cfg


def add_parser(sub) -> None:
    d = sub.add_parser("doctor", help="check GPU and driver health (NVML) and show the device a job would get")
    d.add_argument("--config", help=f"configuration file (default: {DEFAULT_CONFIG_PATH} if present)")
    d.add_argument("--device", help="judge for this device instead of the configured one: auto, cpu, mps, cuda, cuda:N")
    d.add_argument("--amp", choices=["auto", "bf16", "fp16", "off"])
    d.add_argument("--json", action="store_true", help="print the health report as JSON")
    d.add_argument("--no-smoke", action="store_true", help="skip the CUDA smoke test (one forward and backward on the GPU)")
    d.set_defaults(func=run)


def exit_code(decision) -> int:
    """Return 0 for ok, 1 for warn, 2 for fail or a job that would not run now."""
    if decision.action != "run":
        return 2
    return {"ok": 0, "warn": 1, "fail": 2}[decision.report["verdict"]]


def _pair(a, b, sep="/") -> str:
    return NA if a == NA and b == NA else f"{a}{sep}{b}"


def _watts(v) -> str:
    return NA if v == NA else f"{v:.0f}"


COLUMNS = [
    ("index", lambda g: g["index"]),
    ("name", lambda g: g["name"]),
    ("pci.bus_id", lambda g: g["pci_bus_id"]),
    ("memory.used/total [MiB]", lambda g: _pair(g["memory_used_mib"], g["memory_total_mib"], " / ")),
    ("temp [°C] (slowdown/shutdown)", lambda g: f"{g['temperature_c']} ({_pair(g['temp_slowdown_c'], g['temp_shutdown_c'])})"),
    ("power.draw/limit [W]", lambda g: _pair(_watts(g["power_draw_w"]), _watts(g["power_limit_w"]), " / ")),
    ("pstate", lambda g: g["pstate"]),
    ("util [%]", lambda g: g["utilization_gpu_pct"]),
    ("pcie.gen cur/max", lambda g: _pair(g["pcie_gen_current"], g["pcie_gen_max"])),
    ("pcie.width cur/max", lambda g: _pair(g["pcie_width_current"], g["pcie_width_max"])),
    ("ecc (unc. volatile)", lambda g: g["ecc_mode"] if g["ecc_mode"] != "Enabled" else f"on ({g['ecc_volatile_uncorrected']})"),
    ("clocks_event_reasons", lambda g: NA if g["clocks_event_reasons"] == NA else ",".join(g["clocks_event_reasons"]) or "none"),
    ("verdict", lambda g: g["verdict"]),
]


def gpu_table(gpus: list[dict]) -> list[str]:
    """Given the report's GPU entries, return the lines of an aligned table (header first)."""
    rows = [[h for h, _ in COLUMNS]] + [[str(get(g)) for _, get in COLUMNS] for g in gpus]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _driver_line(report: dict) -> str:
    h, t = report["host"], report["torch"]
    if h["status"] == "ok":
        driver = (f"NVIDIA driver {h['driver_version']}, NVML {h['nvml_version']}, "
                  f"CUDA {h['cuda_driver_version']} (driver), {len(report['gpus'])} GPU(s)")
    else:
        driver = {"no_library": "no NVIDIA driver (NVML library not found)",
                  "no_driver": "no NVIDIA driver loaded",
                  "version_mismatch": "NVIDIA driver/library version mismatch: reboot required"}.get(
            h["status"], f"NVML error: {h['detail']}")
    cuda = f"CUDA {t['cuda_version']}" if t["cuda_version"] else "CPU build"
    return f"{driver}; torch {t['version']} ({cuda}) sees {t['device_count']} CUDA GPU(s)"


def smoke_lines(report: dict, skipped: bool = False) -> list[str]:
    """Return the lines about the CUDA smoke tests in a report (one per GPU tried)."""
    if skipped:
        return ["cuda smoke test: skipped (--no-smoke)"]
    tests = report.get("smoke_tests") or []
    if not tests:
        return ["cuda smoke test: not run (no CUDA GPU planned)"]
    out = []
    for t in tests:
        where = f"{t['device']} amp={t['amp_dtype']}"
        if t["ok"]:
            out.append(f"cuda smoke test: ok in {t['seconds']:.2f} s ({where}, loss {t['loss']:.3g})")
        else:
            out.append(f"cuda smoke test: FAILED after {t['seconds']:.2f} s ({where}): {t['error']}")
    return out


def render(decision, smoke_skipped: bool = False) -> list[str]:
    """Return the text ``ds-ops doctor`` prints for a GateDecision."""
    r = decision.report
    out = [_driver_line(r), ""]
    if r["gpus"]:
        out += gpu_table(r["gpus"]) + [""]
    out.append(f"verdict: {r['verdict']}")
    if r["findings"]:
        out.append(f"  host: {max((f['level'] for f in r['findings']), key=LEVELS.__getitem__)}")
        out += [f"    {f['level']:<4}  {f['check']}: {f['message']}" for f in r["findings"]]
    for g in r["gpus"]:
        out.append(f"  GPU {g['index']} {g['name']}: {g['verdict']}")
        out += [f"    {f['level']:<4}  {f['check']}: {f['message']}" for f in g["findings"]]
    out += smoke_lines(r, smoke_skipped)
    if decision.plan is not None:
        amp = decision.plan.amp_name + (" (fp32)" if decision.plan.amp_dtype is None else "")
        scaler = " with GradScaler" if decision.plan.use_grad_scaler else ""
        tf32 = ", tf32 matmuls" if decision.plan.tf32 else ""
        out.append(f"a job would get: device {decision.plan.device}, amp {amp}{scaler}{tf32}")
    else:
        out.append(f"a job would get: no device ({decision.action}, health.on_fail={r['on_fail']})")
    if decision.reason:
        out.append(f"  because: {decision.reason}")
    return out


def run(args) -> int:
    """``ds-ops doctor``: print health and the device a job would get; return 0/1/2 (see module)."""
    cfg = load_cfg(args, {"device": args.device, "amp": args.amp})
    decision = gate_job(cfg, smoke=not args.no_smoke)
    code = exit_code(decision)
    if args.json:
        print(json.dumps({**decision.report, "exit_code": code}, sort_keys=True))
    else:
        print("\n".join(render(decision, smoke_skipped=args.no_smoke)))
    return code
