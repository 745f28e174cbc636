"""End-to-end: ds-ops's incident alerts through Debian 12's own Prometheus (``make e2e``).

A container of its own (test_deb_e2e.py's upgrades and purge stay out of the way): ds-ops from
DS_OPS_DEB, then Debian's prometheus-node-exporter and prometheus from the .debs that rootfs.sh
keeps in the root file system (the container has no network), wired as docs/INSTALL.md says.
Prometheus scrapes the node exporter on localhost:9100 and evaluates the rules ds-ops ships every
SCRAPE_S seconds. A member of group ds-ops drops SMD machine-1-2's training file into incoming/,
then a labelled stretch of its test period, in chunks, into score/. Checked through Prometheus's
HTTP API on localhost: the ds_ops series come through the node exporter, the shipped incident
alert (DsOpsIncident; DsOpsIncidentCritical too when the incident is critical) fires while the
incident is open and resolves once it closes; and ``journalctl -u ds-trainer -p warning`` holds
one incident-opened and one incident-closed entry per incident (and an incident-escalated one per
warning that became critical), with their catalog text (``-x``).

Keeping it honest: the shipped rules file passes ``promtool check rules`` as it is. Its ``for:``
durations (minutes) are too long to wait for, so Prometheus loads a copy in which only the rules'
``for:`` (and a group's ``interval:``, if set) are cut to FOR_S; every expression, label and
annotation is the shipped one. Where the chunks end is planned from ``ds-ops score`` of the
whole stretch (the chunked series scores as the whole file does): the incidents expected are
those :func:`opt_ds_ops.scoring.incidents.track` makes of its flagged rows with the incident rule
of the installed conffile (``scoring.incident_*`` as shipped: flagged runs less than
``incident_quiet_s``, 30 minutes, apart are one incident, which closes only after that long
without a flagged row) and the model's sample period (the SMD files have no time column: rows
``train.sample_period_s`` apart). Every chunk but one ends after a whole quiet spell of rows
clearly under the threshold (no incident can be open there), that one on a row clearly over it
inside the labelled incident, so the alert can only fire there, and does only if the daemon
carries the incident across files.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlencode

import numpy as np
import pytest
import yaml

from nspawn import Container, ContainerError, cached_rootfs
from opt_ds_ops.config.conffile import DEFAULT_CONFIG_PATH, load_config
from opt_ds_ops.observe.journal import MESSAGE_IDS
from opt_ds_ops.scoring.incidents import IncidentPolicy, Tracker, track
from test_deb_e2e import catalog_entry

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
UNIT = "ds-trainer.service"
SPOOL = "/var/spool/ds-ops"
MODELS = "/var/models"
MODEL = "machine-1-2"                    # bundled real SMD data, bound read-only at /srv/smd
USER = "alice"                           # a member of group ds-ops, not root
HOME = f"/home/{USER}"
TOOLS_DIR = "/var/local/ds-ops-e2e-tools"   # rootfs.sh: the test tools' .debs, not installed
TEXTFILE_DIR = "/var/lib/prometheus/node-exporter"
SHIPPED_RULES = "/usr/share/doc/ds-ops/examples/ds-ops.rules.yml"
TEST_RULES = "/etc/prometheus/ds-ops-e2e.rules.yml"
PROM_CONFIG = "/etc/prometheus/ds-ops-e2e.yml"
PROM_DROP_IN = "/etc/systemd/system/prometheus.service.d/ds-ops-e2e.conf"
PROM = "http://localhost:9090"
SCRAPE_S = 2                             # Prometheus's scrape and evaluation interval here
FOR_S = 4                                # the test copy's for: (the shipped file's are minutes)
TRAIN_TIMEOUT_S = 300
SCORED_TIMEOUT_S = 60                    # a chunk dropped -> its rows counted in Prometheus
ALERT_TIMEOUT_S = 60                     # the incident open in Prometheus -> its alert firing / gone
PRE_ROWS, POST_ROWS = 500, 300           # rows of the test period around the incident
CALM, HOT = 0.8, 1.2                     # a chunk ends after a quiet spell under CALM x threshold, or over HOT x
CRITICAL_MARGIN = 1e-3                   # a peak this close (relative) to critical_ratio x threshold: not asserted

PROM_CONFIG_TEXT = f"""\
# ds-ops e2e: Prometheus scrapes the node exporter and evaluates ds-ops's rules every {SCRAPE_S} s
global:
  scrape_interval: {SCRAPE_S}s
  evaluation_interval: {SCRAPE_S}s
scrape_configs:
  - job_name: node
    static_configs:
      - targets: ["localhost:9100"]
