"""The puller against a real Prometheus (Debian's package): history of real SMD rows backfilled
with promtool as 12 hosts, each scenario a host of its own (tests/prometheus_kit.py). One pull at a
time with the clock set by hand, as ``ds-ops pull --once --now`` does."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, SMD_TRAIN
from opt_ds_ops.dataset import load_dataset
from opt_ds_ops.sources.prometheus import MAX_POINTS, Prometheus, PrometheusError
from opt_ds_ops.config.conffile import DatasetConfig
from opt_ds_ops.config.sidecar import parse_sidecar
from opt_ds_ops.sources.puller import NAME_TRIES, drop, load_state, pull, save_state, shard_of, sidecar_text
from opt_ds_ops.sources.sourcefile import parse_source
from prometheus_kit import PrometheusServer, openmetrics

DAY = 86400.0
T0 = 1_790_000_000 // 86400 * 86400.0   # 2026-09-21T00:00Z: the history's first step
STEPS = 2 * 1440                           # two days of 1-minute rows
HOSTS = [f"h{i}:9100" for i in range(8)]
LATE, GONE, GAPPY = "late:9100", "gone:9100", "gappy:9100"
GAP = (T0 + 1.7 * DAY, 10)                 # gappy's smd_a has no value for 10 steps from here
RESET = T0 + 1.75 * DAY                    # h0's counter starts again from 0 here
SOURCE = """prometheus: {url}
step: 1m
train_window: 2d
min_history: 6h
score_every: 5m
delay: 0s
catch_up: {catch_up}
shard: {shard}
series:
  - name: smd_a
    query: smd_a
  - name: smd_b
    query: smd_b
  - name: req_rate
    query: sum by (instance) (rate(requests_total[5m]))
"""


def history() -> tuple[str, dict]:
    """OpenMetrics text of every host, and {host: {time: (smd_a, smd_b)}} as written."""
    rows = np.loadtxt(SMD_TRAIN, delimiter=",", dtype=np.float64)[:, [0, 9]]
    rng = np.random.default_rng(7)
    fam = {"smd_a": ("gauge", {}), "smd_b": ("gauge", {}), "requests": ("counter", {})}
    truth = {}
    for k, host in enumerate(HOSTS + [LATE, GONE, GAPPY]):
        first, last = (1.45 * DAY if host == LATE else 0), (1.1 * DAY if host == GONE else 2 * DAY)
        times = [T0 + 60 * i for i in range(STEPS) if first <= 60 * i < last]
        part = rows[1000 + 50 * k:1000 + 50 * k + STEPS] + 0.01 * k  # per-host offset: the hosts differ
        a = [(t, float(part[i, 0])) for i, t in enumerate(times)
             if not (host == GAPPY and GAP[0] <= t < GAP[0] + 60 * GAP[1])]
        fam["smd_a"][1][host] = a
        fam["smd_b"][1][host] = [(t, float(part[i, 1])) for i, t in enumerate(times)]
        count, counter = 0.0, []
        for t in times:
            count = 0.0 if host == HOSTS[0] and t == RESET else count + float(rng.integers(50, 61))
            counter.append((t, count))
        fam["requests"][1][host] = counter
        truth[host] = {t: (dict(a).get(t), v) for t, v in fam["smd_b"][1][host]}
    return openmetrics(fam), truth


@pytest.fixture(scope="module")
def prom(tmp_path_factory):
    text, truth = history()
    # a job whose targets are the hosts, sharded by Prometheus's own hashmod into label "shard"
    shards = ("[{job_name: shards, static_configs: [{targets: [%s]}], relabel_configs: [{source_labels: [__address__], "
              "modulus: 2, target_label: shard, action: hashmod}]}]" % ", ".join(f'"{h}"' for h in HOSTS + [LATE, GONE, GAPPY]))
    server = PrometheusServer(tmp_path_factory.mktemp("prometheus"), text, shards).start()
    server.truth = truth
    yield server
    server.stop()


def source(prom, shard="0/1", catch_up="1d", url=None):
    return parse_source(SOURCE.format(url=url or prom.url, shard=shard, catch_up=catch_up).encode(), "node.yaml", "node")


def spool_at(root):
    for d in ("incoming", "score"):
        (root / "spool" / d).mkdir(parents=True, exist_ok=True)
    return str(root / "spool")


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


@pytest.mark.parametrize("name", ["1e3", "12e4", "0777", "10_30", "null", "yes", "machine-1-2"])
def test_the_pullers_sidecars_keep_a_hosts_name_as_text(name):
    """A host's name is text in the sidecars the puller drops, however YAML would read it bare
    (1e3 a number, 0777 octal, 10_30 1030, null nothing, yes true): the model is the host's."""
    for key in ("name", "model"):
        options, model = parse_sidecar(sidecar_text(key, name).encode(), "h.yaml", DatasetConfig())
        assert model == name and options.time_column == "time"


def test_a_host_is_trained_once_then_scored_by_interval_with_named_columns(tmp_path, prom):
    spool, state = spool_at(tmp_path), load_state(str(tmp_path / "state.json"))
    src, client = source(prom), Prometheus(prom.url)
    first = pull(src, client, spool, state, T0 + 1.2 * DAY)
    # LATE has no row yet, GONE's last was at 1.1 days: neither is in Prometheus now, and neither is trained
    assert set(first.trained) == set(HOSTS) | {GAPPY} and not first.scored
    name, rows, path = first.trained["h3:9100"]
    assert (name, rows) == ("h3_9100", int(1.2 * 1440))  # the first step has no rate() yet: one sample
    assert first.missing["h3:9100"] == {"req_rate": 1} and first.left_out["h3:9100"] == 1
    assert re.fullmatch(r"h3_9100\.train-20260922T044800Z\.[0-9a-f]{16}\.csv", os.path.basename(path)), path
    assert Path(path[:-4] + ".yaml").read_text() == "name: \"h3_9100\"\ntime_column: time\n"
    table = read_csv(path)
    assert table[0] == ["time", "smd_a", "smd_b", "req_rate"]
    for line in table[1:]:  # Prometheus's values, as written, at their own times: no value invented
        t = float(line[0])
        assert (float(line[1]), float(line[2])) == prom.truth["h3:9100"][t]
    ds = load_dataset(path)
    assert ds.header == ["smd_a", "smd_b", "req_rate"] and ds.data.shape == (rows, 3) and ds.time is not None
    # the next interval: five new rows per trained host, into score/ with the model named
    second = pull(src, client, spool, state, T0 + 1.2 * DAY + 300)
    assert not second.trained and set(second.scored) == set(HOSTS) | {GAPPY} and not second.gone
    name, rows, path = second.scored["h3:9100"]
    assert rows == 5 and [float(r[0]) for r in read_csv(path)[1:]] == [T0 + 1.2 * DAY + 60 * i for i in range(1, 6)]
    assert (tmp_path / "spool" / "score" / (path.rsplit("/", 1)[1][:-4] + ".yaml")).read_text() == \
        "model: \"h3_9100\"\ntime_column: time\n"
    assert not list((tmp_path / "spool").rglob("*.part")) and not list((tmp_path / "spool").rglob(".*"))
    assert pull(src, client, spool, state, T0 + 1.2 * DAY + 359).scored == {}  # no whole new step yet


