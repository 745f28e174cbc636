"""GPU readings while training (opt_ds_ops/health/gpustats.py) on a fake NVML, into metadata.json and the journal.

The fake replaces ``pynvml`` at its boundary (tests/fakes/fake_pynvml.py); the jobs train on the
CPU, with a health report that names the fake GPU, so the readings path is the one a GPU job takes.
The last test runs a daemon job on a fake GPU (tests/fakes/fake_cuda.py: a CUDA runtime on the CPU)
whose dataset copy runs out of memory.
"""

from __future__ import annotations

import io
import json
import os
import time

import numpy as np
import pynvml

from daemon_kit import done_names, job_context, read_json, spool_dir, write_config
from fakes.fake_pynvml import FakeNvml, h200, install
from opt_ds_ops.health import gpustats
from opt_ds_ops.config.conffile import Config, TrainConfig
from opt_ds_ops.health.device import plan_device
from opt_ds_ops.health.gpustats import GpuSampler, sampler_for
from opt_ds_ops.training.job import run_job
from opt_ds_ops.observe.journal import MESSAGE_IDS

HOT = pynvml.nvmlClocksEventReasonSwPowerCap | pynvml.nvmlClocksEventReasonHwThermalSlowdown
GPU0 = {"decision": {"gpu": {"index": 0, "uuid": h200().uuid}}}


def sequence(*values):
    """A reading that changes per query (the last value repeats); an exception in it is raised."""
    it = iter(values)

    def nxt():
        v = next(it, values[-1])
        if isinstance(v, Exception):
            raise v
        return v
    return nxt


def test_a_reading_has_the_fields_nvidia_smi_names(monkeypatch):
    install(monkeypatch, FakeNvml(gpus=[h200(temperature_c=64, power_draw_mw=612_345, memory_used_mib=5597,
                                             utilization=(97, 40), clocks_event_mask=pynvml.nvmlClocksEventReasonSwPowerCap,
                                             processes=[(os.getpid(), 1500 * 2**20), (4242, 4096 * 2**20)])]))
    s = sampler_for(GPU0)
    r = s.read()
    s.close()
    assert r == {"index": 0, "temperature_c": 64, "power_draw_w": 612.3, "sm_clock_mhz": 1980, "memory_used_mib": 5597,
                 "process_memory_mib": 1500, "utilization_gpu_pct": 97, "pstate": "P0",
                 "clocks_event_reasons": ["SwPowerCap"], "throttle_started": []}


def test_no_sampler_when_the_decision_names_no_gpu():
    assert sampler_for(None) is None and sampler_for({"decision": {"device": "cpu", "gpu": None}}) is None


def test_a_thermal_slowdown_that_starts_during_the_job_is_reported_once(monkeypatch):
    install(monkeypatch, FakeNvml(gpus=[h200(clocks_event_mask=sequence(
        pynvml.nvmlClocksEventReasonGpuIdle, pynvml.nvmlClocksEventReasonSwPowerCap, HOT, HOT, 0))]))
    s = sampler_for(GPU0)  # the baseline: GpuIdle
    started = [s.read()["throttle_started"] for _ in range(4)]
    assert started == [[], ["HwThermalSlowdown"], [], []]  # SwPowerCap at full load is no slowdown


def test_a_slowdown_already_active_at_the_start_is_not_a_new_one(monkeypatch):
    install(monkeypatch, FakeNvml(gpus=[h200(clocks_event_mask=HOT)]))
    assert sampler_for(GPU0).read()["throttle_started"] == []


def test_nvml_failing_mid_job_gives_na_and_the_error_never_an_exception(monkeypatch):
    gpu = h200(power_draw_mw=sequence(70_000, pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)))
    install(monkeypatch, FakeNvml(gpus=[gpu]))
    s = sampler_for(GPU0)
    r = s.read()
    assert r["power_draw_w"] == "n/a" and r["errors"] == {"power_draw_w": "Unknown Error"} and r["temperature_c"] == 30
    gpu.lost = True  # fallen off the bus (Xid 79)
    r = s.read()
    assert set(r) == {"index", "error"} and r["error"].startswith("GPU lost: GPU is lost")


