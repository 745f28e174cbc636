"""``ds-ops status``: the spool's queue, the running job and its epoch, the latest results.

Read from the spool directory alone, so it works whether or not the daemon runs (and as any user
who can read the spool).
"""

from __future__ import annotations

import json

from ..config import DEFAULT_CONFIG_PATH
from ..journal import safe_text
from ..spool import Spool, spool_status
from . import CliError, load_cfg


def add_parser(sub) -> None:
    s = sub.add_parser("status", help="show the spool: queue, running job and epoch, latest results")
    s.add_argument("--config", help=f"configuration file naming spool.dir (default: {DEFAULT_CONFIG_PATH} if present)")
    s.add_argument("--spool-dir", help="spool directory (default: spool.dir from the config)")
    s.add_argument("--last", type=int, default=5, metavar="N", help="how many latest results to show (default 5)")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.set_defaults(func=run)


def _job_line(job: dict) -> str:
    state = job.get("state", "?")
    if job.get("daemon_alive") and state == "running":
        epoch = f" epoch {job['epoch']}/{job.get('epochs', '?')} loss {job['loss']:.6g}" if job.get("epoch") else " (loading)"
        what = f"training{epoch} on {job.get('device', '?')}, daemon pid {job.get('pid')}"
    elif state == "deferred":
        what = "deferred by the health gate"
    else:
        resume = "from its checkpoint" if job.get("checkpoint") else "from epoch 1"
        what = f"{state}, daemon not running it now; resumes {resume} on the next start"
    return f"  {safe_text(job.get('dataset') or '?')}  job {job.get('job_id', '?')}: {what}"


def run(args) -> int:
    """``ds-ops status [--json]``: exit 0; 1 if the spool directory does not exist."""
    root = args.spool_dir or load_cfg(args, {}).spool.dir
    try:
        st = spool_status(Spool(root), last=max(args.last, 0))
    except FileNotFoundError:
        raise CliError(f"spool directory {root} does not exist (is ds-trainer installed? see spool.dir)") from None
    except PermissionError as e:
        raise CliError(f"cannot read the spool directory: {e.strerror} ({e.filename})") from None
    if args.json:
        print(json.dumps(st, sort_keys=True))
        return 0
    print(f"spool {st['spool']}: {len(st['queue'])} queued, {len(st['processing'])} in processing, "
          f"{st['done_count']} done, {st['failed_count']} failed")
    for name in st["queue"]:
        print(f"  queued  {safe_text(name)}")
    for entry in st.get("ignored", []):
        print(f"  ignored {safe_text(entry['name'])}: {entry['kind']}, not a regular file (left in incoming/)")
    for job in st["processing"]:
        print(_job_line(job))
    if st["recent_done"]:
        print("latest done:")
        for d in st["recent_done"]:
            loss = d.get("final_train_loss")
            loss_text = f"{loss:.6g}" if isinstance(loss, (int, float)) else "n/a"
            print(f"  {safe_text(d.get('dataset_file') or '?')}  -> {d.get('model_dir')}  loss {loss_text}  "
                  f"{d.get('device')} {d.get('finished_at')}")
    if st["recent_failed"]:
        print("latest failed:")
        for d in st["recent_failed"]:
            print(f"  {safe_text(d.get('dataset_file') or '?')}  [{d.get('stage')}] {safe_text(str(d.get('reason')))}")
    return 0
