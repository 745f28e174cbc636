"""``ds-ops requeue NAME``: put failed/NAME back into incoming/ for the daemon to train again (a file
that was to be scored: back into score/).

Who may run it: root or the service user ds-ops (``sudo ds-ops requeue NAME``): failed/ is
written by the daemon only (mode 2750), so a member of group ds-ops cannot move files out of it.
Fix the file first (or drop a sidecar ``STEM.yaml`` into incoming/), then requeue; the dataset
goes back under the name it was dropped with, its sidecar beside it, and its ``.error.json`` is
removed. A later success of the same name also clears it from ``ds-ops status``'s latest failed.
"""

from __future__ import annotations

import json

from ..config import DEFAULT_CONFIG_PATH
from ..spool import Spool, SpoolError, requeue
from . import CliError, load_cfg


def add_parser(sub) -> None:
    s = sub.add_parser("requeue", help="move a dataset from failed/ back to incoming/ (root or user ds-ops)")
    s.add_argument("name", metavar="NAME", help="the dataset's name in failed/ (ds-ops status lists them)")
    s.add_argument("--config", help=f"configuration file naming spool.dir (default: {DEFAULT_CONFIG_PATH} if present)")
    s.add_argument("--spool-dir", help="spool directory (default: spool.dir from the config)")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.set_defaults(func=run)


def run(args) -> int:
    """``ds-ops requeue NAME``: exit 0; 1 if NAME is not in failed/, is already in incoming/, or
    the spool cannot be written (one ``ds-ops: error:`` line saying who may)."""
    root = args.spool_dir or load_cfg(args, {}).spool.dir
    try:
        moved = requeue(Spool(root), args.name)
    except SpoolError as e:
        raise CliError(str(e)) from None
    except PermissionError as e:
        raise CliError(f"cannot move {args.name} out of failed/: {e.strerror} ({e.filename}); "
                       "run it as root or as the service user: sudo ds-ops requeue NAME") from None
    except OSError as e:
        raise CliError(f"cannot requeue {args.name}: {e.strerror} ({e.filename})") from None
    if args.json:
        print(json.dumps({"requeued": moved["dataset"], "sidecar": moved["sidecar"]}, sort_keys=True))
    else:
        side = f" with its sidecar {moved['sidecar']}" if moved["sidecar"] else ""
        back = "score" if (moved.get("error") or {}).get("drop") == "score" else "incoming"  # issue 19
        print(f"failed/{args.name} -> {back}/{moved['dataset']}{side}; the daemon takes it next")
    return 0
