"""``ds-ops status``: the spool's queue, every running job with its GPU, stage and epoch, the latest results,
and per scored model its last scored time, rows scored and whether an anomaly is open.

Read from the spool directory alone, so it works whether or not the daemon runs (and as any user
who can read the spool), and with a broken conffile (it says so and reads ``spool.dir`` from the
file if it can, else uses the default). ``--follow`` prints it again every ``--interval`` seconds.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime, timezone

import yaml

from ..config.conffile import DEFAULT_CONFIG_PATH, ConfigError, ScoringConfig, SpoolConfig
from ..scoring.results import model_views
from ..observe.incident_entries import top_text
from ..observe.journal import safe_text
from ..spool import Spool, spool_status
from . import CliError, load_cfg


def add_parser(sub) -> None:
    s = sub.add_parser("status", help="show the spool: queue, running job and epoch, latest results")
    s.add_argument("--config", help=f"configuration file naming spool.dir (default: {DEFAULT_CONFIG_PATH} if present)")
    s.add_argument("--spool-dir", help="spool directory (default: spool.dir from the config)")
    s.add_argument("--last", type=int, default=5, metavar="N", help="how many latest results to show (default 5)")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.add_argument("--follow", action="store_true", help="print the status again every --interval seconds (Ctrl-C ends)")
    s.add_argument("--interval", type=float, default=2.0, metavar="S", help="seconds between --follow updates (default 2)")
    s.set_defaults(func=run)


def _spool_root(args) -> str:
    """Return the spool directory: --spool-dir, else the conffile's spool.dir. A conffile that does
    not validate is reported on stderr (one ``ds-ops: warning:`` line) and its ``spool.dir`` used
    if it is a readable absolute path, else the default."""
    if args.spool_dir:
        return args.spool_dir
    try:
        return load_cfg(args, {}).spool.dir
    except ConfigError as e:
        root = SpoolConfig().dir
        try:
            with open(args.config or DEFAULT_CONFIG_PATH, encoding="utf-8") as f:
                raw = yaml.safe_load(f)
            candidate = raw["spool"]["dir"]
            if isinstance(candidate, str) and candidate.startswith("/"):
                root = candidate
        except Exception:  # a broken file: anything may be wrong with it; the default it is
            pass
        print(f"ds-ops: warning: {e}; showing spool {root} (ds-ops check-config)", file=sys.stderr)
        return root


def _results_dir(args) -> str:
    """Return scoring.results_dir from the conffile (the default where it does not validate)."""
    try:
        return load_cfg(args, {}).scoring.results_dir
    except ConfigError:
        return ScoringConfig().results_dir


def _utc(seconds: float) -> str:
    """Unix seconds as ``2026-12-03T14:00:00Z``."""
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _model_line(v: dict) -> str:
    """One scored model: ``  NAME  last scored ..., N rows scored (F flagged, I incidents), ...``."""
    at = v.get("scored_at")
    when = _utc(at) if at else "?"
    sev = str(v.get("severity") or "warning").upper()
    anomaly = f"{sev} INCIDENT OPEN: {top_text(v.get('top_metrics'))}" if v.get("active") else "no open incident"
    drift = f", drift ratio {v['drift_ratio']:.2f}" if isinstance(v.get("drift_ratio"), (int, float)) else ""
    nxt = v.get("next_retrain_at")
    retrain = f", next retrain {_utc(nxt)}" if isinstance(nxt, (int, float)) else ""
    failed = v.get("retrain_failed")
    if isinstance(v.get("next_retrain_data_time"), str) and not isinstance(failed, dict):
        retrain = f", next retrain once the data reaches {v['next_retrain_data_time']}"
    if isinstance(failed, dict):
        after = failed.get("next_try_at")
        retrain += (f", retraining FAILED {failed.get('failures')} time(s), last at {safe_text(str(failed.get('failed_at')))}:"
                    f" {safe_text(str(failed.get('reason')))[:200]}; next try not before "
                    + (f"the data reaches {failed['next_try_data_time']}" if isinstance(failed.get("next_try_data_time"), str)
                       else _utc(after) if isinstance(after, (int, float)) else "?"))
    reg = v.get("regime")
    regime = ""
    if isinstance(reg, dict):
        moved = ", ".join(f"{safe_text(str(m.get('metric')))} {_num(m.get('before'))} -> {_num(m.get('after'))}"
                          for m in reg.get("metrics") or [])
        regime = (f", CHANGE OF REGIME since {safe_text(str(reg.get('started_time') or '?'))} ({moved}) scored against "
                  "the new levels, not yet learned by a retraining")
    return (f"  {safe_text(v['model'])}  last scored {when}, {v['rows_total']} rows scored ({v['flagged_total']} "
            f"flagged, {_count(v['incidents_total'], 'incident')}, {v.get('critical_total', 0)} critical), "
            f"{anomaly}{regime}{drift}{retrain}")


def _num(v) -> str:
    return f"{v:.4g}" if isinstance(v, (int, float)) and not isinstance(v, bool) else "?"


def _count(n, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def next_retrains(args, views: dict) -> None:
    """Add ``next_retrain_at`` (Unix seconds: the newest version's training end + retrain.every,
    as the daemon counts it, or the end of a failed retraining's back-off if later) to each scored
    model's view when retrain.every is set, and ``retrain_failed`` (the last failure, its
    ``next_try_at``) where the model's last retraining failed."""
    from ..daemon.retrainer import backoff_s, last_trained, next_try_s, read_failure

    try:
        cfg = load_cfg(args, {})
    except ConfigError:
        return
    for name, v in views.items():
        failure = read_failure(cfg.scoring.results_dir, name)
        after = next_try_s(cfg.retrain, failure)
        if failure is not None:
            v["retrain_failed"] = dict(failure, next_try_at=after)
            if isinstance(failure.get("data_s"), (int, float)):  # the daemon counts the back-off on the data's clock
                v["retrain_failed"]["next_try_data_time"] = _utc(float(failure["data_s"]) + backoff_s(failure))
        if not cfg.retrain.every:
            continue
        trained, data_s = last_trained(cfg.models_dir, name)
        every_s = cfg.retrain.every_s
        if data_s is not None and v.get("last_time") is not None:  # by the data's clock (opt_ds_ops.daemon.retrainer.due)
            v["next_retrain_data_time"] = _utc(data_s + every_s)
            continue
        nxt = trained + every_s if trained is not None else None
        v["next_retrain_at"] = max(nxt, after) if nxt is not None and after is not None else nxt


