"""The shipped Prometheus alerting rules (docs/examples/ds-ops.rules.yml, installed to
/usr/share/doc/ds-ops/examples/): ``promtool check rules`` accepts them and ``promtool test rules``
shows each alert firing, and not firing, on series named as the daemon writes them.

promtool is Debian's ``prometheus`` package; CI installs it (.ci/run sets DS_OPS_CI=1: there a
missing promtool fails these tests instead of skipping them).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from opt_ds_ops.observe.metrics import METRIC_NAMES
from opt_ds_ops.sources.metrics import PULL_METRIC_NAMES

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "docs" / "examples" / "ds-ops.rules.yml"


@pytest.fixture
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        if os.environ.get("DS_OPS_CI"):
            pytest.fail("promtool is not installed (Debian package prometheus: scripts/install-build-deps.sh prometheus)")
        pytest.skip("promtool is not installed here (apt-get install prometheus); CI runs this test")
    return path


def test_promtool_accepts_the_shipped_rules(promtool):
    r = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 19 rules found" in r.stdout


def test_the_rules_use_only_series_the_daemon_writes():
    exprs = " ".join(rule["expr"] for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"])
    used = set(re.findall(r"\bds_ops_[a-z_]+", exprs))
    assert used and used <= set(METRIC_NAMES) | set(PULL_METRIC_NAMES), used - set(METRIC_NAMES) - set(PULL_METRIC_NAMES)


UNIT_TEST = """
rule_files: [{rules}]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      # model m: an incident open from minute 3 to minute 12, critical from minute 6 to 11; model quiet: none
      - series: 'ds_ops_incident_open{{model="m", instance="h:9100", job="node"}}'
        values: '0 0 0 1x9 0x10'
      - series: 'ds_ops_incident_critical{{model="m", instance="h:9100", job="node"}}'
        values: '0 0 0 0 0 0 1x5 0x10'
      - series: 'ds_ops_incident_open{{model="quiet", instance="h:9100", job="node"}}'
        values: '0x20'
      - series: 'ds_ops_incident_critical{{model="quiet", instance="h:9100", job="node"}}'
        values: '0x20'
      - series: 'ds_ops_score_last{{model="m", instance="h:9100", job="node"}}'
        values: '0.1x20'
    alert_rule_test:
      - {{eval_time: 2m, alertname: DsOpsIncident, exp_alerts: []}}
      - eval_time: 3m
        alertname: DsOpsIncident
        exp_alerts:
          - exp_labels: {{severity: warning, model: m, instance: "h:9100", job: node}}
            exp_annotations:
              summary: "Incident in m on h:9100"
              description: >-
                ds-ops model m has an open incident: its telemetry is over the anomaly threshold
                (last score 0.1). The top metrics are in ds_ops_incident_top_metric_share{{model="m"}},
                in `journalctl -u ds-trainer -p warning` and in `ds-ops status`.
      - {{eval_time: 14m, alertname: DsOpsIncident, exp_alerts: []}}
      - {{eval_time: 5m, alertname: DsOpsIncidentCritical, exp_alerts: []}}
      - eval_time: 6m
        alertname: DsOpsIncidentCritical
        exp_alerts:
          - exp_labels: {{severity: critical, model: m, instance: "h:9100", job: node}}
            exp_annotations:
              summary: "Critical incident in m on h:9100"
              description: >-
                ds-ops model m has an open incident whose peak score reached scoring.incident_critical_ratio
                (2 as shipped) times its threshold. The top metrics are in
                ds_ops_incident_top_metric_share{{model="m"}} and `ds-ops status`.
      - {{eval_time: 12m, alertname: DsOpsIncidentCritical, exp_alerts: []}}
  - interval: 1m
    input_series:
      # one incident counted at minute 5 (it opened and closed inside one scored file)
      - series: 'ds_ops_incidents_total{{model="m", instance="h:9100", job="node"}}'
        values: '2x4 3x40'
    alert_rule_test:
      - {{eval_time: 4m, alertname: DsOpsIncidentSeen, exp_alerts: []}}
      - eval_time: 10m
        alertname: DsOpsIncidentSeen
        exp_alerts:
          - exp_labels: {{severity: info, model: m, instance: "h:9100", job: node}}
            exp_annotations:
              summary: "Incident(s) in m on h:9100 in the last 15 minutes"
              description: >-
                ds-ops model m opened about 1 incident(s) in the last 15 minutes;
                `journalctl -u ds-trainer -p warning` has their start, end and top metrics.
      - {{eval_time: 30m, alertname: DsOpsIncidentSeen, exp_alerts: []}}
  - interval: 1m
    input_series:
      # a critical incident counted at minute 5 (opened, escalated and closed inside one scored file)
      - series: 'ds_ops_critical_incidents_total{{model="m", instance="h:9100", job="node"}}'
        values: '0x4 1x40'
    alert_rule_test:
      - {{eval_time: 4m, alertname: DsOpsCriticalIncidentSeen, exp_alerts: []}}
      - eval_time: 10m
        alertname: DsOpsCriticalIncidentSeen
        exp_alerts:
          - exp_labels: {{severity: critical, model: m, instance: "h:9100", job: node}}
            exp_annotations:
              summary: "Critical incident(s) in m on h:9100 in the last 15 minutes"
              description: >-
                ds-ops model m had about 1 critical incident(s) in the last 15 minutes;
                `journalctl -u ds-trainer -p crit` has each one.
      - {{eval_time: 30m, alertname: DsOpsCriticalIncidentSeen, exp_alerts: []}}
  - interval: 1m
    input_series:
      # model m scored at minute 0 (Unix time 0 in promtool's clock) and never again; model new
      # has never scored a row: it cannot stall
      - series: 'ds_ops_last_scored_timestamp_seconds{{model="m", instance="h:9100", job="node"}}'
        values: '0x60'
      - series: 'ds_ops_scored_rows_total{{model="m", instance="h:9100", job="node"}}'
        values: '1000x60'
      - series: 'ds_ops_scored_rows_total{{model="new", instance="h:9100", job="node"}}'
        values: '0x60'
    alert_rule_test:
      - {{eval_time: 30m, alertname: DsOpsScoringStalled, exp_alerts: []}}
      - eval_time: 40m
        alertname: DsOpsScoringStalled
        exp_alerts:
          - exp_labels: {{severity: warning, model: m, instance: "h:9100", job: node}}
            exp_annotations:
              summary: "ds-ops stopped scoring m on h:9100"
              description: >-
                No telemetry of model m has been scored for 40m 0s. Check what drops files into
                /var/spool/ds-ops/score/, `ds-ops status` (the score/ queue, latest failed) and
                `journalctl -u ds-trainer -p warning`.
