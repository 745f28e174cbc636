"""The ``ds-ops`` subcommands, one module each, named for its subcommand; every module has
``add_parser(sub)`` and ``run(args)``, and :mod:`opt_ds_ops.cli` dispatches to them.

Shared here: :class:`CliError` and :func:`load_cfg` (the conffile plus command-line overrides).
"""

from __future__ import annotations

import os

from ..config.conffile import DEFAULT_CONFIG_PATH, Config, load_config, with_overrides


class CliError(Exception):
    """A user-facing error: printed as ``ds-ops: error: MESSAGE`` and exit code 1."""


def load_cfg(args, overrides: dict) -> Config:
    """Load --config (or the default conffile, which may be absent) and apply command-line overrides."""
    path = args.config or os.environ.get("DS_OPS_CONFIG")
    cfg = load_config(path or DEFAULT_CONFIG_PATH, missing_ok=path is None)
    return with_overrides(cfg, overrides)