def test_a_host_appears_waits_for_its_history_and_one_goes(tmp_path, prom):
    spool, state = spool_at(tmp_path), load_state(str(tmp_path / "state.json"))
    src, client = source(prom), Prometheus(prom.url)
    assert GONE in pull(src, client, spool, state, T0 + 1.05 * DAY).trained
    seen = pull(src, client, spool, state, T0 + 1.6 * DAY)  # LATE has 3.6 h of rows: under min_history (6 h)
    assert seen.waiting == {LATE: pytest.approx(0.15 * DAY - 60)} and LATE not in seen.trained
    assert LATE not in seen.left_out  # a waiting host's steps left out are counted once, when it trains
    # GONE's last rows are scored; backfilled history has no staleness marker, so Prometheus repeats
    # its last sample for its 5-minute lookback
    assert not seen.gone and seen.scored[GONE][1] == int(0.05 * 1440) - 1 + 5
    went = pull(src, client, spool, state, T0 + 1.605 * DAY)
    assert went.gone == {GONE: T0 + 1.1 * DAY - 60 + 300} and GONE in state["hosts"]
    assert went.waiting == {}  # looked at again every 15 minutes (a 24th of min_history), not each pull
    later = pull(src, client, spool, state, T0 + 1.75 * DAY)
    assert later.trained[LATE][1] == int(0.3 * 1440) and not later.gone  # a host that went is said once
    assert later.left_out[LATE] == 1 and later.missing[LATE] == {"req_rate": 1}  # its first step: no rate yet
    assert state["hosts"][GONE]["last_seen"] == T0 + 1.1 * DAY - 60 + 300 and state["hosts"][GONE]["gone"]


def test_steps_without_a_value_are_left_out_and_said_never_zero(tmp_path, prom):
    spool, state = spool_at(tmp_path), load_state(str(tmp_path / "state.json"))
    src, client = source(prom), Prometheus(prom.url)
    pull(src, client, spool, state, GAP[0] - 3600)
    report = pull(src, client, spool, state, GAP[0] + 3600)
    # Prometheus looks back 5 minutes for a sample: the first 5 steps of the gap still have the last value
    assert report.missing[GAPPY] == {"smd_a": GAP[1] - 5} and report.left_out[GAPPY] == GAP[1] - 5
    times = [float(r[0]) for r in read_csv(report.scored[GAPPY][2])[1:]]
    assert len(times) == 120 - (GAP[1] - 5) and GAP[0] + 60 * 7 not in times
    assert all("0.0" != r[1] for r in read_csv(report.scored[GAPPY][2])[1:])


def test_a_counter_reset_is_no_jump_in_its_rate(tmp_path, prom):
    spool, state = spool_at(tmp_path), load_state(str(tmp_path / "state.json"))
    src, client = source(prom), Prometheus(prom.url)
    pull(src, client, spool, state, RESET - 3600)
    report = pull(src, client, spool, state, RESET + 3600)
    rate = np.array([float(r[3]) for r in read_csv(report.scored[HOSTS[0]][2])[1:]])
    assert len(rate) == 120 and 50 / 60 * 0.8 <= rate.min() and rate.max() <= 60 / 60 * 1.2


def test_a_range_over_prometheus_points_limit_is_asked_in_pieces(prom):
    step = 15.0  # two days at 15 s: 11,520 points per series, over the 11,000 one answer may hold
    got = Prometheus(prom.url).query_range("smd_b", T0, T0 + 2 * DAY - step, step, "instance")
    assert (2 * DAY / step) > MAX_POINTS and len(got["h5:9100"]) == 2 * DAY / step
    assert got["h5:9100"][T0 + 60] == prom.truth["h5:9100"][T0 + 60][1]


def test_shards_share_the_hosts_each_once(tmp_path, prom):
    modelled = []
    for i in range(2):
        spool, state = spool_at(tmp_path / str(i)), load_state(str(tmp_path / f"{i}.json"))
        report = pull(source(prom, shard=f"{i}/2"), Prometheus(prom.url), spool, state, T0 + 1.2 * DAY)
        assert all(shard_of(h, 2) == i for h in state["hosts"])
        modelled.append(set(report.trained))
    assert modelled[0] | modelled[1] == set(HOSTS) | {GAPPY} and not modelled[0] & modelled[1]
    assert modelled[0] and modelled[1]
    # the shard each host has by Prometheus's own hashmod (its targets API shows the relabelled labels)
    deadline, theirs = time.monotonic() + 60, {}
    while len(theirs) < 11 and time.monotonic() < deadline:  # the scrape manager takes its targets a moment after start
        time.sleep(0.5)
        with urllib.request.urlopen(prom.url + "/api/v1/targets", timeout=30) as r:
            targets = json.load(r)["data"]["activeTargets"]
        theirs = {t["labels"]["instance"]: int(t["labels"]["shard"]) for t in targets if t["labels"]["job"] == "shards"}
    assert len(theirs) == 11 and theirs == {h: shard_of(h, 2) for h in theirs}


def test_prometheus_down_writes_nothing_and_the_next_pull_covers_the_gap(tmp_path, prom):
    spool, state_path = spool_at(tmp_path), str(tmp_path / "state.json")
    src, client = source(prom, catch_up="1h"), Prometheus(prom.url, timeout_s=5)
    state = load_state(state_path)
    pull(src, client, spool, state, T0 + 1.2 * DAY)
    save_state(state_path, state)
    before = sorted(p.name for p in (tmp_path / "spool").rglob("*"))
    down = Prometheus(f"http://127.0.0.1:{_closed_port()}", timeout_s=5)
    with pytest.raises(PrometheusError) as e:
        pull(src, down, spool, load_state(state_path), T0 + 1.2 * DAY + 300)
    assert e.value.unavailable and "not reachable" in str(e.value)
    assert sorted(p.name for p in (tmp_path / "spool").rglob("*")) == before
    # back after 3 hours: the last hour is pulled (catch_up), the two before it are said to be skipped
    state = load_state(state_path)
    report = pull(src, client, spool, state, T0 + 1.2 * DAY + 3 * 3600)
    assert report.scored["h1:9100"][1] == 60 and report.skipped_s["h1:9100"] == pytest.approx(2 * 3600)


def test_an_answer_over_the_bound_is_refused_whole(tmp_path, prom):
    spool, state = spool_at(tmp_path), load_state(str(tmp_path / "state.json"))
    small = Prometheus(prom.url, max_response_bytes=64 * 1024)
    with pytest.raises(PrometheusError, match="over max_response_bytes"):
        pull(source(prom), small, spool, state, T0 + 1.2 * DAY)
    assert not list((tmp_path / "spool").rglob("*.csv")) and state["hosts"] == {}


