"""The ``ds-ops`` command: parses arguments and runs one subcommand from :mod:`opt_ds_ops.commands`.

Exit codes: 0 success, 1 bad input or configuration (one message on stderr, no traceback),
2 usage (argparse's convention). A subcommand may return other codes it documents (doctor).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from . import EARLY_STOP, __version__


def _hold_stop_signals() -> None:
    """For ``ds-ops daemon``: until the daemon installs its own handlers, remember a SIGTERM or
    SIGINT instead of dying of it (importing torch takes seconds; systemd may stop us meanwhile)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: EARLY_STOP.append(signum))


if sys.argv[1:2] == ["daemon"]:  # `ds-ops daemon` or `python -m opt_ds_ops.cli daemon`
    _hold_stop_signals()  # before the imports below, which load torch

from .commands import CliError  # noqa: E402 - after the signal hold, on purpose
from .commands import check_config as check_config_cmd  # noqa: E402
from .commands import daemon as daemon_cmd  # noqa: E402
from .commands import doctor as doctor_cmd  # noqa: E402
from .commands import evaluate as evaluate_cmd  # noqa: E402
from .commands import models as models_cmd  # noqa: E402
from .commands import pull as pull_cmd  # noqa: E402
from .commands import report as report_cmd  # noqa: E402
from .commands import requeue as requeue_cmd  # noqa: E402
from .commands import score as score_cmd  # noqa: E402
from .commands import status as status_cmd  # noqa: E402
from .commands import train as train_cmd  # noqa: E402
from .config.conffile import ConfigError  # noqa: E402
from .dataset import DatasetError  # noqa: E402
from .health.device import DeviceError  # noqa: E402
from .model.detection import ScoreError  # noqa: E402
from .store.versions import StoreError  # noqa: E402
from .training.job import JobError  # noqa: E402

COMMANDS = [train_cmd, score_cmd, evaluate_cmd, doctor_cmd, daemon_cmd, status_cmd, models_cmd,
            requeue_cmd, check_config_cmd, report_cmd, pull_cmd]
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
