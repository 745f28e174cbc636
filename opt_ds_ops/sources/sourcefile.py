"""A source file: where the puller reads telemetry and how it makes models of it.

```yaml
prometheus: http://127.0.0.1:9090     # the server's base URL (http or https)
host_label: instance                  # one model per value of this label
step: 1m                              # one row per step
train_window: 7d                      # a new host's training file covers this much
min_history: 1d                       # ... and is written once it has this much
score_every: 5m                       # a chunk per host per interval
delay: 1m                             # the newest step pulled is this far behind now (scrapes land late)
catch_up: 1d                          # after an outage the next pull covers at most this much of it
model_prefix: node-                   # model name: prefix + the host label's value, made safe
shard: 0/1                            # this server's shard of the hosts (hashmod of the host label)
series:                               # one column each, in this order; the name is the column's
  - name: cpu_user
    query: sum by (instance) (rate(node_cpu_seconds_total{mode="user"}[5m]))
```

Every query must keep ``host_label`` in its result (``sum by (instance)``); counters are read
through ``rate()`` in the query itself, so a counter reset is Prometheus's to handle, never a jump.
Parsed once (:func:`load_source`), bounded, every bad key a :class:`~opt_ds_ops.config.conffile.ConfigError`
naming the file and the key.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass

from ..config.conffile import ConfigError, _build_guarded, _field, _parse_yaml_bytes, _shown

SOURCE_MAX_BYTES = 256 * 1024
MAX_SERIES = 512
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d|w)$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_COLUMN = re.compile(r"^[A-Za-z_][A-Za-z0-9_:.\-]{0,199}$")
_LABEL = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def parse_duration(text: str) -> float:
    """Return Prometheus's duration ``30s``, ``5m``, ``1.5h``, ``7d`` in seconds; ValueError otherwise."""
    m = _DURATION.match(str(text).strip())
    if not m:
        raise ValueError(f"not a duration like 30s, 5m, 1h, 7d: {text!r}")
    return float(m[1]) * _UNITS[m[2]]


def _duration_ok(v: str) -> bool:
    try:
        return parse_duration(v) > 0
    except ValueError:
        return False


def _url_ok(v: str) -> bool:
    try:
        u = urllib.parse.urlsplit(v)
        return (u.scheme in ("http", "https") and bool(u.hostname) and not u.query and not u.fragment
                and u.username is None and u.password is None)
    except ValueError:  # an invalid IPv6 host, a bad port
        return False


def _shard_ok(v: str) -> bool:
    m = re.match(r"^(\d+)/(\d+)$", v.strip())
    return bool(m) and 0 <= int(m[1]) < int(m[2]) <= 10000


@dataclass(frozen=True)
class SourceOptions:
    """The scalar keys of a source file (its ``series`` list is :class:`Series`)."""

    prometheus: str = _field("http://127.0.0.1:9090", _url_ok, "an http(s) URL without credentials or query")
    host_label: str = _field("instance", lambda v: bool(_LABEL.match(v)), "a Prometheus label name")
    step: str = _field("1m", _duration_ok, "a duration like 15s, 1m")
    train_window: str = _field("7d", _duration_ok, "a duration like 7d")
    min_history: str = _field("1d", _duration_ok, "a duration like 1d")
    score_every: str = _field("5m", _duration_ok, "a duration like 5m")
    delay: str = _field("1m", lambda v: v in ("0", "0s") or _duration_ok(v), "a duration like 1m, or 0s")
    catch_up: str = _field("1d", _duration_ok, "a duration like 1d")
    model_prefix: str = _field("", lambda v: len(v) <= 64 and "/" not in v, "text of at most 64 characters, no /")
    shard: str = _field("0/1", _shard_ok, "I/N with 0 <= I < N, like 0/1 or 1/2")
    timeout_s: float = _field(30.0, lambda v: 0 < v <= 600, "seconds in (0, 600]")
    max_response_bytes: int = _field(64 << 20, lambda v: 1024 <= v <= 4 << 30, "bytes in [1 KiB, 4 GiB]")
    max_hosts: int = _field(2000, lambda v: 1 <= v <= 100000, "an integer in [1, 100000]")


@dataclass(frozen=True)
class Series:
    """One column: its name (what an alert names) and the PromQL that gives it per host."""

    name: str
    query: str


