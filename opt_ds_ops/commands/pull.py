"""``ds-ops pull SOURCE``: read telemetry from Prometheus into the spool, one model per host.

SOURCE is a source file (``/etc/ds-ops/sources/NAME.yaml``, :mod:`opt_ds_ops.sources.sourcefile`).
Each pull (every ``score_every``; once with ``--once``) writes a new host's training window into
``incoming/`` and each trained host's new rows into ``score/``, the safe way, as the member of
group ds-ops it runs as (the unit ``ds-pull@NAME.service`` runs it as the user ds-pull, outside
the daemon's sandbox). Prometheus down or slow: the pull fails whole (nothing written, nothing
marked done), is said once in the journal, and is tried again with back-off (5 s doubling, at
most ``score_every``); the next pull that succeeds covers the gap, up to ``catch_up``. Metrics
``ds_ops_pull_*`` go to ``ds_ops_pull_NAME.prom`` in ``metrics.textfile_dir`` when it exists.
``--now`` sets the clock of a ``--once`` pull (a replay or a test advances it by hand).
"""

from __future__ import annotations

import calendar
import json
import os
import pwd
import signal
import threading
import time

from ..config.conffile import DEFAULT_CONFIG_PATH, ConfigError
from ..observe.journal import LOG_INFO, LOG_NOTICE, LOG_WARNING, EventLog, safe_text
from ..sources.metrics import PullMetrics
from ..sources.prometheus import Prometheus, PrometheusError
from ..sources.puller import (PullReport, drop_names, load_state, processing_records, pull, save_state,
                              sweep_lone_sidecars)
from ..sources.sourcefile import Source, load_source
from ..spool.layout import ERROR_SUFFIX, FAILED, INCOMING
from . import CliError, load_cfg

DEFAULT_STATE_DIR = "/var/lib/ds-ops/pull"
BACKOFF_FIRST_S = 5.0


def add_parser(sub) -> None:
    s = sub.add_parser("pull", help="read telemetry from Prometheus into the spool: one model per host (a source file)")
    s.add_argument("source", metavar="SOURCE", help="the source file (/etc/ds-ops/sources/NAME.yaml)")
    s.add_argument("--config", help=f"configuration file naming spool.dir and metrics.textfile_dir (default: {DEFAULT_CONFIG_PATH} if present)")
    s.add_argument("--spool-dir", help="spool directory (default: spool.dir from the config)")
    s.add_argument("--models-dir", help="the daemon's model store, where a host's model is looked for "
                                        "(default: models_dir from the config)")
    s.add_argument("--state-dir", default=DEFAULT_STATE_DIR, help=f"where the puller keeps its state (default: {DEFAULT_STATE_DIR})")
    s.add_argument("--shard", metavar="I/N", help="this server's shard of the hosts (default: the source's shard:)")
    s.add_argument("--once", action="store_true", help="one pull, then exit (exit 1 if it failed)")
    s.add_argument("--now", type=float, metavar="EPOCH", help="with --once: the pull's clock, in epoch seconds")
    s.set_defaults(func=run)


def _with_shard(source: Source, shard: str | None) -> Source:
    if shard is None:
        return source
    import dataclasses

    from ..config.conffile import _build

    options = _build(type(source.options), {**dataclasses.asdict(source.options), "shard": shard}, "--shard")
    return dataclasses.replace(source, options=options)


