"""Source files of ``ds-ops pull``: the shipped example parses, every bad key is one error naming the
file and the key, and ``ds-ops check-config --source`` says so."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import REPO
from opt_ds_ops.config.conffile import ConfigError
from opt_ds_ops.sources.sourcefile import load_source, parse_duration, parse_source

EXAMPLE = REPO / "docs" / "examples" / "node-exporter.source.yaml"
GOOD = "series:\n  - name: load1\n    query: max by (instance) (node_load1)\n"


def test_the_shipped_node_exporter_example_parses_with_its_names_and_clock():
    src = load_source(str(EXAMPLE))
    assert src.name == "node-exporter.source" and len(src.series) == 16 and src.columns[0] == "cpu_user"
    assert (src.step_s, src.seconds("train_window"), src.seconds("score_every"), src.shard) == (60, 7 * 86400, 300, (0, 1))
    assert all("by (instance)" in s.query for s in src.series)


@pytest.mark.parametrize("text, error", [
    ("", "a source file is a mapping with a 'series' list"),
    ("step: 1m\n", "key 'series' must be a list"),
    ("series: []\n", "key 'series' must be a list"),
    (GOOD + "stepp: 1m\n", "unknown key 'stepp' (allowed: prometheus, host_label, step,"),
    (GOOD + "seriess: []\n", "max_hosts, series)"),
    (GOOD + "step: 1 minute\n", "key 'step' must be a duration like 15s, 1m"),
    (GOOD + "prometheus: ftp://x\n", "key 'prometheus' must be an http(s) URL"),
    (GOOD + "shard: 2/2\n", "key 'shard' must be I/N with 0 <= I < N"),
    (GOOD + "host_label: host-name\n", "key 'host_label' must be a Prometheus label name"),
    (GOOD + "min_history: 1m\n", "key 'min_history' must be at least two steps"),
    (GOOD + "min_history: 8d\n", "and at most train_window"),
    (GOOD + "score_every: 10s\n", "key 'score_every' must be at least one step"),
    ("series:\n  - name: a\n    query: a\n  - name: a\n    query: b\n", "series[2].name 'a' is taken"),
    ("series:\n  - name: Time\n    query: a\n", "is the time column"),
    ("series:\n  - name: '7'\n    query: a\n", "series[1].name must be a column name"),
    ("series:\n  - name: a\n", "series[1] must be a mapping with exactly the keys name and query"),
    ("series:\n  - name: a\n    query: ''\n", "series[1].query must be PromQL text"),
    ("series: [\n", "invalid YAML"),
    (GOOD + "step: 1500ms\n", "key 'step' must be a whole number of seconds"),
    (GOOD + "step: 1m\nstep: 5m\n", "found the key 'step' twice"),  # PyYAML alone keeps the last
    ("series:\n  - name: a\n    query: a\n    query: b\n", "found the key 'query' twice"),
    (GOOD + "prometheus: http://user:pw@127.0.0.1:9090\n", "key 'prometheus' holds an @, as credentials do"),
])
def test_a_bad_source_is_one_error_naming_the_file_and_the_key(text, error):
    with pytest.raises(ConfigError) as e:
        parse_source(text.encode(), "/etc/ds-ops/sources/node.yaml", "node")
    assert str(e.value).startswith("/etc/ds-ops/sources/node.yaml") and error in str(e.value)


def test_durations_are_prometheus_durations():
    assert [parse_duration(d) for d in ("15s", "5m", "1.5h", "7d", "1w", "500ms")] == [15, 300, 5400, 604800, 604800, 0.5]
    with pytest.raises(ValueError):
        parse_duration("5 m")


def test_check_config_validates_sources(tmp_path):
    conf = tmp_path / "trainer.yaml"
    conf.write_text("")
    bad = tmp_path / "bad.yaml"
    bad.write_text(GOOD + "shard: 3/2\n")
    cmd = [sys.executable, "-m", "opt_ds_ops.cli", "check-config", "--config", str(conf), "--source", str(EXAMPLE)]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert p.returncode == 0, p.stderr
    assert f"{EXAMPLE}: ok: 16 series from http://127.0.0.1:9090, one model per instance, a row every 1m, shard 0/1" in p.stdout
    p = subprocess.run([*cmd, "--source", str(bad)], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert p.returncode == 1 and f"ds-ops: error: {bad}: key 'shard' must be I/N" in p.stderr


def test_ds_ops_pull_starts_without_torch(tmp_path):
    """The puller is one process per source beside the daemon: its command imports neither torch nor
    the training code (1.5 s and 265 MB resident before; about 0.15 s and 40 MB now)."""
    code = ("import sys; from opt_ds_ops.cli import main; rc = main(['pull', sys.argv[1], '--once', '--config', '/dev/null']); "
            "print(rc, sorted(m for m in ('torch', 'opt_ds_ops.training', 'opt_ds_ops.model') if m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "absent.yaml")], capture_output=True, text=True,
                       cwd=REPO, timeout=120)
    assert p.stdout.split("\n")[0] == "1 []", p.stdout + p.stderr
    assert "absent.yaml: cannot read" in p.stderr and "Traceback" not in p.stderr


def test_credentials_in_the_url_are_refused_and_never_printed(tmp_path):
    """A password in the URL would be printed by check-config and in every failed pull's line:
    refused, without showing it, by check-config and by ds-ops pull; a merge key still works."""
    conf = tmp_path / "trainer.yaml"
    conf.write_text(f"spool:\n  dir: {tmp_path}\n")
    src = tmp_path / "node.yaml"
    # the forms urlsplit reads differently from a plain pattern: # or ? or / in the password, a tab or
    # a control character that urlsplit drops
    for url in ("https://alice:s3cr3t-pw@prom.example:9090/", "http://alice:s3cr3t#x@h", "http://alice:s3cr3t?x@h",
                "http://alice:s3c/r3t@h", '"h\\tttp://alice:s3cr3t@h"', '"\\x01http://alice:s3cr3t@h"'):
        src.write_text(GOOD + f"prometheus: {url}\n")
        for cmd in (["check-config", "--config", str(conf), "--source", str(src)],
                    ["pull", str(src), "--config", str(conf), "--once"]):
            p = subprocess.run([sys.executable, "-m", "opt_ds_ops.cli", *cmd], capture_output=True, text=True, cwd=REPO,
                               timeout=120)
            assert p.returncode == 1 and "key 'prometheus' holds an @, as credentials do" in p.stderr, (url, p.stderr)
            assert "s3c" not in p.stdout + p.stderr and "alice" not in p.stdout + p.stderr, (url, p.stderr)
    merged = parse_source(b"series:\n  - &b {name: a, query: up}\n  - <<: *b\n    name: b\n", "m.yaml", "m")
    assert merged.columns == ["a", "b"]  # YAML's merge key repeats keys on purpose: not a duplicate


@pytest.mark.skipif(os.path.exists("/etc/ds-ops/trainer.yaml"), reason="the default conffile is installed")
def test_check_config_validates_a_source_where_no_conffile_is_installed():
    p = subprocess.run([sys.executable, "-m", "opt_ds_ops.cli", "check-config", "--source", str(EXAMPLE)],
                       capture_output=True, text=True, cwd=REPO, timeout=120,
                       env={k: v for k, v in os.environ.items() if k != "DS_OPS_CONFIG"})
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == (f"{EXAMPLE}: ok: 16 series from http://127.0.0.1:9090, one model per instance, "
                                "a row every 1m, shard 0/1")
