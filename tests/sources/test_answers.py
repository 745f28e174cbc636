"""What ``ds-ops pull`` does with an answer no real Prometheus gives: a malformed field of a 200
answer, or an answer that trickles in. The peer is a small HTTP server of the test's own (the one
fake here: a real Prometheus cannot be made to answer this), the puller the real command."""

from __future__ import annotations

import http.server
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.parse

import pytest

from conftest import REPO
from opt_ds_ops.sources.prometheus import Prometheus, PrometheusError

T0 = 1_790_000_000 // 86400 * 86400.0
GOOD = [[T0 + 60 * i, "1.5"] for i in range(3)]


def _answer(result) -> bytes:
    return json.dumps({"status": "success", "data": {"resultType": "matrix", "result": result}}).encode()


def _series(metric=None, values=None) -> list:
    return [{"metric": {"instance": "h:9100"} if metric is None else metric, "values": GOOD if values is None else values}]


# each field of a 200 answer with the wrong type or value, and what the error names
MALFORMED = {
    "label set an object list": (_answer([{"metric": [1, 2], "values": GOOD}]), "label set that is not a mapping"),
    "label set null": (_answer([{"metric": None, "values": GOOD}]), "label set that is not a mapping"),
    "numeric host label": (_answer(_series({"instance": 42})), "not a label value's text"),
    "empty host label": (_answer(_series({"instance": ""})), "not a label value's text"),
    "values an object": (_answer(_series(values={"a": 1})), "values that are not a list"),
    "values null": (_answer([{"metric": {"instance": "h:9100"}, "values": None}]), "values that are not a list"),
    "a 3-item point": (_answer(_series(values=[[T0, "1", "2"]])), 'point that is not [time, "value"]'),
    "a point null": (_answer(_series(values=[None])), "point that is not"),
    "value an object": (_answer(_series(values=[[T0, {"v": 1}]])), "value that is not a number's text"),
    "value null": (_answer(_series(values=[[T0, None]])), "value that is not a number's text"),
    "value abc": (_answer(_series(values=[[T0, "abc"]])), "value that is not a number's text"),
    "value a bare number": (_answer(_series(values=[[T0, 1.5]])), "value that is not a number's text"),
    "time a string": (_answer(_series(values=[["NaN", "1"]])), "time that is not a finite number"),
    "time NaN": (_answer(_series(values=[[T0, "1"]])).replace(str(T0).encode(), b"NaN"), "time that is not a finite number"),
    "time null": (_answer(_series(values=[[None, "1"]])), "time that is not a finite number"),
    "time true": (_answer(_series(values=[[True, "1"]])), "time that is not a finite number"),
    "result an object": (json.dumps({"status": "success", "data": {"resultType": "matrix", "result": {"a": 1}}}).encode(),
                         "is not Prometheus's JSON"),
    "data a list": (b'{"status": "success", "data": [1]}', "is not Prometheus's JSON"),
    "not JSON at all": (b"\x00\xffnot json", "is not Prometheus's JSON"),
    "time of 400 digits": (_answer(_series(values=[[T0, "1"]])).replace(str(T0).encode(), b"9" * 400),
                           "time that is not a finite number"),
    "nested 200,000 deep": (b"[" * 200_000, "is not Prometheus's JSON"),
}

# answers that break HTTP itself, sent as raw bytes (the status line, a header, the chunks)
BROKEN_HTTP = {
    "no status line": b"garbage\r\n\r\n",
    "a 70 kB header": b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n{}",
    "a bad chunk size": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    "a body cut short": b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n{\"status\"",
}


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True


def serve(body, trickle_s: float = 0.0):
    """An HTTP server on a free loopback port that answers every POST with ``body`` (200; or
    ``body(form)``, the request's form fields), one byte every ``trickle_s`` seconds if that is
    set; return (server, its URL)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            form = urllib.parse.parse_qs(self.rfile.read(int(self.headers.get("Content-Length", 0))).decode())
            answer = body({k: v[0] for k, v in form.items()}) if callable(body) else body
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            try:
                if trickle_s:
                    for i in range(len(answer)):
                        self.wfile.write(answer[i:i + 1])
                        self.wfile.flush()
                        time.sleep(trickle_s)
                else:
                    self.wfile.write(answer)
            except OSError:
                pass  # the client gave up

        def log_message(self, *args):
            pass

    server = _Server(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def serve_raw(answer: bytes, pace_s: float = 0.0):
    """A TCP server on a free loopback port that reads a request and sends ``answer`` as it is
    (one byte every ``pace_s`` seconds if set), then closes; return (server socket, its URL)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)

    def loop():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.recv(65536)
                    if pace_s:
                        for i in range(len(answer)):
                            conn.sendall(answer[i:i + 1])
                            time.sleep(pace_s)
                    else:
                        conn.sendall(answer)
                except OSError:
                    pass  # the client gave up

    threading.Thread(target=loop, daemon=True).start()
    return listener, f"http://127.0.0.1:{listener.getsockname()[1]}"


