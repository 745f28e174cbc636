"""``ds-ops requeue NAME``: put failed/NAME back into incoming/ for the daemon to train again (a file
that was to be scored: back into score/). NAME is the file's name in failed/ or, as for every other
command, the model's name: the file's stem or the ``name:`` of its sidecar (``machine-1-2`` for
``failed/machine-1-2.txt.gz``); a model name that several files in failed/ have is refused with
their names.

Who may run it: root or the service user ds-ops (``sudo ds-ops requeue NAME``): failed/ is
written by the daemon only (mode 2750), so a member of group ds-ops cannot move files out of it.
Fix the file first (or drop a sidecar ``STEM.yaml`` into incoming/), then requeue; the dataset
goes back under the name it was dropped with, its sidecar beside it, and its ``.error.json`` is
removed. A later success of the same name also clears it from ``ds-ops status``'s latest failed.
"""

from __future__ import annotations

import json
import os

from ..config.conffile import DEFAULT_CONFIG_PATH, ConfigError, DatasetConfig
from ..config.sidecar import parse_sidecar
from ..dataset import dataset_stem
from ..spool import ERROR_SUFFIX, FAILED, SIDECAR_SUFFIX, Spool, SpoolError, read_json, requeue, sidecar_name
from ..store.model_dir import StoreError, safe_model_name
from . import CliError, load_cfg


def add_parser(sub) -> None:
    s = sub.add_parser("requeue", help="move a dataset from failed/ back to incoming/ (a file to score: to score/; root or user ds-ops)")
    s.add_argument("name", metavar="NAME", help="the dataset's name in failed/ (ds-ops status lists them) or its model's")
    s.add_argument("--config", help=f"configuration file naming spool.dir (default: {DEFAULT_CONFIG_PATH} if present)")
    s.add_argument("--spool-dir", help="spool directory (default: spool.dir from the config)")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.set_defaults(func=run)


def run(args) -> int:
    """``ds-ops requeue NAME``: exit 0; 1 if NAME is not in failed/, is already in incoming/, or
    the spool cannot be written (one ``ds-ops: error:`` line saying who may)."""
    root = args.spool_dir or load_cfg(args, {}).spool.dir
    try:
        args.name = failed_file(Spool(root), args.name)
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
        back = "score" if (moved.get("error") or {}).get("drop") == "score" else "incoming"  # back where it was dropped
        print(f"failed/{args.name} -> {back}/{moved['dataset']}{side}; the daemon takes it next")
    return 0


def model_of(spool: Spool, name: str) -> str:
    """Return the model name of failed/NAME: its sidecar's ``name:`` (or ``model:``), else the stem of
    the name it was dropped as (its ``.error.json``'s ``dataset``), else of NAME itself."""
    side = spool.path(FAILED, sidecar_name(name, SIDECAR_SUFFIX))
    if os.path.isfile(side) and not os.path.islink(side) and _same_owner(side, spool.path(FAILED, name)):
        try:
            with open(side, "rb") as f:
                named = parse_sidecar(f.read(64 * 1024 + 1), side, DatasetConfig())[1]
            if named:
                return named
        except (OSError, ConfigError):
            pass  # the error.json says what was wrong with it; the file's stem still names the model
    doc = read_json(spool.path(FAILED, sidecar_name(name, ERROR_SUFFIX))) or {}
    dropped = doc.get("dataset") if isinstance(doc.get("dataset"), str) else name
    return dataset_stem(dropped)


def _model_key(name: str) -> str:
    """The model name as the store spells it (``Disk Latency`` and ``Disk_Latency`` are one model)."""
    try:
        return safe_model_name(name)
    except StoreError:
        return name


def _same_owner(a: str, b: str) -> bool:
    """True if a and b belong to one uid: a sidecar names the model of its own uploader's file only."""
    try:
        return os.lstat(a).st_uid == os.lstat(b).st_uid
    except OSError:
        return False


def failed_file(spool: Spool, name: str) -> str:
    """Given NAME, a file name in failed/ or a model name, return the file name in failed/ to
    requeue: NAME itself if failed/NAME is a file, else the one file there of model NAME. Raises
    SpoolError for a model name that several files there have (naming them); a name that matches
    nothing is returned as given, for :func:`opt_ds_ops.spool.requeue` to refuse."""
    if os.path.isfile(spool.path(FAILED, name)) or "/" in name or name.startswith("."):
        return name
    try:
        entries = sorted(os.listdir(spool.dir(FAILED)))
    except OSError:
        return name  # requeue says why
    attached = {sidecar_name(e, s) for e in entries for s in (ERROR_SUFFIX, SIDECAR_SUFFIX)}
    files = [e for e in entries if e not in attached and not e.startswith(".")
             and os.path.isfile(spool.path(FAILED, e)) and not os.path.islink(spool.path(FAILED, e))]
    matches = [e for e in files if _model_key(model_of(spool, e)) == _model_key(name)]
    if len(matches) > 1:
        raise SpoolError(f"{len(matches)} files in failed/ are of model {name}: {', '.join(matches)}; "
                         "requeue one by its file name")
    return matches[0] if matches else name
