"""Helpers for tests that run the real ``ds-ops daemon`` process on temporary directories."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from conftest import REPO, SMD_TRAIN

SMD_ROWS = 23694  # rows of the bundled machine-1-2 training file (data/smd/README.md)
START_TIMEOUT_S = 120  # generous: the test machines are shared and importing torch takes seconds
JOB_TIMEOUT_S = 300


def write_config(root: Path, *, epochs: int = 1, batch_size: int = 2048, settle_s: float = 0.5,
                 scan_interval_s: float = 30.0, max_dataset_bytes: int | None = None, watcher: str | None = None,
                 max_crashes: int | None = None, name: str = "trainer.yaml", quiet_s: float = 1.0,
                 extra: list[str] | None = None, shipped_training: bool = False, train_keys: tuple[str, ...] = ()) -> Path:
    """Write a conffile for a daemon on root/spool and root/models; return its path.
    ``shipped_training``: no ``train:`` keys (the shipped plateau rule), ``epochs`` and ``batch_size`` unused.
    ``train_keys``: more ``train:`` lines, ``KEY: VALUE`` each."""
    train = [] if shipped_training else [
        "train:",
        f"  epochs: {epochs}",
        "  stopping: epochs",  # daemon tests count epochs; the plateau rule is tested apart
        f"  batch_size: {batch_size}",
        "  lr: 1.0e-3",  # the seed's, as the daemon tests were written for (the shipped default is 1e-2)
    ]
    if train_keys:
        train = (train or ["train:"]) + [f"  {k}" for k in train_keys]
    lines = [
        f"models_dir: {root / 'models'}",
        "device: cpu",
        *train,
        "spool:",
        f"  dir: {root / 'spool'}",
        f"  settle_s: {settle_s}",
        f"  scan_interval_s: {scan_interval_s}",
        f"  quiet_s: {quiet_s}",
    ]
    if max_dataset_bytes is not None:
        lines.append(f"  max_dataset_bytes: {max_dataset_bytes}")
    if watcher is not None:
        lines.append(f"  watcher: {watcher}")
    if max_crashes is not None:
        lines.append(f"  max_crashes: {max_crashes}")
    lines += extra or []
    path = root / name
    path.write_text("\n".join(lines) + "\n")
    return path


def drop_dac_capabilities(caps: tuple[int, ...] = (1, 2)) -> None:
    """preexec_fn: remove CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from the bounding set, so that a
    root daemon gets EACCES on a mode-000 file like any service user would (PR_CAPBSET_DROP).
    ``caps``: the capability numbers to drop (see :func:`as_service_user`)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in caps:
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def as_service_user() -> None:
    """preexec_fn: a root daemon with no more power over other users' files than the unit's user
    ds-ops: without CAP_CHOWN, CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH and CAP_FOWNER (so chmod,
    chown and utime of another uid's inode fail with EPERM, as they do for the service)."""
    drop_dac_capabilities((0, 1, 2, 3))


def base_env(**extra: str) -> dict:
    """The environment of a daemon under test: this repository importable, not under systemd.

    OMP_NUM_THREADS=1: the suite runs torch processes side by side on 2 cores, where two OpenMP
    threads each made a 1-epoch SMD training 7-60x slower (0.27-6 s against 0.04 s, measured).
    """
    env = {k: v for k, v in os.environ.items() if k not in ("JOURNAL_STREAM", "NOTIFY_SOCKET", "WATCHDOG_USEC",
                                                           "WATCHDOG_PID", "DS_OPS_CONFIG")}
    env["PYTHONPATH"] = str(REPO)
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


