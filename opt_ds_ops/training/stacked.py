"""Many small models trained as one: K datasets of one shape, K TelemetryAutoencoders in one stack.

A host's model has about 2,300 weights; a step of one is some 40 tiny kernels (on a GPU) or a few
small matrix products and Python's overhead (on the CPU), so a fleet's trainings leave the device
idle between launches. :func:`train_stacked` trains K of them in one loop: every weight gets a
leading model dimension (a Linear's (out, in) weight becomes (K, out, in), applied with a batched
matrix product), every BatchNorm1d normalises each model's channels over that model's own rows (one
``batch_norm`` over (rows, K x channels)), and one fused AdamW updates the stacked tensors (its
update is per element, so each model's moments are its own). The loss is the sum of the K models'
MSEs, whose gradient for model k's weights is model k's own.

Each model keeps what :func:`opt_ds_ops.training.fit.train` gives one model: its own data, split
and scaler, the seed's initial weights (every model alone would start from them), its optimizer
state, its own plateau rule (:class:`opt_ds_ops.training.stopping.Stopper`, evaluated on its own
validation rows through a real TelemetryAutoencoder holding a copy of its weights, as the in-memory
loop evaluates: the same ``_evaluate``), its best weights, its
threshold (:func:`opt_ds_ops.training.fit.finish_result`, the same code) and its epoch history.
A model whose rule stops it is finished and leaves the stack; the others go on. The result equals
training each alone within float rounding, which in fp32 on the CPU (its default) is none: the
batched products, the per-channel BatchNorm and the per-element AdamW give the same bits as one
model's (tested in tests/training/test_stacked.py). Under autocast (bf16) BatchNorm's backward over
K x channels rounds differently from one over one model's channels, and on a GPU the products may
too: there the stack equals alone within float rounding, which training amplifies.

What can be stacked (:func:`stack_key`): in-memory datasets of the same width and row count (so
the same split and batches), with ``input_window`` 1. A run of the stack is one call: it has no
checkpoint (an interrupted stack starts over), and one model's failure (a non-finite loss) fails
only that model (its slot in the returned list is the TrainingError).
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..config.conffile import TrainConfig
from ..health.device import DevicePlan
from ..model.network import TelemetryAutoencoder, feature_errors, model_inputs
from ..model.scaling import clip_inputs, fit_scaler, standardise
from .common import (
    EpochStats, TrainingError, TrainingInterrupted, TrainResult, batch_bounds, begin_run, is_out_of_memory, make_optimizer,
    split_rows
)
from .fit import _NOTHING_CARRIED, _evaluate, _sums, difference_inputs, finish_result, input_form, out_of_memory_reason
from .stopping import Stopper, eval_subset

LINEARS = ("encoder.0", "encoder.3", "decoder.0", "decoder.3")
NORMS = ("encoder.1", "decoder.1")
SLOPE = 0.2  # LeakyReLU's, as TelemetryAutoencoder


def stack_key(data, cfg: TrainConfig) -> tuple | None:
    """Return what datasets must share to be trained in one stack (rows, width), or None when this
    one cannot be stacked (streamed from disk, or windowed inputs)."""
    if not isinstance(data, np.ndarray) or data.ndim != 2 or cfg.input_window != 1:
        return None
    return (int(data.shape[0]), int(data.shape[1]))


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: a matrix product's backward on a
    transposed gradient reduces in another order than on a contiguous one (the last bits differ,
    and training amplifies them), so every product of the stack sees what one model's sees."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class _StackedLinear(torch.autograd.Function):
    """K Linear layers at once: x (K, rows, in), weight (K, out, in), bias (K, out) -> (K, rows, out).

    Autograd's own backward of ``baddbmm`` computes the weight's gradient as x^T @ grad, transposed,
    where one Linear computes grad^T @ x: the same sums in another order, which differ in the last
    bits for some shapes (8 x 24 on the CPU). This backward computes each product in one Linear's
    order. Under autocast the inputs are cast to the autocast dtype, as autocast does for a Linear.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            x, weight, bias = x.to(dtype), weight.to(dtype), bias.to(dtype)
        ctx.save_for_backward(x, weight)
        with torch.autocast(device_type, enabled=False):
            return torch.baddbmm(bias.unsqueeze(1), x, weight.transpose(1, 2))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad = grad.to(x.dtype)
        grad_x = torch.bmm(grad, weight) if ctx.needs_input_grad[0] else None
        grad_w = torch.bmm(grad.transpose(1, 2), x)
        grad_b = grad.sum(dim=1)
        return grad_x, grad_w, grad_b


