"""The soak test (scripts/soak.py) at smoke size: real daemons SIGKILLed while real drops arrive.

`make soak` runs the full size (200 datasets, 100 kills, 4 writers); this runs 12 datasets, 5 kills
and 2 writers (about 30 s on 2 cores) so that the script itself stays working.
"""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO


def test_soak_smoke(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "soak.py"), "--datasets", "12", "--kills", "5", "--writers", "2",
         "--root", str(tmp_path / "soak"), "--timeout-s", "600"],
        capture_output=True, text=True, cwd=REPO, timeout=900,  # a hang guard only; the soak has its own timeout
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "soak passed" in proc.stdout, proc.stdout