@pytest.mark.parametrize("case", sorted(BROKEN_HTTP))
def test_an_answer_that_breaks_http_is_an_error_never_a_crash(case):
    listener, url = serve_raw(BROKEN_HTTP[case])
    try:
        with pytest.raises(PrometheusError) as e:
            Prometheus(url, timeout_s=5).query_range("up", T0, T0 + 120, 60.0, "instance")
    finally:
        listener.close()
    assert e.value.unavailable and "not reachable" in str(e.value), str(e.value)


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\nX-A: 1\r\nX-B: 2\r\nX-C: 3\r\nX-D: 4\r\n\r\n",  # headers at a byte every 0.2 s
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"0" * 40 + b"2\r\n{}\r\n0\r\n\r\n",  # a chunk size
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 60\r\n\r\n" + b"x" * 60,  # an error's body
], ids=["headers", "chunk size", "error body"])
def test_every_part_of_a_slow_answer_is_cut_off_at_the_deadline(answer):
    listener, url = serve_raw(answer, pace_s=0.2)
    t = time.monotonic()
    try:
        with pytest.raises(PrometheusError, match=r"did not answer 'up' in full within timeout_s \(2 s\)") as e:
            Prometheus(url, timeout_s=2).query_range("up", T0, T0 + 120, 60.0, "instance")
    finally:
        listener.close()
    assert e.value.unavailable and time.monotonic() - t < 2 + 1.5, time.monotonic() - t  # the answer: 12 s and more


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_field_is_an_error_naming_it_never_a_crash(case):
    body, says = MALFORMED[case]
    server, url = serve(body)
    try:
        with pytest.raises(PrometheusError) as e:
            Prometheus(url, timeout_s=5).query_range("up", T0, T0 + 120, 60.0, "instance")
    finally:
        server.shutdown()
        server.server_close()
    assert says in str(e.value), str(e.value)


def test_a_well_formed_answer_still_reads():
    server, url = serve(_answer(_series(values=GOOD + [[T0 + 180, "NaN"], [T0 + 240, "+Inf"]])))
    try:
        out = Prometheus(url, timeout_s=5).query_range("up", T0, T0 + 240, 60.0, "instance")
    finally:
        server.shutdown()
    assert out == {"h:9100": {T0: 1.5, T0 + 60: 1.5, T0 + 120: 1.5}}  # NaN and +Inf: missing, not numbers


def test_an_answer_that_trickles_in_is_cut_off_at_its_deadline():
    """An answer at two bytes a second: cut off once timeout_s passes, not read for as long as it trickles."""
    server, url = serve(_answer(_series()), trickle_s=0.5)
    t = time.monotonic()
    try:
        with pytest.raises(PrometheusError, match=r"did not answer 'up' in full within timeout_s \(2 s\)") as e:
            Prometheus(url, timeout_s=2).query_range("up", T0, T0 + 120, 60.0, "instance")
    finally:
        server.shutdown()
        server.server_close()
    took = time.monotonic() - t
    assert e.value.unavailable and took < 2 + 1.5, took  # the answer alone would take about 100 s


SOURCE = """prometheus: {url}
step: 1m
train_window: 1d
min_history: 1h
timeout_s: 5
series:
  - name: up
    query: up
"""


