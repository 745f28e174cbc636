"""``ds-ops check-config [--config F]``: validate the conffile without starting anything.

The unit's ``ExecReload=`` runs it before signalling the daemon, so ``systemctl reload
ds-trainer`` fails, with the error, on a conffile the daemon would refuse. Run that way it runs
in the unit's sandbox and control group, as the daemon does: it also refuses a feature the sandbox
does not allow (:mod:`opt_ds_ops.daemon.sandbox`: ``daemon.distributed_min_bytes`` without loopback TCP)
and memory budgets too small for a job process (:mod:`opt_ds_ops.daemon.budget`), and prints the memory
each job process gets.
"""

from __future__ import annotations

import json
import os
import threading

from ..config.conffile import DEFAULT_CONFIG_PATH, ConfigError, config_to_dict, load_config
from ..daemon.budget import job_processes, this_process_budget
from ..daemon.sandbox import distributed_refusal
from ..sources.sourcefile import load_source

NVML_TIMEOUT_S = 10.0  # a GPU count that takes longer is given up (no GPUs counted)


def add_parser(sub) -> None:
    s = sub.add_parser("check-config", help="validate the conffile (exit 1 with the file, key and rule)")
    s.add_argument("--config", help=f"configuration file (default: {DEFAULT_CONFIG_PATH})")
    s.add_argument("--json", action="store_true", help="print the effective configuration as JSON")
    s.add_argument("--source", action="append", default=[], metavar="FILE",
                   help="also validate this source file of ds-ops pull (/etc/ds-ops/sources/NAME.yaml); repeatable")
    s.set_defaults(func=run)


def gpu_count(timeout_s: float = NVML_TIMEOUT_S) -> int | None:
    """Return how many GPUs NVML sees, or None (no NVML, no driver, no GPU, no answer in time)."""
    box: dict = {}

    def read() -> None:
        from ..health.nvml import read_host

        host = read_host()
        box["n"] = len(host.gpus) if host.status == "ok" else None

    t = threading.Thread(target=read, name="gpu-count", daemon=True)
    t.start()
    t.join(timeout_s)
    return box.get("n") or None


def run(args) -> int:
    """Exit 0 and print ``FILE: ok`` and the memory per job process (and a line per ``--source``;
    with ``--source`` and no conffile given or installed, the source files alone);
    1 with one ``ds-ops: error: FILE: ...`` line (ConfigError) for a missing, unreadable or invalid
    file (the conffile or a source), a feature this process's sandbox refuses or a memory budget
    below what a job process needs."""
    path = args.config or os.environ.get("DS_OPS_CONFIG") or DEFAULT_CONFIG_PATH
    if args.source and path == DEFAULT_CONFIG_PATH and not os.path.exists(path) and not args.json:
        for src in [load_source(f) for f in args.source]:  # a puller's host needs no trainer.yaml
            print(_source_line(src))
        return 0
    cfg = load_config(path)
    why = distributed_refusal(cfg)
    if why:
        raise ConfigError(f"{path}: {why}")
    pinned = cfg.device in ("cpu", "mps") or cfg.device.startswith("cuda:")
    gpus = None if pinned or (cfg.daemon.max_jobs != "auto" and not cfg.daemon.distributed_min_bytes) else gpu_count()
    budgets = [("", this_process_budget(cfg, job_processes(cfg, gpus, 1, pinned)))]
    nproc = cfg.daemon.distributed_ranks() or (gpus if cfg.device != "cpu" else None) or 1
    if cfg.daemon.distributed_min_bytes and nproc > 1 and not cfg.device.startswith(("cuda:", "mps")):
        budgets.append((f"a distributed job ({nproc} ranks): ", this_process_budget(cfg, job_processes(cfg, gpus, nproc))))
    for head, budget in budgets:
        if budget.problem():
            raise ConfigError(f"{path}: {head}{budget.problem()}")
    sources = [load_source(f) for f in args.source]
    if args.json:
        print(json.dumps(dict(config_to_dict(cfg), source=path), sort_keys=True))
    else:
        print(f"{path}: ok")
        for head, budget in budgets:
            print(f"{head}{budget.line()}")
        for src in sources:
            print(_source_line(src))
    return 0


def _source_line(src) -> str:
    return (f"{src.path}: ok: {len(src.series)} series from {src.options.prometheus}, one model per "
            f"{src.options.host_label}, a row every {src.options.step}, shard {src.options.shard}")