"""
PROM_RULE_FILES = f"rule_files:\n  - {TEST_RULES}\n"
PROM_DROP_IN_TEXT = f"[Service]\nExecStart=\nExecStart=/usr/bin/prometheus --config.file={PROM_CONFIG}\n"
GET = "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())"


@pytest.fixture(scope="module")
def deb() -> Path:
    """The .deb under test (make e2e passes the one make deb built)."""
    if os.geteuid() != 0:
        pytest.fail("the end-to-end test boots a container: run it as root")
    path = Path(os.environ.get("DS_OPS_DEB", "")).resolve()
    if not path.is_file():
        pytest.fail(f"DS_OPS_DEB={os.environ.get('DS_OPS_DEB')!r} is not a built .deb (make deb)")
    return path


@pytest.fixture(scope="module")
def box(deb, pytestconfig):
    """A booted Debian 12 container with the .deb's directory at /srv/debs and SMD at /srv/smd;
    prints the module's wall time at the end (make e2e's output)."""
    started = time.monotonic()
    c = Container(cached_rootfs(deb), {deb.parent: "/srv/debs", REPO / "data/smd": "/srv/smd"},
                  log_dir=REPO / "build/e2e-alerts")
    print(f"container {c.name}: extracted in {c.timings['extract_s']:.1f} s, booted in {c.timings['boot_s']:.1f} s")
    yield c
    c.save_journal()
    c.stop()
    with pytestconfig.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():  # as capsys.disabled()
        print(f"\ntest_alerts_e2e.py: {time.monotonic() - started:.0f} s wall time in all ("
              + ", ".join(f"{k[:-2]} {v:.1f} s" for k, v in c.timings.items()) + ")")


@pytest.fixture(autouse=True)
def diagnostics_on_failure(request, box):
    """After a failed test, print the journals and what Prometheus says (tests/conftest.py keeps the reports)."""
    yield
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        print(diagnostics(box))


def diagnostics(box: Container) -> str:
    """Return the units' journals, ds_ops.prom and Prometheus's targets, rules and alerts."""
    parts = []
    for title, argv in (
            ("journalctl -u ds-trainer", f"journalctl -u {UNIT} -n 80 --no-pager -o short-precise"),
            ("journalctl -u prometheus -u prometheus-node-exporter",
             "journalctl -u prometheus -u prometheus-node-exporter -n 40 --no-pager -o short-precise"),
            ("ds_ops.prom (score and incident series)",
             f"grep -E 'score|incident|scored|flagged' {TEXTFILE_DIR}/ds_ops.prom"),
            ("score/ and results", f"ls -la {SPOOL}/score {SPOOL}/failed; ls -laR /var/lib/ds-ops/scores | tail -n 30")):
        r = box.run(argv, check=False, timeout=60)
        parts.append(f"---- {title}\n{r.stdout}{r.stderr}")
    for path in ("targets", "rules", "alerts"):
        try:
            parts.append(f"---- Prometheus /api/v1/{path}\n{json.dumps(api(box, path), indent=1)[:6000]}")
        except Exception as e:  # a diagnostic must not hide the test's own failure
            parts.append(f"---- Prometheus /api/v1/{path}: {e}")
    return "\n".join(parts)


def api(box: Container, path: str, **params) -> dict | list:
    """GET Prometheus's HTTP API (/api/v1/PATH?PARAMS) from inside the container; return its data.
    Raise ContainerError if it cannot be reached or answers an error."""
    url = f"{PROM}/api/v1/{path}" + (f"?{urlencode(params)}" if params else "")
    r = box.run(["python3", "-c", GET, url], check=False, timeout=30)
    if r.returncode != 0:
        raise ContainerError(f"GET {url}: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
    doc = json.loads(r.stdout)
    if doc.get("status") != "success":
        raise ContainerError(f"GET {url}: {doc}")
    return doc["data"]


def query(box: Container, expr: str) -> list[dict]:
    """Return the instant vector of a PromQL expression: [{"metric": {...}, "value": [t, "v"]}, ...]."""
    return api(box, "query", query=expr)["result"]


def value(box: Container, expr: str) -> float | None:
    """Return the value of a PromQL expression of one sample, None if it has none."""
    result = query(box, expr)
    assert len(result) <= 1, (expr, result)
    return float(result[0]["value"][1]) if result else None


def wait(what: str, timeout_s: float, probe, interval_s: float = 0.5):
    """Call probe() until it returns a true value; return that. Raise ContainerError after
    timeout_s, with probe's last answer (a ContainerError it raised counts as a no)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            got = probe()
        except ContainerError as e:
            got = e
        if got and not isinstance(got, ContainerError):
            return got
        if time.monotonic() > deadline:
            raise ContainerError(f"timed out after {timeout_s:.0f} s waiting for {what}; last: {got!r}")
        time.sleep(interval_s)


def alerts(box: Container, name: str) -> list[dict]:
    """Return Prometheus's active (pending or firing) alerts named name, of MODEL."""
    return [a for a in api(box, "alerts")["alerts"]
            if a["labels"].get("alertname") == name and a["labels"].get("model") == MODEL]


def shortened(rules: dict) -> dict:
    """Return a copy of a Prometheus rules document with each rule's for: and each group's
    interval: (where set) cut to FOR_S seconds; nothing else changes."""
    copy = json.loads(json.dumps(rules))
    for group in copy["groups"]:
        if "interval" in group:
            group["interval"] = f"{SCRAPE_S}s"
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = f"{FOR_S}s"
    return copy


def shipped_alert(rules: dict, series: str) -> dict:
    """Return the shipped alerting rule whose expression is about the series: the first series it
    names (DsOpsDriftNotLearned also checks ds_ops_last_scored_timestamp_seconds, to skip a model
    no longer fed; DsOpsScoringStalled is the rule on it)."""
    found = [r for g in rules["groups"] for r in g["rules"]
             if "alert" in r and (re.search(r"\bds_ops_[a-z_]+", r["expr"]) or [None])[0] == series]
    assert len(found) == 1, f"{SHIPPED_RULES}: {len(found)} alerting rules on {series}: {found}"
    return found[0]


def test_installs_ds_ops_then_debians_prometheus_and_node_exporter_offline(box, deb):
    assert box.run(["ls", "/sys/class/net"]).stdout.split() == ["lo"], "the container must have no network"
    # localhost resolves, as on an installed Debian (debian-installer writes /etc/hosts; the minimal
    # root file system has none, which test_deb_e2e.py keeps on purpose: docs/operating.md, torchrun)
    box.run("test ! -e /etc/hosts && cat > /etc/hosts", input="127.0.0.1\tlocalhost\n::1\t\tlocalhost ip6-localhost ip6-loopback\n")
    # dpkg without an fsync per file (Dpkg::Options --force-unsafe-io, as image builds do): test_deb_e2e.py
    # checks the install as documented; here it is set-up, and fsyncing the venv's files took ~100 s
    apt = "apt-get install -y -q --no-install-recommends -o Dpkg::Options::=--force-unsafe-io"
    started = time.monotonic()
    box.run(f"cd /srv/debs && {apt} ./{deb.name}", timeout=900)
    took_ds_ops = time.monotonic() - started
    # docs/INSTALL.md, "Prometheus metrics": the node exporter, its textfile directory to ds-ops, a restart
    box.run(f"{apt} {TOOLS_DIR}/*.deb", timeout=600)
    print(f"apt install: ds-ops {took_ds_ops:.1f} s, the tools {time.monotonic() - started - took_ds_ops:.1f} s; "
          + box.run(["dpkg-query", "-W", "-f", "${Package} ${Version}  ", "prometheus", "prometheus-node-exporter"]).stdout)
    box.run(["setfacl", "-m", "u:ds-ops:rwx", TEXTFILE_DIR])
    box.run(["systemctl", "restart", UNIT], timeout=300)
    for unit in (UNIT, "prometheus-node-exporter.service", "prometheus.service"):
        box.wait_for(["systemctl", "is-active", "-q", unit], 60, f"{unit} active")
    box.run(["useradd", "--create-home", USER])
    box.run(["usermod", "-aG", "ds-ops", USER])


