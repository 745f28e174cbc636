"""A health gate that answers from a script, for daemon tests that need defer/refuse answers.

The job process gets :func:`gate` pickled by name; it reads ``$DS_OPS_TEST_GATE`` (a directory
holding ``answers.json``: a list of [action, reason, verdict]) and answers the n-th call with the
n-th entry, counting calls in ``calls`` there. ``run`` answers carry a CPU plan.
"""

from __future__ import annotations

import json
import os


def gate(cfg, need_bytes):
    from opt_ds_ops.device import plan_device
    from opt_ds_ops.health import GateDecision

    d = os.environ["DS_OPS_TEST_GATE"]
    calls = os.path.join(d, "calls")
    n = os.path.getsize(calls) if os.path.exists(calls) else 0
    with open(calls, "a") as f:
        f.write("x")
    action, reason, verdict = json.load(open(os.path.join(d, "answers.json")))[n]
    report = {"verdict": verdict, "gpus": []}
    return GateDecision(action, plan_device("cpu", "off") if action == "run" else None, reason, report)