class StackedAutoencoder(nn.Module):
    """K TelemetryAutoencoders of one shape as one module: forward (K, rows, D) -> (K, rows, D).

    Parameters and buffers are the TelemetryAutoencoder's with a leading model dimension, named with
    ``__`` for ``.`` (``encoder__0__weight`` is (K, hidden, D)). :meth:`state_dict_of` and
    :meth:`module_of` give model k back as a TelemetryAutoencoder state_dict or module;
    :meth:`keep` narrows the stack to some of its models."""

    def __init__(self, states: list[dict], args: dict):
        super().__init__()
        self.args = dict(args)
        for key in states[0]:
            stacked = torch.stack([s[key] for s in states])
            name = key.replace(".", "__")
            if key.endswith(("running_mean", "running_var", "num_batches_tracked")):
                self.register_buffer(name, stacked.clone())
            else:
                self.register_parameter(name, nn.Parameter(stacked.clone()))
        self.keys = list(states[0])

    def _t(self, key: str) -> torch.Tensor:
        return getattr(self, key.replace(".", "__"))

    def _linear(self, x: torch.Tensor, layer: str) -> torch.Tensor:
        return _StackedLinear.apply(x, self._t(f"{layer}.weight"), self._t(f"{layer}.bias"))

    def _norm(self, x: torch.Tensor, layer: str) -> torch.Tensor:
        x = _ContiguousGrad.apply(x)  # the Linear before gets its gradient in its own layout, as alone
        k, rows, c = x.shape
        flat = x.transpose(0, 1).reshape(rows, k * c)  # channel j of model i is column i * c + j
        if self.training:
            self._t(f"{layer}.num_batches_tracked").add_(1)
        y = F.batch_norm(flat, self._t(f"{layer}.running_mean").view(-1), self._t(f"{layer}.running_var").view(-1),
                         self._t(f"{layer}.weight").reshape(-1), self._t(f"{layer}.bias").reshape(-1),
                         training=self.training, momentum=0.1, eps=1e-5)
        return y.reshape(rows, k, c).transpose(0, 1).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.leaky_relu(self._norm(self._linear(x, "encoder.0"), "encoder.1"), SLOPE)
        h = F.leaky_relu(self._linear(h, "encoder.3"), SLOPE)
        h = F.leaky_relu(self._norm(self._linear(h, "decoder.0"), "decoder.1"), SLOPE)
        return self._linear(h, "decoder.3")

    def state_dict_of(self, k: int) -> dict:
        """Model k's TelemetryAutoencoder state_dict (views of the stack: copy to keep)."""
        return {key: self._t(key)[k] for key in self.keys}

    def module_of(self, k: int) -> TelemetryAutoencoder:
        """Model k as a TelemetryAutoencoder on the stack's device, holding a copy of its weights."""
        m = TelemetryAutoencoder(**self.args).to(self._t(self.keys[0]).device)
        m.load_state_dict({key: v.detach().clone() for key, v in self.state_dict_of(k).items()})
        return m

    @torch.no_grad()
    def narrow(self, slots: list[int]) -> None:
        """Keep only the models at ``slots`` (in order): every parameter and buffer is re-made."""
        index = torch.tensor(slots, device=self._t(self.keys[0]).device)
        for name, buf in list(self.named_buffers()):
            self.register_buffer(name, buf.index_select(0, index).clone())
        for name, p in list(self.named_parameters()):
            self.register_parameter(name, nn.Parameter(p.detach().index_select(0, index).clone()))


