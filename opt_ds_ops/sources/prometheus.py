"""Prometheus's HTTP API, the one call the puller needs: ``/api/v1/query_range``.

Prometheus answers at most 11,000 points per series per query, so a longer range is asked in
pieces (:data:`MAX_POINTS` steps each) and joined. Every answer is bounded in bytes before it is
parsed (``max_response_bytes``): a query that matches far more series than expected is an error
naming the bound, never a daemon's worth of memory, and must arrive whole within ``timeout_s`` of
the request: connection, headers and body (one that trickles in is cut off then, not read for as
long as it trickles). A value Prometheus gives as NaN or ±Inf is a missing value here (the row
will say so), never a number. Every field of an answer is checked before it is used: a label set that is not a mapping,
a host label that is not text, a point that is not ``[time, "value"]``, a time that is not a finite
number or a value that is not a number's text is a :class:`PrometheusError` naming the query and
the field, never a crash.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import socket
import threading
import urllib.parse

MAX_POINTS = 11000  # Prometheus's limit of points per series in one query_range answer


class PrometheusError(Exception):
    """The query failed: ``unavailable`` when the server could not be reached or answered 5xx
    (try again later), else the query or the answer was bad (a 4xx, an answer over the bound)."""

    def __init__(self, message: str, unavailable: bool = False):
        super().__init__(message)
        self.unavailable = unavailable


def _pieces(start: float, end: float, step: float) -> list[tuple[float, float]]:
    """Return [start, end] cut into ranges of at most MAX_POINTS steps each (both ends inclusive)."""
    out, span = [], (MAX_POINTS - 1) * step
    t = start
    while t <= end:
        out.append((t, min(end, t + span)))
        t += span + step
    return out


class Prometheus:
    """A Prometheus server at ``url`` (its base: ``http://host:9090``, or a path prefix)."""

    def __init__(self, url: str, timeout_s: float = 30.0, max_response_bytes: int = 64 << 20):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.max_response_bytes = max_response_bytes

    def query_range(self, query: str, start: float, end: float, step: float, label: str) -> dict[str, dict[float, float]]:
        """Return {value of ``label``: {time: value}} for ``query`` over [start, end] at ``step``
        seconds, asked in pieces of at most MAX_POINTS steps. A result series without ``label``
        is an error naming it (the query lost the host label: ``sum by (LABEL) (...)``); two of
        one host (the query kept another label) too. Raises PrometheusError."""
        out: dict[str, dict[float, float]] = {}
        for lo, hi in _pieces(start, end, step):
            for metric, values in self._matrix(query, lo, hi, step):
                host = self._host(query, metric, label)
                points = out.setdefault(host, {})
                for t, value in self._points(query, values, label, host):
                    if t in points:
                        raise PrometheusError(f"{query!r} gives more than one series for {label}={host!r} "
                                              f"({_labels(metric)}); aggregate the others away, e.g. sum by ({label}) (...)")
                    if math.isfinite(value):
                        points[t] = value
        return out

    def _host(self, query: str, metric, label: str) -> str:
        """The value of ``label`` in a result series' label set: text, else PrometheusError."""
        if not isinstance(metric, dict):
            raise PrometheusError(f"{self.url}: a result series of {query!r} has a label set that is not a mapping: "
                                  f"{_short(metric)}")
        host = metric.get(label)
        if host is None:
            raise PrometheusError(f"a result series of {query!r} has no label {label!r} ({_labels(metric)}); "
                                  f"keep it in the query, e.g. sum by ({label}) (...)")
        if not isinstance(host, str) or not host:
            raise PrometheusError(f"{self.url}: a result series of {query!r} has label {label} = {_short(host)}, "
                                  "not a label value's text")
        return host

    def _points(self, query: str, values, label: str, host: str):
        """Yield (time, value) of a result series' ``values``: each ``[time, "value"]``, the time a
        finite number, the value a number's text (NaN and ±Inf allowed); else PrometheusError."""
        where = f"{self.url}: the answer to {query!r} for {label}={host!r}"
        if not isinstance(values, list):
            raise PrometheusError(f"{where} has values that are not a list: {_short(values)}")
        for point in values:
            if not isinstance(point, list) or len(point) != 2:
                raise PrometheusError(f"{where} has a point that is not [time, \"value\"]: {_short(point)}")
            t, v = point
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not _finite(t):
                raise PrometheusError(f"{where} has a time that is not a finite number: {_short(t)}")
            try:
                if not isinstance(v, str):
                    raise ValueError
                value = float(v)
            except ValueError:
                raise PrometheusError(f"{where} has a value that is not a number's text: {_short(v)}") from None
            yield float(t), value

    def _matrix(self, query: str, start: float, end: float, step: float) -> list[tuple[dict, list]]:
        body = urllib.parse.urlencode({"query": query, "start": repr(start), "end": repr(end), "step": repr(step)}).encode()
        status, raw = self._post("/api/v1/query_range", body, query)
        if status != 200:
            raise PrometheusError(f"{self.url} answered HTTP {status} to {query!r}: {_error_of(raw[:65536])}",
                                  unavailable=status >= 500 or status == 429)
        if len(raw) > self.max_response_bytes:
            raise PrometheusError(f"the answer to {query!r} over {_when(start)}..{_when(end)} is over "
                                  f"max_response_bytes ({self.max_response_bytes}): narrow the query or the hosts")
        try:
            doc = json.loads(raw)
            if doc.get("status") != "success" or doc["data"]["resultType"] != "matrix":
                raise PrometheusError(f"{self.url}: {query!r} did not give a range vector: {_error_of(raw)}")
            return [(s["metric"], s["values"]) for s in doc["data"]["result"]]
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            raise PrometheusError(f"{self.url}: the answer to {query!r} is not Prometheus's JSON") from None

    def _post(self, path: str, body: bytes, query: str) -> tuple[int, bytes]:
        """POST body to the server's path; return (HTTP status, at most max_response_bytes + 1
        bytes of the answer). The whole exchange (connection, headers, body, an error's body) has
        timeout_s: at the deadline a timer shuts the socket down, whatever the answer's pace.
        PrometheusError (unavailable) if the server cannot be reached, breaks HTTP or is too slow."""
        u = urllib.parse.urlsplit(self.url)
        cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
        conn = cls(u.hostname, u.port, timeout=self.timeout_s)
        expired, sockets = threading.Event(), []  # the connection's socket, kept: a response that
        # closes the connection takes it over from conn (conn.sock is None then)

        def cut() -> None:
            expired.set()
            for sock in sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

        timer = threading.Timer(self.timeout_s, cut)
        timer.daemon = True
        timer.start()
        try:
            conn.connect()
            sockets.append(conn.sock)
            if expired.is_set():  # the deadline passed while connecting, before there was a socket to cut
                raise TimeoutError
            conn.request("POST", u.path.rstrip("/") + path, body=body,
                         headers={"Content-Type": "application/x-www-form-urlencoded", "User-Agent": "ds-ops-pull"})
            response = conn.getresponse()
            raw = response.read(self.max_response_bytes + 1)
            if response.length and len(raw) <= self.max_response_bytes:  # the connection ended early
                raise http.client.IncompleteRead(raw, response.length)
            return response.status, raw
        except (OSError, http.client.HTTPException) as e:
            if expired.is_set():
                raise PrometheusError(f"{self.url} did not answer {query!r} in full within timeout_s "
                                      f"({self.timeout_s:g} s)", unavailable=True) from None
            reason = getattr(e, "strerror", None) or str(e) or type(e).__name__
            raise PrometheusError(f"{self.url} not reachable: {reason}", unavailable=True) from None
        finally:
            timer.cancel()
            conn.close()


def _finite(t) -> bool:
    try:
        return math.isfinite(t)
    except OverflowError:  # an integer too large for a float (JSON allows any number of digits)
        return False


def _short(value) -> str:
    """A field of an answer as the journal may show it: its JSON, at most 80 characters."""
    try:
        text = json.dumps(value, ensure_ascii=True)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _error_of(raw: bytes) -> str:
    try:
        doc = json.loads(raw)
        return f"{doc.get('errorType', 'error')}: {doc.get('error', '')}"[:300]
    except ValueError:
        return raw[:200].decode("utf-8", "replace")


def _labels(metric: dict) -> str:
    return "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(metric.items()))[:200] + "}"


def _when(t: float) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
