"""The Grafana dashboard and the Alertmanager route shipped beside the rules
(/usr/share/doc/ds-ops/examples/): every expression of the dashboard is PromQL that promtool
accepts and reads only series ds-ops writes; the route passes ``amtool check-config`` and sends
each shipped alert to the receiver its severity says. promtool and amtool are Debian's prometheus
and prometheus-alertmanager packages (.ci/run installs both: there a missing one fails)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest
import yaml

from conftest import REPO
from opt_ds_ops.observe.metrics import METRIC_NAMES
from opt_ds_ops.sources.metrics import PULL_METRIC_NAMES

EXAMPLES = REPO / "docs" / "examples"
DASHBOARD = EXAMPLES / "grafana-dashboard.json"
ROUTES = EXAMPLES / "alertmanager.yml"
RULES = EXAMPLES / "ds-ops.rules.yml"
RECEIVER = {"critical": "ops-pager", "warning": "ops-mail", "info": "null"}


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        if os.environ.get("DS_OPS_CI"):
            pytest.fail(f"{name} is not installed (Debian: prometheus, prometheus-alertmanager)")
        pytest.skip(f"{name} is not installed here")
    return path


def expressions() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p["targets"]]
    exprs += [re.match(r"label_values\((.+), \w+\)$", v["definition"])[1] for v in doc["templating"]["list"] if v["type"] == "query"]
    # Grafana's variables as a multi-value "All" puts them: a regex
    return [e.replace("$instance", ".*").replace("$model", ".*") for e in exprs]


def test_every_dashboard_expression_is_promql_promtool_accepts(tmp_path):
    promtool = tool("promtool")
    exprs = expressions()
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"dashboard:panel_{i}", "expr": e}
                                                         for i, e in enumerate(exprs)]}]}
    path = tmp_path / "dashboard.rules.yml"
    path.write_text(yaml.safe_dump(rules))
    r = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and f"SUCCESS: {len(exprs)} rules found" in r.stdout, r.stdout + r.stderr
    bad = path.with_name("bad.rules.yml")
    bad.write_text(yaml.safe_dump({"groups": [{"name": "x", "rules": [{"record": "x:y", "expr": "sum by (model (x)"}]}]}))
    assert subprocess.run([promtool, "check", "rules", str(bad)], capture_output=True, timeout=60).returncode != 0


def test_the_dashboard_reads_only_series_ds_ops_writes_and_shows_each_role():
    used = set(re.findall(r"\bds_ops_[a-z_]+", " ".join(expressions())))
    known = set(METRIC_NAMES) | set(PULL_METRIC_NAMES)
    assert used <= known, used - known
    for needed in ("ds_ops_score_last", "ds_ops_score_threshold", "ds_ops_incident_top_metric_share",
                   "ds_ops_jobs_finished_total", "ds_ops_last_failure_timestamp_seconds", "ds_ops_model_age_seconds"):
        assert needed in used, needed


def test_the_alertmanager_route_passes_amtool_and_sends_each_alert_by_its_severity():
    amtool = tool("amtool")
    r = subprocess.run([amtool, "check-config", str(ROUTES)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr
    rules = [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]
    assert len(rules) == 19
    for rule in rules:
        severity = rule["labels"]["severity"]
        r = subprocess.run([amtool, "config", "routes", "test", f"--config.file={ROUTES}", f"alertname={rule['alert']}",
                            f"severity={severity}", "instance=h:9100", "model=m"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and r.stdout.split() == [RECEIVER[severity]], (rule["alert"], r.stdout, r.stderr)
