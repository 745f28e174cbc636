"""A Debian 12 system booted with systemd as PID 1 in ``systemd-nspawn``, entered with ``nsenter``.

How, and why this way (tmpfs /run in a private mount namespace, ``--register=no``, nsenter instead
of machinectl): ../shared/recipes/systemd-e2e/README.md. Needs root, systemd-container, debootstrap
and zstd on the host.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


class ContainerError(RuntimeError):
    """The container could not be booted, or a command in it failed."""


def cached_rootfs(deb: Path) -> Path:
    """Given the .deb under test, return the cached root file system tarball that can install it.

    Built by rootfs.sh (debootstrap, about 80 s) when missing. Raise ContainerError if it fails.
    """
    r = subprocess.run([str(HERE / "rootfs.sh"), str(deb)], capture_output=True, text=True)
    if r.returncode != 0:
        raise ContainerError(f"rootfs.sh failed ({r.returncode}):\n{r.stderr}")
    if r.stderr:
        print(r.stderr, end="")
    return Path(r.stdout.strip())


class Container:
    """One booted container: ``run`` executes a command inside it; ``stop`` halts it cleanly.

    ``binds`` maps host directories to read-only paths inside; the container has no network.
    """

    def __init__(self, tarball: Path, binds: dict[Path, str], log_dir: Path):
        self.log_dir = log_dir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix="ds-ops-e2e.", dir="/var/tmp"))
        self.root = self.work / "root"
        self.root.mkdir()
        started = time.monotonic()
        subprocess.run(f"zstd -dc {tarball} | tar -C {self.root} --numeric-owner --xattrs --acls -xf -",
                       shell=True, check=True)
        self.timings = {"extract_s": time.monotonic() - started}
        self.name = f"ds-ops-e2e-{os.getpid()}"
        args = [f"--machine={self.name}", "--private-network"]
        args += [f"--bind-ro={host}:{inside}" for host, inside in binds.items()]
        self.console = open(self.log_dir / "console.log", "wb")
        started = time.monotonic()
        self.nspawn = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", str(HERE / "nspawn-boot.sh"),
             str(self.root), *args],
            stdin=subprocess.DEVNULL, stdout=self.console, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            self.pid1 = self._find_pid1()
            self._wait_running()
        except BaseException:
            self.stop()
            raise
        self.timings["boot_s"] = time.monotonic() - started

    def _find_pid1(self, timeout_s: float = 30) -> int:
        """Return the host PID of the container's systemd: the child of systemd-nspawn named systemd.

        (unshare and nspawn-boot.sh exec, so our child process ends up being systemd-nspawn.)
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.nspawn.poll() is not None:
                raise ContainerError(f"systemd-nspawn exited with {self.nspawn.returncode}; see "
                                     f"{self.log_dir / 'console.log'}")
            found = subprocess.run(["pgrep", "-P", str(self.nspawn.pid), "-x", "systemd"],
                                   capture_output=True, text=True).stdout.split()
            if found:
                return int(found[0])
            time.sleep(0.1)
        raise ContainerError("no systemd process appeared in the container")

    def _wait_running(self, timeout_s: float = 60) -> None:
        # is-system-running --wait fails at once until PID 1 has its private bus socket: retry.
        deadline = time.monotonic() + timeout_s
        state = ""
        while time.monotonic() < deadline:
            r = self.run(["systemctl", "is-system-running", "--wait"], check=False, timeout=timeout_s)
            state = r.stdout.strip()
            if state in ("running", "degraded"):
                break
            time.sleep(0.2)
        if state != "running":
            failed = self.run(["systemctl", "--failed", "--no-pager"], check=False).stdout
            raise ContainerError(f"container did not reach 'running' (state {state!r}):\n{failed}")

    def run(self, argv: list[str] | str, *, check: bool = True, user: str | None = None,
            timeout: float = 600, input: str | None = None) -> subprocess.CompletedProcess:
        """Run argv (a list, or a string for ``sh -c``) inside the container as root or ``user``.

        Return the completed process (text stdout/stderr). Raise ContainerError if check and it
        exits non-zero.
        """
        if isinstance(argv, str):
            argv = ["sh", "-c", argv]
        if user:
            argv = ["runuser", "-u", user, "--", *argv]
        full = ["nsenter", "--target", str(self.pid1), "--all", "--",
                "env", "-i", "PATH=/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8", "HOME=/root",
                "DEBIAN_FRONTEND=noninteractive", *argv]
        r = subprocess.run(full, capture_output=True, text=True, timeout=timeout, input=input)
        if check and r.returncode != 0:
            raise ContainerError(f"{argv} exited with {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}")
        return r

    def wait_for(self, argv: list[str] | str, timeout_s: float, what: str, interval_s: float = 0.5,
                 user: str | None = None) -> subprocess.CompletedProcess:
        """Run argv until it exits 0; return that run. Raise ContainerError after timeout_s."""
        deadline = time.monotonic() + timeout_s
        while True:
            r = self.run(argv, check=False, user=user)
            if r.returncode == 0:
                return r
            if time.monotonic() > deadline:
                raise ContainerError(f"timed out after {timeout_s:.0f} s waiting for {what}\n"
                                     f"last stdout:\n{r.stdout}\nlast stderr:\n{r.stderr}")
            time.sleep(interval_s)

    def save_journal(self) -> None:
        """Write the whole journal of this boot to log_dir/journal.txt (for CI artefacts)."""
        try:
            r = self.run(["journalctl", "-b", "--no-pager", "-o", "short-precise"], check=False, timeout=60)
            (self.log_dir / "journal.txt").write_text(r.stdout + r.stderr)
        except Exception as e:  # a diagnostic must not hide the test's own failure
            (self.log_dir / "journal.txt").write_text(f"could not read the journal: {e}\n")

    def stop(self) -> None:
        """Halt the container (SIGTERM to systemd-nspawn = clean shutdown) and delete its files."""
        started = time.monotonic()
        if self.nspawn.poll() is None:
            self.nspawn.send_signal(signal.SIGTERM)
            try:
                self.nspawn.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.nspawn.pid, signal.SIGKILL)
                self.nspawn.wait(timeout=30)
        self.console.close()
        self.timings["halt_s"] = time.monotonic() - started
        shutil.rmtree(self.work, ignore_errors=True)
        self.timings["remove_s"] = time.monotonic() - started - self.timings["halt_s"]
