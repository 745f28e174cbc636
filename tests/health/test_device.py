"""Device, AMP and TF32 decision on this CPU-only machine; the dataset's placement on a fake GPU
(tests/fakes/fake_cuda.py: a CUDA runtime on the CPU that runs out of memory)."""

from __future__ import annotations

import pytest
import torch

from fakes.fake_cuda import fake_cuda, fake_cuda_runtime
from fakes.fake_pynvml import h200
from opt_ds_ops.health.device import DeviceError, plan_device, resolve_amp, resolve_device
from opt_ds_ops.training.fit import GPU_HEADROOM_BYTES, _place


def test_auto_picks_the_cpu_and_fp32_without_a_gpu():
    plan = plan_device("auto", "auto")
    assert plan.device == torch.device("cpu")
    assert plan.amp_dtype is None and plan.amp_name == "off" and not plan.use_grad_scaler


def test_explicit_amp_is_honoured_and_fp16_brings_the_grad_scaler():
    assert resolve_amp("bf16", torch.device("cpu")) == torch.bfloat16
    plan = plan_device("cpu", "fp16")
    assert plan.amp_dtype == torch.float16 and plan.use_grad_scaler


@pytest.mark.parametrize("spec", ["cuda", "cuda:1"])
def test_a_missing_cuda_device_is_a_clear_error(spec):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(DeviceError, match="torch sees no CUDA GPU"):
        resolve_device(spec)


# --- CUDA out of memory at the dataset's placement (fake CUDA runtime on the CPU) ----------------

MiB = 1024**2


@pytest.fixture
def gpu(monkeypatch):
    """torch sees one H200 (fake_cuda) whose runtime runs on the CPU and raises out of memory for
    copies of at least ``oom_min_bytes`` (every copy by default)."""
    def make(**kw):
        fake_cuda(monkeypatch, [h200()])
        return fake_cuda_runtime(monkeypatch, "oom", **kw)
    return make


def test_out_of_memory_on_the_copy_retries_in_pinned_host_memory_and_says_so(gpu):
    rt = gpu(free_bytes=80 * 1024 * MiB)
    x = torch.ones(1000, 38)
    placed, placement, note = _place(x, torch.device("cuda", 0))
    assert placement == "pinned-host" and rt.calls == ["to", "pin_memory"] and torch.equal(placed, x)
    assert note.startswith("CUDA out of memory placing the dataset (1 MiB) on cuda:0 (CUDA out of memory. Tried to allocate")
    assert note.endswith("retried with the dataset in pinned host memory")


def test_a_dataset_that_fits_goes_to_the_gpu_without_a_note(gpu):
    rt = gpu(oom_min_bytes=10**12)  # no copy is that large
    assert _place(torch.ones(10, 4), torch.device("cuda", 0))[1:] == ("gpu", "") and rt.calls == ["to"]


def test_too_little_free_memory_goes_to_pinned_host_memory_without_trying(gpu):
    rt = gpu(free_bytes=GPU_HEADROOM_BYTES)
    assert _place(torch.ones(10, 4), torch.device("cuda", 0))[1:] == ("pinned-host", "") and rt.calls == ["pin_memory"]


def test_a_second_out_of_memory_fails_stage_training_naming_free_and_needed_memory(gpu, tmp_path, small_smd_csv):
    from opt_ds_ops.config.conffile import Config, TrainConfig
    from opt_ds_ops.health.device import DevicePlan
    from opt_ds_ops.training.job import JobError, run_job

    free = iter([600 * MiB, 300 * MiB])  # enough to try the GPU; then another process took memory
    rt = gpu(free_bytes=lambda: next(free))
    cfg = Config(models_dir=str(tmp_path / "models"), train=TrainConfig(epochs=1))
    plan = DevicePlan(torch.device("cuda", 0), torch.bfloat16)
    with pytest.raises(JobError) as err:
        run_job(str(small_smd_csv), cfg, plan=plan)
    e = err.value
    assert e.stage == "training" and e.cause_type == "TrainingError"
    assert "CUDA out of memory on cuda:0 even with the dataset in pinned host memory: 300 MiB free, the job needs about 513 MiB" in str(e)
    assert "Tried to allocate" in str(e) and "\n" not in str(e)
    assert rt.calls[:3] == ["to", "pin_memory", "to"]  # GPU, retry pinned, then the validation split: out of memory again
    assert not (tmp_path / "models").exists()


def test_tf32_is_planned_only_with_amp_off_on_a_gpu_that_has_it(monkeypatch):
    fake_cuda(monkeypatch, [h200()])  # compute capability 9.0
    assert plan_device("cuda:0", "off", tf32=True).tf32 and plan_device("cuda:0", "off", tf32=True).matmul_precision == "high"
    assert not plan_device("cuda:0", "bf16", tf32=True).tf32
    assert not plan_device("cuda:0", "off").tf32 and plan_device("cuda:0", "off").matmul_precision == "highest"
    assert not plan_device("cpu", "off", tf32=True).tf32
    fake_cuda(monkeypatch, [h200(compute_capability=(7, 0))])  # Volta: no TF32 tensor cores
    assert not plan_device("cuda:0", "off", tf32=True).tf32


def test_a_job_whose_dataset_hit_out_of_memory_trains_from_pinned_host_memory_and_says_so(
        gpu, tmp_path, small_smd_csv, monkeypatch):
    from opt_ds_ops.config.conffile import Config, TrainConfig
    from opt_ds_ops.training.job import run_job

    x_train_bytes = 2700 * 38 * 4  # the 3,000-row slice's training split (90 %), float32
    rt = gpu(oom_min_bytes=x_train_bytes)  # only the dataset's copy runs out of memory; smaller ones fit
    precision = []
    monkeypatch.setattr(torch, "set_float32_matmul_precision", precision.append)
    cfg = Config(models_dir=str(tmp_path / "models"), train=TrainConfig(epochs=2))
    job = run_job(str(small_smd_csv), cfg, plan=plan_device("cuda:0", "off", tf32=True))
    md = job.metadata
    assert md["device"] == "cuda:0" and md["data_placement"] == "pinned-host" and md["epochs"] == 2
    assert md["data_placement_note"].startswith("CUDA out of memory placing the dataset (1 MiB) on cuda:0")
    assert md["data_placement_note"].endswith("retried with the dataset in pinned host memory")
    assert rt.calls[:2] == ["to", "pin_memory"] and md["final_train_loss"] < 2
    assert (md["tf32"], md["float32_matmul_precision"], precision) == (True, "high", ["high"])