def test_prometheus_scrapes_the_node_exporter(box):
    """Our configuration, by a drop-in for Debian's unit (the rules come later)."""
    box.run(f"cat > {PROM_CONFIG}", input=PROM_CONFIG_TEXT)
    box.run(["promtool", "check", "config", PROM_CONFIG])
    box.run(f"mkdir -p {os.path.dirname(PROM_DROP_IN)} && cat > {PROM_DROP_IN} && systemctl daemon-reload",
            input=PROM_DROP_IN_TEXT)
    box.run(["systemctl", "restart", "prometheus.service"], timeout=120)

    def node_up():
        targets = api(box, "targets")["activeTargets"]
        return [t for t in targets if t["labels"].get("job") == "node" and t["health"] == "up"]
    wait("Prometheus to scrape the node exporter", 60, node_up)
    assert [t["scrapeUrl"] for t in api(box, "targets")["activeTargets"]] == ["http://localhost:9100/metrics"]


def test_the_node_exporter_serves_the_ds_ops_series_of_a_training_job(box):
    started = time.monotonic()
    box.run(f"cp /srv/smd/train/{MODEL}.txt.gz {SPOOL}/incoming/{MODEL}.txt.gz.part && "
            f"mv {SPOOL}/incoming/{MODEL}.txt.gz.part {SPOOL}/incoming/{MODEL}.txt.gz", user=USER)
    box.wait_for(f"test -f {MODELS}/{MODEL}/current/metadata.json", TRAIN_TIMEOUT_S, f"model {MODEL}")
    print(f"dataset dropped -> model: {time.monotonic() - started:.1f} s")
    threshold = json.loads(box.run(["cat", f"{MODELS}/{MODEL}/current/metadata.json"], user=USER).stdout)["threshold"]
    got = wait("the model's threshold in Prometheus", 60,
               lambda: query(box, f'ds_ops_model_threshold{{model="{MODEL}"}}'))
    # the daemon's textfile, through the node exporter's textfile collector, as Prometheus stored it
    assert [(s["metric"]["job"], s["metric"]["instance"]) for s in got] == [("node", "localhost:9100")], got
    assert float(got[0]["value"][1]) == threshold, (got, threshold)
    assert value(box, 'node_textfile_scrape_error{job="node"}') == 0
    version = box.run(["ds-ops", "--version"]).stdout.split()[1]
    assert query(box, "ds_ops_build_info")[0]["metric"]["version"] == version
    assert value(box, 'ds_ops_jobs_finished_total{result="done"}') >= 1


def test_prometheus_loads_the_shipped_rules(box):
    box.run(["promtool", "check", "rules", SHIPPED_RULES])            # the shipped file, as it is
    shipped = yaml.safe_load(box.run(["cat", SHIPPED_RULES]).stdout)
    incident = shipped_alert(shipped, "ds_ops_incident_open")
    critical = shipped_alert(shipped, "ds_ops_incident_critical")
    stalled = shipped_alert(shipped, "ds_ops_last_scored_timestamp_seconds")
    print(f"shipped rules: {incident['alert']} for {incident.get('for', '0s')}, {critical['alert']} for "
          f"{critical.get('for', '0s')}, {stalled['alert']} for {stalled.get('for', '0s')}; the test copy's for: "
          f"{FOR_S}s where set")
    box.run(f"cat > {TEST_RULES}", input=yaml.safe_dump(shortened(shipped), sort_keys=False))
    box.run(f"cat > {PROM_CONFIG}", input=PROM_CONFIG_TEXT + PROM_RULE_FILES)
    box.run(["promtool", "check", "config", PROM_CONFIG])               # and the copy, through the config
    box.run(["systemctl", "reload", "prometheus.service"])

    def rules_evaluated():
        rules = {r["name"]: r for g in api(box, "rules")["groups"] for r in g["rules"]}
        names = (incident["alert"], critical["alert"], stalled["alert"])
        return all(rules.get(n, {}).get("health") == "ok" for n in names) and rules
    rules = wait("Prometheus to evaluate the ds-ops rules", 60, rules_evaluated)
    for rule in (incident, critical, stalled):  # the shipped incident rules have no for: (an incident is already
        want = FOR_S if "for" in rule else 0     # persistent); the API says 0 for none
        assert rules[rule["alert"]]["duration"] == want, rules[rule["alert"]]


def read_period(box: Container, first: int, rows: int, name: str) -> None:
    """As USER, write HOME/name.txt and HOME/name.labels: rows of the SMD test period from row first."""
    for sub, ext in (("test", "txt"), ("test_label", "labels")):
        box.run(f"zcat /srv/smd/{sub}/{MODEL}.txt.gz | tail -n +{first + 1} | head -n {rows} > {HOME}/{name}.{ext}",
                user=USER)


def score_whole(box: Container, name: str) -> tuple[dict, list[dict]]:
    """As USER, ``ds-ops score`` HOME/name.txt whole with its labels; return (the JSON summary,
    the per-row CSV rows)."""
    r = box.run(["ds-ops", "score", MODEL, f"{HOME}/{name}.txt", "--labels", f"{HOME}/{name}.labels",
                 "--output", f"{HOME}/{name}.scores.csv", "--json"], user=USER, timeout=300, check=False)
    assert r.returncode in (0, 3), (r.returncode, r.stderr)       # 3: rows were flagged (ds-ops(1))
    rows = list(csv.DictReader(io.StringIO(box.run(["cat", f"{HOME}/{name}.scores.csv"], user=USER).stdout)))
    return json.loads(r.stdout), rows


