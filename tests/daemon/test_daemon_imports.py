"""The daemon's own process never imports torch: its jobs are forked from the forkserver, which has
torch and the training code preloaded (opt_ds_ops.daemon.worker), so the daemon starts without the
seconds of CPU and hundreds of MB that torch costs, and stays without them while it serves."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import torch

from conftest import REPO
from daemon_kit import START_TIMEOUT_S, Daemon, base_env, done_names, prom_samples, spool_dir, write_config

# A meta-path finder that refuses torch, then the imports: "OK" or the chain of opt_ds_ops frames that reached torch.
NO_TORCH = """
import sys, traceback
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch blocked: " + name)
sys.meta_path.insert(0, Block())
for m in sys.argv[1:]:
    try:
        __import__(m)
        print("OK", m)
    except ImportError as e:
        chain = [f"{f.filename}:{f.lineno}" for f in traceback.extract_tb(e.__traceback__) if "opt_ds_ops" in f.filename]
        print("FAIL", m, " -> ".join(chain))
"""


def test_the_daemon_and_the_command_line_import_without_torch():
    modules = ["opt_ds_ops.daemon.service", "opt_ds_ops.cli", "opt_ds_ops.commands.daemon"]
    p = subprocess.run([sys.executable, "-c", NO_TORCH, *modules], capture_output=True, text=True, cwd=REPO,
                       env=base_env(), timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split("\n")[:-1] == [f"OK {m}" for m in modules], p.stdout


def test_a_daemon_that_trained_a_dataset_never_loaded_torch_in_its_own_process(tmp_path):
    (tmp_path / "prom").mkdir()
    conf = write_config(tmp_path, epochs=1, extra=["metrics:", f"  textfile_dir: {tmp_path / 'prom'}"])
    rows = np.random.default_rng(0).normal(size=(2000, 4))
    d = Daemon(conf)
    try:
        d.wait_until(lambda: "ds-trainer ready" in d.log(), "the daemon to be ready", timeout_s=START_TIMEOUT_S)
        part = spool_dir(tmp_path, "incoming") / "small.csv.part"
        part.write_text("".join(",".join(f"{v:.6f}" for v in r) + "\n" for r in rows))
        part.rename(spool_dir(tmp_path, "incoming") / "small.csv")
        d.wait_until(lambda: "small.csv" in done_names(tmp_path), "small.csv in done/")
        # the job trained in a child of the forkserver, a process of its own: the daemon's maps have no libtorch
        with open(f"/proc/{d.proc.pid}/maps") as f:
            maps = f.read()
        assert "libtorch" not in maps, [line for line in maps.splitlines() if "torch" in line][:5]
        assert re.search(r"health (ok|warn): .* -> cpu amp=off", d.log())  # the start-up check, in a forkserver's child
        info = dict(next(k for k in prom_samples(tmp_path / "prom" / "ds_ops.prom") if k[0] == "ds_ops_build_info")[1])
        assert (info["torch"], info["cuda"]) == (str(torch.__version__), torch.version.cuda or "none")
        rc, _ = d.stop()
        assert rc == 0, d.log()
    finally:
        d.kill()
