"""A rank entry for tests/training/test_distributed.py, run under torchrun by opt_ds_ops.training.distributed.run_ranks:
each of 2 gloo ranks runs GlooSyncBatchNorm on its part of one batch (1,001 rows: parts of 501 and
500) and compares output, gradients and running statistics with one BatchNorm1d over the whole
batch; rank 0 writes the largest differences to DIR/diffs.json."""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from opt_ds_ops.training.distributed import GlooSyncBatchNorm, exit_rank, run_rank, shard


def body(group) -> None:
    torch.manual_seed(0)
    x = torch.randn(1001, 24) * 3 + 1
    upstream = torch.randn(1001, 24)
    whole = nn.BatchNorm1d(24)
    with torch.no_grad():
        whole.weight.uniform_(0.5, 1.5)
        whole.bias.uniform_(-1, 1)
    part = GlooSyncBatchNorm(24)
    part.load_state_dict(whole.state_dict())
    lo, hi = shard(1001, group.rank, group.world_size)
    xw, xp = x.clone().requires_grad_(), x[lo:hi].clone().requires_grad_()
    yw, yp = whole(xw), part(xp)
    (yw * upstream).sum().backward()
    (yp * upstream[lo:hi]).sum().backward()
    grads = torch.cat([part.weight.grad, part.bias.grad])
    dist.all_reduce(grads)  # DDP would sum (then average) the parameter gradients like this
    first = part.running_mean.clone()
    dist.broadcast(first, 0)
    diffs = {
        "output": float((yw[lo:hi] - yp).abs().max()),
        "input_grad": float((xw.grad[lo:hi] - xp.grad).abs().max()),
        # sums over 1,001 rows: relative to the largest gradient
        "weight_grad": float((whole.weight.grad - grads[:24]).abs().max() / whole.weight.grad.abs().max()),
        "bias_grad": float((whole.bias.grad - grads[24:]).abs().max() / whole.bias.grad.abs().max()),
        "running_mean": float((whole.running_mean - part.running_mean).abs().max()),
        "running_var": float((whole.running_var - part.running_var).abs().max()),
        "ranks_agree": float((first - part.running_mean).abs().max()),
    }
    if group.rank == 0:
        with open(os.path.join(sys.argv[sys.argv.index("--dir") + 1], "diffs.json"), "w") as f:
            json.dump(diffs, f)


if __name__ == "__main__":
    exit_rank(run_rank(sys.argv[sys.argv.index("--dir") + 1], "gloo", body))
