"""man ds-ops (debian/ds-ops.1): every subcommand of the parser has an entry with an example, and
the page has the exit codes, the files, the safe drops, requeue, deleting models, journal access
and the metric names; man(1) renders it without warnings where man is installed."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from conftest import REPO
from opt_ds_ops.cli import build_parser
from opt_ds_ops.observe.metrics import METRIC_NAMES

MANPAGE = REPO / "debian" / "ds-ops.1"


def subcommands() -> list[str]:
    (sub,) = [a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction"]
    return list(sub.choices)


def sections(text: str) -> dict[str, str]:
    parts = re.split(r"^\.SH (.+)$", text, flags=re.M)
    return {parts[i].strip('"'): parts[i + 1] for i in range(1, len(parts), 2)}


def test_every_subcommand_has_an_entry_with_an_example():
    commands = sections(MANPAGE.read_text())["COMMANDS"]
    entries = re.split(r"^\.TP\n", commands, flags=re.M)[1:]
    by_name = {}
    for entry in entries:
        m = re.match(r'\.BI? "?ds-ops ([a-z-]+)', entry)
        assert m, entry[:80]
        by_name[m.group(1)] = entry
    assert sorted(by_name) == sorted(subcommands())
    for name, entry in by_name.items():
        if name != "daemon":  # the service's own process: run by the unit, not by hand
            assert re.search(rf"^Example[s]?:\n(\.nf\n)?\.B (sudo )?ds-ops {re.escape(name)}\b", entry, re.M), name


def test_the_page_covers_exit_codes_files_drops_requeue_rm_journal_and_metrics():
    text = MANPAGE.read_text()
    s = sections(text)
    assert {"EXIT STATUS", "FILES", "SPOOL", "METRICS", "JOURNAL", "EXAMPLES"} <= set(s)
    assert all(f".B {code}" in s["EXIT STATUS"] for code in ("0", "1", "2"))
    assert ".part" in s["SPOOL"] and "rename" in s["SPOOL"]
    assert "systemd-journal" in s["JOURNAL"] and "adm" in s["JOURNAL"]
    assert "sudo ds-ops requeue" in text and "ds-ops models rm" in text.replace("\\-", "-")
    plain = s["METRICS"].replace("\\-", "-")
    assert all(name in plain for name in METRIC_NAMES), [n for n in METRIC_NAMES if n not in plain]


@pytest.mark.skipif(shutil.which("man") is None, reason="man(1) is not installed here")
def test_man_renders_the_page_without_warnings():
    r = subprocess.run(["man", "--warnings", "-l", str(MANPAGE)], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, MANWIDTH="100", LC_ALL="C.UTF-8", MANPAGER="cat", PAGER="cat"))
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert "ds-ops requeue NAME" in r.stdout
