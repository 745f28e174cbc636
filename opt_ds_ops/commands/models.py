"""``ds-ops models``: list, show, promote, roll back, pin, unpin and remove model versions.

Who may run what: reading (list, show) needs read access to models_dir (anyone, by default);
changing (promote, rollback, pin, unpin, rm) needs write access to the model's directory: root
or the service user ds-ops (``sudo ds-ops models promote ...``). Every change records who
(the user, and ``SUDO_USER``) and why (``--why``) in the version's metadata.json
(``operator_log``). See :mod:`opt_ds_ops.store.versions` for how each change stays atomic.
"""

from __future__ import annotations

import argparse
import json
import os

from ..config.conffile import DEFAULT_CONFIG_PATH
from ..observe.journal import safe_text
from ..scoring.results import remove_series
from ..store.admin import list_models, pin, promote, remove, resolve, rollback, version_summary
from ..store.model_dir import METADATA_FILE, StoreError, current_version, read_metadata
from . import CliError, load_cfg


def add_parser(sub) -> None:
    s = sub.add_parser("models", help="list model versions; promote, roll back, pin or remove them")
    s.add_argument("--config", help=f"configuration file naming models_dir (default: {DEFAULT_CONFIG_PATH} if present)")
    s.add_argument("--models-dir", help="model store (default: models_dir from the config)")
    s.add_argument("--json", action="store_true", help="print one JSON document")
    s.set_defaults(func=run, action="list")
    acts = s.add_subparsers(dest="action", metavar="ACTION")
    acts.add_parser("list", help="every model, its versions, current, dataset, losses, threshold, age")
    a = acts.add_parser("show", help="one version's metadata.json (NAME: its current version)")
    a.add_argument("spec", metavar="NAME[/VERSION]")
    a = acts.add_parser("promote", help="make VERSION the current one of NAME")
    a.add_argument("name", metavar="NAME")
    a.add_argument("version", metavar="VERSION")
    a.add_argument("--why", help="reason, recorded in the version's metadata")
    a = acts.add_parser("rollback", help="make the version before the current one current")
    a.add_argument("name", metavar="NAME")
    a.add_argument("--why", help="reason, recorded in the version's metadata")
    for verb, text in (("pin", "never prune this version (NAME: its current version)"), ("unpin", "undo pin")):
        a = acts.add_parser(verb, help=text)
        a.add_argument("spec", metavar="NAME[/VERSION]")
        a.add_argument("--why", help="reason, recorded in the version's metadata")
    a = acts.add_parser("rm", help="remove one version (removing current moves it back to the version that was "
                        "current before, as rollback) or a whole model with its scoring series")
    a.add_argument("spec", metavar="NAME[/VERSION]")
    a.add_argument("--why", help="reason, recorded when current moves")
    for p in acts.choices.values():  # the options also after the action: `ds-ops models list --json`
        p.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print one JSON document")
        p.add_argument("--models-dir", default=argparse.SUPPRESS, help="model store (default: models_dir from the config)")
        p.add_argument("--config", default=argparse.SUPPRESS, help="configuration file naming models_dir")


def _age(seconds) -> str:
    if not isinstance(seconds, (int, float)):
        return "?"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def _num(v, fmt: str = ".6g") -> str:
    return format(v, fmt) if isinstance(v, (int, float)) else "n/a"


def _gate_note(gate: dict | None, current: bool = True) -> str:
    """``  gate: promoted flags 1.2% vs current-then 3.4%``: the promotion gate's verdict, or nothing;
    a version the gate passed that is not ``current`` (held by the operator, or current moved on)
    is ``passed, not current``. A refusal says the gate's own reason (``not promoted
    (flagged-vs-design): it flags 4.63% of the 1620 held-back rows the champion did not flag, ...``):
    the test that failed may not be the flagged shares, which then read as if it were better."""
    if not gate:
        return ""
    if gate.get("promote"):
        verdict = "promoted" if current else "passed, not current"
    else:
        verdict = f"not promoted ({safe_text(str(gate.get('failed') or gate.get('mode')))})"
        if isinstance(gate.get("reason"), str) and gate["reason"]:
            return f"\n      gate: {verdict}: {safe_text(gate['reason'][:300])}"
    champ = gate.get("champion_flagged_share")
    vs = f" vs current-then {champ:.2%}" if isinstance(champ, float) else ""
    flags = f" flags {gate['flagged_share']:.2%}{vs}" if isinstance(gate.get("flagged_share"), float) else ""
    return f"\n      gate: {verdict}{flags}"


def _retrain_note(version_dir: str) -> str:
    """``  retrained (every): 6601 of 10081 history rows, 3480 left out (58 flagged segments)``
    for a version made by retraining, else nothing."""
    try:
        md = read_metadata(version_dir)
    except StoreError:
        return ""
    rt, ex = md.get("retrain"), md.get("excluded") or {}
    if not isinstance(rt, dict):
        return ""
    rows = (f": {ex.get('rows_kept')} of {ex.get('rows_in')} history rows, {ex.get('rows_left_out')} left out "
            f"({ex.get('segments')} flagged segments)" if isinstance(ex.get("rows_in"), int) else "")
    return f"\n      retrained ({rt.get('trigger')}){rows}"