def test_ds_ops_pull_says_one_line_and_sets_up_0_for_each_malformed_answer(tmp_path):
    """Acceptance: ``ds-ops pull --once`` against each malformed answer: exit status 1, one
    "pull failed" line naming the field, ds_ops_pull_up 0, no traceback, nothing dropped."""
    spool, prom = tmp_path / "spool", tmp_path / "prom"
    for d in ("incoming", "score"):
        (spool / d).mkdir(parents=True)
    prom.mkdir()
    (tmp_path / "trainer.yaml").write_text(f"spool:\n  dir: {spool}\nmetrics:\n  textfile_dir: {prom}\n"
                                           f"models_dir: {tmp_path / 'models'}\n")
    for case in sorted(MALFORMED):
        body, says = MALFORMED[case]
        server, url = serve(body)
        try:
            (tmp_path / "node.yaml").write_text(SOURCE.format(url=url))
            p = subprocess.run([sys.executable, "-m", "opt_ds_ops.cli", "pull", str(tmp_path / "node.yaml"), "--config",
                                str(tmp_path / "trainer.yaml"), "--state-dir", str(tmp_path / "state"), "--once",
                                "--now", str(T0 + 86400)], capture_output=True, text=True, cwd=REPO, timeout=120)
        finally:
            server.shutdown()
        assert p.returncode == 1, (case, p.stderr)
        assert "Traceback" not in p.stderr, (case, p.stderr)
        lines = [line for line in p.stderr.splitlines() if "pull failed" in line]
        assert len(lines) == 1 and says in lines[0], (case, p.stderr)
        assert 'ds_ops_pull_up{source="node"} 0.0' in (prom / "ds_ops_pull_node.prom").read_text(), case
        assert not any(spool.rglob("*.csv")), case


def test_ds_ops_pull_looks_for_a_hosts_model_in_the_store_models_dir_names(tmp_path):
    """``--models-dir``: the store of a daemon whose conffile the puller does not read; a host
    whose model has a current version there is scored, one whose store is elsewhere waits."""
    def up(form: dict) -> bytes:  # one host, a value every step of the range asked
        start, end, step = (float(form[k]) for k in ("start", "end", "step"))
        n = int((end - start) // step) + 1
        return _answer(_series(values=[[start + i * step, f"{i % 7}.5"] for i in range(n)]))

    spool, models = tmp_path / "spool", tmp_path / "daemon-models"
    for d in ("incoming", "score"):
        (spool / d).mkdir(parents=True)
    server, url = serve(up)
    try:
        (tmp_path / "node.yaml").write_text(SOURCE.format(url=url))
        def pull(now: float, *extra: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "opt_ds_ops.cli", "pull", str(tmp_path / "node.yaml"),
                                   "--spool-dir", str(spool), "--state-dir", str(tmp_path / "state"),
                                   "--once", "--now", str(now), *extra], capture_output=True, text=True, cwd=REPO, timeout=120)

        p = pull(T0 + 86400, "--config", "/dev/null", "--models-dir", str(models))
        assert p.returncode == 0 and "to incoming/ to train model h_9100" in p.stderr, p.stderr
        (models / "h_9100" / "v1").mkdir(parents=True)
        (models / "h_9100" / "current").symlink_to("v1")  # the daemon trained it
        other = tmp_path / "other.yaml"  # the store of --config, when --models-dir is not given: not there
        other.write_text(f"models_dir: {tmp_path / 'other-models'}\n")
        p = pull(T0 + 86400 + 600, "--config", str(other))
        assert p.returncode == 0 and "waiting for their model's first version" in p.stderr, p.stderr
        assert not any((spool / "score").iterdir())
        p = pull(T0 + 86400 + 1200, "--config", str(other), "--models-dir", str(models))
        assert p.returncode == 0, p.stderr
        # a spool path that is not there is said so, not "run as a member of group ds-ops" (before)
        p = subprocess.run([sys.executable, "-m", "opt_ds_ops.cli", "pull", str(tmp_path / "node.yaml"), "--spool-dir",
                            str(tmp_path / "no-spool"), "--once"], capture_output=True, text=True, cwd=REPO, timeout=120)
        assert p.returncode == 1 and f"no spool directory {tmp_path / 'no-spool' / 'incoming'}" in p.stderr, p.stderr
    finally:
        server.shutdown()
    assert [e.name for e in (spool / "score").iterdir() if e.name.endswith(".csv")], p.stderr
