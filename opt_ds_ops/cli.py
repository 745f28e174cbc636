"""The ``ds-ops`` command: parses arguments and runs one subcommand from :mod:`opt_ds_ops.commands`.

Exit codes: 0 success, 1 bad input or configuration (one message on stderr, no traceback),
2 usage (argparse's convention). A subcommand may return other codes it documents (doctor).
"""

from __future__ import annotations

import argparse
import os
import sys

from . import __version__
from .commands import CliError
from .commands import daemon as daemon_cmd
from .commands import doctor as doctor_cmd
from .commands import score as score_cmd
from .commands import status as status_cmd
from .commands import train as train_cmd
from .config import ConfigError
from .dataset import DatasetError
from .device import DeviceError
from .job import JobError
from .score import ScoreError
from .store import StoreError

COMMANDS = [train_cmd, score_cmd, doctor_cmd, daemon_cmd, status_cmd]
USER_ERRORS = (CliError, ConfigError, DatasetError, DeviceError, JobError, ScoreError, StoreError)


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of the ``ds-ops`` command."""
    p = argparse.ArgumentParser(prog="ds-ops", description="Telemetry anomaly-detection training appliance.")
    p.add_argument("--version", action="version", version=f"ds-ops {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``ds-ops``; returns the exit code (0 ok, 1 bad input or config, 2 usage)."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except USER_ERRORS as e:
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
