"""What the daemon reads of a training job, without torch: an epoch's record, the step bound of its
progress line, and the journal line's tails of a saved version's metadata.

The daemon's process never imports torch (its jobs get it from the forkserver), so what it needs
of the trainers lives here; :mod:`.common`, :mod:`.stopping` and :mod:`.job` re-export these names.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config.conffile import TrainConfig


@dataclass
class EpochStats:
    """One epoch: mean train and validation MSE (standardised units), throughput (samples/s),
    and ``steps``: the optimizer steps of the run so far (this epoch's included; 0 in a checkpoint
    written before the field existed).

    ``gpu``: the job's GPU read through NVML at the epoch's end (:meth:`opt_ds_ops.health.gpustats.GpuSampler.read`:
    °C, W, MHz, MiB, %, throttle reasons), None on the CPU."""

    epoch: int
    train_loss: float
    val_loss: float | None
    samples_per_s: float
    seconds: float
    skipped_steps: int = 0
    gpu: dict | None = None
    steps: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)

    def line(self, epochs: int, max_steps: int | None = None) -> str:
        """One human line: ``epoch 2/5 loss=0.843029 val_loss=1.013831 1,312,349 samples/s``; with
        ``max_steps`` (the plateau rule's bound) ``epoch 12/1000 step 132/500 loss=...``."""
        val = f" val_loss={self.val_loss:.6f}" if self.val_loss is not None else ""
        skipped = f" skipped_steps={self.skipped_steps}" if self.skipped_steps else ""
        step = f" step {self.steps:,}/{max_steps:,}" if max_steps and self.steps else ""
        return f"epoch {self.epoch}/{epochs}{step} loss={self.train_loss:.6f}{val} {self.samples_per_s:,.0f} samples/s{skipped}"


def step_cap(cfg: TrainConfig) -> int | None:
    """Return ``max_steps`` under the plateau rule (the bound that ends training first, for progress
    lines and ratios), None under ``stopping: epochs``."""
    return cfg.max_steps if cfg.stopping == "plateau" else None


def columns_note(ds: dict) -> str:
    """Return what metadata.json's ``dataset`` says about columns and time, as a log-line tail:
    ``; time index 'Time' (epoch_ms); left out: column 1 ('Time'), ...; 3 rows ... sorted``."""
    parts = []
    if ds.get("time"):
        parts.append(f"time index {ds['time']['column']!r} ({ds['time']['kind']})")
    left = [d["column"] for d in ds.get("left_out") or [] if not d["why"].startswith("time index")]
    if left:
        parts.append("left out: " + ", ".join(left[:8]) + (", ..." if len(left) > 8 else ""))
    parts.extend(ds.get("notes") or [])
    return "".join("; " + p for p in parts)


def stopping_note(metadata: dict) -> str:
    """Return the journal line's tail for why training stopped (docs/detection.md) and whether the model
    is suspect: ``; stopped: plateau after 800 steps; suspect: 1 warning(s)`` ("" for neither)."""
    stop = metadata.get("stopping") or {}
    note = f"; stopped: {stop['reason']} after {stop['steps']} steps" if stop.get("reason") else ""
    warnings = metadata.get("warnings") or []
    return note + (f"; suspect: {len(warnings)} warning(s), see model-suspect" if warnings else "")
