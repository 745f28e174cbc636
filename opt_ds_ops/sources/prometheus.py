"""Prometheus's HTTP API, the one call the puller needs: ``/api/v1/query_range``.

Prometheus answers at most 11,000 points per series per query, so a longer range is asked in
pieces (:data:`MAX_POINTS` steps each) and joined. Every answer is bounded in bytes before it is
parsed (``max_response_bytes``): a query that matches far more series than expected is an error
naming the bound, never a daemon's worth of memory. A value Prometheus gives as NaN or ±Inf is a
missing value here (the row will say so), never a number.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.parse
import urllib.request

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
                host = metric.get(label)
                if host is None:
                    raise PrometheusError(f"a result series of {query!r} has no label {label!r} ({_labels(metric)}); "
                                          f"keep it in the query, e.g. sum by ({label}) (...)")
                points = out.setdefault(host, {})
                for t, v in values:
                    t = float(t)
                    if t in points:
                        raise PrometheusError(f"{query!r} gives more than one series for {label}={host!r} "
                                              f"({_labels(metric)}); aggregate the others away, e.g. sum by ({label}) (...)")
                    value = float(v)
                    if math.isfinite(value):
                        points[t] = value
        return out

    def _matrix(self, query: str, start: float, end: float, step: float) -> list[tuple[dict, list]]:
        body = urllib.parse.urlencode({"query": query, "start": repr(start), "end": repr(end), "step": repr(step)}).encode()
        req = urllib.request.Request(self.url + "/api/v1/query_range", data=body, method="POST",
                                     headers={"Content-Type": "application/x-www-form-urlencoded",
                                              "User-Agent": "ds-ops-pull"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                raw = r.read(self.max_response_bytes + 1)
        except urllib.error.HTTPError as e:
            detail = _error_of(e.read(65536))
            raise PrometheusError(f"{self.url} answered HTTP {e.code} to {query!r}: {detail}",
                                  unavailable=e.code >= 500 or e.code == 429) from None
        except (urllib.error.URLError, OSError, TimeoutError) as e:
            reason = getattr(e, "reason", e)
            raise PrometheusError(f"{self.url} not reachable: {reason}", unavailable=True) from None
        if len(raw) > self.max_response_bytes:
            raise PrometheusError(f"the answer to {query!r} over {_when(start)}..{_when(end)} is over "
                                  f"max_response_bytes ({self.max_response_bytes}): narrow the query or the hosts")
        try:
            doc = json.loads(raw)
            if doc.get("status") != "success" or doc["data"]["resultType"] != "matrix":
                raise PrometheusError(f"{self.url}: {query!r} did not give a range vector: {_error_of(raw)}")
            return [(s["metric"], s["values"]) for s in doc["data"]["result"]]
        except (ValueError, KeyError, TypeError, AttributeError):
            raise PrometheusError(f"{self.url}: the answer to {query!r} is not Prometheus's JSON") from None


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
