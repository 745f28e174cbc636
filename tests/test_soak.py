"""The soaks (scripts/soak.py, scripts/alert_soak.py, scripts/pull_soak.py, scripts/fuzz_soak.py):
real daemons or pullers SIGKILLed while real drops, good and hostile, arrive.

They are marked ``soak`` and run by their own targets, once, at the size those give: `make soak`
(the soak, the alert soak and the pull soak) and `make fuzz-soak`, which CI runs at its size (.ci/run); `make
test` deselects them. Each takes its arguments from an environment variable, set by those targets
(an empty value: the script's own defaults, the full soak); unset, as when one is run by hand with
``pytest -m soak tests/test_soak.py``, it runs at smoke size: 12 datasets, 5 kills and 2 writers;
4 chunks; 20 pulls; 40 hostile items, 4 good datasets and 3 kills (about 30 s each on 2 cores).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import REPO

SMOKE = {
    "DS_OPS_SOAK_ARGS": "--datasets 12 --kills 5 --writers 2 --timeout-s 600",
    "DS_OPS_ALERT_SOAK_ARGS": "--chunks 4 --timeout-s 400",
    "DS_OPS_PULL_SOAK_ARGS": "--pulls 20 --timeout-s 400",
    "DS_OPS_FUZZ_SOAK_ARGS": "--hostile 40 --good 4 --kills 3 --timeout-s 300 --stall-s 60",
}


def _soak(script: str, variable: str, root: Path) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run scripts/SCRIPT with the arguments $VARIABLE gives (its smoke size where unset) under
    root, its output printed as it comes (the soak targets and CI's stages show it: pytest -s) and
    kept; return the finished process and the arguments. Every soak has its own --timeout-s."""
    args = shlex.split(os.environ.get(variable, SMOKE[variable]))
    cmd = [sys.executable, str(REPO / "scripts" / script), "--root", str(root), *args]  # a --root of theirs wins
    lines = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO) as p:
        for line in p.stdout:
            print(line, end="", flush=True)
            lines.append(line)
    return subprocess.CompletedProcess(cmd, p.returncode, "".join(lines), ""), args


@pytest.mark.soak
def test_soak(tmp_path):
    proc, _ = _soak("soak.py", "DS_OPS_SOAK_ARGS", tmp_path / "soak")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "soak passed" in proc.stdout, proc.stdout[-6000:]


@pytest.mark.soak
def test_alert_soak(tmp_path):
    """scripts/alert_soak.py: chunks that each open an incident, a SIGKILL in each."""
    proc, _ = _soak("alert_soak.py", "DS_OPS_ALERT_SOAK_ARGS", tmp_path / "alerts")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "alert soak: ok" in proc.stdout, proc.stdout[-6000:]


@pytest.mark.soak
def test_pull_soak(tmp_path):
    """scripts/pull_soak.py: ds-ops pull SIGKILLed at random points of its pulls from a real
    Prometheus, a member planting names and taking two hosts' model names: every host's rows
    scored once, the anomaly paged once, the taken hosts blocked."""
    from prometheus_kit import need_prometheus

    need_prometheus()
    # not under tmp_path: pytest makes its folders 0700, and the puller runs as a uid of its own
    root = Path(tempfile.mkdtemp(prefix="ds-ops-pull-soak-"))  # the soak removes it when it passes
    proc, args = _soak("pull_soak.py", "DS_OPS_PULL_SOAK_ARGS", root)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "pull soak passed" in proc.stdout, proc.stdout[-6000:]
    if os.geteuid() == 0:  # the member is another uid only as root
        assert "member uid 12345" in proc.stdout and "'aimed after a drop'" in proc.stdout, proc.stdout[-6000:]


@pytest.mark.soak
def test_fuzz_soak(tmp_path):
    """scripts/fuzz_soak.py: hostile items of every kind and good datasets, the daemon SIGKILLed;
    every item it was asked for dropped and every kill done."""
    proc, args = _soak("fuzz_soak.py", "DS_OPS_FUZZ_SOAK_ARGS", tmp_path / "fuzz-soak")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "fuzz soak passed" in proc.stdout, proc.stdout[-6000:]
    sys.path.insert(0, str(REPO / "scripts"))
    import fuzz_soak

    asked = fuzz_soak.parser().parse_args(args)
    assert f"hostile_dropped: {asked.hostile}" in proc.stdout and f"kills: {asked.kills}" in proc.stdout, proc.stdout[-6000:]


def test_fuzz_soak_items_and_their_bytes_follow_the_seed(tmp_path):
    """The same --seed drops the same items with the same bytes (a failure is reproducible); another does not."""
    sys.path.insert(0, str(REPO / "scripts"))
    import fuzz_soak
    import soak

    datasets = soak.Datasets(3, 18)
    seeds = fuzz_soak.seed_files(datasets.matrix)
    assert set(seeds) == set(fuzz_soak.SEED_FORMATS)

    def drop_all(seed: int, where: Path) -> dict[str, bytes]:
        where.mkdir()
        dirs = soak.make_spool(where)
        h = fuzz_soak.Hostile(len(fuzz_soak.KINDS) + 1, datasets.plans[:1], seed, seeds, dirs, 1, 0.0)
        h.drop_squats()
        for it in h.items[1:]:
            h.make(it)
        h.stop()  # the holders of held-open files
        for t in h.stallers:
            t.join(30)
        return {e.name: (e.is_file(follow_symlinks=False) and Path(e.path).read_bytes(), it)
                for it in h.items for e in os.scandir(dirs["incoming"]) if e.name in it["entries"]}

    first, again, other = (drop_all(s, tmp_path / n) for s, n in ((18, "a"), (18, "b"), (19, "c")))
    kinds = {it["kind"] for _, it in first.values()}
    assert kinds == set(fuzz_soak.KINDS) | {"squat"}
    assert {n: b for n, (b, _) in first.items()} == {n: b for n, (b, _) in again.items()}
    assert {n: b for n, (b, _) in first.items()} != {n: b for n, (b, _) in other.items()}
