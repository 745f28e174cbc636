"""The training step: one forward, backward and AdamW update on a batch, eager or replayed from a CUDA graph.

The TelemetryAutoencoder is tiny (about 2,000 weights a layer), so on a GPU a step is bound by
kernel launches, not arithmetic: some 40 kernels of a few microseconds each, each launched by
Python. A CUDA graph records the step's kernels once and replays them with one launch
(PyTorch's "whole-network capture", https://pytorch.org/docs/stable/notes/cuda.html#cuda-graphs):

* warm-up: the first :data:`WARMUP_STEPS` full batches run eagerly on a side stream (they are real
  steps of the job, so nothing is trained twice), which creates AdamW's state and the GradScaler's
  scale before capture, as the PyTorch notes require;
* capture: on the next full batch, with the gradients set to None so that backward allocates them
  in the graph's private memory pool; autocast runs with ``cache_enabled=False`` (required inside
  a capture);
* replay: the batch is copied into the graph's static input tensor, the graph replays, and the
  static loss tensor holds the batch's loss.

bf16 and fp32 capture the whole step, the fused AdamW update included (``capturable=True``: its
step counter and bias corrections stay on the GPU). fp16 captures forward, loss and the scaled
backward only: ``GradScaler.step`` looks at the gradients for inf/NaN and may skip the update,
which the PyTorch notes say to keep outside the graph; the update then runs eagerly, as do a batch
of another size (an epoch's last batch) and every step on the CPU. A capture that fails (an
operator that cannot be captured, a driver that refuses) is not an error: the job goes on with
eager steps and :attr:`TrainStep.mode` says why.

Numerics: the replayed kernels are the eager step's kernels on the same tensors, so a captured
run equals an eager run of the same job up to the order of floating-point reductions;
``scripts/gpu-check.sh`` measures both and prints the difference of their final losses.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

WARMUP_STEPS = 3  # eager full-batch steps on a side stream before capture (PyTorch's notes use 3; DDP needs 11)


class TrainStep:
    """Callable ``step(xb) -> (loss, skipped)`` for one batch.

    xb: (rows, D) float32 on the model's device. ``loss``: 0-d float32 tensor on the device, the
    batch's mean squared error (before scaling); ``skipped``: 0-d bool tensor, True when the fp16
    GradScaler skipped this update (inf/NaN gradients), None without a GradScaler. Nothing is
    synchronised with the host.

    ``capture``: record the step in a CUDA graph once :data:`WARMUP_STEPS` full batches of
    ``batch_rows`` rows have run (CUDA devices only; ignored elsewhere). :attr:`mode` is
    ``"eager"``, ``"cuda-graph"`` (whole step) or ``"cuda-graph-fwd-bwd"`` (fp16: the update is
    eager), or ``"eager (capture failed: ...)"``.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                 amp_dtype: torch.dtype | None, device: torch.device, batch_rows: int, capture: bool):
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.amp_dtype, self.device, self.batch_rows = amp_dtype, device, batch_rows
        self.loss_fn = nn.MSELoss()
        self.capture = bool(capture) and device.type == "cuda"
        self.mode = "eager"
        self._warm = 0
        self._graph: torch.cuda.CUDAGraph | None = None
        self._static_x: torch.Tensor | None = None
        self._static_loss: torch.Tensor | None = None

    def _autocast(self, cache_enabled: bool = True):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype, cache_enabled=cache_enabled)

    def __call__(self, xb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self._graph is not None and xb.shape[0] == self.batch_rows:
            self._static_x.copy_(xb, non_blocking=True)
            scale_before = self._scale_before()
            self._graph.replay()
            if self.mode == "cuda-graph-fwd-bwd":
                self.scaler.step(self.optimizer)
                self.scaler.update()
            return self._static_loss.detach().clone(), self._skipped(scale_before)
        if self.capture and self._graph is None and xb.shape[0] == self.batch_rows and xb.is_cuda:
            if self._warm >= WARMUP_STEPS:
                if self._try_capture(xb):
                    return self(xb)
            else:
                self._warm += 1
                side = torch.cuda.Stream(self.device)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    out = self._eager(xb)
                torch.cuda.current_stream(self.device).wait_stream(side)
                return out
        return self._eager(xb)

    def _eager(self, xb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step as the seed writes it, without a host sync: autocast forward, fp32 MSE, scaled backward."""
        with self._autocast():
            recon = self.model(xb)
        loss = self.loss_fn(recon.float(), xb)
        # set_to_none=False once captured: the graph owns the gradient tensors and must keep them
        self.optimizer.zero_grad(set_to_none=self._graph is None)
        scale_before = self._scale_before()
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return loss.detach(), self._skipped(scale_before)

    def _scale_before(self) -> torch.Tensor | None:
        # GradScaler lowers its scale exactly when it skips a step
        return self.scaler._scale.clone() if self.scaler.is_enabled() and self.scaler._scale is not None else None

    def _skipped(self, scale_before: torch.Tensor | None) -> torch.Tensor | None:
        if not self.scaler.is_enabled():
            return None
        if scale_before is None:  # the scale did not exist before the first step
            return torch.zeros((), dtype=torch.bool, device=self.device)
        return self.scaler._scale < scale_before

    def _try_capture(self, xb: torch.Tensor) -> bool:
        """Capture the step in a CUDA graph; on failure fall back to eager steps (mode says why)."""
        whole = not self.scaler.is_enabled()
        static_x = xb.detach().clone()
        graph = torch.cuda.CUDAGraph()
        self.optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize(self.device)
        try:
            with torch.cuda.graph(graph):
                with self._autocast(cache_enabled=False):
                    recon = self.model(static_x)
                static_loss = self.loss_fn(recon.float(), static_x)
                self.scaler.scale(static_loss).backward()
                if whole:
                    self.optimizer.step()
        except Exception as e:  # noqa: BLE001 - any capture failure means: train eagerly
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            self.mode = f"eager (capture failed: {first[:200]})"
            self.capture = False
            with contextlib.suppress(Exception):
                torch.cuda.synchronize(self.device)
            self.optimizer.zero_grad(set_to_none=True)
            return False
        self._graph, self._static_x, self._static_loss = graph, static_x, static_loss
        self.mode = "cuda-graph" if whole else "cuda-graph-fwd-bwd"
        return True
