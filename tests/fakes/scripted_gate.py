"""A health gate that answers from a script, for daemon tests that need defer/refuse answers.

The job process gets :func:`gate` pickled by name; it reads ``$DS_OPS_TEST_GATE`` (a directory
holding ``answers.json``: a list of [action, reason, verdict]) and answers the n-th call with the
n-th entry, counting calls in ``calls`` there. ``run`` answers carry a CPU plan.
"""

from __future__ import annotations

import json
import os


def gate(cfg, need_bytes):
    from opt_ds_ops.health.device import plan_device
    from opt_ds_ops.health.policy import GateDecision

    d = os.environ["DS_OPS_TEST_GATE"]
    calls = os.path.join(d, "calls")
    n = os.path.getsize(calls) if os.path.exists(calls) else 0
    with open(calls, "a") as f:
        f.write("x")
    action, reason, verdict = json.load(open(os.path.join(d, "answers.json")))[n]
    report = {"verdict": verdict, "gpus": []}
    return GateDecision(action, plan_device("cpu", "off") if action == "run" else None, reason, report)


def gpu_gate(cfg, need_bytes):
    """A gate for the GPU-readings test: installs a fake NVML (tests/fakes/fake_pynvml.py) in the
    job process, one H200 whose readings change per query as a GPU's do while a job trains, and
    answers "run" with a CPU plan and a report whose decision names that GPU (NVML index 0), so the
    job reads it every epoch. Readings (baseline at the job's start, then epochs 1, 2, 3):
    temperature 30, 71, 86, 88 °C; power 70, 650, 690 W, then NVML fails (UNKNOWN); clocks-event
    reasons GpuIdle, SwPowerCap, SwPowerCap+HwThermalSlowdown (twice); this process holds 1500 MiB.
    """
    import sys

    import pynvml as real

    from fakes.fake_pynvml import FakeNvml, h200
    from opt_ds_ops.health.device import plan_device
    from opt_ds_ops.health.policy import GateDecision

    def script(values):
        calls = iter(values)

        def next_value():
            v = next(calls, values[-1])
            if isinstance(v, Exception):
                raise v
            return v
        return next_value

    hot = real.nvmlClocksEventReasonSwPowerCap | real.nvmlClocksEventReasonHwThermalSlowdown
    gpu = h200(temperature_c=script([30, 71, 86, 88]),
               power_draw_mw=script([70_000, 650_000, 690_000, real.NVMLError(real.NVML_ERROR_UNKNOWN)]),
               clocks_event_mask=script([real.nvmlClocksEventReasonGpuIdle, real.nvmlClocksEventReasonSwPowerCap,
                                         hot, hot]),
               processes=lambda: [(os.getpid(), 1500 * 1024 * 1024), (1, 4096 * 1024 * 1024)],
               memory_used_mib=5597)
    sys.modules["pynvml"] = FakeNvml(gpus=[gpu]).module()
    report = {"verdict": "ok", "gpus": [], "decision": {"action": "run", "device": "cpu", "amp_dtype": "off",
                                                        "gpu": {"index": 0, "uuid": gpu.uuid}}}
    return GateDecision("run", plan_device("cpu", "off"), "", report)


def oom_gate(cfg, need_bytes):
    """A gate for the out-of-memory test: makes torch in the job process see one H200 whose CUDA
    runtime runs on the CPU (tests/fakes/fake_cuda.py) and runs out of memory for copies of
    ``$DS_OPS_TEST_OOM_BYTES`` bytes or more; answers "run" on cuda:0 with fp32."""
    from _pytest.monkeypatch import MonkeyPatch

    from fakes.fake_cuda import fake_cuda, fake_cuda_runtime
    from fakes.fake_pynvml import h200
    from opt_ds_ops.health.device import plan_device
    from opt_ds_ops.health.policy import GateDecision

    mp = MonkeyPatch()  # never undone: the job process ends with the job
    fake_cuda(mp, [h200()])
    fake_cuda_runtime(mp, "oom", oom_min_bytes=int(os.environ["DS_OPS_TEST_OOM_BYTES"]))
    report = {"verdict": "ok", "gpus": [], "decision": {"action": "run", "device": "cuda:0", "amp_dtype": "off"}}
    return GateDecision("run", plan_device("cuda:0", "off"), "", report)


# ---- two fake GPUs, one job per GPU (daemon.max_jobs) -------------------------------------------
GPU_UUIDS = ("GPU-00000000-0000-4000-8000-00000000a000", "GPU-00000000-0000-4000-8000-00000000b001")


