"""GPU and driver health (NVML) and the health gate before every job.

INTERIM: this first version only makes the device decision; the NVML checks, verdicts and the
on_fail policy arrive with the health issue. The interface below is the one the daemon uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .config import Config
from .device import DevicePlan, plan_device


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


def gate_job(cfg: Config, need_bytes: int | None = None) -> GateDecision:
    """Given the configuration and the bytes a job needs on the device, return the GateDecision."""
    plan = plan_device(cfg.device, cfg.amp)
    return GateDecision(action="run", plan=plan, report={"verdict": "unchecked", "device": str(plan.device)})
