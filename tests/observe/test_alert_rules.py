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
    assert "SUCCESS: 3 rules found" in r.stdout


def test_the_rules_use_only_series_the_daemon_writes():
    exprs = " ".join(rule["expr"] for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"])
    used = set(re.findall(r"\bds_ops_[a-z_]+", exprs))
    assert used and used <= set(METRIC_NAMES), used - set(METRIC_NAMES)


UNIT_TEST = """
rule_files: [{rules}]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      # model m: anomalous from minute 3 to minute 12; model quiet: never
      - series: 'ds_ops_anomaly_active{{model="m", instance="h:9100", job="node"}}'
        values: '0 0 0 1x9 0x10'
      - series: 'ds_ops_anomaly_active{{model="quiet", instance="h:9100", job="node"}}'
        values: '0x20'
      - series: 'ds_ops_score_last{{model="m", instance="h:9100", job="node"}}'
        values: '0.1x20'
    alert_rule_test:
      - {{eval_time: 7m, alertname: DsOpsAnomalyActive, exp_alerts: []}}
      - eval_time: 9m
        alertname: DsOpsAnomalyActive
        exp_alerts:
          - exp_labels: {{severity: warning, model: m, instance: "h:9100", job: node}}
            exp_annotations:
              summary: "Anomaly in m on h:9100"
              description: >-
                ds-ops model m has flagged its telemetry as anomalous for 5 minutes (last score 0.1).
                The top metrics are in ds_ops_anomaly_top_metric_share{{model="m"}}, in
                `journalctl -u ds-trainer -p warning` and in `ds-ops status`.
      - {{eval_time: 14m, alertname: DsOpsAnomalyActive, exp_alerts: []}}
  - interval: 1m
    input_series:
      # one segment counted at minute 5 (it began and ended inside one scored file)
      - series: 'ds_ops_anomaly_segments_total{{model="m", instance="h:9100", job="node"}}'
        values: '2x4 3x40'
    alert_rule_test:
      - {{eval_time: 4m, alertname: DsOpsAnomalySeen, exp_alerts: []}}
      - eval_time: 10m
        alertname: DsOpsAnomalySeen
        exp_alerts:
          - exp_labels: {{severity: info, model: m, instance: "h:9100", job: node}}
            exp_annotations:
              summary: "Anomaly segment(s) in m on h:9100 in the last 15 minutes"
              description: >-
                ds-ops model m flagged about 1 anomaly segment(s) in the last 15 minutes;
                `journalctl -u ds-trainer -p warning` has their start, end and top metrics.
      - {{eval_time: 30m, alertname: DsOpsAnomalySeen, exp_alerts: []}}
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


def test_each_alert_fires_when_it_should_and_not_before(promtool, tmp_path):
    test = tmp_path / "ds-ops.rules.test.yml"
    test.write_text(UNIT_TEST.format(rules=RULES))
    r = subprocess.run([promtool, "test", "rules", str(test)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