class Daemon:
    """One real ``python -m opt_ds_ops.cli daemon --config CONF`` process, output in root/daemon-N.log."""

    count = 0

    def __init__(self, conf: Path, *, env: dict | None = None, preexec_fn=None, argv: list[str] | None = None):
        Daemon.count += 1
        self.conf = conf
        self.log_path = conf.parent / f"daemon-{Daemon.count}.log"
        self._log = open(self.log_path, "wb")
        cmd = argv or [sys.executable, "-m", "opt_ds_ops.cli", "daemon", "--config", str(conf)]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO,
                                     env=env or base_env(), preexec_fn=preexec_fn)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_until(self, predicate, what: str, timeout_s: float = JOB_TIMEOUT_S, poll_s: float = 0.05):
        """Poll predicate() until it returns something truthy; fail with the daemon's log on timeout or exit."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            if not self.alive():
                raise AssertionError(f"daemon exited ({self.proc.returncode}) before: {what}\n{self.log()}")
            time.sleep(poll_s)
        raise AssertionError(f"timed out after {timeout_s} s waiting for: {what}\n{self.log()}")

    def stop(self, sig=signal.SIGTERM, timeout_s: float = 60) -> tuple[int, float]:
        """Send sig and wait; return (exit code, seconds from signal to exit)."""
        t0 = time.monotonic()
        self.proc.send_signal(sig)
        rc = self.proc.wait(timeout_s)
        self._log.close()
        return rc, time.monotonic() - t0

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait(30)
        self._log.close()


def run_until(conf: Path, predicate, what: str, **daemon_kwargs) -> "Daemon":
    """Start a daemon on conf, wait until predicate() is true, stop it with SIGTERM and assert it
    exited 0; return it (its log stays readable). The process is killed if anything fails first."""
    d = Daemon(conf, **daemon_kwargs)
    try:
        d.wait_until(predicate, what)
        rc, _ = d.stop()
        assert rc == 0, d.log()
    finally:
        d.kill()
    return d


@contextlib.contextmanager
def service(root: Path, preexec_fn, env: dict | None = None, **cfg):
    """A real daemon on root (``preexec_fn``: as which user, e.g. :func:`as_service_user`), with
    incoming/ at the package's mode 3770; asserts at the end that the same process is alive and
    stops with 0."""
    conf = write_config(root, **cfg)
    d = Daemon(conf, preexec_fn=preexec_fn, env=env)
    try:
        d.wait_until(lambda: "ds-trainer ready" in d.log(), "the daemon to be ready", timeout_s=START_TIMEOUT_S)
        os.chmod(spool_dir(root, "incoming"), 0o3770)
        yield d
        assert d.alive(), d.log()
        rc, _ = d.stop()
        assert rc == 0, d.log()
    finally:
        d.kill()


class NotifySocket:
    """A unix datagram socket standing in for systemd's NOTIFY_SOCKET; a thread collects the messages
    (as systemd does: an unread socket fills after 10 datagrams and blocks the sender)."""

    def __init__(self, path: Path):
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.2)
        self.messages: list[str] = []
        self._closed = False
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._closed:
            try:
                self.messages.append(self.sock.recv(65536).decode())
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return

    def drain(self) -> list[str]:
        return list(self.messages)

    def close(self) -> None:
        self._closed = True
        self._thread.join(2)
        self.sock.close()


def spool_dir(root: Path, which: str) -> Path:
    return root / "spool" / which


def done_names(root: Path) -> set[str]:
    d = spool_dir(root, "done")
    return {p.name for p in d.iterdir() if not p.name.endswith(".result.json")} if d.exists() else set()


def failed_names(root: Path) -> set[str]:
    d = spool_dir(root, "failed")
    return {p.name for p in d.iterdir() if not p.name.endswith(".error.json")} if d.exists() else set()


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def job_dir(root: Path, name: str) -> Path | None:
    """The processing/JOB directory whose record names dataset ``name``, or None."""
    processing = spool_dir(root, "processing")
    if not processing.exists():
        return None
    for d in sorted(processing.iterdir()):
        try:
            if json.loads((d / "job.json").read_text()).get("dataset") == name:
                return d
        except (FileNotFoundError, NotADirectoryError, ValueError):
            continue
    return None


def job_record(root: Path, name: str) -> dict | None:
    """The job record (processing/JOB/job.json) of dataset ``name``, or None if there is none (yet)."""
    d = job_dir(root, name)
    try:
        return json.loads((d / "job.json").read_text()) if d else None
    except (FileNotFoundError, ValueError):
        return None


def versions(root: Path, model_name: str) -> list[str]:
    """Complete model versions of model_name (hidden temporary directories excluded)."""
    d = root / "models" / model_name
    if not d.exists():
        return []
    return sorted(p.name for p in d.iterdir() if not p.name.startswith(".") and p.name != "current")


def copy_smd(dest: Path) -> Path:
    """Copy the bundled real SMD machine-1-2 training file (gzip text) to dest."""
    dest.write_bytes(SMD_TRAIN.read_bytes())
    return dest


def job_context():
    """The multiprocessing context an in-process daemon's jobs start in: the daemon's own forkserver
    (:func:`opt_ds_ops.daemon.worker.context`, torch and ds-ops imported once for all the test's
    jobs instead of once per spawned job). A job is forked from a server started in the state of the
    test that starts it (environment, directory, umask, limits: tests/conftest.py restarts a server
    started in another), so no test's jobs see another's environment; tests in the same state share
    a server, and none outlives a test that leaves a job behind."""
    from opt_ds_ops.daemon import worker

    return worker.context()


def in_process_daemon(conf: Path, gate=None):
    """Return (a Daemon of conffile ``conf`` run in this process, with its job processes forked by
    the test's forkserver (:func:`job_context`); the journal events it sends, as dicts with
    MESSAGE): tick it with ``d._tick()``. ``gate`` replaces the job processes' health gate
    (tests/fakes/scripted_gate.py); its start-up health check runs in this process, which has the
    test's fakes of NVML and CUDA (``health_in_process``)."""
    import io

    from opt_ds_ops.config.conffile import load_config
    from opt_ds_ops.daemon import service as daemon_mod
    from opt_ds_ops.daemon.notify import Notifier
    from opt_ds_ops.observe.journal import EventLog
    from opt_ds_ops.spool import open_spool

    cfg = load_config(str(conf))
    sent: list[dict] = []
    log = EventLog(journal=False, stream=io.StringIO())
    log._journal = type("Capture", (), {"send": staticmethod(lambda MESSAGE, **f: sent.append(dict(f, MESSAGE=MESSAGE)))})
    d = daemon_mod.Daemon(cfg, open_spool(cfg.spool.dir), log, Notifier({}), str(conf),
                          mp_context=job_context(), gate=gate, health_in_process=True)
    return d, sent