def run(args) -> int:
    """Exit 0 (a loop stopped by SIGTERM, or a --once pull that succeeded); 1 for a bad source or
    configuration, or a --once pull that failed."""
    if args.now is not None and not args.once:
        raise CliError("--now sets the clock of one pull: give --once too")
    cfg = load_cfg(args, {})
    try:
        source = _with_shard(load_source(args.source), args.shard)
    except ConfigError as e:
        raise CliError(str(e)) from None
    spool_root = args.spool_dir or cfg.spool.dir
    for which in ("incoming", "score"):
        where = os.path.join(spool_root, which)
        if not os.path.isdir(where):
            raise CliError(f"no spool directory {where}: is the spool's path right (--spool-dir, or spool.dir in "
                           "the configuration), and the daemon (ds-trainer) started once, which makes it?")
        if not os.access(where, os.W_OK | os.X_OK):
            raise CliError(f"cannot write {where}: run as a member of group ds-ops "
                           "(the unit ds-pull@NAME.service runs as the user ds-pull, a member)")
    try:
        os.makedirs(args.state_dir, exist_ok=True)
    except OSError as e:
        raise CliError(f"cannot create {args.state_dir}: {e.strerror}") from None
    puller = Puller(source, spool_root, os.path.join(args.state_dir, source.name + ".json"),
                    PullMetrics(source, cfg.metrics.textfile_dir), EventLog(identifier="ds-pull"),
                    args.models_dir or cfg.models_dir)
    if args.once:
        return 0 if puller.once(time.time() if args.now is None else args.now) else 1
    puller.forever()
    return 0


OTHER_STATE_FRESH_S = 86400.0  # another source's state counts if its puller saved it within this (it saves every pull)


def _stamp_s(rest: str) -> float | None:
    """The epoch seconds of a training file's ``STAMP`` (``20260922T044800Z.TOKEN.csv``), or None."""
    try:
        return float(calendar.timegm(time.strptime(rest[:16], "%Y%m%dT%H%M%SZ")))
    except ValueError:
        return None