def test_ds_ops_pull_once_logs_each_host_and_writes_its_metrics(tmp_path, prom):
    spool = spool_at(tmp_path)
    (tmp_path / "prom").mkdir()
    (tmp_path / "trainer.yaml").write_text(f"spool:\n  dir: {spool}\nmetrics:\n  textfile_dir: {tmp_path / 'prom'}\n")
    (tmp_path / "node.yaml").write_text(SOURCE.format(url=prom.url, shard="0/1", catch_up="1d"))
    cmd = [sys.executable, "-m", "opt_ds_ops.cli", "pull", str(tmp_path / "node.yaml"), "--config",
           str(tmp_path / "trainer.yaml"), "--state-dir", str(tmp_path / "state"), "--once"]
    p = subprocess.run([*cmd, "--now", str(T0 + 1.2 * DAY)], capture_output=True, text=True, cwd=REPO, timeout=120,
                       preexec_fn=lambda: os.umask(0o027))  # the unit's UMask=
    assert p.returncode == 0, p.stderr
    assert "node: new host h0:9100: 1728 rows to incoming/ to train model h0_9100" in p.stderr
    # node_exporter's user reads it, whatever the unit's umask
    assert (tmp_path / "prom" / "ds_ops_pull_node.prom").stat().st_mode & 0o777 == 0o644
    assert "0 chunk(s) of 0 rows to score/, 9 training file(s) to incoming/" in p.stderr
    state = json.loads((tmp_path / "state" / "node.json").read_text())
    assert state["hosts"]["h0:9100"]["scored_until"] == T0 + 1.2 * DAY
    prom_text = (tmp_path / "prom" / "ds_ops_pull_node.prom").read_text()
    assert 'ds_ops_pull_up{source="node"} 1.0' in prom_text and 'ds_ops_pull_hosts{source="node",state="trained"} 9.0' in prom_text
    (tmp_path / "bad.yaml").write_text("series: []\n")
    p = subprocess.run([*cmd[:4], str(tmp_path / "bad.yaml"), *cmd[5:]], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert p.returncode == 1 and "key 'series' must be a list" in p.stderr


def _closed_port() -> int:
    from prometheus_kit import free_port

    return free_port()


def test_every_query_of_the_shipped_node_exporter_source_is_promql_prometheus_accepts(prom):
    from opt_ds_ops.sources.sourcefile import load_source

    src = load_source(str(REPO / "docs" / "examples" / "node-exporter.source.yaml"))
    for s in src.series:  # a bad query is HTTP 400 (bad_data): query_range raises naming it
        assert Prometheus(prom.url).query_range(s.query, T0, T0 + 600, 60, "instance") == {}, s.name
    with pytest.raises(PrometheusError, match="HTTP 400"):
        Prometheus(prom.url).query_range("sum by (instance (x)", T0, T0 + 600, 60, "instance")


class Counting(Prometheus):
    """The real client, recording each query's range."""

    def __init__(self, url):
        super().__init__(url)
        self.asked = []

    def query_range(self, query, start, end, step, label):
        self.asked.append((start, end))
        return super().query_range(query, start, end, step, label)


def test_a_first_pull_before_any_host_still_finds_them_in_the_next(tmp_path, prom):
    spool, state = spool_at(tmp_path), load_state(str(tmp_path / "state.json"))
    src, client = source(prom), Prometheus(prom.url)
    assert pull(src, client, spool, state, T0 - 3600).trained == {} and state["hosts"] == {}
    assert set(pull(src, client, spool, state, T0 + 1.2 * DAY).trained) == set(HOSTS) | {GAPPY}


def test_rows_wait_for_the_models_first_version_and_are_not_lost(tmp_path, prom):
    spool, state = spool_at(tmp_path), load_state(str(tmp_path / "state.json"))
    src, client = source(prom), Prometheus(prom.url)
    pull(src, client, spool, state, T0 + 1.2 * DAY)
    waiting = pull(src, client, spool, state, T0 + 1.2 * DAY + 600, model_ready=lambda name: name != "h3_9100")
    assert waiting.pending == {"h3:9100": "h3_9100"} and "h3:9100" not in waiting.scored and "h4:9100" in waiting.scored
    ready = pull(src, client, spool, state, T0 + 1.2 * DAY + 900)
    times = [float(r[0]) for r in read_csv(ready.scored["h3:9100"][2])[1:]]
    assert times == [T0 + 1.2 * DAY + 60 * i for i in range(1, 16)]  # from the training file's end on


def test_a_host_whose_model_was_removed_is_trained_again_and_one_never_trained_waits(tmp_path, prom):
    """`ds-ops models rm` of a host's model: the puller trains the host again from its last
    train_window (it waited for the removed model for good before); a model that never had a
    version (its training still queued), or a store that cannot be read, is waited for, not
    trained twice; a gone host's removed model is not made again from its old rows."""
    spool, state = spool_at(tmp_path), load_state(str(tmp_path / "state.json"))
    src, client = source(prom), Prometheus(prom.url)
    first = pull(src, client, spool, state, T0 + 1.05 * DAY)
    assert {"h3:9100", "h5:9100", GONE} <= set(first.trained)
    queued = lambda name: name != "h5_9100"  # noqa: E731 - h5's first version is not there yet
    pull(src, client, spool, state, T0 + 1.05 * DAY + 300, model_ready=queued)
    pull(src, client, spool, state, T0 + 1.2 * DAY)
    pull(src, client, spool, state, T0 + 1.2 * DAY + 120)  # GONE went (its rows end at 1.1 days)
    assert state["hosts"][GONE]["gone"]
    unreadable = lambda name: False  # noqa: E731 - every `current` looks missing, nothing certainly removed
    stale = pull(src, client, spool, state, T0 + 1.2 * DAY + 300, model_ready=unreadable)
    assert not stale.removed and not stale.trained and "h3:9100" in stale.pending
    gone = lambda name: name not in ("h3_9100", "h5_9100", "gone_9100")  # noqa: E731 - h3's and GONE's removed since
    removed = lambda name: name in ("h3_9100", "gone_9100")  # noqa: E731
    again = pull(src, client, spool, state, T0 + 1.2 * DAY + 600, model_ready=gone, model_removed=removed)
    assert again.removed == {"h3:9100": "h3_9100"} and again.pending["h5:9100"] == "h5_9100"
    assert GONE not in again.trained and state["hosts"][GONE]["scored_until"] is not None  # not from its old rows
    model, rows, path = again.trained["h3:9100"]
    assert model == "h3_9100" and "h5:9100" not in again.trained and "h3:9100" not in again.scored
    times = [float(r[0]) for r in read_csv(path)[1:]]
    assert times[-1] == T0 + 1.2 * DAY + 600 and times[0] < T0 + 600  # its last train_window (2 d: from the start)
    assert state["hosts"]["h3:9100"]["scored_until"] == T0 + 1.2 * DAY + 600
    later = pull(src, client, spool, state, T0 + 1.2 * DAY + 900)
    assert [float(r[0]) for r in read_csv(later.scored["h3:9100"][2])[1:]][0] == T0 + 1.2 * DAY + 660
    assert not later.removed and not later.trained


def test_the_pullers_store_check_counts_only_a_missing_model_as_removed(tmp_path):
    from opt_ds_ops.commands.pull import Puller

    models = tmp_path / "models"
    (models / "kept" / "v1").mkdir(parents=True)
    p = Puller.__new__(Puller)
    p.models_dir = str(models)
    assert p.model_removed("gone") and not p.model_removed("kept")
    p.models_dir = str(tmp_path / "not-mounted")  # the store itself missing: no removal
    assert not p.model_removed("gone")


def test_a_gone_host_does_not_widen_the_others_queries(tmp_path, prom):
    spool, state = spool_at(tmp_path), load_state(str(tmp_path / "state.json"))
    src, client = source(prom), Counting(prom.url)
    pull(src, client, spool, state, T0 + 1.05 * DAY)
    pull(src, client, spool, state, T0 + 1.6 * DAY)
    assert state["hosts"][GONE]["scored_until"] == T0 + 1.6 * DAY
    pull(src, client, spool, state, T0 + 1.62 * DAY)  # GONE went: said, its scoring waits
    client.asked.clear()
    pull(src, client, spool, state, T0 + 1.62 * DAY + 300)
    assert client.asked and all(end - start == 4 * 60 for start, end in client.asked)  # the last 5 steps only


def test_a_state_that_cannot_be_saved_is_a_failed_pull_said_in_the_journal(tmp_path, prom, capsys):
    from opt_ds_ops.commands.pull import Puller
    from opt_ds_ops.observe.journal import EventLog
    from opt_ds_ops.sources.metrics import PullMetrics

    src = source(prom)
    puller = Puller(src, spool_at(tmp_path), str(tmp_path / "absent" / "node.json"), PullMetrics(src, ""),
                    EventLog(journal=False), str(tmp_path / "models"))
    assert puller.once(T0 + 1.2 * DAY) is False and puller.failures == 1
    assert "node: pull failed, nothing marked pulled: No such file or directory" in capsys.readouterr().err


def test_a_real_daemon_trains_and_scores_what_the_puller_drops_naming_the_series(tmp_path, prom):
    """The puller's drops through a real daemon: the model is trained from Prometheus's rows with the
    series' names as its columns and Prometheus's times, the next hour scored as a chunk of its
    series, and the scores equal ``ds-ops score`` of the same rows as a file."""
    from daemon_kit import Daemon, done_names, read_json, write_config

    one = SOURCE.replace("query: smd_a\n", 'query: smd_a{{instance="h3:9100"}}\n')  # one host: one model
    src = parse_source(one.format(url=prom.url, shard="0/1", catch_up="1d").encode(), "node.yaml", "node")
    conf = write_config(tmp_path, shipped_training=True, extra=["scoring:", f"  results_dir: {tmp_path / 'scores'}"])
    spool, state = str(tmp_path / "spool"), load_state(str(tmp_path / "state.json"))
    d = Daemon(conf)
    try:
        d.wait_until(lambda: "ds-trainer ready" in d.log(), "the daemon to be ready", timeout_s=120)
        trained = pull(src, Prometheus(prom.url), spool, state, T0 + 1.2 * DAY)
        assert list(trained.trained) == ["h3:9100"]
        d.wait_until(lambda: any(n.startswith("h3_9100.train-") for n in done_names(tmp_path)), "the model", timeout_s=300)
        ready = lambda name: (tmp_path / "models" / name / "current").exists()  # noqa: E731
        scored = pull(src, Prometheus(prom.url), spool, state, T0 + 1.2 * DAY + 3600, ready)
        name, rows, path = scored.scored["h3:9100"]
        chunk = tmp_path / "chunk.csv"
        chunk.write_bytes(open(path, "rb").read())
        d.wait_until(lambda: (tmp_path / "scores" / name).exists() and any(
            (p / "summary.json").exists() for p in (tmp_path / "scores" / name).iterdir() if not p.name.startswith(".")),
            "the chunk's result", timeout_s=300)
        assert d.stop()[0] == 0
    finally:
        d.kill()
    (result,) = [p for p in (tmp_path / "scores" / name).iterdir() if not p.name.startswith(".") and p.is_dir()]
    summary = read_json(result / "summary.json")
    assert summary["rows"] == rows == 60
    daemon_rows = read_csv(result / "rows.csv")
    assert daemon_rows[0][:3] == ["row", "time", "score"]
    by_file = tmp_path / "by-file.csv"
    p = subprocess.run([sys.executable, "-m", "opt_ds_ops.cli", "score", str(tmp_path / "models" / name), str(chunk),
                        "--output", str(by_file), "--config", str(conf)], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert p.returncode == 0, p.stderr
    header = read_csv(by_file)[0]
    theirs = np.array([float(r[header.index("score")]) for r in read_csv(by_file)[1:]])
    ours = np.array([float(r[2]) for r in daemon_rows[1:]])
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)  # rows.csv keeps 6 significant digits
    metadata = read_json(tmp_path / "models" / name / "current" / "metadata.json")
    assert metadata["dataset"]["header"] == ["smd_a", "smd_b", "req_rate"] and metadata["dataset"]["time"]["gaps"] == 0
    assert metadata["dataset"]["time"]["first"] == "2026-09-21T00:01:00.000000Z"  # Prometheus's clock, kept


def test_two_servers_share_a_source_by_shard_and_every_host_is_modelled_by_one(tmp_path, prom):
    """Two ds-ops servers, each a real daemon with its own spool and model store and a ``ds-ops
    pull --once`` of the same source with its own shard (0/2 and 1/2): every host with enough
    history gets a model on exactly one of them, the one Prometheus's own hashmod gives it."""
    from daemon_kit import Daemon, done_names, failed_names, prom_samples, write_config

    servers, daemons = [tmp_path / "a", tmp_path / "b"], []
    try:
        for i, root in enumerate(servers):
            root.mkdir()
            (root / "prom").mkdir()
            conf = write_config(root, epochs=2, extra=["metrics:", f"  textfile_dir: {root / 'prom'}"])
            (root / "node.yaml").write_text(SOURCE.format(url=prom.url, shard=f"{i}/2", catch_up="1d"))
            daemons.append(Daemon(conf))
        for d in daemons:
            d.wait_until(lambda d=d: "ds-trainer ready" in d.log(), "the daemon to be ready", timeout_s=120)
        expected = {}
        for i, root in enumerate(servers):
            p = subprocess.run([sys.executable, "-m", "opt_ds_ops.cli", "pull", str(root / "node.yaml"), "--config",
                                str(root / "trainer.yaml"), "--state-dir", str(root / "state"), "--once",
                                "--now", str(T0 + 1.2 * DAY)], capture_output=True, text=True, cwd=REPO, timeout=120)
            assert p.returncode == 0, p.stderr
            # the hosts with enough history (6 h) that still answer (GONE went quiet at 1.1 days)
            expected[i] = {h.replace(":", "_") for h in HOSTS + [GAPPY] if shard_of(h, 2) == i}
        def modelled(root):
            return {p.name for p in (root / "models").iterdir() if (p / "current").exists()} if (root / "models").exists() else set()

        def finished(root):  # training files in done/ (a model's current appears a moment before its file moves)
            return len([n for n in done_names(root) if ".train-" in n and not n.endswith(".yaml")])

        for (i, root), d in zip(enumerate(servers), daemons):
            d.wait_until(lambda root=root, i=i: (modelled(root) >= expected[i] and finished(root) >= len(expected[i]))
                         or failed_names(root), f"server {i}'s {len(expected[i])} trainings", timeout_s=600)
            assert not failed_names(root), failed_names(root)
            assert finished(root) == len(expected[i])
        for d in daemons:
            assert d.stop()[0] == 0
    finally:
        for d in daemons:
            d.kill()
    models = [modelled(root) for root in servers]
    assert models[0] == expected[0] and models[1] == expected[1], models
    assert not models[0] & models[1] and models[0] | models[1] == {h.replace(":", "_") for h in HOSTS + [GAPPY]}
    assert models[0] and models[1]  # both servers have work: the hash splits these 9 hosts
    for i, root in enumerate(servers):  # each server's metrics name its own models only
        samples = prom_samples(root / "prom" / "ds_ops.prom")
        assert {dict(labels)["model"] for name, labels in samples if name == "ds_ops_model_threshold"} == expected[i]


def test_a_series_a_host_never_has_is_named_and_a_waiting_host_is_looked_at_again_on_its_clock(tmp_path, prom):
    """A query that gives nothing for a host (here only h0 has ``only_h0``): no complete row can come,
    so the host waits, and the pull names the series; the others train. A waiting host is looked
    at again every 24th of min_history (6 h here: every 15 minutes), not only hourly."""
    from opt_ds_ops.sources.puller import recheck_s

    text = SOURCE.format(url=prom.url, shard="0/1", catch_up="1d") + '  - name: only_h0\n    query: smd_a{instance="h0:9100"}\n'
    src = parse_source(text.encode(), "node.yaml", "node")
    assert recheck_s(src) == 900.0 and recheck_s(source(prom)) == 900.0
    spool, state = spool_at(tmp_path), load_state(str(tmp_path / "state.json"))
    report = pull(src, Prometheus(prom.url), spool, state, T0 + 1.2 * DAY)
    assert list(report.trained) == ["h0:9100"]
    assert report.never and all(v == (["only_h0"], True) for v in report.never.values()) and "h1:9100" in report.never
    assert report.waiting["h1:9100"] == 0.0
    # looked at again after 15 minutes (not an hour), still named
    again = pull(src, Prometheus(prom.url), spool, state, T0 + 1.2 * DAY + 300)
    assert not again.never
    # half a score_every (5 minutes) early is on time: a pull that wakes a little early still looks
    again = pull(src, Prometheus(prom.url), spool, state, T0 + 1.2 * DAY + 900 - 140)
    assert again.never.get("h1:9100") == (["only_h0"], False)  # said again, but no news: not a warning


def test_a_step_missing_several_series_is_one_step_left_out():
    """The journal's and ds_ops_pull_missing_steps_total's count is of steps, the series' own
    counts beside it (a newest step without three series' values was once said as 3 steps)."""
    from types import SimpleNamespace

    from opt_ds_ops.sources.puller import _rows

    values = np.arange(30, dtype=float).reshape(3, 10)
    values[:, 9] = np.nan  # the newest step: no series has it yet
    values[0, 4] = np.nan
    src = SimpleNamespace(series=[SimpleNamespace(name=n) for n in ("a", "b", "c")])
    rows, missing, left_out = _rows(values, 1000.0 + 60 * np.arange(10), src)
    assert missing == {"a": 2, "b": 1, "c": 1} and left_out == 2 and len(rows) == 8


def test_names_a_member_plants_first_never_stop_a_drop_nor_are_replaced(tmp_path, monkeypatch):
    """Before, the next chunk's name was MODEL.<stamp of its first row>.yaml: a member who created
    the next names first stopped the puller's rename (sticky bit) for good, and the host was never
    scored again. Now each drop's name ends in 16 random hex digits, and a name that is taken
    (planted here by giving the token generator's first answers away) is left as it is and another
    one tried: the chunk lands, the planted files are untouched."""
    from opt_ds_ops.sources import puller

    score = tmp_path / "spool" / "score"
    score.mkdir(parents=True)
    planted = ["0" * 16, "1" * 16]
    for token in planted:  # a member's files at the names the puller will try first
        (score / f"web-3.20261201T000000Z.{token}.yaml").write_text("model: someone-else\n")
        (score / f"web-3.20261201T000000Z.{token}.csv").write_text("mine\n")
    tokens = iter(planted + ["2" * 16])
    monkeypatch.setattr(puller.secrets, "token_hex", lambda n: next(tokens))
    path = drop(str(tmp_path / "spool"), "score", "web-3.20261201T000000Z", "model: web-3\n", b"time,a\n1,2\n")
    assert os.path.basename(path) == f"web-3.20261201T000000Z.{'2' * 16}.csv"
    assert Path(path).read_bytes() == b"time,a\n1,2\n" and Path(path[:-4] + ".yaml").read_text() == "model: web-3\n"
    for token in planted:
        assert (score / f"web-3.20261201T000000Z.{token}.csv").read_text() == "mine\n"
        assert (score / f"web-3.20261201T000000Z.{token}.yaml").read_text() == "model: someone-else\n"
    assert not [p for p in score.iterdir() if p.name.startswith(".pull.tmp-")]
    monkeypatch.setattr(puller.secrets, "token_hex", lambda n: planted[0])  # every name taken: an error, nothing left
    with pytest.raises(FileExistsError, match=f"{NAME_TRIES} random names"):
        drop(str(tmp_path / "spool"), "score", "web-3.20261201T000000Z", "model: web-3\n", b"x")
    assert len(list(score.iterdir())) == 6
    monkeypatch.undo()
    real = [drop(str(tmp_path / "spool"), "score", "h.T", "model: h\n", b"x") for _ in range(2)]
    assert real[0] != real[1]  # no two drops share a name, so no member can know the next one


def test_a_model_name_a_member_took_first_blocks_the_host_with_a_reason_and_drops_nothing(tmp_path, prom):
    """Before: a member trained h3_9100 before the puller; its training file was refused, yet the
    host was marked trained and a chunk dropped every pull, each failing. Now the name's owner is
    checked: a name that is another uid's takes no training file and no chunk, the host is
    'blocked' with the owner named (journal at warning when it starts, ds_ops_pull_hosts{state=
    "blocked"}), and the same once a trained host's name is taken after a models rm."""
    spool, state = spool_at(tmp_path), load_state(str(tmp_path / "state.json"))
    src, client = source(prom), Prometheus(prom.url)
    taken = {"h3_9100": "its model name h3_9100 belongs to uid 1001 (alice)"}
    first = pull(src, client, spool, state, T0 + 1.2 * DAY, model_taken=taken.get)
    assert "h3:9100" not in first.trained and first.blocked["h3:9100"] == (taken["h3_9100"], True)
    assert not [n for n in os.listdir(os.path.join(spool, "incoming")) if n.startswith("h3_9100.")]
    assert state["hosts"]["h3:9100"]["scored_until"] is None and state["hosts"]["h3:9100"]["blocked"]
    later = pull(src, client, spool, state, T0 + 1.2 * DAY + 300, model_taken=taken.get)
    assert "h3:9100" not in later.scored and "h4:9100" in later.scored  # the others go on
    taken["h4_9100"] = "its model name h4_9100 belongs to uid 1002 (bob)"  # taken after the puller's model
    third = pull(src, client, spool, state, T0 + 1.2 * DAY + 600, model_taken=taken.get)
    assert third.blocked["h4:9100"] == (taken["h4_9100"], True) and "h4:9100" not in third.scored
    fourth = pull(src, client, spool, state, T0 + 1.2 * DAY + 900, model_taken=taken.get)
    assert fourth.blocked["h4:9100"] == (taken["h4_9100"], False)  # said once at warning, then known
    from opt_ds_ops.sources.metrics import PullMetrics

    m = PullMetrics(src, str(tmp_path))
    m.pulled(fourth, state, T0 + 1.2 * DAY + 900)
    text = (tmp_path / "ds_ops_pull_node.prom").read_text()
    assert 'ds_ops_pull_hosts{source="node",state="blocked"} 2.0' in text


def test_the_pullers_owner_check_reads_the_current_versions_uploader(tmp_path):
    from opt_ds_ops.commands.pull import Puller

    p = Puller.__new__(Puller)
    p.models_dir = str(tmp_path / "models")
    for name, uid in (("alices", 1001), ("mine", os.geteuid()), ("roots", 0)):
        (tmp_path / "models" / name / "v1").mkdir(parents=True)
        (tmp_path / "models" / name / "v1" / "metadata.json").write_text(json.dumps({"uploader_uid": uid}))
        os.symlink("v1", tmp_path / "models" / name / "current")
    why = p.model_taken("alices")
    assert why.startswith("its model name alices belongs to uid 1001") and "ds-ops models rm alices" in why
    assert p.model_taken("mine") is None and p.model_taken("roots") is None and p.model_taken("absent") is None


def test_a_refused_first_training_is_tried_again_after_a_back_off_not_waited_for_for_ever(tmp_path, prom):
    """Before: a host whose first training file the daemon refused (constant rows, quarantine, out
    of memory) waited 'for its model's first version' for ever and counted as trained. Now the
    refusal in failed/ (its .error.json) sends the host back to waiting, trained again from its last
    train_window after 1 hour (doubling for each failure in a row), counted as failed meanwhile."""
    from opt_ds_ops.commands.pull import Puller

    spool, state = spool_at(tmp_path), load_state(str(tmp_path / "state.json"))
    (tmp_path / "spool" / "failed").mkdir()
    src, client = source(prom), Prometheus(prom.url)
    p = Puller.__new__(Puller)
    p.spool_root = spool
    first = pull(src, client, spool, state, T0 + 1.2 * DAY)
    path = first.trained["h3:9100"][2]
    not_h3 = lambda name: name != "h3_9100"  # noqa: E731 - h3's model never comes
    waiting = pull(src, client, spool, state, T0 + 1.2 * DAY + 300, model_ready=not_h3, train_failed=p.train_failed)
    assert waiting.pending == {"h3:9100": "h3_9100"} and not waiting.train_failed  # not known to have failed yet
    (tmp_path / "spool" / "failed" / (os.path.basename(path) + ".error.json")).write_text(
        json.dumps({"stage": "dataset", "reason": "every feature column is constant"}))
    failed = pull(src, client, spool, state, T0 + 1.2 * DAY + 600, model_ready=not_h3, train_failed=p.train_failed)
    assert failed.train_failed == {"h3:9100": "every feature column is constant"} and "h3:9100" not in failed.pending
    entry = state["hosts"]["h3:9100"]
    assert entry["scored_until"] is None and entry["train_failures"] == 1
    assert entry["retry_at"] == T0 + 1.2 * DAY + 600 + 3600
    early = pull(src, client, spool, state, T0 + 1.2 * DAY + 3600, model_ready=not_h3, train_failed=p.train_failed)
    assert "h3:9100" not in early.trained  # within its back-off
    again = pull(src, client, spool, state, T0 + 1.2 * DAY + 4500, model_ready=not_h3, train_failed=p.train_failed)
    assert again.trained["h3:9100"][0] == "h3_9100" and again.trained["h3:9100"][2] != path  # a new file, a new name
    ok = pull(src, client, spool, state, T0 + 1.2 * DAY + 4800, train_failed=p.train_failed)
    assert "h3:9100" in ok.scored and "train_failures" not in state["hosts"]["h3:9100"]


def test_two_sources_over_the_same_hosts_do_not_share_a_model(tmp_path):
    """model_prefix ships empty: before, a second source over the same hosts trained a new version
    of the first source's model with its own columns (every later chunk failed). Now a name another
    source's puller on this server held first (its state file beside this one's: trained earlier,
    or at the same time by a source whose name sorts first) is that source's: this host is blocked,
    naming the source and the fix. Each source's check gives the same answer: no deadlock."""
    from types import SimpleNamespace

    from opt_ds_ops.commands.pull import Puller

    def puller(name: str) -> Puller:
        p = Puller.__new__(Puller)
        p.source, p.state_path, p.models_dir = SimpleNamespace(name=name), str(tmp_path / f"{name}.json"), str(tmp_path)
        return p

    def state(trained_at):
        return {"format": 1, "hosts": {"h:9100": {"model": "h_9100", "trained_at": trained_at, "scored_until": trained_at}}}

    for own, other, first in ((200.0, 100.0, "node"), (100.0, 300.0, "app"), (100.0, 100.0, "app")):
        save_state(str(tmp_path / "node.json"), state(other))
        app = puller("app")
        app.others = app.other_sources(state(own))
        node = puller("node")
        node.others = node.other_sources(state(other))
        held = {"app": app.model_taken("h_9100"), "node": node.model_taken("h_9100")}
        loser = "node" if first == "app" else "app"
        assert held[first] is None and held[loser] is not None, (own, other, held)
        assert f"is source {first}'s already" in held[loser] and "model_prefix" in held[loser]
        save_state(str(tmp_path / "app.json"), state(own))  # both states on disk, as the next pulls see them
    waiting = puller("app")
    waiting.others = waiting.other_sources({"format": 1, "hosts": {}})  # not trained here yet: node's
    assert "is source node's already (" in waiting.model_taken("h_9100")
    old = time.time() - 2 * 86400  # node's puller stopped saving two days ago (renamed, turned off): holds nothing
    os.utime(tmp_path / "node.json", (old, old))
    waiting.others = waiting.other_sources({"format": 1, "hosts": {}})
    assert waiting.model_taken("h_9100") is None


def test_a_training_dropped_before_a_kill_is_adopted_not_dropped_twice(tmp_path, prom):
    """Before: a puller killed after dropping a host's training file, before saving its state,
    dropped a second one at its next start (the model trained twice). Now the host's own training
    (its file still in incoming/, claimed in processing/, or the model's current version this uid
    dropped) is adopted: the host is trained up to that file's end and scored from there."""
    from opt_ds_ops.commands.pull import Puller

    spool, state = spool_at(tmp_path), load_state(str(tmp_path / "state.json"))
    (tmp_path / "spool" / "processing").mkdir()
    src, client = source(prom), Prometheus(prom.url)
    before = dict(state, hosts={})
    first = pull(src, client, spool, before, T0 + 1.2 * DAY)  # dropped; its state never saved (killed)
    dropped = first.trained["h3:9100"][2]
    p = Puller.__new__(Puller)
    p.spool_root, p.models_dir = spool, str(tmp_path / "models")
    end = T0 + 1.2 * DAY
    p._own = None  # a pull lists the spool once
    assert p.own_training("h3_9100") == (end, os.path.basename(dropped)) and p.own_training("h4_9100")[0] == end
    assert p.own_training("nobody") is None
    again = pull(src, client, spool, state, T0 + 1.2 * DAY + 300, own_training=p.own_training)
    assert again.adopted["h3:9100"] == ("h3_9100", end) and "h3:9100" not in again.trained
    assert state["hosts"]["h3:9100"]["train_file"] == os.path.basename(dropped)  # a refusal of it is still seen
    assert [n for n in os.listdir(os.path.join(spool, "incoming")) if n.startswith("h3_9100.train-")
            and n.endswith(".csv")] == [os.path.basename(dropped)]  # one training file, not two
    assert state["hosts"]["h3:9100"]["scored_until"] == end
    later = pull(src, client, spool, state, T0 + 1.2 * DAY + 600, own_training=p.own_training)
    assert [float(r[0]) for r in read_csv(later.scored["h3:9100"][2])[1:]][0] == end + 60  # from its end on


def test_hosts_of_another_shard_after_a_change_of_shard_leave_the_state_and_the_metrics(tmp_path, prom):
    """Before: after a change of shard (0/1 to 0/2) the hosts that moved away stayed 'trained' in
    the state and in ds_ops_pull_hosts, with a stale last-seen, for ever."""
    from opt_ds_ops.sources.metrics import PullMetrics

    spool, state = spool_at(tmp_path), load_state(str(tmp_path / "state.json"))
    client = Prometheus(prom.url)
    whole = source(prom, shard="0/1")
    m = PullMetrics(whole, str(tmp_path))
    m.pulled(pull(whole, client, spool, state, T0 + 1.2 * DAY), state, T0 + 1.2 * DAY)
    m.pulled(pull(whole, client, spool, state, T0 + 1.2 * DAY + 300), state, T0 + 1.2 * DAY + 300)
    half = source(prom, shard="0/2")
    report = pull(half, client, spool, state, T0 + 1.2 * DAY + 600)
    away = {h for h in HOSTS + [GAPPY] if shard_of(h, 2) != 0}
    assert away and set(report.moved) >= away and not away & set(state["hosts"])
    m.pulled(report, state, T0 + 1.2 * DAY + 600)
    text = (tmp_path / "ds_ops_pull_node.prom").read_text()
    for h in away:
        assert f'host="{h}"' not in text, h
    kept = sorted(set(HOSTS) - away)[0]
    assert f'host="{kept}"' in text


def test_colliding_model_names_do_not_depend_on_the_hosts_order():
    """Before, the first host in sorted order took a shared safe name and the other was refused for
    good (``a/b`` took ``a_b``'s name). Now the name a host gets depends on the
    hosts, not their order: the host whose label is the name exactly keeps it; the other claimants
    each get the name with 8 hex digits of their label's SHA-256; a name held in the state stays its
    holder's."""
    import hashlib
    import itertools

    from opt_ds_ops.sources.puller import model_names

    src = parse_source(SOURCE.format(url="http://127.0.0.1:9", shard="0/1", catch_up="1d").encode(), "node.yaml", "node")
    tag = lambda h: hashlib.sha256(h.encode()).hexdigest()[:8]  # noqa: E731
    hosts = ["a/b", "a_b", "a b", "c:9100", "..."]
    want = {"a_b": "a_b", "a/b": f"a_b-{tag('a/b')}", "a b": f"a_b-{tag('a b')}",
            "c:9100": "c_9100"}
    for order in itertools.permutations(hosts):
        assert model_names(src, order, {}) == want  # "..." has no usable character: left out, refused by the pull
    # two mangled claims, neither exact: both get their own name, whichever comes first
    both = {"a/b": f"a_b-{tag('a/b')}", "a b": f"a_b-{tag('a b')}"}
    assert model_names(src, ["a/b", "a b"], {}) == model_names(src, ["a b", "a/b"], {}) == both
    assert model_names(src, ["a/b"], {}) == {"a/b": "a_b"}  # alone: the safe name, as before
    # a name a host of the state holds stays its holder's, even against the exact label
    assert model_names(src, ["a_b"], {"a_b": "a/b"}) == {"a_b": f"a_b-{tag('a_b')}"}
    # a label that is another's hashed name: the hashed name takes more digits, no two hosts share one
    twin = f"a_b-{tag('a/b')}"
    got = model_names(src, ["a/b", "a_b", twin], {})
    assert got[twin] == twin and got["a/b"] == f"a_b-{hashlib.sha256(b'a/b').hexdigest()[:16]}" and len(set(got.values())) == 3
    long = "x" * 300
    assert len(model_names(src, [long, long[:-1] + "/"], {})[long[:-1] + "/"]) == 200


def test_a_sidecar_left_alone_by_a_killed_drop_is_removed_by_the_next_pull_and_no_other(tmp_path):
    """A puller SIGKILLed between a drop's two renames leaves its sidecar without the CSV (the pull
    soak left 7 in 200 pulls). Before, they stayed for good; now the next pull removes its own such
    sidecars once a minute old, of its own models only, and nothing of another uid, a pair, a
    young one, a name it does not make, or one whose CSV the daemon is claiming."""
    from opt_ds_ops.sources.puller import LONE_SIDECAR_AGE_S, sweep_lone_sidecars

    spool = Path(spool_at(tmp_path))
    tok = "0123456789abcdef"
    old = time.time() - LONE_SIDECAR_AGE_S - 5
    files = {
        "score/10.0.0.5_9100.20260921T120100Z.%s.yaml" % tok: True,          # lone, old, own model: removed
        "incoming/10.0.0.5_9100.train-20260921T120100Z.%s.yaml" % tok: True,  # a training file's: removed
        "score/web_9100.20260921T120100Z.%s.yaml" % tok: False,              # its CSV is there
        "score/web_9100.20260921T120100Z.%s.csv" % tok: False,
        "score/other_9100.20260921T120100Z.%s.yaml" % tok: False,            # not a model of this source
        "score/10.0.0.5_9100.20260921T120100Z.yaml": False,                  # no token: another writer's name
        "score/10.0.0.5_9100.20260921T120600Z.%s.yaml" % ("f" * 16): False,  # young: a drop in progress
    }
    for rel in files:
        (spool / rel).write_text("model: x\n")
        if "120600Z" not in rel:
            os.utime(spool / rel, (old, old))
    claimed = "score/web_9100.20260921T120600Z.%s.yaml" % tok  # its CSV is being claimed: processing/ names it
    (spool / claimed).write_text("model: web_9100\n")
    os.utime(spool / claimed, (old, old))
    files[claimed] = False
    (spool / "processing" / "20261205T000000Z-abcd").mkdir(parents=True)
    (spool / "processing" / "20261205T000000Z-abcd" / "job.json").write_text(
        json.dumps({"dataset": "web_9100.20260921T120600Z.%s.csv" % tok, "drop": "score"}))
    removed = sweep_lone_sidecars(str(spool), {"10.0.0.5_9100", "web_9100"}, os.geteuid(), time.time())
    assert removed == sorted(rel for rel, gone in files.items() if gone)
    assert all((spool / rel).exists() != gone for rel, gone in files.items())
    # another uid's lone sidecar of the same model is never the puller's to remove
    (spool / ("score/web_9100.20260921T121100Z.%s.yaml" % tok)).write_text("model: web_9100\n")
    os.utime(spool / ("score/web_9100.20260921T121100Z.%s.yaml" % tok), (old, old))
    assert sweep_lone_sidecars(str(spool), {"web_9100"}, os.geteuid() + 1, time.time()) == []


@pytest.fixture(scope="module")
def prom_names(tmp_path_factory):
    """A real Prometheus with two hosts whose labels make one safe name: ``a/b`` with two days of
    history, ``a_b`` from day 1 on (too little history to train at 1.2 days: waiting)."""
    rows = np.loadtxt(SMD_TRAIN, delimiter=",", dtype=np.float64)[:, [0, 9]]
    fam = {"smd_a": ("gauge", {}), "smd_b": ("gauge", {}), "requests": ("counter", {})}
    for k, (host, first) in enumerate((("a/b", 0.0), ("a_b", 1.0 * DAY))):
        times = [T0 + 60 * i for i in range(STEPS) if 60 * i >= first]
        part = rows[2000 + 50 * k:2000 + 50 * k + STEPS] + 0.01 * k
        fam["smd_a"][1][host] = [(t, float(part[i, 0])) for i, t in enumerate(times)]
        fam["smd_b"][1][host] = [(t, float(part[i, 1])) for i, t in enumerate(times)]
        fam["requests"][1][host] = [(t, 50.0 * i) for i, t in enumerate(times)]
    server = PrometheusServer(tmp_path_factory.mktemp("prometheus-names"), openmetrics(fam)).start()
    yield server
    server.stop()


def test_a_waiting_host_keeps_its_claim_to_its_exact_name_and_a_given_name_is_kept(tmp_path, prom_names):
    """Before, a pull named only the hosts it looked at, so ``a/b`` (its history complete) took the
    name ``a_b`` while the host ``a_b`` waited for its history, which was then refused; a host's
    name was also worked out anew after ``models rm``. Now a waiting host's claim counts, the host
    whose label is the name exactly gets it, the other its hashed name, and a host keeps the name it
    was given when it is trained again."""
    import hashlib

    spool, state = spool_at(tmp_path), load_state(str(tmp_path / "state.json"))
    src, client = source(prom_names), Prometheus(prom_names.url)
    hashed = "a_b-" + hashlib.sha256(b"a/b").hexdigest()[:8]
    first = pull(src, client, spool, state, T0 + 1.2 * DAY)
    assert {h: v[0] for h, v in first.trained.items()} == {"a/b": hashed} and set(first.waiting) == {"a_b"}
    second = pull(src, client, spool, state, T0 + 1.3 * DAY, model_ready=lambda name: name == hashed)
    assert {h: v[0] for h, v in second.trained.items()} == {"a_b": "a_b"}
    # a/b's model removed from the store (ds-ops models rm): trained again, under the name it had
    third = pull(src, client, spool, state, T0 + 1.3 * DAY + 300, model_ready=lambda name: name == "a_b",
                 model_removed=lambda name: name == hashed)
    assert third.removed == {"a/b": hashed} and {h: v[0] for h, v in third.trained.items()} == {"a/b": hashed}


def test_a_new_model_prefix_models_every_host_again_under_its_new_name(tmp_path, prom, capsys):
    """docs/prometheus.md told an operator whose hosts' names another source holds to give the
    source its own ``model_prefix``, "which renames every host's model"; before, a trained host kept
    its old name in the state for good. Now the state keeps the prefix its names were made with,
    and a new one trains every host again under its new name, said in the journal with the old
    models to remove; a state from before (no prefix kept) is taken as made with today's."""
    from opt_ds_ops.commands.pull import Puller
    from opt_ds_ops.observe.journal import EventLog
    from opt_ds_ops.sources.metrics import PullMetrics

    spool, path = spool_at(tmp_path), str(tmp_path / "node.json")
    one = 'smd_a{{instance=~"h[34]:9100"}}'
    plain = parse_source(SOURCE.replace("query: smd_a\n", f"query: {one}\n").format(
        url=prom.url, shard="0/1", catch_up="1d").encode(), "node.yaml", "node")
    state = load_state(path)
    assert set(pull(plain, Prometheus(prom.url), spool, state, T0 + 1.2 * DAY).trained) == {"h3:9100", "h4:9100"}
    del state["model_prefix"]  # a state saved before the prefix was kept: taken as made with today's
    assert not pull(plain, Prometheus(prom.url), spool, state, T0 + 1.2 * DAY + 300).renamed
    assert state["model_prefix"] == ""
    save_state(path, state)
    prefixed = parse_source(SOURCE.replace("query: smd_a\n", f"query: {one}\n").format(
        url=prom.url, shard="0/1", catch_up="1d").encode() + b"model_prefix: dc1-\n", "node.yaml", "node")
    puller = Puller(prefixed, spool, path, PullMetrics(prefixed, ""), EventLog(journal=False), str(tmp_path / "models"))
    assert puller.once(T0 + 1.2 * DAY + 600)
    state = load_state(path)
    assert {h: e["model"] for h, e in state["hosts"].items() if e["model"]} == {"h3:9100": "dc1-h3_9100", "h4:9100": "dc1-h4_9100"}
    assert state["model_prefix"] == "dc1-"
    err = capsys.readouterr().err
    assert "model_prefix is now 'dc1-' (was ''): 2 host(s) are modelled again" in err and "h3_9100 h4_9100" in err
    assert len(list((tmp_path / "spool" / "incoming").glob("dc1-h*.train-*.csv"))) == 2
    # and back to no prefix: the first names' training files from before are not adopted (their rows
    # are old), each host is trained again from its last train_window
    before = Path(path).read_bytes()
    puller = Puller(plain, spool, path, PullMetrics(plain, ""), EventLog(journal=False), str(tmp_path / "models"))
    assert puller.once(T0 + 1.3 * DAY)
    err = capsys.readouterr().err
    assert "model_prefix is now '' (was 'dc1-')" in err and "was dropped before the puller last stopped" not in err
    assert len(list((tmp_path / "spool" / "incoming").glob("h*.train-*.csv"))) == 4
    # that pull killed after its drops, before its state was saved: the next adopts its own drops
    # (they end after the last pull saved under dc1-), and trains nothing twice
    Path(path).write_bytes(before)
    assert puller.once(T0 + 1.3 * DAY + 300)
    err = capsys.readouterr().err
    assert err.count("was dropped before the puller last stopped") == 2, err
    assert len(list((tmp_path / "spool" / "incoming").glob("h*.train-*.csv"))) == 4


def test_a_waiting_host_not_due_and_a_blocked_host_keep_their_claims_to_their_names(tmp_path, prom_names):
    """The re-review of the names: a waiting host that a pull does not look at (not due) still
    claims its exact name, and a host blocked by a member's model of its name holds it: a new host
    whose label makes the same name gets its hashed name and is trained, not refused for as long as
    the other waits or is blocked. The names a source's drops may carry (the sweep of lone
    sidecars) are the ones its pulls give."""
    import hashlib

    from opt_ds_ops.sources.puller import drop_names

    src, client = source(prom_names), Prometheus(prom_names.url)
    hashed = "a_b-" + hashlib.sha256(b"a/b").hexdigest()[:8]
    now = T0 + 1.2 * DAY
    waiting = {"format": 1, "hosts": {"a_b": {"model": None, "scored_until": None, "last_seen": None,
                                              "checked_at": now - 60, "seen_at": now - 60}}}
    got = pull(src, client, spool_at(tmp_path / "one"), waiting, now)
    assert {h: v[0] for h, v in got.trained.items()} == {"a/b": hashed} and "a_b" not in got.waiting  # not looked at
    blocked = {"format": 1, "hosts": {"a_b": {"model": "a_b", "scored_until": now - 600, "trained_at": now - 600,
                                              "last_seen": now - 600, "checked_at": now - 600, "seen_at": now - 600,
                                              "blocked": "its model name a_b belongs to uid 1001 (alice)"}}}
    assert drop_names(src, blocked) == set()
    taken = lambda name: "its model name a_b belongs to uid 1001 (alice)" if name == "a_b" else None  # noqa: E731
    got = pull(src, client, spool_at(tmp_path / "two"), blocked, now, model_taken=taken)
    assert {h: v[0] for h, v in got.trained.items()} == {"a/b": hashed} and not got.refused and set(got.blocked) == {"a_b"}
    assert drop_names(src, blocked) == {hashed}
    assert drop_names(src, waiting) == {hashed, "a_b"}  # a/b's own, and a_b's once it trains
