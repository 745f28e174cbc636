"""A rank entry for tests/training/test_distributed.py, run under torchrun by opt_ds_ops.training.distributed.run_ranks:
every rank joins the gloo group and meets the others once; rank 1 is then killed, rank 0 waits
(torchrun must stop it). ``DS_OPS_TEST_RANK_DEATH``: ``kill`` (the default) is SIGKILL, no error
file and no word of its own, as after the kernel's OOM killer; ``abort`` is SIGABRT after the two
lines C++'s std::terminate prints for an exception thrown on one of gloo's threads."""

import os
import signal
import sys
import time

import torch.distributed as dist

from opt_ds_ops.training.distributed import exit_rank, run_rank


def body(group) -> None:
    dist.barrier()
    if group.rank == 1:
        if os.environ.get("DS_OPS_TEST_RANK_DEATH") == "abort":
            sys.stderr.write("terminate called after throwing an instance of 'gloo::IoException'\n"
                             "  what():  [gloo/transport/tcp/pair.cc:598] Connection closed by peer [127.0.0.1]:4242\n")
            sys.stderr.flush()
            os.abort()
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)


if __name__ == "__main__":
    exit_rank(run_rank(sys.argv[sys.argv.index("--dir") + 1], "gloo", body))
