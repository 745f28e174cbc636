"""A rank entry for tests/training/test_distributed.py, run under torchrun by opt_ds_ops.training.distributed.run_ranks:
every rank joins the gloo group and meets the others once; rank 1 is then killed (SIGKILL: no error
file of its own, as after the kernel's OOM killer), rank 0 waits (torchrun must stop it)."""

import os
import signal
import sys
import time

import torch.distributed as dist

from opt_ds_ops.training.distributed import run_rank


def body(group) -> None:
    dist.barrier()
    if group.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)


if __name__ == "__main__":
    sys.exit(run_rank(sys.argv[sys.argv.index("--dir") + 1], "gloo", body))
