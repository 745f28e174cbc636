"""One pull of a source: which hosts to train and which to score, over which steps, and the drops.

Each pull ends at the newest whole step ``delay`` behind now (``end``). A host of this server's
shard (:func:`shard_of`, Prometheus's ``hashmod``) is in one of three states, kept in the
puller's state file (``STATE_DIR/SOURCE.json``, written atomically after each pull):

* **waiting**: seen, not trained. When it has ``min_history`` of complete rows within the last
  ``train_window``, its rows go to ``incoming/`` as one training file, and it is *trained* from
  ``end``. A new host is looked at in the pull that first sees it, a waiting one again hourly.
* **trained**: each pull writes its rows after ``scored_until`` up to ``end`` to ``score/`` (at
  most ``catch_up`` of them: a gap longer than that after an outage is left unscored, and said).
* **gone**: trained, but absent from Prometheus's answer: nothing is written, ``scored_until``
  stays, and the state says when it was last seen. Its model stays in the store.

A row is a step at which every series has a value for the host. A step where some series has
none (a scrape missed, a series not yet there) is left out, and the pull says how many and of
which series: the time column shows the gap, and no value is ever invented. Each drop is the
spool's safe way: the sidecar (``name:``/``model:``, ``time_column: time``) renamed into place
first, then the CSV written as ``.part`` and renamed.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import dataclass, field

from ..fsutil import write_atomic
from ..spool.layout import INCOMING, SCORE
from ..store.model_dir import StoreError, safe_model_name
from .prometheus import Prometheus, PrometheusError
from .sourcefile import Source

STATE_FORMAT = 1
RECHECK_WAITING_S = 3600.0  # a host with too little history is looked at again this often


def shard_of(host: str, of: int) -> int:
    """Return host's shard of ``of``, as Prometheus's ``hashmod`` relabelling computes it: the
    MD5 of the label value, its last 8 bytes as a big-endian integer, modulo ``of``."""
    return int.from_bytes(hashlib.md5(host.encode("utf-8")).digest()[8:], "big") % of


@dataclass
class PullReport:
    """What one pull did: per host the rows written and left out, and what it says of the hosts."""

    end: float
    trained: dict = field(default_factory=dict)      # host -> (model, rows, path)
    scored: dict = field(default_factory=dict)       # host -> (model, rows, path)
    waiting: dict = field(default_factory=dict)      # host -> seconds of complete history so far
    gone: dict = field(default_factory=dict)         # host -> last seen (epoch seconds) or None
    missing: dict = field(default_factory=dict)      # host -> {series: steps without a value}
    refused: dict = field(default_factory=dict)      # host -> why no model is made of it
    skipped_s: dict = field(default_factory=dict)    # host -> seconds of an outage left unscored (catch_up)


def load_state(path: str) -> dict:
    """Return the puller's state at path, or a new one if there is none."""
    try:
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
    except FileNotFoundError:
        return {"format": STATE_FORMAT, "hosts": {}, "checked_at": None}
    if state.get("format") != STATE_FORMAT:
        raise ValueError(f"{path}: state format {state.get('format')!r}, this ds-ops reads {STATE_FORMAT}")
    return state


def save_state(path: str, state: dict) -> None:
    write_atomic(path, (json.dumps(state, sort_keys=True, indent=1) + "\n").encode(), prefix=".state.tmp-", mode=0o640)


def _grid(start: float, end: float, step: float) -> list[float]:
    n = int(math.floor((end - start) / step + 1e-9)) + 1
    return [start + i * step for i in range(max(n, 0))]


def _fetch(prom: Prometheus, source: Source, start: float, end: float) -> dict[str, list[dict[float, float]]]:
    """Return {host: [points of series 1, ...]} over [start, end] for every series of source."""
    out: dict[str, list[dict[float, float]]] = {}
    label = source.options.host_label
    for i, s in enumerate(source.series):
        for host, points in prom.query_range(s.query, start, end, source.step_s, label).items():
            out.setdefault(host, [{} for _ in source.series])[i] = points
        if len(out) > source.options.max_hosts:
            raise PrometheusError(f"{len(out)} hosts answer {s.name!r}, over max_hosts ({source.options.max_hosts})")
    return out


def _rows(points: list[dict[float, float]], grid: list[float], source: Source) -> tuple[list[tuple], dict[str, int]]:
    """Return (the complete rows (time, value, ...) on grid, {series: steps it had no value at});
    steps before the host's first value of any series are not missing: it was not there yet."""
    rows, missing = [], {}
    first = min((min(p) for p in points if p), default=math.inf)
    for t in grid:
        if t < first:
            continue
        values = [p.get(t) for p in points]
        if None in values:
            for s, v in zip(source.series, values):
                if v is None:
                    missing[s.name] = missing.get(s.name, 0) + 1
            continue
        rows.append((t, *values))
    return rows, missing


