"""A rank entry for tests/training/test_distributed.py, run under torchrun by opt_ds_ops.training.distributed.run_ranks:
every rank joins the gloo group, meets the others once, then sleeps for a minute without a word
(a long epoch: nothing it writes would tell it that its launcher is gone)."""

import sys
import time

import torch.distributed as dist

from opt_ds_ops.training.distributed import exit_rank, run_rank


def body(group) -> None:
    dist.barrier()
    time.sleep(60)


if __name__ == "__main__":
    exit_rank(run_rank(sys.argv[sys.argv.index("--dir") + 1], "gloo", body))