class StackOptimizer:
    """AdamW for a stack, as each model alone has it: one AdamW (fused where torch has it, as
    :func:`opt_ds_ops.training.common.make_optimizer` gives one model) over every model's own
    slices of the stacked weights (views, updated in place), each with its own moments and step.
    Over the stacked tensors themselves the update would be the same arithmetic, but a vectorised
    kernel's last elements of a tensor take a scalar path: a model's slice at another offset in a
    larger tensor rounds differently in the last bit, and training amplifies that."""

    def __init__(self, stack: StackedAutoencoder, cfg: TrainConfig, device: torch.device,
                 moved: list[dict] | None = None):
        self.stack, self.cfg, self.device = stack, cfg, device
        params = list(stack.parameters())
        self.views = [[p.detach()[k] for p in params] for k in range(params[0].shape[0])]
        self.optimizer = make_optimizer([v for views in self.views for v in views], cfg, device)
        for views, states in zip(self.views, moved or []):
            for v, state in zip(views, states):
                if state:
                    self.optimizer.state[v] = state

    def zero_grad(self) -> None:
        for p in self.stack.parameters():
            p.grad = None

    def step(self) -> None:
        params = list(self.stack.parameters())
        for k, views in enumerate(self.views):
            for v, p in zip(views, params):
                v.grad = p.grad[k]
        self.optimizer.step()

    def narrow(self, slots: list[int]) -> "StackOptimizer":
        """Narrow the stack to ``slots`` and return the optimizer of the narrowed stack, each kept
        model's state moved over."""
        moved = [[self.optimizer.state.get(v, {}) for v in self.views[s]] for s in slots]
        self.stack.narrow(slots)
        return StackOptimizer(self.stack, self.cfg, self.device, moved)


def train_stacked(datasets: list[np.ndarray], cfg: TrainConfig, plan: DevicePlan, *,
                  offsets: list[np.ndarray | None] | None = None,
                  on_epoch: Callable[[int, EpochStats], None] | None = None,
                  should_stop: Callable[[], bool] | None = None) -> list[TrainResult | TrainingError]:
    """Train one TelemetryAutoencoder per dataset, all in one stack; return each one's
    :class:`TrainResult` (or the TrainingError that failed it), in the order given.

    ``datasets``: K >= 1 arrays (rows, D) of one :func:`stack_key`; ``offsets``: each one's
    ``Dataset.offset`` (or None), as :func:`opt_ds_ops.training.fit.train`'s. ``on_epoch(k, stats)``
    after each epoch of model k; ``should_stop()`` after each step: when it turns true the whole run
    raises TrainingInterrupted without a checkpoint (every model trains again from its start).
    Raises ValueError if the datasets cannot share a stack.
    """
    keys = {stack_key(d, cfg) for d in datasets}
    if not datasets or len(keys) != 1 or None in keys:
        raise ValueError(f"datasets of shapes {sorted({np.shape(d) for d in datasets})} cannot be trained in one stack "
                         f"(one width and row count, in memory, input_window 1)")
    offsets = offsets or [None] * len(datasets)
    if len(offsets) != len(datasets) or any(o is not None and np.shape(o) != (datasets[0].shape[1],) for o in offsets):
        raise ValueError(f"offsets: one (D,) array or None per dataset, got {len(offsets)} for {len(datasets)}")
    if plan.use_grad_scaler:
        raise ValueError("fp16 with a GradScaler cannot be stacked (one scale would skip every model's step)")
    try:
        return _train_stacked(datasets, keys.pop(), cfg, plan, offsets, on_epoch, should_stop)
    except torch.OutOfMemoryError as e:
        raise TrainingError(out_of_memory_reason(plan.device, "gpu", sum(d.nbytes for d in datasets) * 3, e)) from None


