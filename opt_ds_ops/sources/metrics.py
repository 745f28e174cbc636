"""The puller's Prometheus metrics, beside the daemon's: ``ds_ops_pull_NAME.prom`` in the
node_exporter textfile directory (``metrics.textfile_dir``), rendered by prometheus_client after
each pull and written as the daemon writes ``ds_ops.prom`` (:mod:`opt_ds_ops.observe.metrics`):
atomically and mode 0644, which the unit's ``UMask=0027`` would otherwise leave unreadable to
node_exporter's user (``write_to_textfile`` keeps the umask's mode); off when that directory does
not exist or is empty in the conffile."""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from ..fsutil import write_atomic

from .puller import PullReport
from .sourcefile import Source


PULL_METRIC_NAMES = ("ds_ops_pull_up", "ds_ops_pull_last_success_time_seconds", "ds_ops_pull_end_time_seconds",
                     "ds_ops_pull_failures_total", "ds_ops_pull_rows_total", "ds_ops_pull_missing_steps_total",
                     "ds_ops_pull_hosts", "ds_ops_pull_host_last_seen_time_seconds")


class PullMetrics:
    def __init__(self, source: Source, textfile_dir: str):
        self.path = os.path.join(textfile_dir, f"ds_ops_pull_{source.name}.prom") if textfile_dir else ""
        self.registry = r = CollectorRegistry()
        labels = ["source"]
        self.up = Gauge("ds_ops_pull_up", "1 if the last pull of the source succeeded, else 0", labels, registry=r)
        self.last_success = Gauge("ds_ops_pull_last_success_time_seconds",
                                  "When the last successful pull ran (epoch seconds)", labels, registry=r)
        self.pulled_until = Gauge("ds_ops_pull_end_time_seconds", "The newest step the last successful pull covered",
                                  labels, registry=r)
        self.failures = Counter("ds_ops_pull_failures", "Pulls that failed (Prometheus unavailable or a bad answer)",
                                labels + ["reason"], registry=r)
        self.rows = Counter("ds_ops_pull_rows", "Rows written to the spool", labels + ["kind"], registry=r)
        self.missing = Counter("ds_ops_pull_missing_steps", "Steps left out of a host's rows for want of a value",
                               labels, registry=r)
        self.hosts = Gauge("ds_ops_pull_hosts", "Hosts of this server's shard by state", labels + ["state"], registry=r)
        self.last_seen = Gauge("ds_ops_pull_host_last_seen_time_seconds", "The time of a trained host's newest row",
                               labels + ["host"], registry=r)
        self.name = source.name
        for reason in ("unavailable", "bad_answer"):
            self.failures.labels(self.name, reason)
        for kind in ("train", "score"):
            self.rows.labels(self.name, kind)
        self.missing.labels(self.name)

    def failed(self, unavailable: bool) -> None:
        self.up.labels(self.name).set(0)
        self.failures.labels(self.name, "unavailable" if unavailable else "bad_answer").inc()
        self.write()

    def pulled(self, report: PullReport, state: dict, now: float) -> None:
        n = self.name
        self.up.labels(n).set(1)
        self.last_success.labels(n).set(now)
        self.pulled_until.labels(n).set(report.end)
        self.rows.labels(n, "train").inc(sum(r[1] for r in report.trained.values()))
        self.rows.labels(n, "score").inc(sum(r[1] for r in report.scored.values()))
        self.missing.labels(n).inc(sum(report.left_out.values()))
        counts = {"trained": 0, "waiting": 0, "gone": 0, "blocked": 0, "failed": 0}
        for host in getattr(self, "_seen_hosts", set()) - {h for h, e in state["hosts"].items()
                                                          if e.get("scored_until") is not None}:
            self.last_seen.remove(n, host)  # forgotten, moved to another shard or waiting again: no stale last-seen
        self._seen_hosts = set()
        for host, entry in state["hosts"].items():
            trained = entry.get("scored_until") is not None
            counts["blocked" if entry.get("blocked") else "failed" if not trained and entry.get("train_failed")
                   else "waiting" if not trained else "gone" if entry.get("gone") else "trained"] += 1
            if trained and entry.get("last_seen") is not None:
                self.last_seen.labels(n, host).set(entry["last_seen"])
                self._seen_hosts.add(host)
        for s, v in counts.items():
            self.hosts.labels(n, s).set(v)
        self.write()

    def write(self) -> None:
        if self.path and os.path.isdir(os.path.dirname(self.path)):
            try:
                write_atomic(self.path, generate_latest(self.registry), prefix=f".{os.path.basename(self.path)}.tmp-")
            except OSError:
                pass  # metrics are best effort: the journal says what each pull did
