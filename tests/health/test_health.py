"""The health gate on a fake NVML (tests/fakes/fake_pynvml.py) and ``ds-ops doctor`` for real on this machine.

The fake replaces ``pynvml`` in sys.modules; fake_cuda makes the CPU build of torch report the same
GPUs. One behaviour per test; the figures of the fake GPUs come from NVIDIA's documents (see the fake).
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from conftest import SMD_TRAIN, run_cli
from fakes.fake_cuda import fake_cuda, fake_cuda_runtime
from fakes.fake_pynvml import FakeNvml, h100, h200, install, v100
from opt_ds_ops import cli
from opt_ds_ops.health import nvml
from opt_ds_ops.config.conffile import Config, ConfigError, HealthConfig, load_config
from opt_ds_ops.health.policy import gate_job

GiB = 1024**3


# The CUDA smoke test runs on the CPU here (fake_cuda_runtime); on a loaded 2-core machine its
# default 5 s budget is no test of anything, so tests give it 600 s unless a test is about the timeout.
RELAXED = 600.0


def cfg(device="auto", amp="auto", **health) -> Config:
    return Config(device=device, amp=amp, health=HealthConfig(**{"smoke_timeout_s": RELAXED, **health}))


def relaxed_conffile(tmp_path) -> str:
    path = tmp_path / "trainer.yaml"
    path.write_text(f"health:\n  smoke_timeout_s: {RELAXED}\n")
    return str(path)


@pytest.fixture
def host(monkeypatch):
    """Install a fake NVML host with the given GPUs (default: one healthy H200) that torch also sees,
    with a working CUDA runtime (on the CPU) for the smoke test; ``runtime`` installs a faulty one."""

    def make(*gpus, torch_cuda="12.4", **kw) -> FakeNvml:
        fake = install(monkeypatch, FakeNvml(gpus=list(gpus) or [h200()], **kw))
        fake_cuda(monkeypatch, fake.gpus if fake.init_error is None else [], cuda_version=torch_cuda)
        if fake.init_error is None and torch_cuda is not None:
            fake_cuda_runtime(monkeypatch)
        return fake

    return make


def findings(decision, gpu=0) -> list[tuple[str, str]]:
    return [(f["level"], f["check"]) for f in decision.report["gpus"][gpu]["findings"]]


def messages(decision, gpu=None) -> str:
    fs = decision.report["findings"] if gpu is None else decision.report["gpus"][gpu]["findings"]
    return " | ".join(f["message"] for f in fs)


# --- readings --------------------------------------------------------------------------------

def test_healthy_h200_reads_like_nvidia_smi(host):
    host()
    g = gate_job(cfg()).report["gpus"][0]
    assert (g["name"], g["pci_bus_id"], g["compute_capability"]) == ("NVIDIA H200", "00000000:18:00.0", "9.0")
    assert (g["memory_total_mib"], g["memory_used_mib"], g["memory_free_mib"]) == (143771, 1, 143770)
    assert (g["temperature_c"], g["temp_slowdown_c"], g["temp_shutdown_c"]) == (30, 89, 92)
    assert (g["power_draw_w"], g["power_limit_w"], g["pstate"]) == (70.0, 700.0, "P0")
    assert (g["pcie_gen_current"], g["pcie_gen_max"], g["pcie_width_current"], g["pcie_width_max"]) == (5, 5, 16, 16)
    assert g["clocks_event_reasons"] == ["GpuIdle"] and g["ecc_mode"] == "Enabled"
    assert g["retired_pages_dbe"] == "n/a" and g["remapped_rows_failure"] is False  # Hopper remaps rows


def test_healthy_h200_runs_the_job_on_cuda_with_bf16(host):
    host()
    d = gate_job(cfg())
    assert d.action == "run" and d.report["verdict"] == "ok" and d.report["gpus"][0]["findings"] == []
    assert (str(d.plan.device), d.plan.amp_name) == ("cuda:0", "bf16")
    assert d.report["host"] == {"status": "ok", "detail": "", "driver_version": "550.54.15",
                                "nvml_version": "12.550.54.15", "cuda_driver_version": "12.4"}
    json.dumps(d.report)  # the report goes into metadata.json as is


def test_gpu_without_bf16_gets_fp16_with_grad_scaler(host, monkeypatch):
    host(v100())
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    d = gate_job(cfg())
    assert (d.plan.amp_name, d.plan.use_grad_scaler) == ("fp16", True)


def test_clocks_event_reasons_decode_to_nvml_names():
    assert nvml.decode_clocks_event_reasons(0x4 | 0x8 | 0x80) == ["SwPowerCap", "HwSlowdown", "HwPowerBrakeSlowdown"]
    assert nvml.decode_clocks_event_reasons(0) == []
    assert nvml.decode_clocks_event_reasons(0x1 | 0x10000) == ["GpuIdle", "Unknown(0x10000)"]


def test_older_driver_without_clocks_event_call_falls_back_to_throttle_reasons(host):
    fake = host(h200(clocks_event_mask=0x20), missing={"nvmlDeviceGetCurrentClocksEventReasons"})
    d = gate_job(cfg())
    assert d.report["gpus"][0]["clocks_event_reasons"] == ["SwThermalSlowdown"]
    assert "nvmlDeviceGetCurrentClocksThrottleReasons" in fake.calls
    assert d.report["gpus"][0]["errors"] == {}


def test_not_supported_fields_are_na_and_never_a_finding(host):
    host(h200(unsupported={"nvmlDeviceGetPowerUsage", "nvmlDeviceGetTemperatureThreshold", "nvmlDeviceGetEccMode",
                           "nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrPcieLinkWidth",
                           "nvmlDeviceGetRemappedRows", "nvmlDeviceGetUtilizationRates"}))
    d = gate_job(cfg())
    g = d.report["gpus"][0]
    for key in ("power_draw_w", "temp_slowdown_c", "ecc_mode", "ecc_volatile_uncorrected", "clocks_event_reasons",
                "pcie_width_current", "remapped_rows_pending", "utilization_gpu_pct"):
        assert g[key] == "n/a", key
    assert g["power_limit_w"] == 700.0 and g["errors"] == {}
    assert d.report["verdict"] == "ok" and d.action == "run" and str(d.plan.device) == "cuda:0"


def test_nvml_error_on_one_field_is_a_warning_naming_it(host):
    host(h200(failing={"nvmlDeviceGetPowerUsage": 4}))  # NVML_ERROR_NO_PERMISSION
    d = gate_job(cfg())
    assert findings(d) == [("warn", "nvml")]
    assert "power_draw_w (Insufficient Permissions)" in messages(d, 0)
    assert d.report["gpus"][0]["temperature_c"] == 30  # the other fields are still read


# --- warn findings ---------------------------------------------------------------------------

@pytest.mark.parametrize("gpu, check, words", [
    (h200(temperature_c=85), "temperature", "85 °C is within 5 °C of the slowdown threshold 89 °C"),
    (h200(clocks_event_mask=0x8 | 0x80), "throttle", "HwSlowdown, HwPowerBrakeSlowdown"),
    (h200(clocks_event_mask=0x40 | 0x8), "throttle", "HwSlowdown, HwThermalSlowdown"),
    (h200(clocks_event_mask=0x20), "throttle", "SwThermalSlowdown"),
    (h200(pcie=(5, 5, 8, 16)), "pcie", "x8 of x16 lanes"),
    (h200(remapped_rows=(0, 1, 1, 0)), "remapped_rows", "row remap is pending"),
    (v100(retired_pages=(10, 5, 0)), "retired_pages", "15 retired pages >= soft limit 15"),
    (v100(retired_pages=(1, 0, 1)), "retired_pages", "pending retirement"),
])
def test_warn_finding(host, gpu, check, words):
    host(gpu)
    d = gate_job(cfg())
    assert findings(d) == [("warn", check)] and words in messages(d, 0)
    assert d.report["verdict"] == "warn" and d.action == "run" and d.plan.device.type == "cuda"
    assert words in d.reason  # the job's reason carries its warnings


@pytest.mark.parametrize("mask", [0x1, 0x4, 0x10, 0x2])  # GpuIdle, SwPowerCap, SyncBoost, ApplicationsClocksSetting
def test_normal_clocks_event_reasons_are_not_findings(host, mask):
    host(h200(clocks_event_mask=mask))
    assert gate_job(cfg()).report["verdict"] == "ok"


def test_lower_pcie_generation_at_idle_is_not_a_finding(host):
    host(h200(pcie=(1, 5, 16, 16), pstate=8))
    assert gate_job(cfg()).report["verdict"] == "ok"


def test_temperature_margin_comes_from_the_config(host):
    host(h200(temperature_c=85))
    assert gate_job(cfg(temp_margin_c=3)).report["verdict"] == "ok"


# --- fail findings ---------------------------------------------------------------------------

@pytest.mark.parametrize("gpu, check, words", [
    (h200(ecc={"volatile_corrected": 3, "volatile_uncorrected": 2, "aggregate_corrected": 9,
               "aggregate_uncorrected": 2}), "ecc", "2 uncorrected (double-bit) ECC errors"),
    (h200(remapped_rows=(0, 8, 0, 1)), "remapped_rows", "row remapping failed"),
    (v100(retired_pages=(40, 23, 0)), "retired_pages", "63 retired pages >= limit 63"),
    (h200(temperature_c=88, shutdown_c=92, slowdown_c=80), "temperature", "within 5 °C of the shutdown threshold 92 °C"),
    (h200(lost=True), "gpu", "GPU is lost"),
])
def test_fail_finding(host, gpu, check, words):
    host(gpu)
    d = gate_job(cfg())
    assert ("fail", check) in findings(d) and words in messages(d, 0)
    assert d.report["verdict"] == "fail" and d.report["gpus"][0]["verdict"] == "fail"


def test_free_memory_below_the_jobs_need_fails_for_that_job(host):
    host(h100(memory_used_mib=80000))
    d = gate_job(cfg(), need_bytes=2 * GiB)
    assert findings(d) == [("fail", "memory")] and "1559 MiB free, the job needs 2048 MiB" in messages(d, 0)
    assert gate_job(cfg(), need_bytes=1 * GiB).report["verdict"] == "ok"


def test_retired_page_limits_come_from_the_config(host):
    host(v100(retired_pages=(3, 2, 0)))
    d = gate_job(cfg(retired_pages_warn=2, retired_pages_fail=5))
    assert findings(d) == [("fail", "retired_pages")]


# --- the host --------------------------------------------------------------------------------

@pytest.mark.parametrize("code, words", [(12, "no NVIDIA driver: libnvidia-ml.so.1 was not found"),
                                         (9, "no NVIDIA driver loaded")])
def test_no_driver_means_the_cpu_with_one_warning(host, code, words):
    host(init_error=code)
    d = gate_job(cfg())
    assert d.action == "run" and str(d.plan.device) == "cpu" and d.plan.amp_dtype is None
    assert d.report["verdict"] == "warn" and len(d.report["findings"]) == 1 and words in messages(d)


@pytest.mark.parametrize("on_fail", ["cpu", "defer", "refuse"])
def test_no_driver_under_device_auto_ignores_on_fail(host, on_fail):
    host(init_error=12)
    assert gate_job(cfg(on_fail=on_fail)).action == "run"


def test_no_driver_when_cuda_is_asked_is_a_fail_under_the_policy(host):
    host(init_error=9)
    d = gate_job(cfg(device="cuda", on_fail="refuse"))
    assert d.action == "refuse" and d.report["verdict"] == "fail" and "no NVIDIA driver loaded" in d.reason


def test_missing_nvidia_ml_py_is_no_library(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "pynvml", None)  # import pynvml -> ImportError
    assert nvml.read_host().status == "no_library"


@pytest.mark.parametrize("on_fail, action, device", [("cpu", "run", "cpu"), ("defer", "defer", None),
                                                     ("refuse", "refuse", None)])
def test_version_mismatch_is_reboot_required_with_the_configured_fallback(host, on_fail, action, device):
    host(init_error=18)  # NVML_ERROR_LIB_RM_VERSION_MISMATCH
    d = gate_job(cfg(on_fail=on_fail))
    assert d.report["verdict"] == "fail" and d.report["host"]["status"] == "version_mismatch"
    assert "reboot required" in d.reason and d.action == action
    assert (str(d.plan.device) if d.plan else None) == device


def test_version_mismatch_under_device_cpu_is_only_a_warning(host):
    host(init_error=18)
    d = gate_job(cfg(device="cpu", on_fail="refuse"))
    assert d.action == "run" and d.report["verdict"] == "warn" and "reboot required" in messages(d)


def test_device_cpu_runs_on_the_cpu_whatever_the_gpu_says(host):
    host(h200(lost=True))
    d = gate_job(cfg(device="cpu", on_fail="refuse"))
    assert d.action == "run" and str(d.plan.device) == "cpu"


def test_torch_built_for_a_newer_cuda_major_than_the_driver_fails(host):
    host(torch_cuda="13.0")
    d = gate_job(cfg(on_fail="refuse"))
    assert d.action == "refuse" and "torch is built with CUDA 13.0 but driver 550.54.15 supports CUDA 12.4" in d.reason


def test_torch_built_for_a_newer_cuda_minor_than_the_driver_warns(host):
    host(torch_cuda="12.8")
    d = gate_job(cfg())
    assert d.report["verdict"] == "warn" and "minor-version compatibility" in messages(d)
    assert str(d.plan.device) == "cuda:0"


def test_cpu_build_of_torch_on_a_gpu_host_runs_on_the_cpu_with_a_warning(host):
    host(torch_cuda=None)
    d = gate_job(cfg())
    assert str(d.plan.device) == "cpu" and "is a CPU build" in messages(d) and d.report["verdict"] == "warn"


def test_torch_seeing_fewer_gpus_than_nvml_warns(host, monkeypatch):
    fake = host(h200(), h100())
    fake_cuda(monkeypatch, fake.gpus[1:])  # torch sees only the H100 (as with CUDA_VISIBLE_DEVICES=1)
    d = gate_job(cfg())
    assert "torch sees 1 GPU(s), NVML sees 2" in messages(d)
    assert [g["torch_index"] for g in d.report["gpus"]] == [None, 0]  # matched by UUID, not position
    assert str(d.plan.device) == "cuda:0" and "H100" in d.reason


# --- two GPUs and the on_fail policy ---------------------------------------------------------

def test_two_gpus_with_one_unhealthy_runs_on_the_healthy_one(host):
    host(h200(ecc={"volatile_corrected": 0, "volatile_uncorrected": 1, "aggregate_corrected": 0,
                   "aggregate_uncorrected": 1}), h200(uuid="GPU-00000000-0000-4000-8000-000000000002",
                                                      bus_id="00000000:2A:00.0"))
    d = gate_job(cfg())
    assert [g["verdict"] for g in d.report["gpus"]] == ["fail", "ok"]
    assert d.report["verdict"] == "fail" and d.action == "run" and str(d.plan.device) == "cuda:1"


def test_a_healthy_gpu_is_preferred_to_a_warning_one(host):
    host(h200(pcie=(5, 5, 8, 16)), h200(uuid="GPU-00000000-0000-4000-8000-000000000002"))
    assert str(gate_job(cfg()).plan.device) == "cuda:1"


def test_cuda_n_names_the_gpu_and_its_failure_applies_the_policy(host):
    host(h200(), h200(uuid="GPU-00000000-0000-4000-8000-000000000002", temperature_c=91))
    d = gate_job(cfg(device="cuda:1", on_fail="defer"))
    assert d.action == "defer" and "GPU 1 temperature" in d.reason


@pytest.mark.parametrize("on_fail", ["cpu", "defer", "refuse"])
def test_on_fail_policy_when_the_only_gpu_fails(host, on_fail):
    host(h200(remapped_rows=(0, 8, 0, 1)))
    d = gate_job(cfg(on_fail=on_fail, retry_s=120))
    assert d.report["verdict"] == "fail" and "row remapping failed" in d.reason
    assert d.report["decision"]["action"] == d.action
    if on_fail == "cpu":
        assert d.action == "run" and str(d.plan.device) == "cpu" and "health.on_fail=cpu" in d.reason
    elif on_fail == "defer":
        assert d.action == "defer" and d.plan is None and "retry in 120 s" in d.reason
    else:
        assert d.action == "refuse" and d.plan is None and d.report["gpus"][0]["findings"]


def test_an_amp_the_gpu_cannot_do_is_refused(host, monkeypatch):
    host(v100())
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    d = gate_job(cfg(amp="bf16"))
    assert d.action == "refuse" and "bf16" in d.reason


# --- the CUDA smoke test in the gate ------------------------------------------------------------

@pytest.fixture
def runtime(monkeypatch):
    """Install the fake CUDA runtime (CPU kernels) with a fault; a hung one is released at teardown."""
    made = []

    def make(fault=None, **kw):
        made.append(fake_cuda_runtime(monkeypatch, fault, **kw))
        return made[-1]

    yield make
    for rt in made:
        rt.release.set()


def test_smoke_test_on_a_working_gpu_passes_and_is_timed(host, runtime):
    host()
    rt = runtime()
    d = gate_job(cfg())
    assert d.action == "run" and str(d.plan.device) == "cuda:0" and d.report["verdict"] == "ok"
    (t,) = d.report["smoke_tests"]
    assert t["ok"] and t["error"] == "" and t["device"] == "cuda:0" and t["amp_dtype"] == "bf16"
    assert t["seconds"] > 0 and 0.5 < t["loss"] < 3  # an untrained autoencoder on N(0, 1) data: MSE about 1
    assert rt.calls[0] == "set_device" and rt.calls[-1] == "synchronize"  # context first, result synchronised
    json.dumps(d.report)


def test_smoke_test_uses_the_grad_scaler_with_fp16(host, runtime, monkeypatch):
    host(v100())
    runtime()
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    scalers = []
    real = torch.amp.GradScaler
    monkeypatch.setattr(torch.amp, "GradScaler", lambda *a, **k: scalers.append(k.get("enabled")) or real(*a, **k))
    (t,) = gate_job(cfg()).report["smoke_tests"]
    assert t["ok"] and t["amp_dtype"] == "fp16" and scalers == [True]


SMOKE_FAULTS = [
    ("error", "AcceleratorError: CUDA error: an illegal memory access was encountered"),
    ("hang", "did not finish within 0.2 s (health.smoke_timeout_s)"),
    ("nan", "the forward pass gave a non-finite loss (nan)"),
]


@pytest.mark.parametrize("fault, words", SMOKE_FAULTS)
@pytest.mark.parametrize("on_fail", ["cpu", "defer", "refuse"])
def test_a_failed_smoke_test_is_a_fail_finding_and_on_fail_decides(host, runtime, fault, words, on_fail):
    host()
    runtime(fault)
    d = gate_job(cfg(on_fail=on_fail, smoke_timeout_s=0.2 if fault == "hang" else RELAXED))
    g = d.report["gpus"][0]
    assert d.report["verdict"] == g["verdict"] == "fail"
    assert ("fail", "cuda") in findings(d) and f"CUDA smoke test failed: {words}" in messages(d, 0)
    (t,) = d.report["smoke_tests"]
    assert not t["ok"] and words in t["error"] and t["timed_out"] == (fault == "hang")
    assert f"GPU 0 cuda: CUDA smoke test failed: {words}" in d.reason
    assert d.action == {"cpu": "run", "defer": "defer", "refuse": "refuse"}[on_fail]
    assert d.report["decision"]["action"] == d.action
    if on_fail == "cpu":
        assert str(d.plan.device) == "cpu" and "health.on_fail=cpu" in d.reason
    json.dumps(d.report)


def test_a_failed_smoke_test_moves_the_job_to_the_next_healthy_gpu(host, runtime, monkeypatch):
    host(h200(), h200(uuid="GPU-00000000-0000-4000-8000-000000000002", bus_id="00000000:2A:00.0"))
    rt = runtime()
    real_sync = torch.cuda.synchronize
    tried = []

    def sync(device=None):  # GPU 0 raises, GPU 1 works
        tried.append(str(device))
        if str(device) == "cuda:0":
            raise torch.AcceleratorError("CUDA error: unspecified launch failure")
        real_sync(device)

    monkeypatch.setattr(torch.cuda, "synchronize", sync)
    d = gate_job(cfg(on_fail="refuse"))
    assert tried == ["cuda:0", "cuda:1"] and d.action == "run" and str(d.plan.device) == "cuda:1"
    assert [t["ok"] for t in d.report["smoke_tests"]] == [False, True]
    assert d.report["gpus"][0]["verdict"] == "fail" and d.report["gpus"][1]["verdict"] == "ok"
    assert rt.calls.count("set_device") == 2


def test_no_smoke_test_when_the_job_is_not_planned_on_a_gpu(host, runtime):
    host()
    rt = runtime("error")
    d = gate_job(cfg(device="cpu"))
    assert d.action == "run" and d.report["smoke_tests"] == [] and rt.calls == []
    assert gate_job(cfg(), smoke=False).report.get("smoke_tests") is None and rt.calls == []


def test_the_daemons_start_up_health_log_runs_no_smoke_test(host, runtime, tmp_path):
    import io

    from opt_ds_ops.daemon.service import Daemon
    from opt_ds_ops.observe.journal import EventLog
    from opt_ds_ops.daemon.notify import Notifier
    from opt_ds_ops.spool import open_spool

    host()
    rt = runtime("error")  # a smoke test would fail the GPU: the log says ok, and no CUDA call was made
    out = io.StringIO()
    d = Daemon(cfg(), open_spool(str(tmp_path / "spool")), EventLog(journal=False, stream=out), Notifier({}),
               str(tmp_path / "trainer.yaml"), health_in_process=True)  # this process has the fakes
    d.duties.log_health()
    assert "health ok: all checks passed -> cuda:0 amp=bf16" in out.getvalue() and rt.calls == []


def test_tf32_is_planned_only_for_fp32_on_a_gpu_that_has_it(host, monkeypatch):
    host()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: dataclasses.make_dataclass(
        "P", ["major"])(9))
    assert gate_job(cfg(), smoke=False).plan.tf32 is False  # bf16 autocast: TF32 does not apply
    off = gate_job(Config(amp="off", tf32=True), smoke=False)
    assert off.plan.tf32 and off.report["decision"]["float32_matmul_precision"] == "high"
    assert "tf32=on" in off.plan.describe()
    assert gate_job(Config(amp="off"), smoke=False).report["decision"]["tf32"] is False
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: dataclasses.make_dataclass(
        "P", ["major"])(7))  # Volta: no TF32
    assert gate_job(Config(amp="off", tf32=True), smoke=False).plan.tf32 is False


# --- configuration ---------------------------------------------------------------------------

def test_health_thresholds_are_validated_with_file_and_key(tmp_path):
    path = tmp_path / "trainer.yaml"
    path.write_text("health:\n  temp_margin_c: 40\n")
    with pytest.raises(ConfigError, match=r"trainer.yaml: line 2, column 3: key 'health.temp_margin_c' must be degrees "
                                          r"Celsius in \[0, 30\]"):
        load_config(str(path))


def test_shipped_conffile_health_section_equals_the_defaults():
    from conftest import REPO

    assert load_config(str(REPO / "etc" / "ds-ops" / "trainer.yaml")).health == HealthConfig()
    assert dataclasses.asdict(HealthConfig()) == {"on_fail": "cpu", "retry_s": 300.0, "temp_margin_c": 5,
                                                 "retired_pages_warn": 15, "retired_pages_fail": 63,
                                                 "smoke_timeout_s": 5.0}
    assert load_config(str(REPO / "etc" / "ds-ops" / "trainer.yaml")).tf32 is Config().tf32 is False


# --- ds-ops doctor and ds-ops train --------------------------------------------------------------

def test_doctor_on_this_machine_says_no_nvidia_driver_and_names_the_cpu():
    p = run_cli("doctor")
    assert p.returncode == 1, p.stderr  # warn: no GPU, the CPU is the device
    assert "no NVIDIA driver" in p.stdout and "a job would get: device cpu, amp off" in p.stdout
    assert p.stderr == ""


def test_doctor_json_on_this_machine():
    p = run_cli("doctor", "--json")
    report = json.loads(p.stdout)
    assert p.returncode == 1 == report["exit_code"]
    assert report["host"]["status"] == "no_library" and "no NVIDIA driver" in report["findings"][0]["message"]
    assert report["decision"] == {"action": "run", "device": "cpu", "amp_dtype": "off",
                                  "reason": "device: auto and no usable CUDA GPU", "tf32": False,
                                  "float32_matmul_precision": "highest", "gpu": None}
    assert report["smoke_tests"] == []


def test_doctor_here_makes_no_cuda_attempt(monkeypatch, capsys):
    """No driver: doctor never reaches the smoke test nor any CUDA call beyond torch's availability query."""
    from opt_ds_ops.health import policy as health, smoke

    def boom(*a, **k):
        raise AssertionError("CUDA was touched")

    monkeypatch.setattr(smoke, "_one_step", boom)
    monkeypatch.setattr(health, "smoke_test", boom)
    for name in ("set_device", "synchronize", "mem_get_info", "init"):
        monkeypatch.setattr(torch.cuda, name, boom)
    assert cli.main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "no NVIDIA driver" in out and "cuda smoke test: not run (no CUDA GPU planned)" in out
    assert cli.main(["doctor", "--no-smoke"]) == 1 and "cuda smoke test: skipped (--no-smoke)" in capsys.readouterr().out


