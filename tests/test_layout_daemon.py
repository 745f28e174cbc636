"""The daemon split by role: each of its modules stays small enough to read in one sitting, and
each role is an object of its own, given what it needs, not a mixin sharing the daemon's ``self``.

The main loop and its signals (service.py), job slots and GPUs (slots.py), a job's claim, start
and messages (dispatch.py), its end (outcome.py), recovery at start-up (recovery.py), the
periodic duties (duties.py) and the timing they share (pacing.py): each under 450 lines, and
none of them imports service.py back.
"""

import ast
from pathlib import Path

import pytest

DAEMON = Path(__file__).resolve().parent.parent / "opt_ds_ops" / "daemon"
DAEMON_ROLES = ("service", "slots", "dispatch", "outcome", "recovery", "duties", "pacing")
MAX_LINES = 450


@pytest.mark.parametrize("name", DAEMON_ROLES)
def test_each_daemon_role_module_is_under_450_lines(name):
    lines = len((DAEMON / f"{name}.py").read_text(encoding="utf-8").splitlines())
    assert lines < MAX_LINES, f"opt_ds_ops/daemon/{name}.py has {lines} lines; split it by role (limit {MAX_LINES})"


def imported_modules(path: Path) -> set[str]:
    """Given a module of opt_ds_ops/daemon, return the daemon modules it imports (at any depth of its code)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("opt_ds_ops.daemon."):
            found.add(node.module.split(".")[2])
    return found


@pytest.mark.parametrize("name", [n for n in DAEMON_ROLES if n != "service"] + ["scoreslot", "retrainer", "jobstack"])
def test_no_part_of_the_daemon_imports_service_py_back(name):
    assert "service" not in imported_modules(DAEMON / f"{name}.py"), (
        f"opt_ds_ops/daemon/{name}.py imports opt_ds_ops.daemon.service: the data flows one way, service.py imports its roles")


def test_the_import_walk_sees_a_sibling_import(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from .service import Daemon\n    from . import pacing\n")
    assert imported_modules(module) == {"service", "pacing"}