@dataclass(frozen=True)
class Source:
    """A parsed source file: ``name`` (the file's stem), its options and series, the durations in seconds."""

    name: str
    path: str
    options: SourceOptions
    series: tuple[Series, ...]

    def seconds(self, key: str) -> float:
        value = getattr(self.options, key)
        return 0.0 if value in ("0", "0s") else parse_duration(value)

    @property
    def step_s(self) -> float:
        return self.seconds("step")

    @property
    def shard(self) -> tuple[int, int]:
        index, of = self.options.shard.split("/")
        return int(index), int(of)

    @property
    def columns(self) -> list[str]:
        return [s.name for s in self.series]


def parse_source(text: bytes, where: str, name: str) -> Source:
    """Return the Source in ``text`` (the bytes of file ``where``, named ``name``). Raises
    ConfigError naming ``where`` and the key for: more than SOURCE_MAX_BYTES, invalid YAML or
    UTF-8, a key given twice, an unknown key, a bad value, credentials in the URL (never shown),
    no series, a series without name or query, two columns of one name, more than MAX_SERIES series, a step that is not a whole number of seconds, windows
    that cannot hold a row (``min_history`` under two steps or over ``train_window``,
    ``score_every`` under one step)."""
    raw = _parse_yaml_bytes(text, where, SOURCE_MAX_BYTES, "source file", unique_keys=True)
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: a source file is a mapping with a 'series' list, got {_shown(raw)}")
    raw = dict(raw)
    if isinstance(raw.get("prometheus"), str) and "@" in raw["prometheus"]:  # never shown: it may hold a password
        raise ConfigError(f"{where}: key 'prometheus' holds an @, as credentials do (user:password@host; not shown): "
                          "ds-ops takes none in a URL, where every failed pull's line and check-config would print "
                          "them; give the server's address alone (a proxy on loopback can add them)", ("prometheus",))
    series_raw = raw.pop("series", None)
    options = _build_guarded(SourceOptions, raw, where, also=("series",))
    if not isinstance(series_raw, list) or not series_raw:
        raise ConfigError(f"{where}: key 'series' must be a list of {{name, query}}, got {_shown(series_raw)}", ("series",))
    if len(series_raw) > MAX_SERIES:
        raise ConfigError(f"{where}: {len(series_raw)} series; a source may have at most {MAX_SERIES}", ("series",))
    series, seen = [], set()
    for i, item in enumerate(series_raw, 1):
        at = f"series[{i}]"
        if not isinstance(item, Mapping) or set(item) != {"name", "query"}:
            raise ConfigError(f"{where}: {at} must be a mapping with exactly the keys name and query, got {_shown(item)}",
                              ("series",))
        col, query = item["name"], item["query"]
        if not isinstance(col, str) or not _COLUMN.match(col):
            raise ConfigError(f"{where}: {at}.name must be a column name ([A-Za-z_][A-Za-z0-9_:.-]*), got {_shown(col)}",
                              ("series",))
        if col.lower() == "time" or col in seen:
            raise ConfigError(f"{where}: {at}.name {col!r} is {'the time column' if col.lower() == 'time' else 'taken'}; "
                              "every column needs a name of its own", ("series",))
        if not isinstance(query, str) or not query.strip() or len(query) > 4096:
            raise ConfigError(f"{where}: {at}.query must be PromQL text of at most 4096 characters, got {_shown(query)}",
                              ("series",))
        seen.add(col)
        series.append(Series(col, query.strip()))
    src = Source(name=name, path=where, options=options, series=tuple(series))
    step = src.step_s
    if step < 1 or step != int(step):
        raise ConfigError(f"{where}: key 'step' must be a whole number of seconds (1s or more), got {options.step}",
                          ("step",))
    if src.seconds("min_history") < 2 * step or src.seconds("min_history") > src.seconds("train_window"):
        raise ConfigError(f"{where}: key 'min_history' must be at least two steps and at most train_window, "
                          f"got {options.min_history}", ("min_history",))
    if src.seconds("score_every") < step:
        raise ConfigError(f"{where}: key 'score_every' must be at least one step ({options.step}), got "
                          f"{options.score_every}", ("score_every",))
    return src


def load_source(path: str) -> Source:
    """Read and parse the source file at path (its name: the file's stem). ConfigError if unreadable."""
    try:
        with open(path, "rb") as f:
            text = f.read(SOURCE_MAX_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    stem = re.sub(r"\.ya?ml$", "", path.rsplit("/", 1)[-1])
    return parse_source(text, path, stem)