def _csv(source: Source, rows: list[tuple]) -> bytes:
    lines = ["time," + ",".join(source.columns)]
    lines += [",".join([str(int(r[0])) if float(r[0]).is_integer() else repr(r[0])] + [repr(v) for v in r[1:]])
              for r in rows]
    return ("\n".join(lines) + "\n").encode()


def drop(spool_root: str, which: str, stem: str, sidecar: str, data: bytes) -> str:
    """Drop ``stem.csv`` with its sidecar ``stem.yaml`` into spool directory ``which`` the safe way:
    the sidecar renamed into place first, then the CSV written as ``.part`` and renamed (group
    readable). Return the CSV's path."""
    directory = os.path.join(spool_root, which)
    write_atomic(os.path.join(directory, stem + ".yaml"), sidecar.encode(), prefix=".pull.tmp-", mode=0o640)
    path = os.path.join(directory, stem + ".csv")
    part = path + ".part"
    with open(part, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(part, 0o640)
    os.rename(part, path)
    return path


def _stamp(t: float) -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(t))


def model_name(source: Source, host: str) -> str:
    return safe_model_name(source.options.model_prefix + host)


def pull(source: Source, prom: Prometheus, spool_root: str, state: dict, now: float) -> PullReport:
    """Do one pull at time ``now`` (epoch seconds): update ``state`` in place and return what was
    done. Raises PrometheusError (nothing written then, ``state`` unchanged) if a query fails."""
    step = source.step_s
    end = math.floor((now - source.seconds("delay")) / step) * step
    index, of = source.shard
    hosts = state["hosts"]
    report = PullReport(end=end)
    mine = lambda h: shard_of(h, of) == index  # noqa: E731
    trained = {h: s for h, s in hosts.items() if s.get("scored_until") is not None}
    catch_up = source.seconds("catch_up")
    starts = {h: max(s["scored_until"] + step, end - catch_up + step) for h, s in trained.items()}
    scoring = _fetch(prom, source, min(starts.values()), end) if starts and min(starts.values()) <= end else {}
    new = [h for h in scoring if mine(h) and h not in hosts]
    due = [h for h, s in hosts.items() if s.get("scored_until") is None and now - (s.get("checked_at") or 0) >= RECHECK_WAITING_S]
    first = state.get("checked_at") is None
    training = {}
    if new or due or first:
        training = _fetch(prom, source, end - source.seconds("train_window") + step, end)
        state["checked_at"] = now

    names = {s["model"]: h for h, s in hosts.items() if s.get("model")}
    candidates = [h for h in training if mine(h) and (h not in hosts or hosts[h].get("scored_until") is None
                                                       and (first or h in due))]
    for host in sorted(candidates):
        entry = hosts.setdefault(host, {"model": None, "scored_until": None, "last_seen": None, "checked_at": None})
        entry["checked_at"] = now
        try:
            name = model_name(source, host)
        except StoreError as e:
            report.refused[host] = str(e)
            continue
        if names.get(name, host) != host:
            report.refused[host] = f"its model name {name} is {names[name]}'s already"
            continue
        rows, missing = _rows(training[host], _grid(end - source.seconds("train_window") + step, end, step), source)
        entry["last_seen"] = rows[-1][0] if rows else entry["last_seen"]
        if missing:
            report.missing[host] = missing
        history = (len(rows) - 1) * step if rows else 0.0
        if len(rows) < 2 or history < source.seconds("min_history"):
            report.waiting[host] = history
            continue
        try:
            path = drop(spool_root, INCOMING, f"{name}.train-{_stamp(end)}", f"name: {name}\ntime_column: time\n",
                        _csv(source, rows))
        except OSError as e:
            report.refused[host] = f"cannot write its training file: {e.strerror} ({e.filename})"
            continue
        entry.update(model=name, scored_until=end, trained_at=end)
        names[name] = host
        report.trained[host] = (name, len(rows), path)

    for host, entry in sorted(trained.items()):
        if not mine(host) or starts[host] > end:
            continue  # another server's, or nothing new since the last pull
        if host not in scoring:
            report.gone[host] = entry.get("last_seen")
            continue
        start = starts[host]
        if start > entry["scored_until"] + step:
            report.skipped_s[host] = start - entry["scored_until"] - step
        rows, missing = _rows(scoring[host], _grid(start, end, step), source)
        if missing:
            report.missing[host] = missing
        if rows:
            try:
                path = drop(spool_root, SCORE, f"{entry['model']}.{_stamp(rows[0][0])}",
                            f"model: {entry['model']}\ntime_column: time\n", _csv(source, rows))
            except OSError as e:
                report.refused[host] = f"cannot write its chunk: {e.strerror} ({e.filename})"
                continue
            report.scored[host] = (entry["model"], len(rows), path)
            entry["last_seen"] = rows[-1][0]
        entry["scored_until"] = end
    return report