def tick_until(d, until, sent: list[dict], look=lambda: None, *, no_failures_in: Path | None = None,
               deadline_s: float = 300) -> list:
    """Tick an in-process daemon (:func:`in_process_daemon`) until ``until()``, asserting it ends
    within deadline_s seconds (the journal's lines shown if not) and, given ``no_failures_in`` (a
    test's root), that nothing lands in its failed/; return ``look()`` after each tick."""
    d.watcher.scan()
    seen = []
    deadline = time.monotonic() + deadline_s
    while not until():
        assert time.monotonic() < deadline, [e["MESSAGE"] for e in sent]
        d._tick()
        if no_failures_in is not None:
            assert not failed_names(no_failures_in), [e["MESSAGE"] for e in sent]
        seen.append(look())
    return seen


def stop_in_process(d, deadline_s: float = 300) -> None:
    """Ask an in-process Daemon to stop (as its SIGTERM handler does), tick it until its jobs have
    ended (asserting they do within deadline_s seconds), then stop its watcher."""
    d.stop_requested = True
    deadline = time.monotonic() + deadline_s
    while d.jobs:
        assert time.monotonic() < deadline
        d._tick()
    d.watcher.stop()


def job_in_processing(tmp_path, name: str, job_id: str, state: str = "running", **extra) -> Path:
    """Lay out processing/JOB as the daemon leaves it when killed: the record and the dataset copy."""
    jdir = spool_dir(tmp_path, "processing") / job_id
    jdir.mkdir(parents=True)
    copy_smd(jdir / "dataset.txt.gz")
    record = {"job_id": job_id, "dataset": name, "state": state, "crashes": 0, "claimed_at": "2026-11-30T00:00:00.000000Z",
              "model_name": name.split(".")[0], "data_file": "dataset.txt.gz", "sha256": hashlib.sha256(SMD_TRAIN.read_bytes()).hexdigest(),
              "size_bytes": SMD_TRAIN.stat().st_size, **extra}
    (jdir / "job.json").write_text(json.dumps(record))
    return jdir


def save_version(tmp_path, model_name: str, job_id: str, *, publish: bool) -> str:
    """Write a model version as a job process would (metadata with its job id), optionally without
    the `current` swap (a SIGKILL between the version's rename and the swap)."""
    from opt_ds_ops.store import versions as store
    from opt_ds_ops.config.conffile import TrainConfig
    from opt_ds_ops.dataset import load_dataset
    from opt_ds_ops.health.device import plan_device
    from opt_ds_ops.training.fit import train

    result = train(load_dataset(str(SMD_TRAIN)).data[:3000], TrainConfig(epochs=1), plan_device("cpu", "off"))
    md = {"job_id": job_id, "dataset": {"file": "machine-1-2.txt.gz", "rows": 3000, "columns": 38, "sha256": hashlib.sha256(SMD_TRAIN.read_bytes()).hexdigest()},
          "epochs": 1, "history": [], "final_train_loss": 1.0, "final_val_loss": 1.0, "threshold": 1.0,
          "threshold_quantile": 0.99, "samples_per_s": 1.0, "device": "cpu", "amp_dtype": "off", "duration_s": 1.0}
    if publish:
        model_dir, _ = store.save_model(str(tmp_path / "models"), model_name, store.model_payload(result), md)
    else:
        real = store.publish
        store.publish = lambda *a: None
        try:
            model_dir, _ = store.save_model(str(tmp_path / "models"), model_name, store.model_payload(result), md)
        finally:
            store.publish = real
    return model_dir


def prom_samples(prom_path: Path) -> dict[tuple, float]:
    """Parse a ds_ops.prom with prometheus_client's parser: {(name, sorted labels): value}; {} while
    it is absent (the daemon says it is ready before its first write of the file)."""
    from prometheus_client.parser import text_string_to_metric_families

    if not prom_path.exists():
        return {}
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(prom_path.read_text()) for s in family.samples}