def _seconds_since(stamp) -> float | None:
    try:
        t = datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc)
    except (TypeError, ValueError):
        return None
    return datetime.now(timezone.utc).timestamp() - t.timestamp()


def time_left_s(job: dict) -> float | None:
    """Return an estimate of the running job's training time left (seconds) at the nearer of its
    two caps: the epochs, and the plateau rule's ``max_steps`` (where the job reports steps; the
    plateau may stop it sooner). The time to its last report divided by the share of that cap
    done, less the time since its start; None before epoch 1."""
    epoch, epochs = job.get("epoch"), job.get("epochs")
    since_start, since_epoch = _seconds_since(job.get("started_at")), _seconds_since(job.get("updated_at"))
    if not (isinstance(epoch, int) and isinstance(epochs, int) and epoch > 0) or since_start is None or since_epoch is None:
        return None
    done = epoch / epochs if epochs > 0 else 0.0
    steps, max_steps = job.get("steps"), job.get("max_steps")
    if isinstance(steps, int) and isinstance(max_steps, int) and max_steps > 0:
        done = max(done, steps / max_steps)
    if done <= 0:
        return None
    return max(max(since_start - since_epoch, 0.0) / min(done, 1.0) - since_start, 0.0)


def _job_line(job: dict) -> str:
    state = job.get("state", "?")
    if job.get("daemon_alive") and state == "running":
        if job.get("epoch"):
            left = time_left_s(job)
            eta = f", about {left:.0f} s left" if left is not None else ""
            step = f" step {job['steps']}/{job['max_steps']}" if job.get("max_steps") else ""
            epoch = f" epoch {job['epoch']}/{job.get('epochs', '?')}{step} loss {job['loss']:.6g}{eta}"
        else:
            epoch = f" ({job.get('stage') or 'loading'})"
        device = f" on {job['device']}" if job.get("device") else ""
        ranks = int(job.get("nproc") or 1)
        gpu = (f" (GPU{'s' if ranks > 1 else ''} {job['gpu_index']} {job.get('gpu_uuid', '')})"
               if job.get("gpu_index") is not None else "")
        under = f" with {ranks} processes under torchrun" if ranks > 1 else ""
        what = f"training{epoch}{device}{gpu}{under}, daemon pid {job.get('pid')}"
    elif job.get("daemon_alive") and state == "claiming":
        what = "being copied into processing/ by the daemon"
    elif job.get("daemon_alive") and state == "claimed":
        what = "claimed, waiting for its turn"
    elif state == "deferred":
        what = "deferred by the health gate"
    else:
        resume = "from its checkpoint" if job.get("checkpoint") else "from epoch 1"
        what = f"{state}, daemon not running it now; resumes {resume} on the next start"
    return f"  {safe_text(job.get('dataset') or '?')}  job {job.get('job_id', '?')}: {what}"