def labelled(rows: list[dict], seg: dict) -> bool:
    return any(r["label"] == "1" for r in rows[seg["start"]: seg["end"] + 1])


def incident_rule(box: Container) -> tuple[IncidentPolicy, float]:
    """Return the daemon's incident rule: the installed conffile's ``scoring.incident_*`` (as
    shipped), and the model's seconds between rows as the daemon takes them
    (:func:`opt_ds_ops.scoring.series.sample_period_s`, else 60)."""
    from opt_ds_ops.scoring.series import sample_period_s

    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write(box.run(["cat", DEFAULT_CONFIG_PATH]).stdout)
        f.flush()
        policy = IncidentPolicy.from_config(load_config(f.name).scoring)
    md = json.loads(box.run(["cat", f"{MODELS}/{MODEL}/current/metadata.json"]).stdout)
    return policy, sample_period_s(SimpleNamespace(metadata=md)) or 60.0


def incidents(rows: list[dict], threshold: float, policy: IncidentPolicy, period_s: float) -> list[dict]:
    """Return the incidents the daemon makes of ``ds-ops score``'s rows scored as one series, in
    order: ``id`` (1, 2, ...: a fresh series), ``start`` (its first flagged row), ``opened`` (the
    row that opened it), ``end`` (its last flagged row), ``opened_severity``, ``escalated`` (the
    row at which a warning became critical, or None), ``severity`` (at the end) and ``open``
    (still open after the last row). The flags are ds-ops score's own (its
    ``anomaly`` column: score > threshold at full precision); the scores, for the severities, its
    6 significant digits."""
    flags = np.array([r["anomaly"] == "1" for r in rows], dtype=bool)
    scores = np.array([float(r["score"]) for r in rows], dtype=np.float64)
    done = track(flags, scores, threshold, Tracker(), policy, period_s)
    out: dict[int, dict] = {}
    for kind, i, inc in done.changes:  # i: the row (one chunk from row 0)
        if kind == "opened":
            out[inc["id"]] = {"id": inc["id"], "start": inc["start_row"], "opened": inc["opened_row"],
                              "opened_severity": inc["severity"], "escalated": None}
        elif kind == "escalated":
            out[inc["id"]]["escalated"] = i
        elif kind == "closed":
            out[inc["id"]].update(end=inc["last_row"], severity=inc["severity"], open=False)
    if done.tracker.open is not None:
        inc = done.tracker.open
        out[inc["id"]].update(end=inc["last_row"], severity=inc["severity"], open=True)
    return list(out.values())


