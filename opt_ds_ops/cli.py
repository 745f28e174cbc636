"""The ``ds-ops`` command: parses arguments and runs one subcommand from :mod:`opt_ds_ops.commands`.

Exit codes: 0 success, 1 bad input or configuration (one message on stderr, no traceback),
2 usage (argparse's convention). A subcommand may return other codes it documents (doctor).
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

from . import EARLY_STOP, __version__


def _hold_stop_signals() -> None:
    """For ``ds-ops daemon``: until the daemon installs its own handlers, remember a SIGTERM or
    SIGINT instead of dying of it (its imports and start-up checks take a while; systemd may stop us meanwhile)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: EARLY_STOP.append(signum))


if sys.argv[1:2] == ["daemon"]:  # `ds-ops daemon` or `python -m opt_ds_ops.cli daemon`
    _hold_stop_signals()  # before main() imports the daemon's modules

# Each subcommand's module, imported only when it runs (or for the whole parser: --help, the man
# page's test). Most load torch through the model and training code; the light ones do not, so the
# puller (one process per source beside the daemon) and the operator's read and admin commands
# (status, models, requeue, check-config: a script or a monitor may run them every few seconds)
# start in a fraction of a second without it, and the daemon's process never loads it (its jobs
# get it from the forkserver, opt_ds_ops.daemon.worker).
COMMAND_MODULES = ["train", "score", "evaluate", "doctor", "daemon", "status", "models", "requeue", "check_config",
                   "report", "pull"]
LIGHT_COMMANDS = {"pull", "status", "models", "requeue", "check-config", "daemon"}  # their own module and the light errors


def _module(name: str):
    return importlib.import_module(f".commands.{name}", __package__)


def user_errors(light: bool = False) -> tuple[type[BaseException], ...]:
    """The errors that end a command with one line and exit status 1 (the light commands' only)."""
    from .commands import CliError
    from .config.conffile import ConfigError
    from .store.model_dir import StoreError

    if light:
        return (CliError, ConfigError, StoreError)
    from .dataset import DatasetError
    from .health.device import DeviceError
    from .model.detection import ScoreError
    from .training.job import JobError
    return (CliError, ConfigError, DatasetError, DeviceError, JobError, ScoreError, StoreError)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """Return the argument parser of the ``ds-ops`` command (with ``only``: of that subcommand alone)."""
    p = argparse.ArgumentParser(prog="ds-ops", description="Telemetry anomaly-detection training appliance.")
    p.add_argument("--version", action="version", version=f"ds-ops {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in [only] if only else COMMAND_MODULES:
        _module(name).add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``ds-ops``; returns the exit code (0 ok, 1 bad input or config, 2 usage)."""
    words = sys.argv[1:] if argv is None else argv
    light = words[0] if words and words[0] in LIGHT_COMMANDS else None
    light = light and light.replace("-", "_")  # the command's module
    args = build_parser(light).parse_args(argv)
    errors = user_errors(light is not None)
    try:
        return args.func(args)
    except errors as e:
        print(f"ds-ops: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("ds-ops: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # stdout went away (`ds-ops ... | head`): stop quietly, as other command-line tools do; point
        # stdout at /dev/null so the interpreter's final flush does not raise again (Python docs, signal).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