def open_failures(spool: Spool, st: dict, last: int) -> int:
    """Return how many datasets in failed/ no later success of the same name superseded: the
    ``N failed`` that still needs an operator. ``st``: :func:`opt_ds_ops.spool.spool_status` ``(spool,
    last)``, whose ``recent_failed`` are the newest ``last`` failures that were not superseded."""
    if st["failed_count"] <= last:
        return len(st["recent_failed"])
    every = spool_status(spool, last=st["failed_count"])  # failed/ is kept short (spool.max_failed)
    return len(every["recent_failed"])


def _print(st: dict) -> None:
    fixed = st["failed_count"] - st.get("failed_open", st["failed_count"])
    print(f"spool {st['spool']}: {len(st['queue'])} queued, {len(st['processing'])} in processing, "
          f"{st['done_count']} done, {st.get('failed_open', st['failed_count'])} failed"
          + (f" ({fixed} more in failed/, trained since)" if fixed > 0 else ""))
    daemon = st.get("daemon_pid")
    running = sum(1 for job in st["processing"] if job.get("daemon_alive") and job.get("state") == "running")
    print(f"daemon: running, pid {daemon}, {running} job{'' if running == 1 else 's'} running" if daemon
          else "daemon: not running (no ds-trainer holds the spool)")
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
        print("latest failed (fix the file, then: sudo ds-ops requeue NAME; a retraining is not requeued: "
              "it backs off and is tried again, see the scored models below):")
        for d in st["recent_failed"]:
            what = " (retraining)" if d.get("kind") == "retrain" else ""  # its JSON says so (older ones do not)
            print(f"  {safe_text(d.get('dataset_file') or '?')}{what}  [{d.get('stage')}] {safe_text(str(d.get('reason')))}")
    print(f"score/: {len(st.get('score_queue', []))} queued")
    for name in st.get("score_queue", []):
        print(f"  queued  {safe_text(name)}")
    if st.get("scoring"):
        print(f"scored models (results in {st.get('results_dir')}):")
        for v in st["scoring"].values():
            print(_model_line(v))


def run(args) -> int:
    """``ds-ops status [--json] [--follow]``: exit 0; 1 if the spool directory does not exist or
    cannot be read."""
    root = _spool_root(args)
    while True:
        try:
            st = spool_status(Spool(root), last=max(args.last, 0))
            st["failed_open"] = open_failures(Spool(root), st, max(args.last, 0))
        except FileNotFoundError:
            raise CliError(f"spool directory {root} does not exist (is ds-trainer installed? see spool.dir)") from None
        except PermissionError as e:
            raise CliError(f"cannot read the spool directory: {e.strerror} ({e.filename}); "
                           "members of group ds-ops may read it") from None
        for job in st["processing"]:
            job["time_left_s"] = time_left_s(job) if job.get("daemon_alive") else None
        st["results_dir"] = _results_dir(args)
        st["scoring"] = model_views(st["results_dir"])
        next_retrains(args, st["scoring"])
        if args.json:
            print(json.dumps(st, sort_keys=True), flush=True)
        else:
            _print(st)
        if not args.follow:
            return 0
        sys.stdout.flush()
        time.sleep(max(args.interval, 0.2))
        if not args.json:
            print()