def test_doctor_prints_the_smoke_tests_time_and_no_smoke_skips_it(host, runtime, capsys, tmp_path):
    host()
    rt = runtime()
    assert cli.main(["doctor", "--config", relaxed_conffile(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"cuda smoke test: ok in \d+\.\d\d s \(cuda:0 amp=bf16, loss [\d.]+\)", out), out
    assert cli.main(["doctor", "--no-smoke"]) == 0
    assert "cuda smoke test: skipped (--no-smoke)" in capsys.readouterr().out and rt.calls.count("synchronize") == 1


def test_doctor_with_a_failing_smoke_test_exits_2(host, runtime, capsys, tmp_path):
    host()
    runtime("error")
    assert cli.main(["doctor", "--json", "--config", relaxed_conffile(tmp_path)]) == 2
    report = json.loads(capsys.readouterr().out)
    assert report["verdict"] == "fail" and report["decision"]["device"] == "cpu"
    assert "illegal memory access" in report["smoke_tests"][0]["error"]


def test_doctor_exit_code_follows_the_policy(tmp_path):
    conf = tmp_path / "trainer.yaml"
    conf.write_text("device: cuda\nhealth:\n  on_fail: refuse\n")
    p = run_cli("doctor", "--config", str(conf))
    assert p.returncode == 2 and "no device (refuse, health.on_fail=refuse)" in p.stdout
    assert run_cli("doctor", "--device", "cpu").returncode == 0


def test_doctor_table_on_a_fake_two_gpu_host(host, capsys, tmp_path):
    host(h200(), h200(uuid="GPU-00000000-0000-4000-8000-000000000002", bus_id="00000000:2A:00.0",
                      clocks_event_mask=0x8 | 0x80))
    assert cli.main(["doctor", "--config", relaxed_conffile(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "NVIDIA driver 550.54.15, NVML 12.550.54.15, CUDA 12.4 (driver), 2 GPU(s)" in out
    assert "1 / 143771" in out and "30 (89/92)" in out and "70 / 700" in out and "HwSlowdown,HwPowerBrakeSlowdown" in out
    assert "warn  throttle: clocks held back by HwSlowdown, HwPowerBrakeSlowdown" in out
    assert "a job would get: device cuda:0, amp bf16" in out


def test_train_stores_the_health_report_in_metadata(tmp_path, small_smd_csv):
    p = run_cli("train", str(small_smd_csv), "--models-dir", str(tmp_path), "--epochs", "1", "--json")
    assert p.returncode == 0 and p.stderr == "", p.stderr
    summary = json.loads(p.stdout)
    assert summary["health"] == "warn"
    health = json.loads((tmp_path / "machine-small" / "current" / "metadata.json").read_text())["health"]
    assert summary["model_dir"].startswith(str(tmp_path)) and health["decision"]["device"] == "cpu"
    assert health["verdict"] == "warn" and health["host"]["status"] == "no_library"


def test_train_text_output_names_the_health_warning(tmp_path, small_smd_csv):
    p = run_cli("train", str(small_smd_csv), "--models-dir", str(tmp_path), "--epochs", "1")
    first = p.stdout.splitlines()[0]
    assert p.returncode == 0 and first.startswith(f"training on {small_smd_csv} (cpu amp=off, 1 epochs; health warn")
    assert "no NVIDIA driver" in first


def test_train_with_device_cuda_on_this_machine_is_refused_cleanly(tmp_path):
    p = run_cli("train", str(SMD_TRAIN), "--models-dir", str(tmp_path), "--device", "cuda")
    assert p.returncode == 1 and "--device cuda: no CUDA GPU is usable here" in p.stderr
    assert "Traceback" not in p.stderr and not any(tmp_path.iterdir())
