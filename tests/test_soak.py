"""The soak tests (scripts/soak.py, scripts/fuzz_soak.py) at smoke size: real daemons SIGKILLed
while real drops, good and hostile, arrive.

`make soak` runs the full size (200 datasets, 100 kills, 4 writers); this runs 12 datasets, 5 kills
and 2 writers (about 30 s on 2 cores) so that the script itself stays working. `make fuzz-soak`
runs 500 hostile items and 50 kills; the smoke test here 40 items and 3 kills. `make soak` also
runs scripts/alert_soak.py with 50 chunks and 50 kills; the smoke test here 4 chunks.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO


def test_soak_smoke(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "soak.py"), "--datasets", "12", "--kills", "5", "--writers", "2",
         "--root", str(tmp_path / "soak"), "--timeout-s", "600"],
        capture_output=True, text=True, cwd=REPO, timeout=900,  # a hang guard only; the soak has its own timeout
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "soak passed" in proc.stdout, proc.stdout


def test_alert_soak_smoke(tmp_path):
    """scripts/alert_soak.py at smoke size: 4 chunks that each open an incident, a SIGKILL in each."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "alert_soak.py"), "--chunks", "4", "--root", str(tmp_path / "alerts"),
         "--timeout-s", "400"],
        capture_output=True, text=True, cwd=REPO, timeout=600,  # a hang guard only; the soak has its own timeout
    )
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "alert soak: ok" in proc.stdout, proc.stdout


def test_fuzz_soak_smoke(tmp_path):
    """scripts/fuzz_soak.py at smoke size: 40 hostile items of every kind, 4 good datasets, 3 kills."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "fuzz_soak.py"), "--hostile", "40", "--good", "4", "--kills", "3",
         "--root", str(tmp_path / "fuzz-soak"), "--timeout-s", "300", "--stall-s", "60"],
        capture_output=True, text=True, cwd=REPO, timeout=600,  # a hang guard only; the soak has its own timeout
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "fuzz soak passed" in proc.stdout, proc.stdout
    assert "hostile_dropped: 40" in proc.stdout and "kills: 3" in proc.stdout, proc.stdout


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
