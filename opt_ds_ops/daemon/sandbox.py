"""What the service's sandbox lets this process do, checked for the features that need it.

``daemon.distributed_min_bytes`` trains a dataset under torchrun, whose ranks meet at a TCP store
on the loopback interface. The shipped unit (debian/ds-ops.ds-trainer.service) allows AF_UNIX
sockets only (``RestrictAddressFamilies=AF_UNIX``, ``IPAddressDeny=any``): there every such job
would fail in its training stage. :func:`loopback_problem` tries a real listen and connect on
127.0.0.1 in this process (which runs in the unit's sandbox when systemd starts it: the daemon,
and ``ds-ops check-config`` as the unit's ``ExecReload=``); where that fails, ``check-config``
refuses the conffile and the daemon turns the feature off, both saying why and naming the
drop-in that enables it (:data:`LOOPBACK_DROP_IN`, docs/operating.md).
"""

from __future__ import annotations

import dataclasses
import socket

PROBE_TIMEOUT_S = 2.0  # IPAddressDeny= drops packets (no error): a connect that hangs this long fails

LOOPBACK_DROP_IN = ("systemctl edit ds-trainer: [Service] RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK "
                    "and IPAddressAllow=localhost (IPAddressDeny=any and PrivateNetwork=yes stay: loopback only)")


def loopback_problem(timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """Listen on 127.0.0.1 (a free port), connect to it and accept, and open a netlink socket (gloo
    and NCCL list the interfaces with getifaddrs(3), which needs AF_NETLINK), in this process;
    return None if that works, else one line saying which step failed and why."""
    step = "socket(AF_INET)"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
            step = "bind 127.0.0.1"
            server.bind(("127.0.0.1", 0))
            server.listen(1)
            server.settimeout(timeout_s)
            step = "connect to 127.0.0.1"
            with socket.create_connection(server.getsockname(), timeout=timeout_s):
                step = "accept on 127.0.0.1"
                conn, _ = server.accept()
                conn.close()
        step = "socket(AF_NETLINK) for getifaddrs(3)"
        socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0).close()  # NETLINK_ROUTE
    except OSError as e:
        return f"{step} failed: {e.strerror or e}"
    return None


def distributed_refusal(cfg, probe=loopback_problem) -> str | None:
    """Given a Config, return why ``daemon.distributed_min_bytes`` cannot work in this process (the
    probe's failure, and how to enable it), or None when it is off or loopback TCP works."""
    if not cfg.daemon.distributed_min_bytes:
        return None
    problem = probe()
    if problem is None:
        return None
    return (f"daemon.distributed_min_bytes is set ({cfg.daemon.distributed_min_bytes} bytes), but torchrun's ranks "
            f"need TCP on loopback and here {problem} (the shipped unit allows AF_UNIX sockets only); to enable it: "
            f"{LOOPBACK_DROP_IN}; or set daemon.distributed_min_bytes: 0")


def without_unusable(cfg, probe=loopback_problem):
    """Return (cfg, None), or (cfg with ``daemon.distributed_min_bytes`` 0, the reason) where the
    sandbox refuses what the feature needs (see :func:`distributed_refusal`)."""
    why = distributed_refusal(cfg, probe)
    if why is None:
        return cfg, None
    return dataclasses.replace(cfg, daemon=dataclasses.replace(cfg.daemon, distributed_min_bytes=0)), why
