"""The daemon split by role (issue 22): each of its modules stays small enough to read in one sitting.

The main loop and its signals (daemon.py), job slots and GPUs (slots.py), a job's claim, start and
messages (jobs.py), its end (endings.py), recovery at start-up (recovery.py), the periodic duties
(duties.py) and the timing they share (pacing.py): each under 450 lines, and none of them imports
daemon.py back.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "opt_ds_ops"
DAEMON_ROLES = ("daemon", "slots", "jobs", "endings", "recovery", "duties", "pacing")
MAX_LINES = 450


@pytest.mark.parametrize("name", DAEMON_ROLES)
def test_each_daemon_role_module_is_under_450_lines(name):
    lines = len((PACKAGE / f"{name}.py").read_text(encoding="utf-8").splitlines())
    assert lines < MAX_LINES, f"opt_ds_ops/{name}.py has {lines} lines; split it by role (limit {MAX_LINES})"


def imported_modules(path: Path) -> set[str]:
    """Given a module of opt_ds_ops, return the opt_ds_ops modules it imports (at any depth of its code)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("opt_ds_ops."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("opt_ds_ops."))
    return found


@pytest.mark.parametrize("name", [n for n in DAEMON_ROLES if n != "daemon"] + ["scorer", "retrain"])
def test_no_part_of_the_daemon_imports_daemon_py_back(name):
    assert "daemon" not in imported_modules(PACKAGE / f"{name}.py"), (
        f"opt_ds_ops/{name}.py imports opt_ds_ops.daemon: the data flows one way, daemon.py imports its roles")
