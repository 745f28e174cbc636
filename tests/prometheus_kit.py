"""A real Prometheus (Debian's prometheus package) for the puller's tests: history written as
OpenMetrics, made into TSDB blocks by ``promtool tsdb create-blocks-from openmetrics`` (the way an
operator backfills), served by a ``prometheus`` process on a free loopback port, stopped after.
Skipped where prometheus is not installed, failing instead under CI (DS_OPS_CI=1)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest


def need_prometheus() -> None:
    if shutil.which("prometheus") and shutil.which("promtool"):
        return
    if os.environ.get("DS_OPS_CI"):
        pytest.fail("prometheus and promtool are not installed (Debian's prometheus package; .ci/run installs it)")
    pytest.skip("needs Debian's prometheus package (prometheus, promtool)")


def openmetrics(families: dict[str, tuple[str, dict[str, list[tuple[float, float]]]]]) -> str:
    """Return OpenMetrics text of {metric: (type, {instance: [(time, value), ...]})}."""
    lines = []
    for metric, (kind, hosts) in families.items():
        lines.append(f"# TYPE {metric} {kind}")
        for host, points in hosts.items():
            suffix = "_total" if kind == "counter" else ""
            lines += [f'{metric}{suffix}{{instance="{host}"}} {v!r} {t:.3f}' for t, v in points]
    return "\n".join(lines) + "\n# EOF\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrometheusServer:
    """``prometheus`` on 127.0.0.1 serving the blocks made from ``text`` (OpenMetrics), with
    ``scrape_configs`` (YAML, flow style) as its own."""

    def __init__(self, root: Path, text: str, scrape_configs: str = "[]"):
        need_prometheus()
        self.root = root
        self.tsdb = root / "tsdb"
        self.tsdb.mkdir(parents=True, exist_ok=True)
        (root / "history.om").write_text(text)
        subprocess.run(["promtool", "tsdb", "create-blocks-from", "openmetrics", str(root / "history.om"), str(self.tsdb)],
                       check=True, capture_output=True, timeout=300)
        (root / "prometheus.yml").write_text(f"global:\n  scrape_interval: 1m\nscrape_configs: {scrape_configs}\n")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = None

    def start(self) -> "PrometheusServer":
        self.log = open(self.root / "prometheus.log", "ab")
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={self.root / 'prometheus.yml'}", f"--storage.tsdb.path={self.tsdb}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=3650d"],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {(self.root / 'prometheus.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError("prometheus not ready in 120 s")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
