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

# Findings in opt_ds_ops/dataset/ (another change owns those files), kept until they are fixed:
# "TARGET/NAME": the bug. Remove a line when its input passes.
KNOWN = {
    "csv/Error-text._split-9b1d4a7cd226": "text._split: a CR inside an unquoted field raises _csv.Error (issue 18 row 5)",
    "csv_gz/Error-text._split-1cae0e473e5f": "text._split: a CR inside an unquoted field raises _csv.Error (issue 18 row 5)",
    "csv/StopIteration-text._column_infos-ed96f7bfdff3": "text._column_infos: a column of numbers and times only "
                                                          "raises StopIteration",
    "csv_gz/StopIteration-text._column_infos-a818ed4c7bec": "text._column_infos: a column of numbers and times only "
                                                             "raises StopIteration",
    "npy/TokenError-arrays._npy_header-ccfea5fa6d93": "arrays._npy_header: a header numpy cannot tokenize raises "
                                                       "tokenize.TokenError",
    "npz/TokenError-arrays._npy_header-e326c2a24493": "arrays._npy_header: a header numpy cannot tokenize raises "
                                                       "tokenize.TokenError",
    "npz/NotImplementedError-arrays._load_npz-1e7c2d88f09a": "arrays._load_npz: zipfile's NotImplementedError "
                                                              "(zip version 23.0) is not caught",
    "npz/NotImplementedError-arrays._load_npz-2721ee6b40a5": "arrays._load_npz: zipfile's NotImplementedError "
                                                              "(strong encryption) is not caught",
    "npz/IndexError-arrays.listcomp-7ee9c35f2c98": "arrays._load_npz: a member with an empty name raises IndexError "
                                                    "in ZipInfo.is_dir",
    "arrow/SystemError-columnar._info-67995f28a502": "columnar._info (to_pylist): unvalidated string offsets, "
                                                      "SystemError (issue 18 row 3)",
    "arrow/Segmentation-fault-timeindex.add-f6bde7d9f2cf": "timeindex.add (Arrow cast): an unvalidated Arrow IPC file "
                                                            "kills the process with SIGSEGV (issue 18 row 3)",
    "arrow/Bus-error-timeindex.add-73de24ba8edd": "timeindex.add (Arrow cast): an unvalidated Arrow IPC file reads "
                                                   "past its memory map, SIGBUS (issue 18 row 3)",
    "arrow/KeyError-columnar.batches-447d0e69c56e": "columnar._open (stream batches): two fields of one name raise "
                                                     "KeyError in RecordBatch.select",
    "arrow/Bus-error-columnar._info-1ed1a73edba7": "columnar._info (to_pylist): an unvalidated Arrow IPC file reads "
                                                    "past its memory map, SIGBUS (issue 18 row 3)",
}


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
