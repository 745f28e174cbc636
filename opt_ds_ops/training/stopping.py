"""When training stops: a plateau of the validation loss, with patience, a minimum and a maximum
number of optimizer steps, and the best weights restored (docs/detection.md).

``train.stopping: plateau`` (the default): the validation loss is evaluated every
``eval_every_steps`` optimizer steps, on at most :data:`EVAL_ROWS` validation rows (evenly
strided), so that an evaluation costs about the same on 5,000 rows as on 5,000,000 and the cost of
the rule is bounded by ``max_steps`` / ``eval_every_steps`` evaluations whatever the dataset's
size. An evaluation improves when its loss is below the reference by more than the relative
``min_delta``; after ``patience`` evaluations in a row without improvement, and at least
``min_steps`` steps, training stops ("plateau"). It stops at ``max_steps`` ("max_steps") or at the
``epochs`` cap ("epochs") otherwise; the weights it stops with are evaluated too (at ``max_steps``
and at the epochs cap, when that step was not an evaluation's), and the weights of the lowest
evaluated loss (a state_dict copy), the last ones included, are put back at the end; the in-memory
loop also offers each epoch's end, whose validation loss it prints (:meth:`Stopper.consider`). ``train.stopping: epochs``: exactly ``epochs`` epochs, the seed's loop
(the 500k x 32 benchmark runs so).

The in-memory loop (:mod:`opt_ds_ops.training.fit`), the torchrun ranks
(:mod:`opt_ds_ops.training.ddp_rank`: the same rows, sharded, the mean all-reduced) and the stack
(:mod:`opt_ds_ops.training.stacked`: one rule per model) evaluate every ``eval_every_steps`` steps;
the streaming loop (:mod:`opt_ds_ops.training.stream`) evaluates at the end of each epoch (its
validation loss is a pass over the validation split on disk) and checks ``max_steps`` after each
window; :meth:`Stopper.summary` says which (``evaluated``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..config.conffile import TrainConfig
from .records import step_cap  # noqa: F401 - re-exported: ds-ops train and evaluate import it here

EVAL_ROWS = 65536  # validation rows one evaluation of the plateau rule reads, at most


def eval_stride(rows: int) -> int:
    """Return the stride that takes at most EVAL_ROWS of ``rows`` validation rows, evenly (1: all)."""
    return 1 if rows <= EVAL_ROWS else math.ceil(rows / EVAL_ROWS)


def eval_subset(x_val: torch.Tensor | None) -> torch.Tensor | None:
    """Return at most EVAL_ROWS rows of x_val (N, D), evenly strided (a view), or None."""
    if x_val is None or eval_stride(x_val.shape[0]) == 1:
        return x_val
    return x_val[:: eval_stride(x_val.shape[0])]


class Stopper:
    """Given a TrainConfig, follow the validation loss and say when to stop; keep the best weights.

    ``steps``: optimizer steps so far (the caller counts them with :meth:`step`). ``reason``: None
    while training, else "plateau", "max_steps" or "epochs". The state round-trips through
    :meth:`state_dict` / :meth:`load_state_dict`, so a checkpoint resumes the rule exactly."""

    def __init__(self, cfg: TrainConfig, evaluated: str = "every_steps"):
        self.cfg, self.evaluated = cfg, evaluated
        self.enabled = cfg.stopping == "plateau"
        self.steps = 0
        self.evaluations = 0
        self.best_loss = math.inf  # the lowest evaluated loss: its weights are restored
        self.best_step = 0
        self.best_state: dict | None = None
        self.evaluated_step = -1  # the step of the last evaluation (the weights at the stop are evaluated once)
        self.ref_loss = math.inf  # the loss the next evaluation must beat by min_delta
        self.bad_evaluations = 0
        self.reason: str | None = None

    def step(self) -> None:
        self.steps += 1

    def due(self) -> bool:
        """True when the in-memory loop should evaluate now: every ``eval_every_steps`` steps, and
        at ``max_steps`` (the weights it stops with are evaluated, so they may be the best)."""
        return self.enabled and (self.steps % self.cfg.eval_every_steps == 0 or self.steps >= self.cfg.max_steps)

    def pending(self) -> bool:
        """True when, under the plateau rule, the weights at the current step are not evaluated yet
        (the epochs cap stopped the loop between two evaluations): evaluate them before :meth:`finish`."""
        return self.enabled and self.evaluated_step != self.steps

    def at_max_steps(self) -> bool:
        """True (and the reason set) once ``max_steps`` steps are done under the plateau rule."""
        if self.enabled and self.steps >= self.cfg.max_steps:
            self.reason = self.reason or "max_steps"
            return True
        return False

    def update(self, val_loss: float | None, model: nn.Module) -> bool:
        """Record one evaluation's validation loss (None: no validation split, only max_steps and
        the epochs cap apply); keep model's weights if it is the lowest; return True to stop."""
        if not self.enabled:
            return False
        self.evaluated_step = self.steps
        if val_loss is not None and math.isfinite(val_loss):
            self.evaluations += 1
            if val_loss < self.best_loss:
                self.best_loss, self.best_step = val_loss, self.steps
                self.best_state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
            if val_loss < self.ref_loss * (1.0 - self.cfg.min_delta):
                self.ref_loss, self.bad_evaluations = val_loss, 0
            else:
                self.bad_evaluations += 1
            if self.bad_evaluations >= self.cfg.patience and self.steps >= self.cfg.min_steps:
                self.reason = "plateau"
                return True
        return self.at_max_steps()

    def consider(self, val_loss: float | None, model: nn.Module) -> None:
        """Record a validation loss measured off the schedule on the same rows (the in-memory loop's
        epoch end): its weights are kept if they are the lowest, so a published model is never worse
        than one the run printed; it counts for neither ``patience`` nor ``evaluations``."""
        if not self.enabled or val_loss is None or not math.isfinite(val_loss):
            return
        if val_loss < self.best_loss:
            self.best_loss, self.best_step = val_loss, self.steps
            self.best_state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}

    def finish(self, model: nn.Module, device: torch.device) -> bool:
        """At the end of training: set the reason ("epochs" when nothing else stopped it) and load
        the best weights into model when the last weights are not them; return True if loaded."""
        self.reason = self.reason or "epochs"
        if self.best_state is None or self.best_step == self.steps:
            return False
        model.load_state_dict({k: v.to(device) for k, v in self.best_state.items()})
        return True

    def summary(self, restored: bool) -> dict:
        """metadata.json's ``stopping``: the rule, why and after how many steps training stopped."""
        out = {"rule": self.cfg.stopping, "reason": self.reason, "steps": self.steps}
        if self.enabled:
            out.update(evaluated=self.evaluated, evaluations=self.evaluations, best_step=self.best_step,
                       best_val_loss=self.best_loss if math.isfinite(self.best_loss) else None,
                       restored_best=restored, patience=self.cfg.patience, min_delta=self.cfg.min_delta,
                       min_steps=self.cfg.min_steps, max_steps=self.cfg.max_steps,
                       eval_every_steps=self.cfg.eval_every_steps if self.evaluated == "every_steps" else None)
        return out

    def line(self) -> str:
        """One human line: ``stopped: plateau after 1,250 steps (best val_loss 0.0521 at step 1,000)``."""
        best = (f" (best val_loss {self.best_loss:.6f} at step {self.best_step:,})"
                if self.enabled and math.isfinite(self.best_loss) else "")
        return f"stopped: {self.reason} after {self.steps:,} steps{best}"

    def state_dict(self) -> dict:
        return {"steps": self.steps, "evaluations": self.evaluations, "best_loss": self.best_loss,
                "best_step": self.best_step, "best_state": self.best_state, "ref_loss": self.ref_loss,
                "bad_evaluations": self.bad_evaluations, "reason": self.reason,
                "evaluated_step": self.evaluated_step}

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


def throttled(on_epoch, cfg: TrainConfig, min_interval_s: float = 1.0):
    """Return on_epoch (a callable of one EpochStats) called for the first 10 epochs and then at
    most once every min_interval_s under the plateau rule, where a small dataset runs hundreds of
    short epochs (one journal or terminal line each otherwise); on_epoch itself under ``epochs``."""
    if on_epoch is None or cfg.stopping != "plateau":
        return on_epoch
    import time

    last = {"at": -math.inf}

    def call(stats) -> None:
        now = time.monotonic()
        if stats.epoch <= 10 or now - last["at"] >= min_interval_s:
            last["at"] = now
            on_epoch(stats)

    return call
