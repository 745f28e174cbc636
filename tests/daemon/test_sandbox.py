"""A feature the service's sandbox does not allow is refused with the reason.

The shipped unit allows AF_UNIX sockets only (``RestrictAddressFamilies=AF_UNIX``), which
torchrun's TCP store on loopback needs: ``daemon.distributed_min_bytes`` there made every large
dataset fail its training stage. Here the restriction is real for the processes under test: an
LD_PRELOAD library, compiled by the test, makes ``socket(AF_INET/AF_INET6)`` fail with
EAFNOSUPPORT, as the unit's seccomp filter does, in ``ds-ops check-config``, in a real daemon and in
everything they start (the job process, torchrun and its ranks inherit the environment).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time

import numpy as np
import pytest

from conftest import run_cli
from daemon_kit import Daemon, base_env, done_names, failed_names, read_json, spool_dir, write_config

SHIM_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <sys/socket.h>

/* What RestrictAddressFamilies=AF_UNIX does: socket() of another family fails with EAFNOSUPPORT. */
int socket(int domain, int type, int protocol) {
    static int (*real)(int, int, int);
    if (BLOCKED(domain)) {
        errno = EAFNOSUPPORT;
        return -1;
    }
    if (!real)
        real = (int (*)(int, int, int))dlsym(RTLD_NEXT, "socket");
    return real(domain, type, protocol);
}
"""


@pytest.fixture(scope="module")
def af_unix_only(tmp_path_factory) -> dict:
    """Return the environment entries that confine a process to AF_UNIX sockets (LD_PRELOAD)."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to build the socket shim")
    d = tmp_path_factory.mktemp("shim")
    (d / "shim.c").write_text(SHIM_C)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-DBLOCKED(d)=((d)==AF_INET||(d)==AF_INET6)", "-o",
                    str(d / "shim.so"), str(d / "shim.c"), "-ldl"], check=True)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-DBLOCKED(d)=((d)==AF_NETLINK)", "-o",
                    str(d / "netlink.so"), str(d / "shim.c"), "-ldl"], check=True)
    probe = subprocess.run(["python3", "-c", "import socket; socket.socket()"], env={"LD_PRELOAD": str(d / "shim.so")},
                           capture_output=True, text=True)
    assert "Address family not supported" in probe.stderr, probe.stderr  # the shim works
    return {"LD_PRELOAD": str(d / "shim.so"), "netlink": str(d / "netlink.so")}


def test_check_config_refuses_distributed_min_bytes_where_loopback_tcp_fails(tmp_path, af_unix_only):
    conf = write_config(tmp_path, extra=["daemon:", "  distributed_min_bytes: 40000"])
    r = run_cli("check-config", "--config", str(conf), env={"LD_PRELOAD": af_unix_only["LD_PRELOAD"]})
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith(f"ds-ops: error: {conf}: daemon.distributed_min_bytes is set (40000 bytes), but "
                               "torchrun's ranks need TCP on loopback and here socket(AF_INET) failed: Address family "
                               "not supported by protocol"), r.stderr
    assert "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK and IPAddressAllow=localhost" in r.stderr
    # TCP allowed but not netlink (a drop-in without AF_NETLINK): gloo's getifaddrs(3) would fail
    r = run_cli("check-config", "--config", str(conf), env={"LD_PRELOAD": af_unix_only["netlink"]})
    assert r.returncode == 1 and "here socket(AF_NETLINK) for getifaddrs(3) failed: Address family not supported" \
        in r.stderr, r.stderr
    # the same file where loopback works, and the feature off under the restriction: fine
    assert run_cli("check-config", "--config", str(conf)).returncode == 0
    off = write_config(tmp_path, name="off.yaml")
    r = run_cli("check-config", "--config", str(off), env={"LD_PRELOAD": af_unix_only["LD_PRELOAD"]})
    assert r.returncode == 0, r.stderr


def test_the_daemon_turns_distributed_off_where_loopback_tcp_fails_and_the_large_dataset_trains(tmp_path,
                                                                                                 af_unix_only):
    """Before: the job's torchrun could not open its TCP store and the dataset went to failed/."""
    conf = write_config(tmp_path, batch_size=256, extra=["daemon:", "  distributed_min_bytes: 40000",
                                                         "  distributed_nproc: 2"])
    d = Daemon(conf, env=base_env(LD_PRELOAD=af_unix_only["LD_PRELOAD"]))
    try:
        d.wait_until(lambda: "ds-trainer ready" in d.log(), "the daemon to start")
        assert ("daemon.distributed_min_bytes is set (40000 bytes), but torchrun's ranks need TCP on loopback and "
                "here socket(AF_INET) failed") in d.log()
        incoming = spool_dir(tmp_path, "incoming")
        np.savetxt(incoming / "big.csv.part", np.random.default_rng(3).normal(size=(3000, 4)), delimiter=",",
                   fmt="%.8f")
        assert (incoming / "big.csv.part").stat().st_size >= 40_000
        (incoming / "big.csv.part").rename(incoming / "big.csv")
        d.wait_until(lambda: done_names(tmp_path) or failed_names(tmp_path), "the job to end")
        time.sleep(0.5)
        assert done_names(tmp_path) == {"big.csv"}, d.log()
        assert read_json(spool_dir(tmp_path, "done") / "big.csv.result.json")["distributed"] is None
        assert d.stop()[0] == 0
    finally:
        d.kill()



def test_torchrun_ranks_meet_on_127_0_0_1_in_a_loopback_only_network_without_etc_hosts(tmp_path):
    """What the unit with the loopback drop-in gives (PrivateNetwork=: a network namespace with only
    lo up) on a system without /etc/hosts (a minimal Debian): before, torchrun --standalone's store
    on localhost:0 and the ranks' master address (the FQDN) did not resolve, and the run failed after
    minutes of retries ("The connection to the C10d store has failed")."""
    import os
    import sys

    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("needs root, unshare and ip for a network and mount namespace")
    hosts = tmp_path / "hosts"
    hosts.write_text("")
    data = tmp_path / "big.csv"
    np.savetxt(data, np.random.default_rng(3).normal(size=(3000, 4)), delimiter=",", fmt="%.8f")
    script = (f"ip link set lo up && mount --bind {hosts} /etc/hosts && ! getent hosts localhost && "
              f"exec {sys.executable} -m opt_ds_ops.cli train {data} --nproc 2 --device cpu --epochs 1 "
              f"--batch-size 256 --models-dir {tmp_path / 'models'} --json")
    r = subprocess.run(["unshare", "--net", "--mount", "sh", "-c", script], env=base_env(), capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(json.loads(r.stdout)["model_dir"] + "/metadata.json") as f:
        assert json.load(f)["distributed"]["world_size"] == 2