"""


SERVICE_TEST = """
rule_files: [{rules}]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      # rewritten every minute until minute 10 (Unix time 600), then never again; another host's file
      # keeps being rewritten
      - series: 'node_textfile_mtime_seconds{{file="/var/lib/prometheus/node-exporter/ds_ops.prom", instance="h:9100", job="node"}}'
        values: '0+60x10 600x30'
      - series: 'node_textfile_mtime_seconds{{file="ds_ops.prom", instance="g:9100", job="node"}}'
        values: '0+60x40'
      - series: 'node_textfile_mtime_seconds{{file="/var/lib/prometheus/node-exporter/other.prom", instance="h:9100", job="node"}}'
        values: '0x40'
    alert_rule_test:
      - {{eval_time: 24m, alertname: DsOpsMetricsStale, exp_alerts: []}}
      - eval_time: 27m
        alertname: DsOpsMetricsStale
        exp_alerts:
          - exp_labels: {{severity: critical, file: /var/lib/prometheus/node-exporter/ds_ops.prom, instance: "h:9100", job: node}}
            exp_annotations:
              summary: "ds-ops on h:9100 stopped writing its metrics"
              description: >-
                ds_ops.prom on h:9100 is 17m 0s old; the daemon
                rewrites it every minute. Check `systemctl status ds-trainer` and
                `journalctl -u ds-trainer -p warning`: until it writes again no other ds-ops alert can fire.
  - interval: 1m
    input_series:
      # the metrics file exists until minute 10, then never again (a purge, a lost ACL)
      - series: 'node_textfile_mtime_seconds{{file="ds_ops.prom", instance="h:9100", job="node"}}'
        values: '0+60x9'
      - series: 'node_textfile_mtime_seconds{{file="other.prom", instance="h:9100", job="node"}}'
        values: '0x60'
    alert_rule_test:
      - {{eval_time: 20m, alertname: DsOpsMetricsMissing, exp_alerts: []}}
      - eval_time: 32m
        alertname: DsOpsMetricsMissing
        exp_alerts:
          - exp_labels: {{severity: warning}}
            exp_annotations:
              summary: "No ds-ops metrics file is exported by any node_exporter"
              description: >-
                node_exporter exports no ds_ops.prom. Give the user ds-ops write access to the textfile
                directory (`sudo setfacl -m u:ds-ops:rwx /var/lib/prometheus/node-exporter`; again after a
                purge and reinstall), restart ds-trainer, and look for "Prometheus metrics not written" in
                `journalctl -u ds-trainer -p warning`.
  - interval: 1m
    input_series:
      # started at minute 0, 5, 10 and 15: three restarts
      - series: 'ds_ops_daemon_start_time_seconds{{instance="h:9100", job="node"}}'
        values: '0x4 300x4 600x4 900x30'
    alert_rule_test:
      - {{eval_time: 12m, alertname: DsOpsDaemonRestarting, exp_alerts: []}}
      - eval_time: 16m
        alertname: DsOpsDaemonRestarting
        exp_alerts:
          - exp_labels: {{severity: warning, instance: "h:9100", job: node}}
            exp_annotations:
              summary: "ds-trainer on h:9100 restarted 3 times in an hour"
              description: >-
                The daemon started 3 times in the last hour. `journalctl -u ds-trainer
                -p err` says why it stopped (a crash, the watchdog, the memory limit).
  - interval: 1m
    input_series:
      - series: 'ds_ops_intake_paused{{instance="h:9100", job="node"}}'
        values: '0x4 1x30'
      - series: 'ds_ops_intake_paused{{instance="g:9100", job="node"}}'
        values: '0x4 1x5 0x30'
    alert_rule_test:
      - {{eval_time: 14m, alertname: DsOpsIntakePaused, exp_alerts: []}}
      - eval_time: 16m
        alertname: DsOpsIntakePaused
        exp_alerts:
          - exp_labels: {{severity: critical, instance: "h:9100", job: node}}
            exp_annotations:
              summary: "ds-ops on h:9100 takes no new files"
              description: >-
                Intake has been paused for 10 minutes after a file system error: no dataset or chunk
                is taken. `journalctl -u ds-trainer -p err` names the error; `ds-ops status` shows the queue.
  - interval: 1m
    input_series:
      # h: 6 failures at minutes 5..10 after 60 quiet minutes; g: 1 failure; a restart of h's daemon at
      # minute 30 sets its counter back to 0 (increase() counts across it)
      - series: 'ds_ops_jobs_finished_total{{result="failed", instance="h:9100", job="node"}}'
        values: '0x64 1+1x5 6x20 0x30'
      - series: 'ds_ops_jobs_finished_total{{result="failed", instance="g:9100", job="node"}}'
        values: '0x64 1x80'
      - series: 'ds_ops_jobs_finished_total{{result="done", instance="g:9100", job="node"}}'
        values: '0+10x150'
    alert_rule_test:
      - {{eval_time: 60m, alertname: DsOpsJobsFailing, exp_alerts: []}}
      - eval_time: 75m
        alertname: DsOpsJobsFailing
        exp_alerts:
          - exp_labels: {{severity: warning, result: failed, instance: "h:9100", job: node}}
            exp_annotations:
              summary: "ds-ops on h:9100: 6 jobs failed in an hour"
              description: >-
                About 6 datasets or chunks were moved to failed/ in the last hour.
                `ds-ops status` lists the latest with their reasons (failed/NAME.error.json).
      - {{eval_time: 140m, alertname: DsOpsJobsFailing, exp_alerts: []}}
  - interval: 1m
    input_series:
      # m: a change of regime said at minute 120, re-baselined and never learned; learned: said at
      # minute 120, learned by a version promoted at hour 30
      - series: 'ds_ops_regime_changes_total{{model="m", instance="h:9100", job="node"}}'
        values: '0x119 1x4600'
      - series: 'ds_ops_regime_unlearned{{model="m", instance="h:9100", job="node"}}'
        values: '0x119 1x4600'
      - series: 'ds_ops_regime_changes_total{{model="learned", instance="h:9100", job="node"}}'
        values: '0x119 1x4600'
      - series: 'ds_ops_regime_unlearned{{model="learned", instance="h:9100", job="node"}}'
        values: '0x119 1x1680 0x2920'
    alert_rule_test:
      - {{eval_time: 119m, alertname: DsOpsRegimeChanged, exp_alerts: []}}
      - eval_time: 125m
        alertname: DsOpsRegimeChanged
        exp_alerts:
          - exp_labels: {{severity: info, model: m, instance: "h:9100", job: node}}
            exp_annotations:
              summary: "Model m on h:9100 met a change of regime"
              description: >-
                Some metrics of m moved to a new level and stayed there. The journal's
                "change of regime" entry names them with their old and new levels (`journalctl -u ds-trainer
                -g "change of regime"`); the model is scored against the new levels and retrained on them
                after retrain.regime_learn_s. If the change was not wanted, that is what to look after.
          - exp_labels: {{severity: info, model: learned, instance: "h:9100", job: node}}
            exp_annotations:
              summary: "Model learned on h:9100 met a change of regime"
              description: >-
                Some metrics of learned moved to a new level and stayed there. The journal's
                "change of regime" entry names them with their old and new levels (`journalctl -u ds-trainer
                -g "change of regime"`); the model is scored against the new levels and retrained on them
                after retrain.regime_learn_s. If the change was not wanted, that is what to look after.
      - {{eval_time: 4h, alertname: DsOpsRegimeChanged, exp_alerts: []}}
      - {{eval_time: 73h, alertname: DsOpsRegimeNotLearned, exp_alerts: []}}
      - eval_time: 75h
        alertname: DsOpsRegimeNotLearned
        exp_alerts:
          - exp_labels: {{severity: warning, model: m, instance: "h:9100", job: node}}
            exp_annotations:
              summary: "Model m on h:9100 has not learned a change of regime"
              description: >-
                m has been scored against re-baselined levels for 3 days: no version that
                knows the new regime was promoted. `ds-ops status` says whether its retrainings fail (a
                back-off); `ds-ops models list m` whether the gate refused one.
  - interval: 1m
    input_series:
      # m: scored every minute at 20 times its design rate; ok: at once; gone: as drifted, but its
      # last file was scored at minute 0 (an exporter retired: the gauge keeps its last value)
      - series: 'ds_ops_model_drift_ratio{{model="m", instance="h:9100", job="node"}}'
        values: '20x500'
      - series: 'ds_ops_last_scored_timestamp_seconds{{model="m", instance="h:9100", job="node"}}'
        values: '0+60x500'
      - series: 'ds_ops_model_drift_ratio{{model="ok", instance="h:9100", job="node"}}'
        values: '1x500'
      - series: 'ds_ops_last_scored_timestamp_seconds{{model="ok", instance="h:9100", job="node"}}'
        values: '0+60x500'
      - series: 'ds_ops_model_drift_ratio{{model="gone", instance="h:9100", job="node"}}'
        values: '20x500'
      - series: 'ds_ops_last_scored_timestamp_seconds{{model="gone", instance="h:9100", job="node"}}'
        values: '0x500'
    alert_rule_test:
      - {{eval_time: 5h, alertname: DsOpsDriftNotLearned, exp_alerts: []}}
      - eval_time: 7h
        alertname: DsOpsDriftNotLearned
        exp_alerts:
          - exp_labels: {{severity: warning, model: m, instance: "h:9100", job: node}}
            exp_annotations:
              summary: "Model m on h:9100 drifted and has not adapted"
              description: >-
                ds-ops model m has flagged 20 times its design rate of
                rows for 6 hours. See `ds-ops status` (retraining, back-off) and `ds-ops models list m`
                (versions the gate refused); docs/retraining.md.
  - interval: 1m
    input_series:
      # h: retrain.every 1 day; m is 2.1 days old and scored every minute; idle is as old but last
      # scored at minute 0; g: retrain.every off, its model as old
      - series: 'ds_ops_retrain_every_seconds{{instance="h:9100", job="node"}}'
        values: '86400x200'
      - series: 'ds_ops_retrain_every_seconds{{instance="g:9100", job="node"}}'
        values: '0x200'
      - series: 'ds_ops_model_age_seconds{{model="m", instance="h:9100", job="node"}}'
        values: '181440+60x200'
      - series: 'ds_ops_last_scored_timestamp_seconds{{model="m", instance="h:9100", job="node"}}'
        values: '0+60x200'
      - series: 'ds_ops_model_age_seconds{{model="idle", instance="h:9100", job="node"}}'
        values: '181440+60x200'
      - series: 'ds_ops_last_scored_timestamp_seconds{{model="idle", instance="h:9100", job="node"}}'
        values: '0x200'
      - series: 'ds_ops_model_age_seconds{{model="m", instance="g:9100", job="node"}}'
        values: '181440+60x200'
      - series: 'ds_ops_last_scored_timestamp_seconds{{model="m", instance="g:9100", job="node"}}'
        values: '0+60x200'
    alert_rule_test:
      - {{eval_time: 50m, alertname: DsOpsModelNotRetrained, exp_alerts: []}}
      - eval_time: 70m
        alertname: DsOpsModelNotRetrained
        exp_alerts:
          - exp_labels: {{severity: warning, model: m, instance: "h:9100", job: node}}
            exp_annotations:
              summary: "Model m on h:9100 is past its retraining period"
              description: >-
                The current version of m is 2d 3h 34m 0s old, over twice
                retrain.every, while it is still scored. `ds-ops status` says whether its retrainings fail
                (a back-off); `ds-ops models list m` whether the gate refused them (check
                one, then `sudo ds-ops models promote m VERSION`) or you pinned or rolled
                it back (then new versions are held by design: unpin, or silence this alert).
  - interval: 1m
    input_series:
      - series: 'ds_ops_gpu_health{{gpu="0", uuid="GPU-1", verdict="fail", instance="h:9100", job="node"}}'
        values: '0x3 1x20'
      - series: 'ds_ops_gpu_health{{gpu="1", uuid="GPU-2", verdict="fail", instance="h:9100", job="node"}}'
        values: '0x30'
    alert_rule_test:
      - {{eval_time: 7m, alertname: DsOpsGpuUnhealthy, exp_alerts: []}}
      - eval_time: 9m
        alertname: DsOpsGpuUnhealthy
        exp_alerts:
          - exp_labels: {{severity: critical, gpu: "0", uuid: GPU-1, verdict: fail, instance: "h:9100", job: node}}
            exp_annotations:
              summary: "GPU 0 on h:9100 failed ds-ops' health check"
              description: >-
                ds-ops judged GPU 0 (GPU-1) unhealthy and starts no training on it.
                `journalctl -u ds-trainer -p warning` has the health line; compare with `nvidia-smi -q`.
