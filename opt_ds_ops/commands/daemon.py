"""``ds-ops daemon``: run the ds-trainer daemon in the foreground (systemd runs it; tests run it directly)."""

from __future__ import annotations

from ..config.conffile import DEFAULT_CONFIG_PATH, load_config
from ..daemon.service import config_path_from, start_daemon
from ..spool import SpoolError
from . import CliError


def add_parser(sub) -> None:
    d = sub.add_parser("daemon", help="watch the spool directory and train a model for every dataset dropped there")
    d.add_argument("--config", help=f"configuration file (default: $DS_OPS_CONFIG, else {DEFAULT_CONFIG_PATH} if present)")
    d.set_defaults(func=run)


def run(args) -> int:
    """``ds-ops daemon``: exit 0 after SIGTERM; 1 if the configuration, spool or models directory is unusable."""
    path, missing_ok = config_path_from(args.config)
    cfg = load_config(path, missing_ok=missing_ok)
    try:
        return start_daemon(cfg, path, missing_ok=missing_ok)
    except SpoolError as e:
        raise CliError(str(e)) from None
