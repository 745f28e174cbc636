"""A rank entry for tests/training/test_distributed.py, run under torchrun by opt_ds_ops.training.distributed.run_ranks:
every rank joins the gloo group and meets the others once; rank 1 then raises, rank 0 waits in a
collective that rank 1 never joins (torchrun must stop it)."""

import sys

import torch
import torch.distributed as dist

from opt_ds_ops.training.distributed import exit_rank, run_rank


def body(group) -> None:
    dist.barrier()
    if group.rank == 1:
        raise ValueError("the disk of rank 1 is on fire")
    dist.all_reduce(torch.zeros(1))


if __name__ == "__main__":
    exit_rank(run_rank(sys.argv[sys.argv.index("--dir") + 1], "gloo", body))