"""


def test_each_service_alert_fires_when_it_should_and_not_before(promtool, tmp_path):
    """Each rule of the ds-ops-service group: silent before its condition has held its ``for:``, firing
    after, and never for the neighbour series that do not meet it."""
    test = tmp_path / "ds-ops-service.rules.test.yml"
    test.write_text(SERVICE_TEST.format(rules=RULES))
    r = subprocess.run([promtool, "test", "rules", str(test)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_each_alert_fires_when_it_should_and_not_before(promtool, tmp_path):
    test = tmp_path / "ds-ops.rules.test.yml"
    test.write_text(UNIT_TEST.format(rules=RULES))
    r = subprocess.run([promtool, "test", "rules", str(test)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


PULL_TEST = """
rule_files: [{rules}]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      # source node: pulls fail from minute 5 (up 0, the last success stays at minute 4); source db pulls on
      - series: 'ds_ops_pull_up{{source="node", instance="h:9100", job="node"}}'
        values: '1x4 0x60'
      - series: 'ds_ops_pull_last_success_time_seconds{{source="node", instance="h:9100", job="node"}}'
        values: '0+60x4 240x60'
      - series: 'ds_ops_pull_up{{source="db", instance="h:9100", job="node"}}'
        values: '1x64'
      - series: 'ds_ops_pull_last_success_time_seconds{{source="db", instance="h:9100", job="node"}}'
        values: '0+60x64'
      - series: 'ds_ops_pull_hosts{{source="node", state="gone", instance="h:9100", job="node"}}'
        values: '0x4 2x70'
      - series: 'ds_ops_pull_hosts{{source="db", state="gone", instance="h:9100", job="node"}}'
        values: '0x74'
      # source node: one host blocked from minute 10 (a member took its model name)
      - series: 'ds_ops_pull_hosts{{source="node", state="blocked", instance="h:9100", job="node"}}'
        values: '0x9 1x70'
      - series: 'ds_ops_pull_hosts{{source="db", state="failed", instance="h:9100", job="node"}}'
        values: '0x79'
    alert_rule_test:
      - {{eval_time: 39m, alertname: DsOpsPullHostsNotModelled, exp_alerts: []}}
      - eval_time: 41m
        alertname: DsOpsPullHostsNotModelled
        exp_alerts:
          - exp_labels: {{severity: warning, source: node, state: blocked, instance: "h:9100", job: node}}
            exp_annotations:
              summary: "1 host(s) of source node not modelled (blocked)"
              description: >-
                1 host(s) of source node have been blocked for
                30 minutes: none of their rows is scored. `journalctl -u ds-pull@node -g
                'is not modelled|refused its training file'` names each host and why (the uid that owns its
                model name, or the daemon's reason).
      - {{eval_time: 19m, alertname: DsOpsPullFailing, exp_alerts: []}}
      - eval_time: 21m
        alertname: DsOpsPullFailing
        exp_alerts:
          - exp_labels: {{severity: warning, source: node, instance: "h:9100", job: node}}
            exp_annotations:
              summary: "ds-ops on h:9100 cannot pull source node from Prometheus"
              description: >-
                Every pull of source node has failed for 15 minutes: its hosts are not scored.
                `journalctl -u ds-pull@node` says why (not reachable, an HTTP error, an
                answer over max_response_bytes).
      - {{eval_time: 38m, alertname: DsOpsPullStale, exp_alerts: []}}
      - eval_time: 41m
        alertname: DsOpsPullStale
        exp_alerts:
          - exp_labels: {{severity: warning, source: node, instance: "h:9100", job: node}}
            exp_annotations:
              summary: "ds-ops on h:9100: source node not pulled for 37m 0s"
              description: >-
                The last successful pull of source node was 37m 0s ago.
                `systemctl status ds-pull@node` says whether the puller runs; rows older than
                the source's catch_up are not scored when it comes back.
      - {{eval_time: 64m, alertname: DsOpsPullHostsGone, exp_alerts: []}}
      - eval_time: 66m
        alertname: DsOpsPullHostsGone
        exp_alerts:
          - exp_labels: {{severity: info, source: node, state: gone, instance: "h:9100", job: node}}
            exp_annotations:
              summary: "2 host(s) of source node gone from Prometheus"
              description: >-
                2 trained host(s) of source node have had no rows in
                Prometheus for an hour. `journalctl -u ds-pull@node -g 'not in Prometheus'` names
                them and their last row; remove a model no longer wanted with `ds-ops models rm NAME`.
"""


def test_each_pull_alert_fires_when_it_should_and_not_before(promtool, tmp_path):
    test = tmp_path / "ds-ops-pull.rules.test.yml"
    test.write_text(PULL_TEST.format(rules=RULES))
    r = subprocess.run([promtool, "test", "rules", str(test)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