def _train_stacked(datasets, key: tuple[int, int], cfg: TrainConfig, plan: DevicePlan, offsets,
                   on_epoch, should_stop) -> list[TrainResult | TrainingError]:
    """:func:`train_stacked`'s body, its arguments checked; ``key``: their (rows, width)."""
    started, t_start = begin_run(cfg, plan)
    device = plan.device
    rows, width = key
    w, _ = input_form(cfg)  # 2 for inputs of differences beside levels, else 1 (stack_key)
    train_idx, val_idx = split_rows(rows, cfg.val_fraction)
    n = len(train_idx)
    prepared = []
    for data in datasets:
        train_rows, val_rows = data[:n], data[n:]
        mean, std = fit_scaler(train_rows)
        z_train = clip_inputs(standardise(train_rows, mean, std), cfg.input_clip)
        diff = difference_inputs(z_train, cfg)  # None for levels alone; then model_inputs is z itself
        x_train = model_inputs(z_train, w, diff=diff, clip=cfg.input_clip)
        x_val = (model_inputs(clip_inputs(standardise(val_rows, mean, std), cfg.input_clip), w, diff=diff,
                              clip=cfg.input_clip).to(device) if len(val_idx) else None)
        prepared.append((mean, std, x_train, x_val, val_rows, diff))
    init = TelemetryAutoencoder(width * w, cfg.hidden, cfg.latent)  # the seed's weights: each model alone starts so
    stack = StackedAutoencoder([init.state_dict()] * len(datasets), init.model_args()).to(device)
    x_all = torch.stack([p[2] for p in prepared]).to(device)  # (K, n, D): the only copy of the training rows
    prepared = [(mean, std, x_val, val_rows, diff) for mean, std, _x, x_val, val_rows, diff in prepared]
    optimizer = StackOptimizer(stack, cfg, device)
    autocast = torch.autocast(device.type, dtype=plan.amp_dtype) if plan.amp_dtype is not None else None
    bounds = batch_bounds(n, cfg.batch_size)
    live = list(range(len(datasets)))  # the stack's models, by their index in datasets
    stoppers = [Stopper(cfg) for _ in datasets]
    x_evals = [eval_subset(p[2]) for p in prepared]
    histories: list[list[EpochStats]] = [[] for _ in datasets]
    results: list[TrainResult | TrainingError | None] = [None] * len(datasets)

    def finish(slot: int, k: int) -> None:
        """Model k (in datasets) at slot ``slot`` of the stack has stopped: publish it."""
        mean, std, x_val, val_rows, diff = prepared[k]
        try:
            model = stack.module_of(slot)
            if stoppers[k].pending():
                _evaluate(stoppers[k], model, x_evals[k])
            restored = stoppers[k].finish(model, device)
            results[k] = finish_result(model, cfg, plan, stoppers[k], restored, x_all[slot], x_val, val_rows,
                                       mean, std, offsets[k], history=histories[k], skipped_total=0, started=started,
                                       t_start=t_start, placement="gpu" if device.type == "cuda" else "host",
                                       placement_note="", step_mode=f"stacked ({len(datasets)} models)", diff=diff)
        except (TrainingError, ValueError, RuntimeError) as e:  # this model's failure, not the stack's
            if isinstance(e, torch.OutOfMemoryError) or is_out_of_memory(e):
                raise  # the stack's memory, not this model's fault
            results[k] = e if isinstance(e, TrainingError) else TrainingError(f"{type(e).__name__}: {e}")

    def end_epoch(slots, epoch: int, done: int, batch_loss: torch.Tensor, t0: float) -> list[int]:
        """End the epoch of the models at ``slots`` after ``done`` batches; return the slots of those
        that end here (failed, stopped by their rule, or at the epochs cap), each published or failed."""
        ended = []
        for slot in slots:
            k = live[slot]
            results[k] = _epoch_end(stack, slot, k, epoch, done, bounds, n, batch_loss[slot], t0, prepared, stoppers,
                                    histories, on_epoch)
            if results[k] is not None:
                ended.append(slot)
            elif stoppers[k].reason is not None or epoch + 1 == cfg.epochs:
                finish(slot, k)
                ended.append(slot)
        return ended

    def drop(done_slots: list[int], *tensors: torch.Tensor) -> list[torch.Tensor]:
        """Take the models at ``done_slots`` out of the stack, its optimizer, x_all and ``tensors``
        (each indexed by slot first); return ``tensors`` narrowed."""
        nonlocal optimizer, x_all
        keep = [s for s in range(len(live)) if s not in done_slots]
        for s in sorted(done_slots, reverse=True):
            del live[s]
        if not keep:
            return list(tensors)
        optimizer = optimizer.narrow(keep)
        index = torch.tensor(keep, device=x_all.device)
        x_all = x_all.index_select(0, index)
        return [t.index_select(0, index.to(t.device)) for t in tensors]

    for epoch in range(cfg.epochs):
        if not live:
            break
        stack.train()
        t0 = time.perf_counter()
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch)
        perm = torch.randperm(n, generator=gen).to(x_all.device)
        buf = x_all.index_select(1, perm)  # (K, n, D): the epoch's shuffled rows of every model
        batch_loss = torch.zeros(len(live), len(bounds), device=device)
        done = len(bounds)
        for b, (s, e) in enumerate(bounds):
            xb = buf[:, s:e]
            with autocast if autocast is not None else contextlib.nullcontext():
                recon = stack(xb)
            # unbind, not recon[i]: each index's backward would fill a whole (K, rows, D) gradient
            losses = torch.stack([F.mse_loss(r.float(), x) for r, x in zip(recon.unbind(0), xb.unbind(0))])
            optimizer.zero_grad()
            losses.sum().backward()  # model k's weights get model k's own gradient
            optimizer.step()
            batch_loss[:, b] = losses.detach()
            if should_stop is not None and should_stop():
                raise TrainingInterrupted(None)
            for k in live:
                stoppers[k].step()
            if not stoppers[live[0]].due():  # every model has run as many steps: due alike
                continue
            stopped = [slot for slot, k in enumerate(live) if _evaluate(stoppers[k], stack.module_of(slot), x_evals[k])]
            stack.train()
            if len(stopped) == len(live):
                done = b + 1
                break
            if stopped:  # those end their epoch and finish now; the others go on with this epoch
                end_epoch(stopped, epoch, b + 1, batch_loss, t0)
                buf, batch_loss = drop(stopped, buf, batch_loss)
        ended = end_epoch(range(len(live)), epoch, done, batch_loss, t0)
        if ended:
            drop(ended)
    return results


