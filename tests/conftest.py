"""Shared fixtures: paths to the bundled real SMD data, small real datasets, and a CLI runner."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
SMD = REPO / "data" / "smd"
SMD_TRAIN = SMD / "train" / "machine-1-2.txt.gz"
SMD_TEST = SMD / "test" / "machine-1-2.txt.gz"
SMD_LABELS = SMD / "test_label" / "machine-1-2.txt.gz"
# The ten labelled SMD machines: ../shared/data/smd beside the checkout (CI lays it there), or $DS_OPS_SMD_DIR.
SHARED_SMD = Path(os.environ.get("DS_OPS_SMD_DIR", REPO.parent / "shared" / "data" / "smd"))


# How long each test of a second or more took alone (seconds, one process, the idle 2-core machine):
# make test hands out the test files with the most of it first, so that no long file starts last and
# runs alone at the end (pytest-xdist's loadfile scheduling gives a free worker the next file in
# collection order, and keeps a file on one worker: its module fixtures are made once). Written by
# ``pytest --store-durations`` (make test-durations); files it does not know run after, in their order.
DURATIONS = Path(__file__).resolve().parent / "durations.json"


def pytest_addoption(parser):
    parser.addoption("--store-durations", action="store_true",
                     help=f"write the duration of each test of a second or more to {DURATIONS.name}")


@pytest.hookimpl(trylast=True)  # after -m and -k took out what does not run
def pytest_collection_modifyitems(config, items):
    """The files with the most known test time first, each file's tests together in their own
    order (a stable sort). Every xdist worker sorts the same way, as it must: the controller checks
    that they collected one order."""
    try:
        known = json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        return
    per_file: dict[str, float] = {}
    for item in items:
        file = item.nodeid.split("::")[0]
        per_file[file] = per_file.get(file, 0.0) + known.get(item.nodeid, 0.0)
    items.sort(key=lambda item: -per_file.get(item.nodeid.split("::")[0], 0.0))


_durations: dict[str, float] = {}


def pytest_runtest_logreport(report):
    if report.when in ("setup", "call", "teardown"):
        _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    """--store-durations: the tests of this run replace their own entries (a run of one file keeps
    the others'); written only after a run that passed, not one that failed or was interrupted."""
    if session.config.getoption("store_durations") and not os.environ.get("PYTEST_XDIST_WORKER") and exitstatus == 0:
        try:
            known = json.loads(DURATIONS.read_text())
        except (OSError, ValueError):
            known = {}
        known = {k: v for k, v in known.items() if k not in _durations}
        known.update({k: round(v, 1) for k, v in _durations.items() if v >= 1.0})
        DURATIONS.write_text(json.dumps(dict(sorted(known.items(), key=lambda kv: -kv[1])), indent=0) + "\n")


def pytest_configure(config):
    """Under pytest-xdist (make test: more workers than cores), one thread of torch in each worker:
    two OpenMP threads per torch process side by side on 2 cores made a 1-epoch SMD training 7-60x
    slower (tests/daemon_kit.py's base_env measured it). The processes the tests start keep their
    thread count (a CLI run as a user runs it: the README's make demo output is what 2 threads
    print), but their OpenMP threads wait for work asleep (OMP_WAIT_POLICY=PASSIVE), not spinning:
    beside a busy core, 300 training steps of 2 threads took 0.88 s of CPU spinning, 0.27 s asleep.
    The numbers they compute do not change."""
    # A suite started in the background by a shell without job control (`make test &`, nohup in a
    # script) inherits SIGINT ignored, and so would every process it starts: the tests that stop a
    # command with SIGINT (Ctrl-C) saw it ignored and failed (status --follow never exited; a
    # 2-process training ran to its end, exit 0). The suite's processes get SIGINT's default back.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp, which reads it
        import torch

        torch.set_num_threads(1)


def _process_state() -> tuple:
    """What a process forked by the forkserver inherits from the state the server was started in:
    the environment (but the name of the running test, which pytest sets and only pytest reads),
    working directory, resource limits, nice value, user, and the umask, signal mask, ignored
    signals, groups and capability bounding set (/proc/self/status)."""
    import resource

    limits = tuple(resource.getrlimit(getattr(resource, name)) for name in dir(resource) if name.startswith("RLIMIT_"))
    status = tuple(line for line in Path("/proc/self/status").read_text().splitlines()
                   if line.split(":")[0] in ("Umask", "SigBlk", "SigIgn", "Groups", "CapBnd", "Uid", "Gid"))
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"))  # pytest's, per test
    return env, os.getcwd(), limits, os.getpriority(os.PRIO_PROCESS, 0), status


_FORKSERVER_STARTED_IN: list = [None]  # the _process_state() the running forkserver was started in


def _forkserver_in_the_callers_state() -> None:
    """Wrap multiprocessing's forkserver start (``ensure_running``, called at each job's start) so a
    job is always forked from a server started in the state of the test that starts the job: a
    server started in another state (another test's environment, limits, directory) is stopped and
    started again. Tests in the same state share one server instead of paying its start each
    (torch, torch._dynamo and ds-ops imported: 2.4 s of CPU, measured; about 40 in-process servers a
    run)."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    if getattr(server, "_ds_ops_tests_wrapped", False):
        return
    start = server.ensure_running

    def ensure_running():
        state = _process_state()
        pid = server._forkserver_pid
        if pid is not None and _FORKSERVER_STARTED_IN[0] != state:
            if _children_of(pid):
                raise RuntimeError("a test changed its process state (environment, limits, ...) while a job "
                                   "forked in the old state still runs: set it before the daemon's first job")
            server._stop()
        start()
        _FORKSERVER_STARTED_IN[0] = state

    server.ensure_running = ensure_running
    server._ds_ops_tests_wrapped = True


def _children_of(pid: int) -> list[int]:
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(entry))
    return children


@pytest.fixture(autouse=True)
def _a_tests_jobs_end_with_it():
    """Nothing a test's in-process daemon forked outlives the test: a job process of the forkserver
    (tests/daemon_kit.py ``job_context``) still alive at the test's end (a test that failed before
    stopping its daemon) is killed (SIGKILL; its own children die with it, PR_SET_PDEATHSIG) and
    the server stopped. (Stopping the server alone would wait for its jobs: each holds the server's
    end of the pipe the server waits on.) A server with no job left stays for the next test, which
    forks from it only if it runs in the state the server was started in
    (:func:`_forkserver_in_the_callers_state`)."""
    _forkserver_in_the_callers_state()
    yield
    forkserver = sys.modules.get("multiprocessing.forkserver")
    pid = forkserver._forkserver._forkserver_pid if forkserver is not None else None
    children = _children_of(pid) if pid is not None else []
    if children:
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        forkserver._forkserver._stop()


@pytest.fixture(scope="session")
def smd_rows() -> np.ndarray:
    """The bundled real SMD machine-1-2 training rows, (23694, 38) float32."""
    return np.loadtxt(SMD_TRAIN, delimiter=",", dtype=np.float32)


@pytest.fixture
def small_smd_csv(tmp_path, smd_rows) -> Path:
    """A real 3,000-row slice of SMD machine-1-2 as a headerless CSV file."""
    path = tmp_path / "machine-small.csv"
    np.savetxt(path, smd_rows[:3000], delimiter=",", fmt="%.6f")
    return path


@pytest.fixture
def spool(tmp_path):
    """A fresh spool (incoming/, processing/, done/, failed/) under tmp_path."""
    from opt_ds_ops.spool import open_spool

    return open_spool(str(tmp_path / "spool"))


def put(spool, which: str, name: str, data: bytes = b"1,2\n3,4\n") -> str:
    """Write data to the spool directory ``which`` (incoming, processing, ...) as name; return its path."""
    path = spool.path(which, name)
    with open(path, "wb") as f:
        f.write(data)
    return path


# The conffile of CLI runs that give none (tests/cli-quick.yaml: the seed's 5 epochs, not a plateau).
CLI_QUICK_CONFIG = Path(__file__).resolve().parent / "cli-quick.yaml"


def pt_with_pickle(path, pkl: bytes | None = None, compression: int = zipfile.ZIP_STORED) -> str:
    """torch.save's archive of a (4, 3) tensor, its data.pkl replaced by ``pkl``, its members
    written with ``compression``."""
    import torch

    torch.save(torch.arange(12, dtype=torch.float32).reshape(4, 3), path)
    with zipfile.ZipFile(path) as z:
        members = [(i.filename, z.read(i)) for i in z.infolist()]
    with zipfile.ZipFile(path, "w", compression) as z:
        for name, data in members:
            z.writestr(name, pkl if pkl is not None and name.endswith("/data.pkl") else data)
    return str(path)


def run_cli(*args: str, env: dict | None = None, timeout: float = 300,
            shipped_defaults: bool = False) -> subprocess.CompletedProcess:
    """Run ``python -m opt_ds_ops.cli ARGS`` as a real process; return the completed process.

    Without ``--config`` among ARGS it reads :data:`CLI_QUICK_CONFIG` (``$DS_OPS_CONFIG``), unless
    ``shipped_defaults``: then no conffile at all, the built-in defaults a new user gets.
    """
    full_env = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    full_env.pop("DS_OPS_CONFIG", None)
    if not shipped_defaults and "--config" not in args:
        full_env["DS_OPS_CONFIG"] = str(CLI_QUICK_CONFIG)
    return subprocess.run(
        [sys.executable, "-m", "opt_ds_ops.cli", *args],
        capture_output=True, text=True, env=full_env, timeout=timeout, cwd=REPO,
    )


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    """Keep each phase's report on the test item (``item.rep_call``), so a fixture can print
    diagnostics after a failed test (tests/e2e/test_alerts_e2e.py; the pattern of pytest's docs,
    "Making test result information available in fixtures"). Here and not in a tests/e2e/conftest.py:
    the tests import this file as ``conftest``, and a second module of that name would shadow it."""
    rep = yield
    setattr(item, f"rep_{rep.when}", rep)
    return rep
