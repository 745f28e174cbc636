"""The daemon's periodic duties: metrics, retention, reload, health logging and STATUS= lines.

None of these touches a job's life: they run when the loop asks (:mod:`opt_ds_ops.daemon.service`), after
a job's end (:mod:`opt_ds_ops.daemon.outcome`), or on SIGHUP.

* **Metrics**: ``ds_ops.prom`` for node_exporter's textfile collector
  (:class:`opt_ds_ops.observe.metrics.MetricsWriter`), written on every state change and at least every
  :data:`opt_ds_ops.daemon.pacing.METRICS_REFRESH_S` seconds.
* **Retention**: done/ and failed/ past ``spool.*_max_age_days`` / ``*_max_bytes``; old model
  versions past ``store.keep_versions`` (never current or pinned ones).
* **Reload** (SIGHUP): the conffile read again; an unusable one is refused and the running one
  kept; a good one says which keys changed.
* **Health at start-up**: the health gate run once (without the CUDA smoke test) and logged.
* **STATUS=**: the idle line (queued, paused, deferred) and the busy line (per job: stage or epoch, GPU).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time

from ..config.conffile import Config, ConfigError, load_config
from ..config.sizes import GPU_HEADROOM_BYTES
from ..observe.incident_entries import removed_message
from ..observe.journal import LOG_INFO, LOG_WARNING, safe_text
from ..spool import DONE, FAILED, SpoolError, check_writable_dir, prune_retention
from ..store.admin import prune
from ..store.model_dir import StoreError
from . import worker
from .pacing import HEALTH_LOG_TIMEOUT_S, METRICS_MIN_GAP_S, METRICS_REFRESH_S


def _changed_keys(old: Config, new: Config) -> list[str]:
    """Return ``key: old -> new`` for each dotted conffile key whose value differs (a good reload says what changed)."""
    from ..config.conffile import config_to_dict

    out = []

    def walk(a: dict, b: dict, prefix: str) -> None:
        for key in sorted(set(a) | set(b)):
            va, vb = a.get(key), b.get(key)
            if isinstance(va, dict) and isinstance(vb, dict):
                walk(va, vb, f"{prefix}{key}.")
            elif va != vb:
                out.append(f"{prefix}{key} {va!r} -> {vb!r}")

    walk(config_to_dict(old), config_to_dict(new), "")
    return out


class Duties:
    """The periodic duties of the daemon (:class:`opt_ds_ops.daemon.service.Daemon`), its ``duties``.

    They read the daemon's configuration, watcher, queue and running jobs, and write only the
    metrics, the journal, STATUS= and, on reload, ``cfg``.
    """

    def __init__(self, daemon):
        self.d = daemon  # its configuration, watcher, queue, running jobs, metrics, journal
        self.series_checked_at: float | None = None  # time.monotonic() of the last look for removed series

    # ---- metrics and retention -------------------------------------------------------------------
    def start_metrics(self) -> None:
        """Say once where metrics go (or why they are off), prune done/ and failed/, write metrics."""
        if self.d.metrics.enabled:
            self.d.log.event("metrics", f"Prometheus metrics: {self.d.metrics.path} (node_exporter textfile collector)")
        else:
            self.d.log.event("metrics", f"Prometheus metrics off: {self.d.metrics.why_off}")
        self.d.guarded(self.retention)
        self.write_metrics()

    def forget_removed_series(self) -> None:
        """Drop the figures of the models whose scoring series went (``ds-ops models rm``, or by hand),
        so that no stale figure stays in ds_ops.prom, and say closed the incident one had open (the
        journal's ``incident-closed``, reason ``removed``), as every other incident is. A stat per
        scored model at most every METRICS_REFRESH_S (not on every write): at most a minute late."""
        if self.series_checked_at is not None and time.monotonic() - self.series_checked_at < METRICS_REFRESH_S:
            return
        self.series_checked_at = time.monotonic()
        m, results = self.d.metrics, self.d.cfg.scoring.results_dir
        for name in [n for n in m.scores if _series_gone(os.path.join(results, n))]:
            self.series_replaced(m.scores.pop(name))

    def series_replaced(self, view: dict) -> None:
        """A model's series went, or started afresh (removed and made again before the check above):
        the incident it had open (``view``, what the daemon last showed of it) is said closed."""
        if view.get("active"):
            self.d.log.event("incident-closed", removed_message(view), priority=LOG_WARNING, model=view.get("model"),
                             incident=view.get("incident"), version=view.get("version"),
                             severity=view.get("severity") or "warning", reason="removed")

    def write_metrics(self, soon: bool = False) -> None:
        """Write ds_ops.prom with the queue, the running jobs (those whose process has not ended:
        a job just finished is not counted before it is reaped) and the last results; a failure is
        a warning logged once per reason, never a stop. ``soon`` (a scored chunk): within
        METRICS_MIN_GAP_S of the last write, the write is left to the main loop's next tick
        (``metrics_dirty``), so that a fleet's chunks, several a second, are written together,
        not one ds_ops.prom each."""
        m = self.d.metrics
        self.forget_removed_series()
        if not m.enabled:
            return
        if soon and time.monotonic() - self.d.metrics_written_at < METRICS_MIN_GAP_S:
            self.d.metrics_dirty = True
            return
        self.d.metrics_dirty = False
        m.queued = self.d.watcher.queued() + len(self.d.pending)
        m.paused = time.monotonic() < self.d.paused_until
        m.jobs = [{"epoch": self.d.records.get(j.job_id, {}).get("epoch") or 0, "epochs": self.d.cfg.train.epochs,
                   "slot": j.slot, "gpu": str(j.gpu["index"]) if j.gpu else "", "uuid": j.gpu["uuid"] if j.gpu else ""}
                  for j in self.d.jobs.values() if j.exitcode() is None]
        self.d.metrics_written_at = time.monotonic()
        problem = m.write()
        if problem:
            self.d.log.event("metrics", f"Prometheus metrics not written: {problem}", priority=LOG_WARNING)

    def prune_versions(self, metadata: dict) -> None:
        """After a job: keep store.keep_versions versions of its model (never current or pinned)."""
        name, keep = metadata.get("name"), self.d.cfg.store.keep_versions
        if not name or keep <= 0:
            return
        try:
            removed = prune(self.d.cfg.models_dir, name, keep)
        except StoreError as e:
            self.d.log.event("model-pruned", f"{safe_text(name)}: old versions not pruned: {e}", priority=LOG_WARNING,
                           model_name=name)
            return
        for version in removed:
            self.d.log.event("model-pruned", f"{safe_text(name)}/{version} removed: the model keeps its newest "
                           f"{keep} versions (store.keep_versions), current and pinned ones", model_name=name)

    def retention(self) -> None:
        """Remove datasets past the retention of done/ and failed/ (spool.*_max_age_days, *_max_bytes)."""
        sp = self.d.cfg.spool
        for dest, days, max_bytes in ((DONE, sp.done_max_age_days, sp.done_max_bytes),
                                      (FAILED, sp.failed_max_age_days, sp.failed_max_bytes)):
            for old in prune_retention(self.d.spool, dest, days, max_bytes):
                self.d.log.event("spool-pruned", f"{dest}/{safe_text(old)} removed with its JSON: past the retention "
                               f"of {dest}/ (spool.{dest}_max_age_days {days:g}, spool.{dest}_max_bytes "
                               f"{max_bytes})", dataset_file=old)

    # ---- STATUS= lines -----------------------------------------------------------------------
    def idle_status(self) -> str:
        queued = self.d.watcher.queued()
        ignored = self.d.watcher.ignored()
        tail = f"; {ignored} non-regular entries ignored" if ignored else ""
        now = time.monotonic()
        if now < self.d.paused_until:
            return f"paused: {self.d.pause_reason}; retry in {self.d.paused_until - now:.0f} s; {queued} queued{tail}"
        if self.d.pending:
            job_id = self.d.pending[0]
            name = self.d.records.get(job_id, {}).get("dataset", job_id)
            left = self.d.retry_at.get(job_id, 0.0) - now
            return (f"deferred {safe_text(name)}: {self.d.defer_reason.get(job_id, '')}; retry in {max(left, 0):.0f} s; "
                    f"{queued} queued{tail}")
        mode = " (polling)" if self.d.watcher.polling else ""
        return f"idle; {queued} in incoming/{mode}{tail}"

    def busy_status(self) -> str:
        """The STATUS= line while jobs run: how many, and per job its dataset, stage or epoch and GPU."""
        parts = []
        for job in self.d.jobs.values():
            r = self.d.records.get(job.job_id, {})
            if r.get("epoch"):
                what = f"epoch {r['epoch']}/{self.d.cfg.train.epochs} loss {r.get('loss', float('nan')):.4g}"
            else:
                what = "health check" if job.stage == "health" else job.stage
            where = (f" on GPU {job.gpu['index']}" if job.gpu else
                     f" on {job.nproc} processes" + (f" (GPUs {r.get('gpu_index')})" if job.gpus else "")
                     if job.nproc > 1 else "")
            parts.append(f"training {safe_text(r.get('dataset', ''))} ({job.job_id}): {what}{where}")
        n = len(self.d.jobs)
        return f"{n} job{'' if n == 1 else 's'} running: {'; '.join(parts)}; {self.d.watcher.queued()} queued"

    # ---- health at start-up --------------------------------------------------------------------
    def log_health(self) -> None:
        """Run the health gate once at start-up, in a thread that is given up on after
        HEALTH_LOG_TIMEOUT_S (a hung NVML call), and log its verdict (warning unless ok).

        The gate reads torch's view of CUDA: it runs in a process of the forkserver, which has
        torch, as the daemon's process never imports it; a daemon made with ``health_in_process``
        (one inside a test, with the test's fakes of NVML and CUDA) runs it here."""
        box: dict = {}

        def run() -> None:
            try:
                if self.d.health_in_process:
                    box["found"] = worker.health_at_start(self.d.cfg, GPU_HEADROOM_BYTES)
                else:
                    box["found"] = worker.health_in_child(self.d.cfg, GPU_HEADROOM_BYTES, self.d.mp_context)
            except Exception as e:  # a broken NVML must not stop the daemon; jobs report it again
                box["error"] = e

        t = threading.Thread(target=run, name="health-at-start", daemon=True)
        t.start()
        t.join(min(HEALTH_LOG_TIMEOUT_S, self.d.cfg.job.health_timeout_s))
        if t.is_alive():
            self.d.slots.hung_read = t  # no NVML read for job slots starts while this one hangs
            self.d.log.event("health", f"health check did not answer within {self.d.cfg.job.health_timeout_s:.0f} s "
                           "(a hung NVML call?); jobs run it again in their own process", priority=LOG_WARNING)
            return
        if "error" in box:
            e = box["error"]
            self.d.log.event("health", f"health check could not run: {type(e).__name__}: {e}", priority=LOG_WARNING)
            return
        report, line = box["found"]
        self.d.slots.reading = (time.monotonic(), self.d.slots.slot_gpus(report))  # the first job's slot uses it
        verdict = report.get("verdict", "?")
        self.d.metrics.health(report)
        decided = report.get("decision") or {}  # the plan's device and AMP dtype, as strings
        self.d.log.event("health", line, priority=LOG_INFO if verdict == "ok" else LOG_WARNING,
                       verdict=verdict, action=decided.get("action"), device=decided.get("device"),
                       amp_dtype=decided.get("amp_dtype"), gpus=len(report.get("gpus", [])))

    # ---- configuration -------------------------------------------------------------------------
    def reload(self) -> None:
        """Re-read the conffile (SIGHUP); keep the running configuration if the new one is unusable."""
        self.d.reload_requested = False
        self.d.notifier.reloading()
        try:
            new = load_config(self.d.config_path, missing_ok=self.d.missing_ok)
            check_writable_dir(new.models_dir, "models directory")
        except (ConfigError, SpoolError) as e:
            self.d.log.event("config-rejected", f"configuration not reloaded, keeping the running one: {e}",
                           priority=LOG_WARNING)
            self.d.notifier.ready(self.idle_status())
            return
        new = self.d.slots.usable(new)
        kept = []
        for key in ("dir", "watcher"):
            if getattr(new.spool, key) != getattr(self.d.cfg.spool, key):
                kept.append(f"spool.{key} stays {getattr(self.d.cfg.spool, key)!r} until a restart")
        if kept:
            spool_cfg = dataclasses.replace(new.spool, dir=self.d.cfg.spool.dir, watcher=self.d.cfg.spool.watcher)
            new = dataclasses.replace(new, spool=spool_cfg)
        if new.metrics != self.d.cfg.metrics:  # the unit's sandbox binds the directory at start
            kept.append(f"metrics.textfile_dir stays {self.d.cfg.metrics.textfile_dir!r} until a restart")
            new = dataclasses.replace(new, metrics=self.d.cfg.metrics)
        changed = _changed_keys(self.d.cfg, new)  # a good reload says what changed
        self.d.cfg = new
        for w in (self.d.watcher, self.d.scorer.watcher):
            w.set_timing(new.spool.settle_s, new.spool.scan_interval_s, new.spool.quiet_s)
        note = f" ({'; '.join(kept)})" if kept else ""
        note += f": {', '.join(changed)}" if changed else ": nothing changed"
        self.d.log.event("config-reloaded", f"configuration reloaded from {self.d.config_path}{note}")
        self.d.metrics.models_dir = new.models_dir
        self.d.metrics.retrain_every_s = new.retrain.every_s
        self.d.notifier.ready(self.idle_status())
        self.write_metrics()


def _series_gone(model_dir: str) -> bool:
    """Whether a model's series directory is certainly gone (ENOENT), not unreadable for a while."""
    try:
        os.lstat(model_dir)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return False