def two_gpus(failing: int | None = None):
    """Return a FakeNvml with two idle H200s (UUIDs :data:`GPU_UUIDS`, NVML indices 0 and 1); GPU
    ``failing`` (if not None) has one uncorrected ECC error since the driver loaded, a health fail."""
    from fakes.fake_pynvml import FakeNvml, h200

    gpus = [h200(uuid=GPU_UUIDS[0], bus_id="00000000:18:00.0"), h200(uuid=GPU_UUIDS[1], bus_id="00000000:2A:00.0")]
    if failing is not None:
        gpus[failing].ecc = {"volatile_corrected": 0, "volatile_uncorrected": 1, "aggregate_corrected": 0,
                             "aggregate_uncorrected": 1}
    return FakeNvml(gpus=gpus)


def slot_gate(cfg, need_bytes):
    """The real health gate (:func:`opt_ds_ops.health.policy.gate_job`, CUDA smoke test included) in a job
    process of a host with :func:`two_gpus` (GPU ``$DS_OPS_TEST_FAILING_GPU`` failing, if set), or
    with no NVIDIA driver at all under ``$DS_OPS_TEST_NO_GPU``.

    Installs at the library boundary: the fake NVML (every GPU, as NVML ignores
    CUDA_VISIBLE_DEVICES); a fake CUDA device map: torch sees the GPUs that
    ``$CUDA_VISIBLE_DEVICES`` names (UUIDs or indices; all without it) as cuda:0..; and a CUDA
    runtime that runs on the CPU, whose synchronize fails (an illegal memory access) on the GPU
    whose UUID is ``$DS_OPS_TEST_SMOKE_FAIL_UUID``. With ``$DS_OPS_TEST_BARRIER`` (a directory
    and a count, ``DIR:N``) the gate first waits until N job processes have arrived there (each
    writes a file named by its pid) and raises RuntimeError if they do not within 120 s: a job
    can then only train if N jobs were in their health stage at the same time.
    """
    import sys
    import time

    from _pytest.monkeypatch import MonkeyPatch

    from fakes.fake_cuda import fake_cuda, fake_cuda_runtime
    from opt_ds_ops.health.policy import gate_job

    if os.environ.get("DS_OPS_TEST_NO_GPU"):  # a host without the NVIDIA driver; torch as it is (CPU)
        import pynvml as real

        from fakes.fake_pynvml import FakeNvml

        sys.modules["pynvml"] = FakeNvml(gpus=[], init_error=real.NVML_ERROR_LIBRARY_NOT_FOUND).module()
        return gate_job(cfg, need_bytes)
    failing = os.environ.get("DS_OPS_TEST_FAILING_GPU")
    fake = two_gpus(int(failing) if failing else None)
    sys.modules["pynvml"] = fake.module()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        seen = list(fake.gpus)
    else:
        seen = [g for v in visible.split(",") for i, g in enumerate(fake.gpus) if v.strip() in (g.uuid, str(i))]
    mp = MonkeyPatch()  # never undone: the job process ends with the job
    fake_cuda(mp, seen)
    bad = os.environ.get("DS_OPS_TEST_SMOKE_FAIL_UUID")
    fake_cuda_runtime(mp, "error" if bad and [g.uuid for g in seen] == [bad] else None)
    barrier = os.environ.get("DS_OPS_TEST_BARRIER")
    if barrier:
        where, n = barrier.rsplit(":", 1)
        open(os.path.join(where, str(os.getpid())), "w").close()
        deadline = time.monotonic() + 120
        while len(os.listdir(where)) < int(n):
            if time.monotonic() > deadline:
                raise RuntimeError(f"barrier: only {len(os.listdir(where))} of {n} jobs ran at once")
            time.sleep(0.05)
    return gate_job(cfg, need_bytes)


def visible_gate(cfg, need_bytes):
    """A gate that trains nothing: it refuses the job with what the job process saw when its gate
    ran, ``CUDA_VISIBLE_DEVICES=...; cuda initialised: False`` (for the test of the forkserver
    path: the variable is set in the job process and CUDA is not initialised there)."""
    import torch

    from opt_ds_ops.health.policy import GateDecision

    seen = f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}; cuda initialised: {torch.cuda.is_initialized()}"
    return GateDecision("refuse", None, seen, {"verdict": "ok", "gpus": []})
