"""Prometheus metrics of the daemon, the node_exporter textfile way: ``ds_ops.prom`` in a directory
that node_exporter's textfile collector reads (Debian's prometheus-node-exporter:
``/var/lib/prometheus/node-exporter``, the conffile's ``metrics.textfile_dir``).

The text comes from prometheus_client (a fresh ``CollectorRegistry`` per write, rendered by
``generate_latest``), never built by hand. It is written atomically: a hidden temporary file in the
same directory (``.ds_ops.prom.tmp-*``: node_exporter reads only ``*.prom``; one a killed write
left is removed when the daemon starts), fsync'ed, chmod 0644 (the unit's
``UMask=0027`` would leave it unreadable to node_exporter's user), renamed over ``ds_ops.prom``.
``prometheus_client.write_to_textfile`` does the same rename but neither the fsync nor the mode,
so :func:`opt_ds_ops.fsutil.write_atomic` is used instead.

Names follow Prometheus's rules (base units, ``_seconds``, ``_total`` for counters,
``_timestamp_seconds`` for Unix times, ``_info`` for build information; see ``METRIC_NAMES``).
Counters count since the daemon started (``ds_ops_daemon_start_time_seconds``); Prometheus's
``rate()``/``increase()`` handle the reset at a restart. The last results (``ds_ops_last_*``) are
taken back from the file the previous run wrote, so a restart does not empty them until the next
job (an alert on ``time() - ds_ops_last_success_timestamp_seconds`` holds across it).
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import stat
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from .. import __version__
from ..fsutil import write_atomic

TEXTFILE = "ds_ops.prom"
TEMP_PREFIX = f".{TEXTFILE}.tmp-"  # the temporary file of a write: ours alone in a directory others write too

# Every metric family written, with its help text (the README lists these names).
METRIC_NAMES = {
    "ds_ops_build_info": "ds-ops build: version, torch and CUDA versions (value 1)",
    "ds_ops_daemon_start_time_seconds": "Unix time the daemon started",
    "ds_ops_jobs_finished_total": "jobs finished since the daemon started, by result (done, failed)",
    "ds_ops_queued_datasets": "datasets waiting: in incoming/ and claimed jobs not yet running",
    "ds_ops_intake_paused": "1 while intake is paused after a file system error, else 0",
    "ds_ops_job_running": "1 while a job runs, else 0",
    "ds_ops_job_epoch": "the running job's last finished epoch (0 before the first; the oldest one's when several run)",
    "ds_ops_job_epochs": "epochs the running job trains",
    "ds_ops_job_progress_ratio": "the running job's share of its cap done (0..1): epochs / epochs, or steps / max_steps under the plateau rule, whichever is larger; the plateau may stop it sooner",
    # daemon.max_jobs: every running job, labelled with its slot and GPU (empty on the CPU)
    "ds_ops_jobs_running": "number of jobs running",
    "ds_ops_slot_job_running": "1 for each running job, by job slot, GPU index and UUID",
    "ds_ops_slot_job_epoch": "each running job's last finished epoch, by job slot, GPU index and UUID",
    "ds_ops_slot_job_progress_ratio": "each running job's share of its cap done (as ds_ops_job_progress_ratio), by job slot, GPU index and UUID",
    "ds_ops_last_success_timestamp_seconds": "Unix time of the last job saved to the model store",
    "ds_ops_last_failure_timestamp_seconds": "Unix time of the last job moved to failed/",
    "ds_ops_last_job_duration_seconds": "wall time of the last saved job, from its claim to done/",
    "ds_ops_last_training_duration_seconds": "training time of the last saved job",
    "ds_ops_last_training_samples_per_second": "training throughput of the last saved job (rows/s)",
    "ds_ops_model_train_loss": "final training loss (MSE, standardised units) of each model's current version",
    "ds_ops_model_val_loss": "final validation loss of each model's current version",
    "ds_ops_model_threshold": "anomaly-score threshold of each model's current version",
    "ds_ops_model_trained_timestamp_seconds": "Unix time each model's current version finished training",
    "ds_ops_model_age_seconds": "seconds since each model's current version finished training",
    "ds_ops_model_versions": "versions kept of each model",
    "ds_ops_gpu_health": "last health verdict per GPU (1 for the verdict it has, 0 for the others)",
    # The scoring spool, per model (opt_ds_ops.daemon.scoreslot); the counters are the model's own
    # (RESULTS/NAME/state.json), so they survive a restart of the daemon
    "ds_ops_score_last": "anomaly score of the last row scored, per model",
    "ds_ops_score_threshold": "anomaly-score threshold the last scored file was judged by, per model",
    "ds_ops_incident_open": "1 while an incident of the model is open (scoring.incident_*), else 0",
    "ds_ops_incident_critical": "1 while the model's open incident is critical (its peak reached "
                                "scoring.incident_critical_ratio times the threshold), else 0",
    "ds_ops_scored_rows_total": "rows scored, per model",
    "ds_ops_flagged_rows_total": "rows flagged as anomalous, per model",
    "ds_ops_incidents_total": "incidents opened, per model",
    "ds_ops_critical_incidents_total": "incidents that opened critical or were escalated to critical, per model",
    "ds_ops_last_scored_timestamp_seconds": "Unix time the model's last file was scored",
    "ds_ops_regime_changes_total": "changes of regime said (scoring.regime_*), per model",
    "ds_ops_regime_unlearned": "1 while the model's series is re-baselined for a change of regime that no promoted "
                               "version has learned yet, else 0",
    # Retraining: the share flagged over retrain.drift_window over the design rate (opt_ds_ops.daemon.retrainer)
    "ds_ops_model_drift_ratio": "share of rows flagged over retrain.drift_window divided by the design rate, per model",
    "ds_ops_retrain_every_seconds": "retrain.every in seconds (0: no periodic retraining), for rules on a model's age",
    "ds_ops_incident_top_metric_share": "share of the open incident's error by metric, its top 3 (rank 1-3), per model",
}
SCORE_COUNTERS = (("ds_ops_scored_rows_total", "rows_total"), ("ds_ops_flagged_rows_total", "flagged_total"),
                  ("ds_ops_incidents_total", "incidents_total"),
                  ("ds_ops_critical_incidents_total", "critical_total"),
                  ("ds_ops_regime_changes_total", "regime_total"))
VERDICTS = ("ok", "warn", "fail")


def _utc_seconds(stamp) -> float | None:
    from datetime import datetime, timezone

    try:
        return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc).timestamp()
    except (TypeError, ValueError):
        return None


# the last results, kept across a restart (MetricsWriter.restore_last): metric -> attribute
LAST_RESULTS = {"ds_ops_last_success_timestamp_seconds": "last_success",
                "ds_ops_last_failure_timestamp_seconds": "last_failure",
                "ds_ops_last_job_duration_seconds": "last_job_s",
                "ds_ops_last_training_duration_seconds": "last_training_s",
                "ds_ops_last_training_samples_per_second": "last_samples_per_s"}


class MetricsWriter:
    """The daemon's metrics: what it knows (counters, the running job, the last results, GPU
    verdicts) plus the model store's current versions, written to ``textfile_dir/ds_ops.prom``.

    ``textfile_dir`` empty or absent: off (:attr:`enabled` False, :attr:`why_off` says why). A
    write that fails (EACCES, ENOSPC, ...) is returned as a message by :meth:`write` (the daemon
    logs it once per distinct reason) and never raises.
    """

    def __init__(self, textfile_dir: str, models_dir: str, *, torch_version: str = "", cuda_version: str = "",
                 read_models=None, retrain_every_s: float = 0.0):
        # read_models(models_dir) -> [(name, current version's metadata, number of versions)]: the
        # model store's reader (opt_ds_ops.store.model_dir.current_models), passed in by the daemon
        # so that this module never imports the store it reports on; None: no per-model series
        self.dir, self.models_dir, self.read_models = textfile_dir, models_dir, read_models
        self.path = os.path.join(textfile_dir, TEXTFILE) if textfile_dir else ""
        self.enabled = bool(textfile_dir) and os.path.isdir(textfile_dir)
        self.why_off = ("metrics.textfile_dir is empty" if not textfile_dir else
                        f"{textfile_dir} does not exist (install prometheus-node-exporter, or set "
                        "metrics.textfile_dir)" if not self.enabled else "")
        self.build = {"version": __version__, "torch": torch_version, "cuda": cuda_version or "none"}
        self.retrain_every_s = float(retrain_every_s)
        self.started = time.time()
        self.finished = {"done": 0, "failed": 0}
        self.queued = 0
        self.paused = False
        # the running jobs, oldest first: {"epoch": n, "epochs": n, "slot": n, "gpu": "0" or "", "uuid": "GPU-..." or ""}
        self.jobs: list[dict] = []
        self.last_success = self.last_failure = None
        self.last_job_s = self.last_training_s = self.last_samples_per_s = None
        self.gpus: dict[tuple[str, str], str] = {}  # (index, uuid) -> verdict
        self.scores: dict[str, dict] = {}  # model -> opt_ds_ops.scoring.results.model_view
        self._last_error = ""
        if self.enabled:
            self.remove_leftovers()
            self.restore_last()

    def restore_last(self) -> list[str]:
        """Take the last results (:data:`LAST_RESULTS`) from the ``ds_ops.prom`` the previous run
        wrote, so that they do not vanish at a restart until the next job; return the metrics restored.

        Others may write in the textfile directory, so only this daemon's own file is read: a
        regular file (not followed through a link) owned by this process's uid, 4 MiB at most, and
        only its unlabelled ``ds_ops_last_*`` lines, by a linear scan, not a parser: a file anyone
        else could have put there restores nothing and costs nothing at start-up."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return []
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size > 4 << 20:
                return []
            text = os.read(fd, st.st_size + 1).decode("ascii", "replace")
        except OSError:
            return []
        finally:
            os.close(fd)
        restored = []
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            attr = LAST_RESULTS.get(name)
            if attr is None:
                continue
            try:
                number = float(value)
            except ValueError:
                continue
            if math.isfinite(number):
                setattr(self, attr, number)
                restored.append(name)
        return restored

    def remove_leftovers(self) -> list[str]:
        """Remove the temporary files of writes that were killed before their rename (``.ds_ops.prom.tmp-*``;
        only this daemon writes ``ds_ops.prom``, so none is in use at its start); return their names."""
        removed = []
        try:
            for name in os.listdir(self.dir):
                if name.startswith(TEMP_PREFIX):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(self.dir, name))
                    removed.append(name)
        except OSError:  # unreadable: write() says why once
            pass
        return removed

    # ---- what the daemon tells it ---------------------------------------------------------------
    def job_done(self, doc: dict) -> None:
        """A job was saved: ``doc`` is its NAME.result.json content (durations in seconds)."""
        self.finished["done"] += 1
        self.last_success = time.time()
        self.last_job_s = doc.get("duration_s")
        self.last_training_s = doc.get("training_duration_s")
        self.last_samples_per_s = doc.get("samples_per_s")

    def job_failed(self) -> None:
        """A job was moved to failed/."""
        self.finished["failed"] += 1
        self.last_failure = time.time()

    def score_done(self, view: dict) -> None:
        """A file was scored: ``view`` is its model's :func:`opt_ds_ops.scoring.results.model_view`."""
        self.scores[view["model"]] = view

    def health(self, report: dict | None) -> None:
        """Keep the verdict of each GPU of a health report (:func:`opt_ds_ops.health.policy.health_report`)."""
        for g in (report or {}).get("gpus") or []:
            self.gpus[(str(g.get("index", "?")), str(g.get("uuid", "")))] = str(g.get("verdict", "?"))

    # ---- rendering ------------------------------------------------------------------------------
    def registry(self) -> CollectorRegistry:
        """Return a registry holding every metric's current value (a new one each call)."""
        reg = CollectorRegistry()

        def gauge(name, value, labels=None):
            g = Gauge(name, METRIC_NAMES[name], labelnames=list(labels or {}), registry=reg)
            if value is not None:
                (g.labels(**labels) if labels else g).set(value)
            return g

        gauge("ds_ops_build_info", 1, self.build)
        gauge("ds_ops_daemon_start_time_seconds", self.started)
        gauge("ds_ops_retrain_every_seconds", self.retrain_every_s)
        c = Counter("ds_ops_jobs_finished", METRIC_NAMES["ds_ops_jobs_finished_total"], ["result"], registry=reg)
        for result, n in self.finished.items():
            c.labels(result=result).inc(n)
        gauge("ds_ops_queued_datasets", self.queued)
        gauge("ds_ops_intake_paused", int(self.paused))
        job = self.jobs[0] if self.jobs else {}

        def ratio(j: dict) -> float:  # the nearer of the two caps: the epochs, and the plateau rule's max_steps
            by_epochs = j.get("epoch", 0) / j["epochs"] if j.get("epochs") else 0.0
            by_steps = j.get("steps", 0) / j["max_steps"] if j.get("max_steps") else 0.0
            return min(1.0, max(by_epochs, by_steps))

        gauge("ds_ops_job_running", int(bool(self.jobs)))
        gauge("ds_ops_job_epoch", job.get("epoch", 0))
        gauge("ds_ops_job_epochs", job.get("epochs", 0))
        gauge("ds_ops_job_progress_ratio", ratio(job))
        gauge("ds_ops_jobs_running", len(self.jobs))
        per_job = {n: Gauge(n, METRIC_NAMES[n], ["slot", "gpu", "uuid"], registry=reg) for n in (
            "ds_ops_slot_job_running", "ds_ops_slot_job_epoch", "ds_ops_slot_job_progress_ratio")}
        for j in self.jobs:
            labels = {"slot": str(j.get("slot", 0)), "gpu": j.get("gpu", ""), "uuid": j.get("uuid", "")}
            per_job["ds_ops_slot_job_running"].labels(**labels).set(1)
            per_job["ds_ops_slot_job_epoch"].labels(**labels).set(j.get("epoch", 0))
            per_job["ds_ops_slot_job_progress_ratio"].labels(**labels).set(ratio(j))
        for name, value in (("ds_ops_last_success_timestamp_seconds", self.last_success),
                            ("ds_ops_last_failure_timestamp_seconds", self.last_failure),
                            ("ds_ops_last_job_duration_seconds", self.last_job_s),
                            ("ds_ops_last_training_duration_seconds", self.last_training_s),
                            ("ds_ops_last_training_samples_per_second", self.last_samples_per_s)):
            g = Gauge(name, METRIC_NAMES[name], registry=reg)
            if isinstance(value, (int, float)):
                g.set(value)
            else:  # never happened yet: no sample rather than a misleading 0
                reg.unregister(g)
        per_model = {n: Gauge(n, METRIC_NAMES[n], ["model"], registry=reg) for n in (
            "ds_ops_model_train_loss", "ds_ops_model_val_loss", "ds_ops_model_threshold",
            "ds_ops_model_trained_timestamp_seconds", "ds_ops_model_age_seconds", "ds_ops_model_versions")}
        now = time.time()
        for name, md, n_versions in (self.read_models(self.models_dir) if self.read_models else ()):
            trained = _utc_seconds(md.get("ended_at"))
            for metric, value in (("ds_ops_model_train_loss", md.get("final_train_loss")),
                                  ("ds_ops_model_val_loss", md.get("final_val_loss")),
                                  ("ds_ops_model_threshold", md.get("threshold")),
                                  ("ds_ops_model_trained_timestamp_seconds", trained),
                                  ("ds_ops_model_age_seconds", now - trained if trained else None),
                                  ("ds_ops_model_versions", n_versions)):
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    per_model[metric].labels(model=name).set(value)
        self._score_families(reg)
        health = Gauge("ds_ops_gpu_health", METRIC_NAMES["ds_ops_gpu_health"], ["gpu", "uuid", "verdict"], registry=reg)
        for (index, uuid), verdict in sorted(self.gpus.items()):
            for v in VERDICTS:
                health.labels(gpu=index, uuid=uuid, verdict=v).set(int(v == verdict))
        return reg

    def _score_families(self, reg: CollectorRegistry) -> None:
        """Add the scoring spool's families: one sample per model, the top metrics only
        for an open incident (3 at most: the label set stays bounded)."""
        gauges = {n: Gauge(n, METRIC_NAMES[n], ["model"], registry=reg) for n in (
            "ds_ops_score_last", "ds_ops_score_threshold", "ds_ops_incident_open", "ds_ops_incident_critical",
            "ds_ops_last_scored_timestamp_seconds",
            "ds_ops_model_drift_ratio", "ds_ops_regime_unlearned")}
        counters = {n: Counter(n[: -len("_total")], METRIC_NAMES[n], ["model"], registry=reg) for n, _ in SCORE_COUNTERS}
        top = Gauge("ds_ops_incident_top_metric_share", METRIC_NAMES["ds_ops_incident_top_metric_share"],
                    ["model", "rank", "metric"], registry=reg)
        for name, v in sorted(self.scores.items()):
            for metric, value in (("ds_ops_score_last", v.get("last_score")), ("ds_ops_score_threshold", v.get("threshold")),
                                  ("ds_ops_incident_open", int(bool(v.get("active")))),
                                  ("ds_ops_incident_critical", int(bool(v.get("active")) and v.get("severity") == "critical")),
                                  ("ds_ops_last_scored_timestamp_seconds", v.get("scored_at")),
                                  ("ds_ops_model_drift_ratio", v.get("drift_ratio")),
                                  ("ds_ops_regime_unlearned", int(v.get("regime") is not None))):
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    gauges[metric].labels(model=name).set(value)
            for metric, key in SCORE_COUNTERS:
                n = v.get(key)
                if isinstance(n, (int, float)) and not isinstance(n, bool) and n >= 0:
                    counters[metric].labels(model=name).inc(n)
            if v.get("active"):
                for rank, t in enumerate(v.get("top_metrics") or [], 1):
                    if rank <= 3 and isinstance(t.get("share"), (int, float)):
                        top.labels(model=name, rank=str(rank), metric=str(t.get("metric"))).set(t["share"])

    def write(self) -> str | None:
        """Write ``ds_ops.prom`` atomically if enabled. Return None on success or when off, else a
        one-line reason the first time a given error happens (to log once), "" for a repeat."""
        if not self.enabled:
            return None
        try:
            write_atomic(self.path, generate_latest(self.registry()), prefix=TEMP_PREFIX)
        except OSError as e:
            hint = (" (the daemon's user ds-ops needs write access: apt install acl; setfacl -m u:ds-ops:rwx "
                    f"{self.dir}, then systemctl restart ds-trainer)" if e.errno in (errno.EACCES, errno.EROFS) else "")
            message = f"cannot write {self.path}: {e.strerror or e}{hint}"
            first = message != self._last_error
            self._last_error = message
            return message if first else ""
        self._last_error = ""
        return None