def _print_list(models: list[dict], models_dir: str) -> None:
    if not models:
        print(f"no models under {models_dir}")
        return
    for m in models:
        print(f"{safe_text(m['name'])}  current {m['current'] or '(none)'}  {len(m['versions'])} version(s)")
        for v in reversed(m["versions"]):
            mark = ("*" if v["current"] else " ") + ("P" if v["pinned"] else " ")
            # the dataset's name is a member's file name: escaped, never a terminal's control sequence
            print(f"  {mark} {safe_text(v['version'])}  {safe_text(v['dataset'] or '?')}  "
                  f"loss {_num(v['final_train_loss'])}  val {_num(v['final_val_loss'])}  "
                  f"threshold {_num(v['threshold'], '.4f')}  age {_age(v['age_s'])}"
                  + _retrain_note(v["path"]) + _gate_note(v.get("promotion"), v["current"]))
    print("(* current, P pinned)")


def run(args) -> int:
    """``ds-ops models [ACTION]``: exit 0; 1 for an unknown name or version, a pinned version to
    remove, or a store that cannot be written (one ``ds-ops: error:`` line; for a user who may not
    write it, one that says who may)."""
    models_dir = args.models_dir or load_cfg(args, {}).models_dir
    action = args.action or "list"
    why = getattr(args, "why", None)
    if action == "list":
        models = list_models(models_dir)
        if args.json:
            print(json.dumps({"models_dir": models_dir, "models": models}, sort_keys=True))
        else:
            _print_list(models, models_dir)
        return 0
    if action == "show":
        name_dir, version = resolve(models_dir, args.spec)
        version = version or current_version(name_dir)
        if version is None:
            raise StoreError(f"model {args.spec!r} has no current version; name one: NAME/VERSION")
        md = read_metadata(os.path.join(name_dir, version))
        summary = version_summary(name_dir, version, current_version(name_dir))
        if args.json:
            print(json.dumps(dict(summary, metadata=md), sort_keys=True))
        else:
            for key in ("name", "version", "path", "current", "pinned", "dataset", "final_train_loss",
                        "final_val_loss", "threshold", "trained_at"):
                print(f"{key}: {summary[key]}")
            print(f"age: {_age(summary['age_s'])}")
            for e in md.get("operator_log", []):
                print(f"{e.get('at')} {e.get('action')} by {e.get('by')}: {e.get('why') or '-'}")
            print(f"(everything: {os.path.join(name_dir, version, METADATA_FILE)}, or --json)")
        return 0
    try:
        doc, text = _change(action, args, models_dir, why)
    except StoreError as e:
        denied = e.__context__  # the store's OSError, behind its one-line StoreError
        if not isinstance(denied, PermissionError):
            raise
        target = args.name if action in ("promote", "rollback") else args.spec
        who = (f"only root and the service user ds-ops may change {models_dir} (members of group ds-ops may read "
               f"it): sudo ds-ops models {action} ...")
        raise CliError(f"cannot {action} {target}: {denied.strerror}; {who}") from None
    print(json.dumps(doc, sort_keys=True) if args.json else text)
    return 0


def _change(action: str, args, models_dir: str, why: str | None) -> tuple[dict, str]:
    """Given a changing action (promote, rollback, pin, unpin, rm) and its arguments, do it; return
    (the JSON document, the line to print). Raises StoreError (:mod:`opt_ds_ops.store.versions`)."""
    if action in ("promote", "rollback"):
        entry = (promote(models_dir, args.name, args.version, why) if action == "promote"
                 else rollback(models_dir, args.name, why))
        name_dir = os.path.join(models_dir, os.path.basename(args.name))
        doc = dict(entry, name=args.name, current=current_version(name_dir))
        return doc, f"{args.name}: current {doc['previous']} -> {doc['current']} ({action} by {doc['by']})"
    if action in ("pin", "unpin"):
        entry = pin(models_dir, args.spec, action == "pin", why)
        return dict(entry, spec=args.spec), f"{args.spec}: {action}ned by {entry['by']}"
    doc = remove(models_dir, args.spec, why)  # rm
    moved = f"; current is now {doc['current']}" if doc["current"] else ""
    if not args.spec.partition("/")[2]:  # the whole model (NAME or NAME/): its scored series too, so a new owner
        # starts from nothing
        results = load_cfg(args, {}).scoring.results_dir
        name = args.spec.partition("/")[0]
        doc["series_removed"] = remove_series(results, name)
        moved += f"; its scoring series ({results}/{name}) removed" if doc["series_removed"] else ""
    return doc, f"removed {args.spec} ({len(doc['removed'])} version(s)){moved}"