def test_no_nvml_at_all_is_a_reading_with_an_error(monkeypatch):
    install(monkeypatch, FakeNvml(init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED))
    s = GpuSampler(0)
    s.open()
    assert s.read() == {"index": 0, "error": "NVML did not initialise: Driver Not Loaded"}


def test_journal_fields_leave_out_what_nvml_could_not_read():
    assert gpustats.field({"temperature_c": "n/a"}, "temperature_c") is None
    assert gpustats.field({"clocks_event_reasons": []}, "clocks_event_reasons") == "none"
    assert gpustats.field({"clocks_event_reasons": ["SwPowerCap", "HwSlowdown"]}, "clocks_event_reasons") == "SwPowerCap,HwSlowdown"
    assert "too hot" in gpustats.throttle_words(["HwThermalSlowdown"])


def test_each_epoch_in_metadata_carries_its_gpu_reading(tmp_path, monkeypatch, small_smd_csv):
    install(monkeypatch, FakeNvml(gpus=[h200(temperature_c=sequence(30, 60, 70, 75))]))
    cfg = Config(models_dir=str(tmp_path / "models"), device="cpu", train=TrainConfig(epochs=3))
    job = run_job(str(small_smd_csv), cfg, plan=plan_device("cpu", "off"), health=GPU0)
    md = json.loads(open(os.path.join(job.model_dir, "metadata.json")).read())
    assert [h["gpu"]["temperature_c"] for h in md["history"]] == [60, 70, 75]
    assert md["tf32"] is None and md["float32_matmul_precision"] is None and md["data_placement_note"] == ""
    cpu = run_job(str(small_smd_csv), cfg, name="cpu-only", plan=plan_device("cpu", "off"), health=None)
    assert [h["gpu"] for h in cpu.metadata["history"]] == [None, None, None]


def run_daemon_job(tmp_path, monkeypatch, gate, rows: int, epochs: int = 3) -> list[dict]:
    """Run one dataset of ``rows`` x 4 through the real daemon in this process, its job forked by
    its forkserver, whose health gate is ``gate`` (tests/fakes/scripted_gate.py); return what the daemon
    sent to journald (captured at systemd-python's send)."""
    from opt_ds_ops.daemon import service as daemon_mod
    from opt_ds_ops.config.conffile import load_config
    from opt_ds_ops.observe.journal import EventLog
    from opt_ds_ops.daemon.notify import Notifier
    from opt_ds_ops.spool import open_spool

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cfg = load_config(str(write_config(tmp_path, settle_s=0, epochs=epochs)))
    sent = []
    log = EventLog(journal=False, stream=io.StringIO())
    log._journal = type("Capture", (), {"send": staticmethod(lambda MESSAGE, **f: sent.append(dict(f, MESSAGE=MESSAGE)))})
    d = daemon_mod.Daemon(cfg, open_spool(cfg.spool.dir), log, Notifier({}), str(tmp_path / "trainer.yaml"),
                          mp_context=job_context(), gate=gate, health_in_process=True)
    np.savetxt(spool_dir(tmp_path, "incoming") / "gpu.csv", np.random.default_rng(0).normal(size=(rows, 4)), delimiter=",")
    assert d.dispatch.take("gpu.csv")
    deadline = time.monotonic() + 300
    while d.job is not None:
        assert time.monotonic() < deadline, sent
        d._tick()
    return sent