def plan(box: Container, policy: IncidentPolicy, period_s: float) -> dict:
    """Choose the stretch of the test period and its chunks: return ``chunks`` ([(first, end) rows
    of each chunk]), ``hot`` (the index of the chunk that ends inside the incident), ``incidents``
    (the stretch's, :func:`incidents`), ``flagged`` (its flagged rows) and ``critical`` (whether
    the incident is critical at the end of the hot chunk; None too close to tell). The incident
    is the longest over labelled rows of the whole period."""
    summary, rows = score_whole(box, "test-period")
    incs = [g for g in incidents(rows, summary["threshold"], policy, period_s) if labelled(rows, g)]
    assert incs, f"ds-ops score flags no labelled anomaly of the test period: {summary['segments']}"
    g = max(incs, key=lambda s: s["end"] - s["start"])
    first = max(0, g["start"] - PRE_ROWS)
    read_period(box, first, g["end"] + 1 + POST_ROWS - first, "stretch")
    summary, rows = score_whole(box, "stretch")                  # scored cold from the stretch's first row
    threshold = summary["threshold"]
    score = [float(r["score"]) for r in rows]
    _, _, quiet = policy.rows(period_s)
    calm_row = [s < CALM * threshold for s in score]

    def calm(e: int) -> bool:
        """A chunk that ends before row e ends with no incident open: its last quiet rows clearly unflagged."""
        return e >= quiet and all(calm_row[e - quiet:e])

    g = max((s for s in incidents(rows, threshold, policy, period_s) if labelled(rows, s)),
            key=lambda s: s["end"] - s["start"])
    inside = [i for i in range(g["start"], g["end"]) if score[i] > HOT * threshold]  # not its last flagged row
    assert inside, f"no row of the incident {g} is over {HOT} x the threshold {threshold}"
    m = inside[len(inside) // 2]
    end = max(e for e in range(len(rows) + 1) if calm(e))       # the stretch ends calm: trim after that
    assert end > g["end"] + quiet, (end, g, quiet)

    def cuts(lo: int, hi: int, k: int) -> list[int]:
        """Return the ends of k chunks of rows lo..hi-1: hi, and k-1 calm ends near equal parts."""
        ends = {hi}
        for j in range(1, k):
            ideal = lo + (hi - lo) * j // k
            ends.add(min((e for e in range(lo + 2, hi) if calm(e)), key=lambda c: abs(c - ideal), default=hi))
        return sorted(ends)

    calm_before = [e for e in range(1, g["start"] + 1) if calm(e)]
    assert calm_before, f"no quiet spell of {quiet} rows under {CALM} x the threshold before the incident {g}"
    before = cuts(0, max(calm_before), 2)
    ends = before + [m + 1] + cuts(m + 1, end, 3)
    assert all(calm(e) for e in ends if e != m + 1), (ends, g)
    chunks = list(zip([0] + ends[:-1], ends))
    incs = incidents(rows[:end], threshold, policy, period_s)  # the daemon scores rows 0..end-1 only
    assert not any(i["open"] for i in incs), incs               # the last chunk ends calm
    peak = max(score[g["start"]: m + 1])
    bound = policy.critical_ratio * threshold
    critical = None if abs(peak - bound) <= CRITICAL_MARGIN * bound else peak >= bound
    print(f"stretch: test rows {first}..{first + end - 1}, threshold {threshold:.4f}, incident rule {policy} at "
          f"{period_s:g} s a row (quiet spell {quiet} rows); incident {g} (labelled), chunks {chunks}, chunk "
          f"{len(before)} ends inside it (row {m}, score {score[m]:.4f}, peak so far {peak:.4f}: critical {critical}); "
          f"{len(incs)} incidents in all: {incs}")
    return {"chunks": chunks, "hot": len(before), "incidents": incs, "critical": critical,
            "flagged": sum(r["anomaly"] == "1" for r in rows[:end])}


def test_the_shipped_incident_alert_fires_for_the_incident_and_resolves_after_it(box):
    shipped = yaml.safe_load(box.run(["cat", SHIPPED_RULES]).stdout)
    name = shipped_alert(shipped, "ds_ops_incident_open")["alert"]
    crit = shipped_alert(shipped, "ds_ops_incident_critical")["alert"]
    policy, period_s = incident_rule(box)
    read_period(box, 0, 1 << 30, "test-period")
    p = plan(box, policy, period_s)
    chunks, hot, incs = p["chunks"], p["hot"], p["incidents"]
    started = time.monotonic()
    total = 0
    for k, (lo, hi) in enumerate(chunks):
        box.run(f"sed -n '{lo + 1},{hi}p' {HOME}/stretch.txt > {HOME}/chunk.txt && "
                f"cp {HOME}/chunk.txt {SPOOL}/score/{MODEL}.txt.part && mv {SPOOL}/score/{MODEL}.txt.part "
                f"{SPOOL}/score/{MODEL}.txt", user=USER)
        total += hi - lo
        wait(f"chunk {k}'s rows counted in Prometheus ({total} in all)", SCORED_TIMEOUT_S,
             lambda: value(box, f'ds_ops_scored_rows_total{{model="{MODEL}"}}') == total)
        opened = value(box, f'ds_ops_incident_open{{model="{MODEL}"}}')
        assert opened == (k == hot), f"after chunk {k} (rows {lo}..{hi - 1}): ds_ops_incident_open {opened}"
        critical = value(box, f'ds_ops_incident_critical{{model="{MODEL}"}}')
        if k != hot:
            assert critical == 0, f"after chunk {k} (rows {lo}..{hi - 1}): ds_ops_incident_critical {critical}"
        elif p["critical"] is not None:
            assert critical == p["critical"], (f"after chunk {k}: ds_ops_incident_critical {critical}, "
                                               f"want {p['critical']}")
        if k < hot:
            assert alerts(box, name) == [] and alerts(box, crit) == [], f"{name} or {crit} pending or firing before it"
        elif k == hot:
            firing = wait(f"{name} firing", FOR_S + ALERT_TIMEOUT_S,
                          lambda: [a for a in alerts(box, name) if a["state"] == "firing"])
            print(f"{name} firing {time.monotonic() - started:.1f} s after the first chunk: {firing[0]['labels']}")
            if critical == 1:
                wait(f"{crit} firing", FOR_S + ALERT_TIMEOUT_S,
                     lambda: [a for a in alerts(box, crit) if a["state"] == "firing"])
            else:
                assert alerts(box, crit) == [], f"{crit} pending or firing for a warning incident"
            top = query(box, f'ds_ops_incident_top_metric_share{{model="{MODEL}"}}')
            assert {s["metric"]["rank"] for s in top} >= {"1"}, top
        elif k == hot + 1:                       # the incident closed in this chunk: resolved at the next evaluation
            wait(f"{name} and {crit} resolved", ALERT_TIMEOUT_S,
                 lambda: alerts(box, name) == [] and alerts(box, crit) == [])
        else:
            assert alerts(box, name) == [] and alerts(box, crit) == [], f"{name} or {crit} again after the incident"
    print(f"{len(chunks)} chunks, {total} rows scored and the alert resolved in {time.monotonic() - started:.1f} s")
    # the incidents counter's alert sees the incidents that open and close inside one file too (never
    # in ds_ops_incident_open): the incident of the hot chunk (not the first) opened after the counter's first
    # sample, the first chunk's, so increase() counts it
    seen = shipped_alert(shipped, "ds_ops_incidents_total")["alert"]
    assert hot >= 1 and any(i["opened"] >= chunks[0][1] for i in incs), (hot, chunks, incs)
    wait(f"{seen} firing", ALERT_TIMEOUT_S, lambda: [a for a in alerts(box, seen) if a["state"] == "firing"])
    # through the query API too: it fired (in the TSDB), and fires no more
    assert query(box, f'ALERTS{{alertname="{name}",model="{MODEL}"}}') == []
    assert value(box, f'max_over_time(ALERTS{{alertname="{name}",model="{MODEL}",alertstate="firing"}}[10m])') == 1
    assert value(box, f'ds_ops_flagged_rows_total{{model="{MODEL}"}}') == p["flagged"]
    assert value(box, f'ds_ops_incidents_total{{model="{MODEL}"}}') == len(incs)
    assert value(box, f'ds_ops_incident_open{{model="{MODEL}"}}') == 0
    assert query(box, f'ds_ops_incident_top_metric_share{{model="{MODEL}"}}') == []
    check_journal(box, incs)


def warnings(box: Container) -> list[dict]:
    """Return ds-trainer's journal entries at priority warning or above."""
    out = box.run(["journalctl", "-u", UNIT, "-p", "warning", "-o", "json", "--no-pager"]).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def check_journal(box: Container, incs: list[dict]) -> None:
    """One incident-opened and one incident-closed entry per incident of the stretch (its id, the
    row that opened it and its first flagged row; its last flagged row), however many chunks and
    flagged runs an incident spans; at priority warning, crit for an incident opened critical;
    one incident-escalated entry, at crit, per incident that opened as a warning and became
    critical (the row that made it so); nothing routine at warning or above; and each entry's
    catalog text, filled with its fields, in ``journalctl -x``."""
    ids = {MESSAGE_IDS["incident-opened"]: "opened", MESSAGE_IDS["incident-closed"]: "closed"}
    def all_closed():
        found = warnings(box)
        return found if sum(e.get("MESSAGE_ID") == MESSAGE_IDS["incident-closed"] for e in found) >= len(incs) else None
    entries = wait("the incident entries in the journal (journald writes asynchronously)", 30, all_closed)
    mine = [e for e in entries if e.get("MESSAGE_ID") in ids and e.get("DS_MODEL") == MODEL]
    opened = [e for e in mine if ids[e["MESSAGE_ID"]] == "opened"]
    closed = [e for e in mine if ids[e["MESSAGE_ID"]] == "closed"]
    assert [(int(e["DS_INCIDENT"]), int(e["DS_ROW"]), int(e["DS_STARTED_ROW"])) for e in opened] == [
        (i["id"], i["opened"], i["start"]) for i in incs], (incs, mine)
    assert [(int(e["DS_INCIDENT"]), int(e["DS_ROW"]), e.get("DS_REASON")) for e in closed] == [
        (i["id"], i["end"], "recovered") for i in incs], (incs, mine)
    assert [(e["PRIORITY"], e["DS_SEVERITY"]) for e in opened] == [
        ("2" if i["opened_severity"] == "critical" else "4", i["opened_severity"]) for i in incs], (incs, opened)
    assert {e["PRIORITY"] for e in closed} == {"4"}, closed
    events = ["incident-opened", "incident-closed"]
    if "incident-escalated" in MESSAGE_IDS:
        escalated = [e for e in entries if e.get("MESSAGE_ID") == MESSAGE_IDS["incident-escalated"]
                     and e.get("DS_MODEL") == MODEL]
        assert [(int(e["DS_INCIDENT"]), int(e["DS_ROW"]), e["PRIORITY"]) for e in escalated] == [
            (i["id"], i["escalated"], "2") for i in incs if i["escalated"] is not None], (incs, escalated)
        mine += escalated
        events += ["incident-escalated"] if escalated else []
    routine = {MESSAGE_IDS[k] for k in ("scored", "job-saved", "job-claimed")}
    assert [e["MESSAGE"] for e in entries if e.get("MESSAGE_ID") in routine] == []
    out = box.run(["journalctl", "-x", "-u", UNIT, "-p", "warning", "--no-pager"]).stdout
    for event in events:
        entry = next(e for e in mine if e["MESSAGE_ID"] == MESSAGE_IDS[event])
        filled = [re.sub(r"@([A-Z0-9_]+)@", lambda m: entry.get(m.group(1), m.group(0)), line)
                  for line in catalog_entry(event)]
        missing = [line for line in filled if line.split(": ", 1)[0] not in ("Defined-By", "Support") and line not in out]
        assert not missing, (event, missing, [line for line in out.splitlines() if MODEL in line][-20:])
    print("journalctl -u ds-trainer -p warning:\n" + box.run(
        ["journalctl", "-u", UNIT, "-p", "warning", "--no-pager", "-o", "cat"]).stdout)


def test_the_shipped_rules_stay_healthy_and_scoring_stalled_does_not_fire(box):
    rules = {r["name"]: r for g in api(box, "rules")["groups"] for r in g["rules"]}
    shipped = yaml.safe_load(box.run(["cat", SHIPPED_RULES]).stdout)
    for rule in (r for g in shipped["groups"] for r in g["rules"]):
        name = rule.get("alert") or rule.get("record")
        assert rules[name]["health"] == "ok" and rules[name].get("lastError", "") == "", rules[name]
    stalled = shipped_alert(shipped, "ds_ops_last_scored_timestamp_seconds")["alert"]
    assert rules[stalled]["state"] == "inactive", rules[stalled]
    assert [a for a in api(box, "alerts")["alerts"] if a["labels"]["alertname"] == stalled] == []


PULL_HOST = "web-1:9100"                 # the backfilled host's instance label: model web-1_9100
PULL_MODEL = "web-1_9100"
PULL_COLUMNS = {"smd_cpu": 0, "smd_load": 1, "smd_mem": 9, "smd_disk": 12}   # series name -> SMD column
PULL_SOURCE = "/etc/ds-ops/sources/web.yaml"
PULL_STATE = "/var/lib/ds-ops/pull"


def backfill(start: float, rows: int, hot: tuple[int, int]) -> str:
    """OpenMetrics of SMD machine-1-2's first rows as four series of PULL_HOST, one a minute from
    start, with smd_mem raised by 1.0 (its range is [0, 1]) on rows hot[0]..hot[1]-1."""
    import gzip

    data = np.loadtxt(io.StringIO(gzip.decompress((REPO / "data/smd/train" / f"{MODEL}.txt.gz").read_bytes()).decode()),
                      delimiter=",")[:rows]
    lines = []
    for name, col in PULL_COLUMNS.items():
        lines.append(f"# TYPE {name} gauge")
        for i in range(rows):
            v = float(data[i, col]) + (1.0 if name == "smd_mem" and hot[0] <= i < hot[1] else 0.0)
            lines.append(f'{name}{{instance="{PULL_HOST}",job="backfill"}} {v!r} {start + 60 * i:.0f}')
    return "\n".join(lines) + "\n# EOF\n"


def test_the_puller_trains_and_scores_a_host_from_prometheus_and_the_incident_names_its_series(box):
    """docs/prometheus.md in the booted system: a host's history backfilled into Debian's Prometheus
    (promtool tsdb create-blocks-from openmetrics), a source naming its series, ``ds-ops pull`` as
    the user ds-pull with its clock set by hand: the first pull trains the model, the next hour's
    pull is scored, the incident injected into its last 20 minutes fires the shipped DsOpsIncident
    in Prometheus, and the journal names the series by name. The daemon's scores equal ``ds-ops
    score`` of the same rows as a file."""
    start = (time.time() // 86400 - 4) * 86400          # four days ago, midnight: 2 days of rows
    train_end, score_end = start + 1.5 * 86400, start + 1.5 * 86400 + 3600
    hot = (int((score_end - start) / 60) - 20, int((score_end - start) / 60) + 1)
    box.run("cat > /tmp/web.om", input=backfill(start, 2 * 1440, hot))
    box.run("promtool tsdb create-blocks-from openmetrics /tmp/web.om /var/lib/prometheus/metrics2 "
            "&& chown -R prometheus:prometheus /var/lib/prometheus/metrics2", timeout=300)
    box.run(["systemctl", "restart", "prometheus.service"], timeout=120)
    wait("the backfilled series in Prometheus", 60,
         lambda: api(box, "query_range", query="smd_mem", start=str(train_end - 600), end=str(train_end), step="60")["result"])
    series = "\n".join(f"  - name: {n}\n    query: max by (instance) ({n}{{job=\"backfill\"}})" for n in PULL_COLUMNS)
    box.run(f"mkdir -p /etc/ds-ops/sources && cat > {PULL_SOURCE}", input=(
        "prometheus: http://localhost:9090\nstep: 1m\ntrain_window: 2d\nmin_history: 1d\nscore_every: 5m\n"
        f"delay: 0s\nseries:\n{series}\n"))
    box.run(["ds-ops", "check-config", "--source", PULL_SOURCE])
    box.run(f"install -d -o ds-pull -g ds-pull -m 750 {PULL_STATE} && setfacl -m u:ds-pull:rwx {TEXTFILE_DIR}")
    pull = ["ds-ops", "pull", PULL_SOURCE, "--once", "--state-dir", PULL_STATE]
    said = lambda text: lambda: text in box.run("journalctl -t ds-pull -o cat --no-pager").stdout  # noqa: E731
    box.run([*pull, "--now", str(train_end)], user="ds-pull")  # its lines go to the journal (its socket is there)
    wait("the puller's journal line", 30, said(f"new host {PULL_HOST}: 2161 rows to incoming/ to train model {PULL_MODEL}"))
    box.wait_for(f"test -f {MODELS}/{PULL_MODEL}/current/metadata.json", TRAIN_TIMEOUT_S, f"model {PULL_MODEL}")
    md = json.loads(box.run(["cat", f"{MODELS}/{PULL_MODEL}/current/metadata.json"]).stdout)
    assert md["dataset"]["header"] == list(PULL_COLUMNS) and md["uploader_uid"] == int(box.run(["id", "-u", "ds-pull"]).stdout)
    # the same pull into a scratch spool first, to keep the chunk the daemon will take from score/
    box.run(f"mkdir -p /tmp/scratch/incoming /tmp/scratch/score && cp -a {PULL_STATE} /tmp/scratch/state "
            "&& chown -R ds-pull /tmp/scratch")
    box.run([*pull[:4], "--state-dir", "/tmp/scratch/state", "--spool-dir", "/tmp/scratch", "--now", str(score_end)],
            user="ds-pull")
    box.run([*pull, "--now", str(score_end)], user="ds-pull")
    wait("the puller's second journal line", 30, said("1 chunk(s) of 60 rows to score/"))
    wait("the chunk's incident in Prometheus", SCORED_TIMEOUT_S,
         lambda: value(box, f'ds_ops_incident_open{{model="{PULL_MODEL}"}}') == 1)
    firing = wait("DsOpsIncident firing for the pulled host", FOR_S + ALERT_TIMEOUT_S,
                  lambda: [a for a in api(box, "alerts")["alerts"] if a["labels"].get("alertname") == "DsOpsIncident"
                           and a["labels"].get("model") == PULL_MODEL and a["state"] == "firing"])
    print(f"DsOpsIncident for {PULL_MODEL}: {firing[0]['annotations'].get('summary')}")
    # the top metrics by the series' names (a shift of one input moves the reconstruction of the
    # others too: the one moved is among the top three, not always the first)
    top = {s["metric"]["rank"]: s["metric"]["metric"]
           for s in query(box, f'ds_ops_incident_top_metric_share{{model="{PULL_MODEL}"}}')}
    assert "1" in top and set(top.values()) <= set(PULL_COLUMNS) and "smd_mem" in top.values(), top
    opened = wait("the incident-opened entry", 30, lambda: [e for e in warnings(box) if e.get("DS_MODEL") == PULL_MODEL
                                                             and e.get("MESSAGE_ID") == MESSAGE_IDS["incident-opened"]])
    named = re.search(r"top metrics: (.*?); in ", opened[0]["MESSAGE"])
    assert named and "smd_mem" in named[1] and not re.search(r"column \d", named[1]), opened[0]["MESSAGE"]
    assert value(box, 'ds_ops_pull_up{source="web"}') == 1
    # the daemon's scores of the chunk, as ds-ops score scores the same rows as a file
    (chunk,) = box.run("ls /tmp/scratch/score/*.csv").stdout.split()
    scored = box.run(["ds-ops", "score", PULL_MODEL, chunk, "--output", "/tmp/by-file.csv"], check=False)
    assert scored.returncode == 3, scored.stderr  # 3: rows flagged (ds-ops score's exit status)
    by_file = list(csv.DictReader(io.StringIO(box.run(["cat", "/tmp/by-file.csv"]).stdout)))
    rows = box.run(f"cat /var/lib/ds-ops/scores/{PULL_MODEL}/*/rows.csv").stdout
    ours = [float(r["score"]) for r in csv.DictReader(io.StringIO(rows))]
    np.testing.assert_allclose(ours, [float(r["score"]) for r in by_file], rtol=1e-5)  # rows.csv: 6 digits


LIVE_SOURCE = "/etc/ds-ops/sources/node.yaml"
PROM_TARGET = "localhost:9100"           # the container's node exporter, as Prometheus labels it
LIVE_MODEL = "localhost_9100"
SHIPPED_SOURCE = "/usr/share/doc/ds-ops/examples/node-exporter.source.yaml"


def test_the_live_path_the_shipped_node_exporter_source_trains_and_scores_this_host(box):
    """The live path, no backfill: the container's own node exporter, scraped by its Prometheus
    every SCRAPE_S seconds since this module began, and the shipped node_exporter source copied
    and edited (docs/prometheus.md) in its URL and its clock, so that minutes stand in for days: a
    row every 2 s instead of a minute, a new host trained after 3 minutes of history instead of a
    day, a chunk every 10 s instead of 5 minutes. ``ds-ops pull`` as ds-pull on the real clock.

    The container has no network device but lo (systemd-nspawn --private-network), so the source's
    three network series give nothing for it: the puller says so by name, and the operator's edit
    that follows (leave them out of the source) is the test's next step. Then the host's model is
    trained with the remaining series as its columns, and a chunk of its newest rows is scored."""
    src = yaml.safe_load(box.run(["cat", SHIPPED_SOURCE]).stdout)
    src.update(prometheus=PROM, step="2s", train_window="10m", min_history="3m", score_every="10s", delay="4s")
    box.run(f"install -d -o ds-pull -g ds-pull -m 750 {PULL_STATE} && setfacl -m u:ds-pull:rwx {TEXTFILE_DIR}")
    pull = ["ds-ops", "pull", LIVE_SOURCE, "--once", "--state-dir", PULL_STATE]
    log = lambda: box.run("journalctl -t ds-pull -o cat --no-pager").stdout  # noqa: E731

    def write_source():
        box.run(f"mkdir -p /etc/ds-ops/sources && cat > {LIVE_SOURCE}", input=yaml.safe_dump(src, sort_keys=False))
        box.run(["ds-ops", "check-config", "--source", LIVE_SOURCE])

    def pulled(pattern):
        box.run(pull, user="ds-pull")
        return re.findall(pattern, log())

    write_source()
    said = wait("the live host's series without a value", 60, lambda: pulled(
        rf"node: host {re.escape(PROM_TARGET)} has .*? no value at all in its window of ([a-z_0-9, ]+): "), 5)
    never = said[-1].split(", ")
    assert {"net_receive_bytes", "net_transmit_bytes", "net_errors"} <= set(never), never
    src["series"] = [s for s in src["series"] if s["name"] not in never]
    names = [s["name"] for s in src["series"]]
    write_source()
    # the host is trained once Prometheus holds 3 minutes of it (the module's earlier tests took some)
    wait("the live host's training file", 240, lambda: pulled(f"to incoming/ to train model {LIVE_MODEL}"), 5)
    box.wait_for(f"test -f {MODELS}/{LIVE_MODEL}/current/metadata.json", TRAIN_TIMEOUT_S, f"model {LIVE_MODEL}")
    md = json.loads(box.run(["cat", f"{MODELS}/{LIVE_MODEL}/current/metadata.json"]).stdout)
    rows = md["rows_train"] + md["rows_val"]
    assert md["dataset"]["header"] == names and rows >= 60, (md["dataset"]["header"], rows)
    before = len(re.findall(r"node: pulled up to \S+ in [\d.]+ s: 1 chunk\(s\) of", log()))
    wait("a scored chunk of the live host", 120,
         lambda: len(pulled(r"node: pulled up to \S+ in [\d.]+ s: 1 chunk\(s\) of")) > before, 5)
    found = wait("the live chunk's result", SCORED_TIMEOUT_S, lambda: box.run(
        f"ls /var/lib/ds-ops/scores/{LIVE_MODEL}/*/summary.json", check=False).stdout.split())
    first = json.loads(box.run(["cat", found[0]]).stdout)
    assert first["rows"] >= 1, first
    failed = box.run(f"ls {SPOOL}/failed", check=False).stdout.split()
    assert not [n for n in failed if n.startswith(LIVE_MODEL)], failed
    print(f"live path: series without a value here: {', '.join(never)}; model {LIVE_MODEL} trained on {rows} rows "
          f"of {len(names)} series, a chunk of {first['rows']} rows scored")


def test_purge_removes_the_acl_entry_on_the_textfile_directory_and_the_group(box):
    """The last test here: purge. The admin's ``setfacl -m u:ds-ops:rwx`` outlived the account
    (``user:<freed uid>:rwx``), a write grant for whichever account next gets the uid."""
    uid = box.run(["id", "-u", "ds-ops"]).stdout.strip()
    pull_uid = box.run(["id", "-u", "ds-pull"]).stdout.strip()
    box.run(["setfacl", "-d", "-m", "u:ds-ops:rwx", TEXTFILE_DIR])  # an admin's default entry too
    box.run(["setfacl", "-m", "u:ds-pull:rwx", TEXTFILE_DIR])  # the puller's (docs/prometheus.md), again
    acl = box.run(["getfacl", "-pc", TEXTFILE_DIR]).stdout
    assert "user:ds-ops:rwx" in acl and "default:user:ds-ops:rwx" in acl and "user:ds-pull:rwx" in acl, acl
    box.run(["apt-get", "purge", "-y", "-q", "ds-ops"], timeout=600)
    acl = box.run(["getfacl", "-pcn", TEXTFILE_DIR]).stdout
    print(f"\ngetfacl -n {TEXTFILE_DIR} after purge (ds-ops was uid {uid}, ds-pull {pull_uid}):\n{acl}")
    assert f"user:{uid}:" not in acl and "user:ds-ops:" not in acl and f"user:{pull_uid}:" not in acl
    assert box.run(["getent", "group", "ds-ops"], check=False).returncode == 2
    assert box.run(["test", "-e", f"{TEXTFILE_DIR}/ds_ops.prom"], check=False).returncode == 1
    left = box.run(f"ls -A {TEXTFILE_DIR} | grep ds_ops || true").stdout.split()
    assert left == [], left  # nor a puller's ds_ops_pull_NAME.prom, stale for good
