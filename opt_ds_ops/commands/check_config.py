"""``ds-ops check-config [--config F]``: validate the conffile without starting anything.

The unit's ``ExecReload=`` runs it before signalling the daemon, so ``systemctl reload
ds-trainer`` fails, with the error, on a conffile the daemon would refuse.
"""

from __future__ import annotations

import json
import os

from ..config import DEFAULT_CONFIG_PATH, config_to_dict, load_config


def add_parser(sub) -> None:
    s = sub.add_parser("check-config", help="validate the conffile (exit 1 with the file, key and rule)")
    s.add_argument("--config", help=f"configuration file (default: {DEFAULT_CONFIG_PATH})")
    s.add_argument("--json", action="store_true", help="print the effective configuration as JSON")
    s.set_defaults(func=run)


def run(args) -> int:
    """Exit 0 and print ``FILE: ok``; 1 with one ``ds-ops: error: FILE: ...`` line (ConfigError,
    raised by :func:`opt_ds_ops.config.load_config`) for a missing, unreadable or invalid file."""
    path = args.config or os.environ.get("DS_OPS_CONFIG") or DEFAULT_CONFIG_PATH
    cfg = load_config(path)
    if args.json:
        print(json.dumps(dict(config_to_dict(cfg), source=path), sort_keys=True))
    else:
        print(f"{path}: ok")
    return 0