def test_a_jobs_journal_events_carry_the_gpu_fields_and_a_throttle_warning(tmp_path, monkeypatch):
    """The real daemon in this process, its job forked by its forkserver, whose gate (tests/fakes/
    scripted_gate.py: gpu_gate) installs the fake NVML there; journald's send is captured."""
    from fakes import scripted_gate

    sent = run_daemon_job(tmp_path, monkeypatch, scripted_gate.gpu_gate, rows=300)
    assert done_names(tmp_path) == {"gpu.csv"}, sent  # NVML failing in epoch 3 did not fail the job
    epochs = [e for e in sent if e["MESSAGE_ID"] == MESSAGE_IDS["job-epoch"]]
    got = [{k: v for k, v in e.items() if k.startswith("DS_GPU_")} for e in epochs]
    assert got == [
        {"DS_GPU_TEMP_C": "71", "DS_GPU_POWER_W": "650", "DS_GPU_SM_CLOCK_MHZ": "1980", "DS_GPU_MEM_USED_MIB": "5597",
         "DS_GPU_PROC_MEM_MIB": "1500", "DS_GPU_UTIL_PCT": "0", "DS_GPU_THROTTLE": "SwPowerCap"},
        {"DS_GPU_TEMP_C": "86", "DS_GPU_POWER_W": "690", "DS_GPU_SM_CLOCK_MHZ": "1980", "DS_GPU_MEM_USED_MIB": "5597",
         "DS_GPU_PROC_MEM_MIB": "1500", "DS_GPU_UTIL_PCT": "0", "DS_GPU_THROTTLE": "SwPowerCap,HwThermalSlowdown"},
        {"DS_GPU_TEMP_C": "88", "DS_GPU_SM_CLOCK_MHZ": "1980", "DS_GPU_MEM_USED_MIB": "5597",  # power: NVML failed
         "DS_GPU_PROC_MEM_MIB": "1500", "DS_GPU_UTIL_PCT": "0", "DS_GPU_THROTTLE": "SwPowerCap,HwThermalSlowdown"},
    ]
    (warning,) = [e for e in sent if e["MESSAGE_ID"] == MESSAGE_IDS["job-gpu-throttle"]]
    assert warning["PRIORITY"] == "4" and warning["DS_EPOCH"] == "2" and warning["DS_GPU_INDEX"] == "0"
    assert warning["DS_GPU_THROTTLE_STARTED"] == "HwThermalSlowdown" and warning["DS_STAGE"] == "training"
    assert "GPU 0 started throttling in epoch 2: HwThermalSlowdown (hardware thermal slowdown" in warning["MESSAGE"]
    result = read_json(spool_dir(tmp_path, "done") / "gpu.csv.result.json")
    md = json.loads(open(os.path.join(result["model_dir"], "metadata.json")).read())
    assert [h["gpu"]["temperature_c"] for h in md["history"]] == [71, 86, 88]
    assert md["history"][2]["gpu"]["errors"] == {"power_draw_w": "Unknown Error"}


def test_a_daemon_job_whose_dataset_hit_cuda_out_of_memory_says_so_when_saved(tmp_path, monkeypatch):
    """The job process sees a fake GPU (scripted_gate.oom_gate) on which the dataset's copy runs out
    of memory: the job trains from pinned host memory and its saved event and metadata say so."""
    from fakes import scripted_gate

    # the training split's model inputs: 2,700 of 3,000 rows x 8 (each of 4 metrics' change and level,
    # train.input_differences as shipped) x 4 bytes; a batch (at most 2,048 rows) stays under it
    monkeypatch.setenv("DS_OPS_TEST_OOM_BYTES", str(2700 * 8 * 4))
    sent = run_daemon_job(tmp_path, monkeypatch, scripted_gate.oom_gate, rows=3000, epochs=1)
    assert done_names(tmp_path) == {"gpu.csv"}, sent
    (saved,) = [e for e in sent if e["MESSAGE_ID"] == MESSAGE_IDS["job-saved"]]
    assert saved["DS_DEVICE"] == "cuda:0" and "; CUDA out of memory placing the dataset (1 MiB) on cuda:0" in saved["MESSAGE"]
    # the saved line then says why training stopped
    assert saved["MESSAGE"].endswith("retried with the dataset in pinned host memory; stopped: epochs after 2 steps")
    result = read_json(spool_dir(tmp_path, "done") / "gpu.csv.result.json")
    md = json.loads(open(os.path.join(result["model_dir"], "metadata.json")).read())
    assert md["data_placement"] == "pinned-host" and md["data_placement_note"] in saved["MESSAGE"]
