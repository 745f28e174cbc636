"""``ds-ops report MODEL_DIR [-o FILE]``: (re)draw a model version's report.png."""

from __future__ import annotations

import os

from ..store.versions import CURRENT
from ..training.report import REPORT_FILE, ReportError, write_report
from . import CliError, load_cfg


def add_parser(sub) -> None:
    s = sub.add_parser("report", help="draw a model version's report.png (losses, score distribution, error scale)")
    s.add_argument("model_dir", metavar="MODEL_DIR",
                   help="a version directory, a 'current' link, a model's directory or a model name under models_dir")
    s.add_argument("-o", "--output", metavar="FILE", help=f"write here instead of MODEL_DIR/{REPORT_FILE}")
    s.add_argument("--config", help="configuration file naming models_dir (for a bare model name)")
    s.set_defaults(func=run)


def resolve_version_dir(spec: str, models_dir: str) -> str:
    """Return the version directory of spec: a version dir, a ``current`` link, a model's
    directory (its current version) or a model name under models_dir. Raises CliError."""
    path = spec
    if not os.path.isdir(path) and os.sep not in spec and os.path.isdir(os.path.join(models_dir, spec)):
        path = os.path.join(models_dir, spec)
    if os.path.isdir(os.path.join(path, CURRENT)):
        path = os.path.join(path, CURRENT)
    if not os.path.isfile(os.path.join(path, "metadata.json")):
        raise CliError(f"{spec}: not a model directory (metadata.json missing)")
    return os.path.realpath(path)


def run(args) -> int:
    """Exit 0 and print the PNG's path; 1 (one ``ds-ops: error:`` line) if MODEL_DIR is not a
    model or the PNG cannot be drawn or written (ReportError)."""
    models_dir = load_cfg(args, {}).models_dir
    version_dir = resolve_version_dir(args.model_dir, models_dir)
    try:
        out = write_report(version_dir, args.output)
    except ReportError as e:
        raise CliError(str(e)) from None
    print(out)
    return 0
