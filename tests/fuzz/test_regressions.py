"""Every committed fuzz input, seed and finding, through its fuzz target (tests/fuzz/targets.py).

A target may read an input or refuse it with DatasetError/ConfigError; any other exception, a
crash of the process or more than targets.TIMEOUT_S seconds on one input fails the test. Inputs
run in a child process (``python tests/fuzz/targets.py TARGET FILE...``): the seeds of a target
together, each finding of ``scripts/fuzz.py`` (tests/fuzz/regressions/TARGET/) on its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

FUZZ = Path(__file__).resolve().parent
REPO = FUZZ.parent.parent
sys.path.insert(0, str(FUZZ))
from targets import TARGETS, TIMEOUT_S  # noqa: E402

# Findings not fixed yet, kept as expected failures: "TARGET/NAME": the bug. Remove a line when
# its input passes. Every finding so far is fixed (docs/development-fuzz.md): none is left.
KNOWN: dict[str, str] = {}


def _inputs(kind: str) -> list[Path]:
    return sorted(p for p in (FUZZ / kind).glob("*/*") if p.is_file() and p.parent.name in TARGETS)


def run_target(target: str, paths: list[Path]) -> subprocess.CompletedProcess:
    """Run the target on the files in a child process, as the fuzzer ran it."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, str(FUZZ / "targets.py"), target, *map(str, paths)], cwd=REPO, env=env,
                          capture_output=True, text=True, errors="replace", timeout=30 + TIMEOUT_S * len(paths))


def _verdict(p: subprocess.CompletedProcess) -> str:
    return f"exit {p.returncode}\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_every_seed_of_the_target_is_read_or_refused_in_time(target):
    seeds = [p for p in _inputs("corpus") if p.parent.name == target]
    assert seeds, f"no seed corpus in tests/fuzz/corpus/{target}/"
    p = run_target(target, seeds)
    assert p.returncode == 0 and sum(ln.startswith("ok ") for ln in p.stdout.splitlines()) == len(seeds), _verdict(p)


REGRESSIONS = _inputs("regressions")


@pytest.mark.parametrize("path", [pytest.param(p, id=f"{p.parent.name}/{p.name}", marks=[pytest.mark.xfail(
    reason=KNOWN[f"{p.parent.name}/{p.name}"], strict=False)] if f"{p.parent.name}/{p.name}" in KNOWN else [])
    for p in REGRESSIONS])
def test_a_fuzz_finding_is_read_or_refused_in_time(path):
    p = run_target(path.parent.name, [path])
    assert p.returncode == 0 and f"ok {path}" in p.stdout, _verdict(p)


def test_every_known_finding_is_committed():
    assert not set(KNOWN) - {f"{p.parent.name}/{p.name}" for p in REGRESSIONS}