def _epoch_end(stack: StackedAutoencoder, slot: int, k: int, epoch: int, done: int, bounds, n: int,
               batch_loss: torch.Tensor, t0: float, prepared, stoppers, histories, on_epoch) -> TrainingError | None:
    """Model k's epoch record (its loss over the ``done`` batches run, its validation loss offered to
    its rule as the in-memory loop does); a TrainingError when its loss or weights are not finite."""
    seconds = time.perf_counter() - t0
    sizes = torch.tensor([e - s for s, e in bounds], dtype=torch.float32, device=batch_loss.device)
    sums = _sums(batch_loss, torch.zeros(len(bounds), dtype=torch.bool), sizes, 0, done, _NOTHING_CARRIED, seconds)
    if sums["nonfinite"]:
        return TrainingError(f"non-finite loss in epoch {epoch + 1} ({sums['nonfinite']} of {len(bounds)} batches)")
    model = stack.module_of(slot)
    if not all(torch.isfinite(p).all() for p in model.parameters()):
        return TrainingError(f"non-finite weights after epoch {epoch + 1}")
    x_val = prepared[k][2]
    val_loss = float(feature_errors(model, x_val).mean()) if x_val is not None else None
    x_eval = eval_subset(x_val)
    if x_eval is x_val:
        stoppers[k].consider(val_loss, model)
    stack.train()
    rows_run = bounds[done - 1][1] if done < len(bounds) else n
    stats = EpochStats(epoch + 1, sums["loss_sum"] / max(sums["rows_counted"], 1), val_loss,
                       rows_run / max(seconds, 1e-9), seconds, 0, steps=stoppers[k].steps)
    histories[k].append(stats)
    if on_epoch is not None:
        on_epoch(k, stats)
    return None