class Puller:
    """The pull loop of one source: state, back-off, journal and metrics around :func:`pull`."""

    def __init__(self, source: Source, spool_root: str, state_path: str, metrics: PullMetrics, log: EventLog,
                 models_dir: str):
        self.source, self.spool_root, self.state_path = source, spool_root, state_path
        self.metrics, self.log, self.models_dir = metrics, log, models_dir
        self.prom = Prometheus(source.options.prometheus, source.options.timeout_s, source.options.max_response_bytes)
        self.failures = 0
        self.last_error = ""
        self.stop = threading.Event()

    def model_ready(self, name: str) -> bool:
        """Whether model ``name`` has a current version (the store is readable by group ds-ops)."""
        return os.path.exists(os.path.join(self.models_dir, name, "current"))

    def other_sources(self, state: dict) -> dict[str, str]:
        """{model name: source} of the names the other sources' pullers on this server hold (their
        state files beside this one's) before this one (``state``): trained earlier, or at the same
        time by a source whose name sorts first. Two sources over the same hosts with the same
        ``model_prefix`` would otherwise make one model of two sources' columns. Only a state saved
        within :data:`OTHER_STATE_FRESH_S` counts: a source renamed or turned off (its puller no
        longer saves it) holds nothing."""
        mine = {e.get("model"): e.get("trained_at") for e in (state.get("hosts") or {}).values()
                if isinstance(e, dict) and e.get("model") and not e.get("blocked")}
        names: dict[str, str] = {}
        here = os.path.dirname(os.path.abspath(self.state_path))
        try:
            files = sorted(f for f in os.listdir(here) if f.endswith(".json") and not f.startswith("."))
        except OSError:
            return names
        for f in files:
            path = os.path.join(here, f)
            if os.path.abspath(path) == os.path.abspath(self.state_path):
                continue
            try:
                if time.time() - os.stat(path).st_mtime > OTHER_STATE_FRESH_S:
                    continue  # no puller saves it any more
                hosts = load_state(path).get("hosts") or {}
            except (OSError, ValueError, AttributeError):
                continue
            other = f[: -len(".json")]
            for entry in hosts.values() if isinstance(hosts, dict) else ():
                if not (isinstance(entry, dict) and isinstance(entry.get("model"), str) and not entry.get("blocked")):
                    continue
                theirs, ours = entry.get("trained_at"), mine.get(entry["model"])
                if not isinstance(theirs, (int, float)):
                    continue  # a name it waits to train: not held yet
                if not isinstance(ours, (int, float)) or (theirs, other) < (ours, self.source.name):
                    names.setdefault(entry["model"], other)
        return names

    def model_taken(self, name: str) -> str | None:
        """Why model ``name`` is not this puller's to feed: another source's on this server
        (:meth:`other_sources`), or another owner's (its current version's ``uploader_uid`` is
        neither this puller's uid nor root's: docs/trust.md); None if it is free or its own."""
        other = getattr(self, "others", {}).get(name)
        if other is not None:
            state = os.path.join(os.path.dirname(os.path.abspath(self.state_path)), f"{other}.json")
            return (f"its model name {name} is source {other}'s already ({state}: both sources make a model of this "
                    "host: give one of them its own model_prefix)")
        try:
            with open(os.path.join(self.models_dir, name, "current", "metadata.json"), encoding="utf-8") as f:
                owner = json.load(f).get("uploader_uid")
        except (OSError, ValueError, AttributeError):
            return None
        if not isinstance(owner, int) or isinstance(owner, bool) or owner in (0, os.geteuid()):
            return None
        try:
            who = pwd.getpwuid(owner).pw_name
        except KeyError:
            who = "no user name"
        return (f"its model name {name} belongs to uid {owner} ({who}), who trained it first: no row of it is dropped "
                f"(give this source another model_prefix, or the owner or root runs ds-ops models rm {name})")

    def own_training(self, name: str) -> tuple[float, str | None] | None:
        """(end in epoch seconds, its file's name) of a training of model ``name`` this puller made
        already: its file ``NAME.train-STAMP.TOKEN.csv`` still in incoming/ (owned by this uid) or
        claimed in processing/, else (end, None) for the model's current version if this uid dropped
        it; None if there is none. The spool is listed once per pull (:meth:`_own_files`)."""
        files = self._own_files()
        if name in files:
            return files[name]
        try:
            with open(os.path.join(self.models_dir, name, "current", "metadata.json"), encoding="utf-8") as f:
                md = json.load(f)
            if md.get("uploader_uid") != os.geteuid():
                return None
            dataset = (md.get("dataset") or {}).get("file") or ""
            end = _stamp_s(dataset[len(name) + len(".train-"):]) if dataset.startswith(f"{name}.train-") else None
            return (end, None) if end is not None else None
        except (OSError, ValueError, AttributeError):
            return None

    def _own_files(self) -> dict[str, tuple[float, str]]:
        """{model: (end, file)} of this uid's training files in incoming/ and processing/, listed once
        per pull (a member's thousands of files there cost one listing, not one per host)."""
        if getattr(self, "_own", None) is not None:
            return self._own
        uid, found = os.geteuid(), []
        incoming = os.path.join(self.spool_root, INCOMING)
        try:
            with os.scandir(incoming) as it:
                for e in it:
                    if ".train-" in e.name and e.name.endswith(".csv") and e.stat(follow_symlinks=False).st_uid == uid:
                        found.append(e.name)
        except OSError:
            pass
        for record in processing_records(self.spool_root):
            dataset = record.get("dataset")
            if isinstance(dataset, str) and ".train-" in dataset and record.get("uploader_uid") == uid:
                found.append(dataset)
        own: dict[str, tuple[float, str]] = {}
        for f in found:
            model, _, rest = f.rpartition(".train-")
            end = _stamp_s(rest)
            if model and end is not None and end >= own.get(model, (-1.0, ""))[0]:
                own[model] = (end, f)
        self._own = own
        return own

    def train_failed(self, file: str) -> str | None:
        """Why the daemon refused training file ``file`` this puller dropped in incoming/ (the reason in
        ``failed/FILE.error.json``), or None while it is not there."""
        try:
            with open(os.path.join(self.spool_root, FAILED, file + ERROR_SUFFIX), encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, ValueError):
            return None
        reason = doc.get("reason") if isinstance(doc, dict) else None
        return safe_text(str(reason))[:300] if reason else "failed (no reason given)"

    def model_removed(self, name: str) -> bool:
        """Whether model ``name`` is certainly gone from the store (``ds-ops models rm``): its
        directory does not exist in a store that can be listed. Any other error (unreadable,
        unmounted, EIO) is no removal."""
        try:
            os.listdir(self.models_dir)
            os.lstat(os.path.join(self.models_dir, name))
        except FileNotFoundError as e:
            return e.filename == os.path.join(self.models_dir, name)
        except OSError:
            return False
        return False

    def failed(self, message: str, unavailable: bool) -> bool:
        """Count a failed pull; say it when it is the first of a streak or says something new."""
        self.failures += 1
        if message != self.last_error:
            self.log.event("source-unavailable", f"{self.source.name}: pull failed, nothing marked pulled: {message}",
                           priority=LOG_WARNING, source=self.source.name)
        self.last_error = message
        self.metrics.failed(unavailable)
        return False

    def once(self, now: float) -> bool:
        """One pull at ``now``; return True if it succeeded. The state is saved only after a success;
        a drop whose state could not be saved is not made twice: the next pull adopts its training
        file (:meth:`own_training`), and the daemon skips a chunk's rows it scored already."""
        try:
            state = load_state(self.state_path)
        except (OSError, ValueError) as e:
            raise CliError(f"cannot read the puller's state: {e}") from None
        t0 = time.monotonic()
        self.others, self._own = self.other_sources(state), None
        swept = sweep_lone_sidecars(self.spool_root, drop_names(self.source, state), os.geteuid(), time.time())
        if swept:
            self.log.event("source-pulled", f"{self.source.name}: removed {len(swept)} sidecar(s) of this puller's left "
                           f"without their CSV by a stop between the two files of a drop: {', '.join(swept[:3])}"
                           + (", ..." if len(swept) > 3 else ""), priority=LOG_NOTICE, source=self.source.name)
        try:
            report = pull(self.source, self.prom, self.spool_root, state, now, self.model_ready, self.model_removed,
                          self.model_taken, self.train_failed, self.own_training)
            save_state(self.state_path, state)
        except PrometheusError as e:
            return self.failed(str(e), e.unavailable)
        except OSError as e:
            return self.failed(f"{e.strerror or e} ({e.filename})", False)
        if self.failures:
            self.log.event("source-unavailable", f"{self.source.name}: pulling again after {self.failures} failed "
                           "pull(s); the gap is covered up to catch_up", priority=LOG_NOTICE, source=self.source.name)
        self.failures, self.last_error = 0, ""
        self.say(report, state, time.monotonic() - t0)
        self.metrics.pulled(report, state, now)
        return True

    def say(self, report: PullReport, state: dict, took_s: float) -> None:
        name = self.source.name
        for host, model in report.removed.items():
            again = (f"trained again: {report.trained[host][1]} rows of its last train_window to incoming/"
                     if host in report.trained else
                     f"it is trained again once it has min_history ({self.source.options.min_history})")
            self.log.event("source-host", f"{name}: host {host}: its model {model} was removed from the store; {again} "
                           "(to stop modelling a host, leave it out of the source's query)", priority=LOG_NOTICE,
                           source=name, host=host, model_name=model)
        for host, (model, rows, path) in report.trained.items():
            if host not in report.removed:
                self.log.event("source-host", f"{name}: new host {host}: {rows} rows to incoming/ to train model {model}",
                               source=name, host=host, model_name=model)
        for host, history in report.waiting.items():
            never, news = report.never.get(host, (None, False))
            self.log.event("source-host", f"{name}: host {host} has {history / 3600:.1f} h of complete rows; "
                           f"its model is trained once it has min_history ({self.source.options.min_history})"
                           + (f"; no value at all in its window of {', '.join(never)}: a row needs every series, so "
                              "none can come until those answer for this host (a rate of a target Prometheus began "
                              "scraping just now answers after its second scrape; else its query, or a series this "
                              "host does not have: leave it out of the source)" if never else ""),
                           priority=LOG_WARNING if news else LOG_INFO, source=name, host=host)  # a warning once per change
        for host, last in report.gone.items():
            when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(last)) if last else "never"
            self.log.event("source-host", f"{name}: host {host} is not in Prometheus's answer (last row {when}); "
                           "its model stays, its scoring waits", priority=LOG_NOTICE, source=name, host=host)
        for host, why in report.refused.items():
            self.log.event("source-host", f"{name}: host {host}: {why}", priority=LOG_WARNING, source=name, host=host)
        for host, (model, adopted) in report.adopted.items():
            self.log.event("source-host", f"{name}: host {host}: its training file for model {model} (rows up to "
                           f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(adopted))}) was dropped before the "
                           "puller last stopped: scored from there, not trained twice", priority=LOG_NOTICE,
                           source=name, host=host, model_name=model)
        if report.old_prefix is not None:
            olds = sorted(set(report.renamed.values()))
            self.log.event("source-host", f"{name}: model_prefix is now {self.source.options.model_prefix!r} (was "
                           f"{report.old_prefix!r}): {len(report.renamed)} host(s) are modelled again under their new "
                           f"names, trained from their last train_window; their old models stay until removed "
                           f"(ds-ops models rm {' '.join(olds[:3])}{' ...' if len(olds) > 3 else ''})",
                           priority=LOG_WARNING, source=name)
        for host, model in report.moved.items():
            self.log.event("source-host", f"{name}: host {host} is of another shard now ({self.source.options.shard}); "
                           f"its model {model} is left to that shard's puller", priority=LOG_NOTICE, source=name, host=host)
        for host, (why, news) in report.blocked.items():
            self.log.event("source-host", f"{name}: host {host} is not modelled: {why}", source=name, host=host,
                           priority=LOG_WARNING if news else LOG_INFO)  # a warning when it starts or changes
        for host, why in report.train_failed.items():
            entry = state["hosts"].get(host) or {}
            at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(entry.get("retry_at") or 0))
            self.log.event("source-host", f"{name}: host {host}: the daemon refused its training file ({why}); trained "
                           f"again from its last train_window after {at} ({entry.get('train_failures')} failure(s) "
                           "in a row; the wait doubles, a day at most)", priority=LOG_WARNING, source=name, host=host)
        for host, skipped in report.skipped_s.items():
            self.log.event("source-host", f"{name}: host {host}: {skipped / 3600:.1f} h of rows left unscored: the gap "
                           f"was longer than catch_up ({self.source.options.catch_up})", priority=LOG_WARNING,
                           source=name, host=host)
        for host in report.forgotten:
            self.log.event("source-host", f"{name}: host {host} forgotten: never trained, and not seen for "
                           f"train_window ({self.source.options.train_window})", source=name, host=host)
        missing = sum(report.left_out.values())  # steps; a step without 3 series' values is one step
        worst = ", ".join(f"{host}: " + ", ".join(f"{s} {n}" for s, n in sorted(m.items(), key=lambda kv: (-kv[1], kv[0]))[:3])
                          for host, m in sorted(report.missing.items())[:3])
        rows = sum(r[1] for r in report.scored.values())
        self.log.event("source-pulled", f"{name}: pulled up to {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(report.end))} "
                       f"in {took_s:.1f} s: {len(report.scored)} chunk(s) of {rows} rows to score/, "
                       f"{len(report.trained)} training file(s) to incoming/"
                       + (f", {len(report.pending)} host(s) waiting for their model's first version" if report.pending else "")
                       + (f"; {missing} step(s) left out for want of a value (values missing by series: {worst})"
                          if missing else ""),
                       priority=LOG_INFO if not missing else LOG_NOTICE, source=name, rows=rows)

    def forever(self) -> None:
        """Pull every score_every (aligned to it), with back-off after a failure, until SIGTERM/SIGINT."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop.set())
        every = self.source.seconds("score_every")
        while not self.stop.is_set():
            ok = self.once(time.time())
            wait = every - time.time() % every if ok else min(every, BACKOFF_FIRST_S * 2 ** (self.failures - 1))
            self.stop.wait(wait)
