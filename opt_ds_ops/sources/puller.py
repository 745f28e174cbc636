"""One pull of a source: which hosts to train and which to score, over which steps, and the drops.

Each pull ends at the newest whole step ``delay`` behind now (``end``; steps are whole seconds,
so every time on the grid is an exact integer). A host of this server's shard (:func:`shard_of`,
Prometheus's ``hashmod``) is in one of these states, kept in the puller's state file
(``STATE_DIR/SOURCE.json``, written atomically after each pull):

* **waiting**: seen, not trained. When it has ``min_history`` of complete rows within the last
  ``train_window``, its rows go to ``incoming/`` as one training file, and it is *trained* from
  ``end``. Every pull asks for the last ``score_every`` of every series, so a new host is seen in
  the first pull it is in Prometheus; one with too little history is looked at again every 24th of
  ``min_history`` (hourly for a day; :func:`recheck_s`; half a ``score_every`` early is on time, so
  a pull that wakes a little early does not skip it), and forgotten when it has not been seen for a
  ``train_window``; the pull names the series it has no value of at all (a query that gives nothing
  for it: no complete row can come until it does).
* **trained**: once its model has a ``current`` version in the store (until then its rows wait,
  up to ``catch_up``), each pull writes its rows after ``scored_until`` up to ``end`` to
  ``score/`` (at most ``catch_up`` of them: a longer gap after an outage is left unscored, and said).
* **removed**: trained, its model had a current version and is not in the store any more
  (``ds-ops models rm``), and the host is in Prometheus's answer: it is waiting again (its model's
  name kept for it), and trained again in the same pull from its last ``train_window`` once it has
  ``min_history``. A gone host's removed model is not made again from its old rows; a store that
  cannot be read is no removal (the rows wait, as for a first version). To stop modelling a host
  that still answers, leave it out of the source's query.
* **gone**: trained, but absent from Prometheus's answer: nothing is written, ``scored_until``
  stays, and the state says when it was last seen. Its model stays in the store. When it comes
  back, its gap is asked for on its own (up to ``catch_up``): a gone host never widens the others'
  queries.

A row is a step at which every series has a value for the host. A step where some series has
none (a scrape missed, a series not yet there) is left out, and the pull says how many and of
which series: the time column shows the gap, and no value is ever invented. Values are kept on the
step grid as float64 arrays (8 bytes a point: a first pull of 1,000 hosts, 7 days at 1 minute and
16 series holds 1.3 GB), and only for the hosts the pull needs. Each drop is the spool's safe way:
the sidecar (``name:``/``model:``, ``time_column: time``) and then the CSV, each written under a
hidden temporary name (which the daemon never claims), fsync'ed and renamed into place under a
name with 16 random hex digits (``MODEL.TIME.TOKEN.csv``), never over a file that is there
(``RENAME_NOREPLACE``): no member can plant the next name first and so stop a host from being
trained or scored (:func:`drop`).
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import math
import os
import secrets
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..fsutil import write_atomic
from ..spool.layout import INCOMING, PROCESSING, SCORE
from ..store.model_dir import StoreError, safe_model_name
from .prometheus import Prometheus, PrometheusError
from .sourcefile import Source

STATE_FORMAT = 1
RECHECK_WAITING_S = 3600.0  # a host with too little history is looked at again this often, at most
TRAIN_RETRY_S, TRAIN_RETRY_MAX_S = 3600.0, 86400.0  # a failed first training: tried again after 1 h, doubling to a day
PIECE_POINTS = 1440  # points per series per query of a long range: an answer stays near 45 KB a host


def recheck_s(source: Source) -> float:
    """How often a waiting host's history is looked at again: a 24th of ``min_history`` (a day's:
    hourly), at most RECHECK_WAITING_S, at least ``score_every`` (a clock of seconds: every pull)."""
    return min(RECHECK_WAITING_S, max(source.seconds("score_every"), source.seconds("min_history") / 24))


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
    pending: dict = field(default_factory=dict)      # host -> model without a current version yet
    gone: dict = field(default_factory=dict)         # host -> last seen (epoch seconds) or None
    missing: dict = field(default_factory=dict)      # host -> {series: steps without a value}
    left_out: dict = field(default_factory=dict)     # host -> steps left out (a value of one series or more missing)
    never: dict = field(default_factory=dict)        # waiting host -> (series with no value at all, new since its last look)
    refused: dict = field(default_factory=dict)      # host -> why no model is made of it, or no file written
    skipped_s: dict = field(default_factory=dict)    # host -> seconds of an outage left unscored (catch_up)
    forgotten: list = field(default_factory=list)    # waiting hosts not seen for a train_window
    removed: dict = field(default_factory=dict)      # host -> its model, removed from the store since: trained again
    blocked: dict = field(default_factory=dict)      # host -> (why its model name is another owner's, news since the last pull)
    train_failed: dict = field(default_factory=dict)  # host -> why its training file failed; tried again after retry_at
    adopted: dict = field(default_factory=dict)      # host -> (model, end): its training found, made before a kill
    moved: dict = field(default_factory=dict)        # host -> its model: of another shard now, dropped from the state
    renamed: dict = field(default_factory=dict)      # host -> its model before a change of model_prefix (trained again)
    old_prefix: str | None = None                    # the model_prefix before this pull's, if it changed


def load_state(path: str) -> dict:
    """Return the puller's state at path, or a new one if there is none."""
    try:
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
    except FileNotFoundError:
        return {"format": STATE_FORMAT, "hosts": {}}
    if state.get("format") != STATE_FORMAT:
        raise ValueError(f"{path}: state format {state.get('format')!r}, this ds-ops reads {STATE_FORMAT}")
    return state


def save_state(path: str, state: dict) -> None:
    write_atomic(path, (json.dumps(state, sort_keys=True, indent=1) + "\n").encode(), prefix=".state.tmp-", mode=0o640)


@dataclass
class Window:
    """Values of every series on the step grid start, start + step, ..., end: per host an array
    (series, steps), NaN where Prometheus gave no value."""

    start: float
    end: float
    step: float
    hosts: dict[str, np.ndarray]

    @functools.cached_property
    def times(self) -> np.ndarray:
        return self.start + self.step * np.arange(int(round((self.end - self.start) / self.step)) + 1)


def _fetch(prom: Prometheus, source: Source, start: float, end: float, keep: Callable[[str], bool]) -> Window:
    """Return the Window of every series of source over [start, end] (grid points) for the hosts
    ``keep`` accepts, asked in pieces of at most PIECE_POINTS steps. Raises PrometheusError, also
    when more than ``max_hosts`` hosts are kept."""
    step, label, n = source.step_s, source.options.host_label, len(source.series)
    count = int(round((end - start) / step)) + 1
    window = Window(start, end, step, {})
    for lo in range(0, count, PIECE_POINTS):
        hi = min(count, lo + PIECE_POINTS) - 1
        for i, s in enumerate(source.series):
            answer = prom.query_range(s.query, start + lo * step, start + hi * step, step, label)
            for host, points in answer.items():
                if not keep(host):
                    continue
                values = window.hosts.get(host)
                if values is None:
                    if len(window.hosts) >= source.options.max_hosts:
                        raise PrometheusError(f"more than max_hosts ({source.options.max_hosts}) hosts of this "
                                              f"shard answer {s.name!r}: raise max_hosts, or share them (shard)")
                    values = window.hosts[host] = np.full((n, count), np.nan)
                for t, v in points.items():
                    k = (t - start) / step
                    if k == int(k) and 0 <= k < count:
                        values[i, int(k)] = v
            del answer
    return window


def _rows(values: np.ndarray, times: np.ndarray, source: Source, lo: int = 0) -> tuple[np.ndarray, dict[str, int], int]:
    """Return (the complete rows from column ``lo`` on, as (time, value, ...) rows; {series: steps it
    had no value at}; the steps left out: a step without two series' values is one); steps before the host's first value of any series are not missing: it was not
    there yet."""
    part = values[:, lo:]
    seen = ~np.isnan(part)
    any_seen = seen.any(axis=0)
    if not any_seen.any():
        return np.empty((0, 1 + len(source.series))), {}, 0
    first = int(np.argmax(any_seen))
    complete = seen.all(axis=0)
    complete[:first] = False
    gaps = (~seen[:, first:]).sum(axis=1)
    missing = {s.name: int(g) for s, g in zip(source.series, gaps) if g}
    rows = np.column_stack([times[lo:][complete], part[:, complete].T])
    return rows, missing, int((~complete[first:]).sum())


def _csv(source: Source, rows: np.ndarray) -> bytes:
    lines = ["time," + ",".join(source.columns)]
    lines += [",".join([str(int(r[0]))] + [repr(float(v)) for v in r[1:]]) for r in rows]
    return ("\n".join(lines) + "\n").encode()


NAME_TRIES = 8  # names tried before a drop gives up (each taken one: another writer's file, left alone)


def sidecar_text(key: str, name: str) -> str:
    """The sidecar of a file the puller drops: the model's name under ``key`` (``name`` for a
    training file, ``model`` for a chunk to score), quoted as a JSON string (valid YAML), so a host
    named ``1e3``, ``0777``, ``null`` or ``yes`` stays that text, and the rows' time column."""
    return f"{key}: {json.dumps(name)}\ntime_column: time\n"


def drop(spool_root: str, which: str, stem: str, sidecar: str, data: bytes) -> str:
    """Drop ``STEM.TOKEN.csv`` with its sidecar ``STEM.TOKEN.yaml`` into spool directory ``which``
    the safe way; return the CSV's path. ``TOKEN`` is 16 random hex digits, so no member of the
    spool's group can plant the next name first (a predictable name in a sticky directory is any
    writer's to take). Each file is written under a hidden temporary name (mkstemp: nothing a member
    planted is written through), fsync'ed and renamed to its name without replacing (RENAME_NOREPLACE), which fails rather than replaces
    a file that is there (another writer's, left as it is); the sidecar first. A taken name is
    tried again with a new token, :data:`NAME_TRIES` times. On an error the sidecar is removed again."""
    directory = os.path.join(spool_root, which)
    for _ in range(NAME_TRIES):
        name = f"{stem}.{secrets.token_hex(8)}"
        side = os.path.join(directory, name + ".yaml")
        try:
            _write_new(side, sidecar.encode())
        except FileExistsError:
            continue
        path = os.path.join(directory, name + ".csv")
        try:
            _write_new(path, data)
        except BaseException as e:
            try:
                os.unlink(side)
            except OSError:
                pass
            if isinstance(e, FileExistsError):
                continue
            raise
        return path
    raise FileExistsError(errno.EEXIST, f"{NAME_TRIES} random names were all taken", os.path.join(directory, stem))


LONE_SIDECAR_AGE_S = 60.0  # a drop writes its CSV right after its sidecar: one alone this long was cut short


def sweep_lone_sidecars(spool_root: str, models: set[str], uid: int, now: float) -> list[str]:
    """Remove the sidecars :func:`drop` left without their CSV when the puller was killed between
    the two renames (``which/NAME.TOKEN.yaml``, no ``NAME.TOKEN.csv``): only files of uid ``uid``,
    of the models in ``models``, with a 16-hex-digit token, and older than LONE_SIDECAR_AGE_S (by
    ``now``, epoch seconds of the wall clock), so no drop in progress and no other writer's file
    is touched; nor one whose CSV the daemon is claiming (a job record in processing/ names it: the
    claim moves the CSV first and takes the sidecar after the copy, and a daemon killed between
    the two finishes the claim when it starts again). Return their paths relative to the spool
    (``score/...``)."""
    removed = []
    for which in (SCORE, INCOMING):
        directory = os.path.join(spool_root, which)
        try:
            names = set(os.listdir(directory))
        except OSError:
            continue
        for name in names:
            stem, _, ext = name.rpartition(".")
            rest, _, token = stem.rpartition(".")
            model = rest.rpartition(".")[0]  # MODEL.STAMP or MODEL.train-STAMP
            if ext != "yaml" or stem + ".csv" in names or len(token) != 16 or not all(c in "0123456789abcdef" for c in token):
                continue
            if model not in models:
                continue
            path = os.path.join(directory, name)
            try:
                st = os.lstat(path)
                if st.st_uid != uid or not stat.S_ISREG(st.st_mode) or now - st.st_mtime < LONE_SIDECAR_AGE_S:
                    continue
                if os.path.exists(os.path.join(directory, stem + ".csv")):  # its CSV came meanwhile
                    continue
                # read after this CSV was seen gone, for each sidecar: a claim of it has its record by then
                if stem + ".csv" in {r.get("dataset") for r in processing_records(spool_root)}:
                    continue
                os.unlink(path)
                removed.append(f"{which}/{name}")
            except OSError:
                continue
    return sorted(removed)


def processing_records(spool_root: str) -> list[dict]:
    """The job records in processing/ (``JOB/job.json``) that can be read, as a member of the
    spool's group reads them; one that cannot (gone meanwhile, not JSON) is left out."""
    processing = os.path.join(spool_root, PROCESSING)
    try:
        jobs = os.listdir(processing)
    except OSError:
        return []
    records = []
    for job in jobs:
        try:
            with open(os.path.join(processing, job, "job.json"), encoding="utf-8") as f:
                record = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def _write_new(path: str, data: bytes) -> None:
    """Write data to a new file at path (mode 0640) the safe way, never over a file that is there
    (FileExistsError; a rename, so the daemon's watcher sees it arrive at once, never two links)."""
    write_atomic(path, data, prefix=".pull.tmp-", mode=0o640, replace=False)


def _stamp(t: float) -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(t))


def model_name(source: Source, host: str) -> str:
    return safe_model_name(source.options.model_prefix + host)


NAME_HASH_DIGITS = 8  # a host whose safe name another host holds or also claims: NAME-<8 hex of its label's SHA-256>


def model_names(source: Source, claimants, held: dict[str, str]) -> dict[str, str]:
    """Return {host: its model name} for ``claimants``, the hosts (label values) that have no name
    of their own yet: a pull's new hosts and every waiting host of the state, due or not. ``held``:
    {model name: host} of the names hosts of the state keep (a host, once its name is given, keeps
    it: retrained after ``models rm`` or a failed first training, it is the same model). The name a
    host gets depends on the hosts alone, never on their order or on which of them a pull looks
    at: its safe name (:func:`model_name`) if no host holds it and no other claimant claims it, or,
    of two claims, the host's whose label value (with the prefix) is that name exactly (``a_b``
    over ``a/b``). Any other claimant gets the safe name with ``-`` and the first
    :data:`NAME_HASH_DIGITS` hex digits of its label's SHA-256 (``a_b-1f2e3d4c``; more digits
    should that be a name claimed or held). A host whose label leaves no usable name is left out
    (the caller says why: :func:`model_name` raises StoreError)."""
    claims: dict[str, list[str]] = {}
    for host in claimants:
        try:
            claims.setdefault(model_name(source, host), []).append(host)
        except StoreError:
            continue
    taken = set(held) | set(claims)
    names = {}
    for name, hosts in sorted(claims.items()):
        exact = [h for h in hosts if source.options.model_prefix + h == name]
        for host in sorted(hosts):
            if name not in held and (len(hosts) == 1 or exact == [host]):
                names[host] = name
                continue
            digest = hashlib.sha256(host.encode("utf-8", "surrogatepass")).hexdigest()
            for n in (NAME_HASH_DIGITS, 16, 64):
                hashed = f"{name[:200 - 1 - n]}-{digest[:n]}"
                if hashed not in taken:
                    break
            names[host] = hashed
            taken.add(hashed)
    return names


def _host_names(source: Source, hosts: dict, new=()) -> tuple[dict[str, str], dict[str, str]]:
    """({host: the name it keeps}, {host: the name :func:`model_names` gives it}) for the state's
    ``hosts`` and ``new`` hosts not in it yet: a host keeps a name it was given (not a blocked
    one's, another owner's); the waiting hosts, the new ones and the blocked ones claim theirs (a
    blocked host claims its name again: not held by itself)."""
    own = {h: e["model"] for h, e in hosts.items() if e.get("model") and not e.get("blocked")}
    claimants = ({h for h, e in hosts.items() if e.get("scored_until") is None} | set(new)) - set(own)
    held = {e["model"]: h for h, e in hosts.items() if e.get("model") and h not in claimants}
    return own, model_names(source, sorted(claimants), held)


def drop_names(source: Source, state: dict) -> set[str]:
    """The model names this source's drops may carry, as :func:`pull` gives them: each host's own
    (not a blocked host's, which is another owner's) and the name a waiting host would get."""
    own, given = _host_names(source, state["hosts"])
    return set(own.values()) | {n for h, n in given.items() if not state["hosts"][h].get("blocked")}


def pull(source: Source, prom: Prometheus, spool_root: str, state: dict, now: float,
         model_ready: Callable[[str], bool] = lambda name: True,
         model_removed: Callable[[str], bool] = lambda name: False,
         model_taken: Callable[[str], str | None] = lambda name: None,
         train_failed: Callable[[str], str | None] = lambda file: None,
         own_training: Callable[[str], tuple[float, str | None] | None] = lambda name: None) -> PullReport:
    """Do one pull at time ``now`` (epoch seconds): update ``state`` in place and return what was
    done. ``model_ready(name)``: whether the model has a current version (its rows wait until it
    has); ``model_removed(name)``: whether it is certainly not in the store any more (not an
    unreadable store); ``model_taken(name)``: why the name is another owner's (a member trained it
    first: no file is dropped for it, the host is ``blocked``), or None; ``train_failed(file)``: why
    the daemon refused a training file this puller dropped (its name), or None while it is not known
    to have failed (the host waits, then trains again after a back-off); ``own_training(name)``: the
    end (epoch seconds) of a training of the name this puller already made (a file dropped before a
    kill, before its state was saved: pending in the spool, or the model's current version) and its
    file's name (None for a current version), adopted instead of dropping a second one, or None. Hosts of another shard (a change of ``shard``) are
    dropped from the state (``report.moved``). Raises PrometheusError (nothing written then,
    ``state`` unchanged) if a query fails."""
    step = source.step_s
    end = math.floor((now - source.seconds("delay")) / step) * step
    index, of = source.shard
    hosts = state["hosts"]
    report = PullReport(end=end)

    def mine(h: str) -> bool:
        return shard_of(h, of) == index

    for h in [h for h in hosts if not mine(h)]:  # the shard changed: another server's puller models it now
        report.moved[h] = hosts.pop(h).get("model")
    prefix = source.options.model_prefix
    if state.setdefault("model_prefix", prefix) != prefix:  # every host is modelled again, under its new name
        report.old_prefix, state["model_prefix"] = state["model_prefix"], prefix
        # a training of a name from before (a prefix used earlier, then again) is not adopted: only one
        # that ends after the last pull saved under the old prefix (this pull's own, dropped before a kill)
        state["prefix_since"] = max([float(e.get("seen_at") or 0) for e in hosts.values()] + [0.0])
        for h, e in list(hosts.items()):
            if e.get("model"):
                report.renamed[h] = e["model"]
            hosts[h] = {"model": None, "scored_until": None, "last_seen": e.get("last_seen"), "checked_at": None,
                        "seen_at": e.get("seen_at")}

    def back(seconds: float) -> float:  # the first grid point of a span of `seconds` ending at end
        return end - (max(1, math.floor(seconds / step + 1e-9)) - 1) * step

    trained = {h: e for h, e in hosts.items() if e.get("scored_until") is not None and mine(h)}
    for h, e in list(trained.items()):
        taken = model_taken(e["model"])
        if taken is not None:  # a member's model of the name: none of this host's rows go to it
            report.blocked[h] = (taken, e.get("blocked") != taken)
            e["blocked"] = taken
            del trained[h]
            continue
        e.pop("blocked", None)
        failed = train_failed(e["train_file"]) if e.get("train_file") and not e.get("had_model") else None
        if failed is not None:  # its first training was refused: waiting again, tried after a back-off
            tries = int(e.get("train_failures") or 0) + 1
            e.update(scored_until=None, trained_at=None, train_file=None, train_failures=tries, train_failed=failed,
                     retry_at=now + min(TRAIN_RETRY_MAX_S, TRAIN_RETRY_S * 2 ** (tries - 1)))
            report.train_failed[h] = failed
            del trained[h]
    oldest = back(source.seconds("catch_up"))
    starts = {h: max(e["scored_until"] + step, oldest) for h, e in trained.items()}
    ready = {h for h, e in trained.items() if starts[h] <= end and model_ready(e["model"])}
    # every pull: the last score_every of every host (new hosts show up here), and the trained
    # hosts' rows since their last pull, but not a gone host's gap (asked for when it is back)
    first = min([back(source.seconds("score_every"))] + [starts[h] for h in ready if not trained[h].get("gone")])
    recent = _fetch(prom, source, first, end, mine)
    for h in set(trained) - ready:
        e = trained[h]
        if e.get("had_model") and h in recent.hosts and model_removed(e["model"]):  # `ds-ops models rm` since
            report.removed[h] = e["model"]  # waiting again, its name kept: trained from its last train_window below
            e.update(scored_until=None, trained_at=None, checked_at=None, gone=False, had_model=False)
        elif starts[h] <= end:
            report.pending[h] = e["model"]
    trained = {h: e for h, e in trained.items() if h not in report.removed}
    for h in ready:
        trained[h]["had_model"] = True
        for k in ("train_failed", "train_failures", "retry_at"):
            trained[h].pop(k, None)
    back_again = [h for h in ready if trained[h].get("gone") and h in recent.hosts and starts[h] < first]
    earlier = _fetch(prom, source, min(starts[h] for h in back_again), end, set(back_again).__contains__) if back_again else None

    new = [h for h in recent.hosts if h not in hosts]
    for h in recent.hosts:
        if h in hosts:
            hosts[h]["seen_at"] = end
    due = [h for h, e in hosts.items() if e.get("scored_until") is None and mine(h)
           and now - (e.get("checked_at") or 0) >= recheck_s(source) - source.seconds("score_every") / 2
           and now >= (e.get("retry_at") or 0)]
    candidates = set(new) | set(due)
    training = _fetch(prom, source, back(source.seconds("train_window")), end, candidates.__contains__) if candidates else None

    names = {e["model"]: h for h, e in hosts.items() if e.get("model")}
    own, given = _host_names(source, hosts, new)  # hosts of another shard left the state above
    for host in sorted(candidates):
        entry = hosts.setdefault(host, {"model": None, "scored_until": None, "last_seen": None, "checked_at": None,
                                        "seen_at": end})
        entry["checked_at"] = now
        values = training.hosts.get(host)
        if values is None:  # a waiting host with no rows in the window any more
            continue
        rows, missing, left_out = _rows(values, training.times, source)
        if len(rows):
            entry["last_seen"] = float(rows[-1, 0])
        try:
            name = own.get(host) or given.get(host) or model_name(source, host)
        except StoreError as e:
            report.refused[host] = str(e)
            continue
        if names.get(name, host) != host:
            report.refused[host] = f"its model name {name} is {names[name]}'s already"
            continue
        taken = model_taken(name)
        if taken is not None:  # a member trained the name first: no training file is dropped for it
            report.blocked[host] = (taken, entry.get("blocked") != taken)
            entry.update(model=name, blocked=taken)
            names[name] = host
            continue
        entry.pop("blocked", None)
        adopted = own_training(name) if not entry.get("train_failed") else None
        if adopted is not None and float(adopted[0]) <= float(state.get("prefix_since") or 0):
            adopted = None  # this name's model from before the prefix changed back: trained afresh
        if adopted is not None:  # dropped before a kill, before the state was saved: not trained twice
            until = min(float(adopted[0]), end)
            entry.update(model=name, scored_until=until, trained_at=until, gone=False, retry_at=None,
                         train_file=adopted[1])  # a refusal of it is seen as of a file this pull dropped
            names[name] = host
            report.adopted[host] = (name, float(adopted[0]))
            continue
        history = (rows[-1, 0] - rows[0, 0]) if len(rows) >= 2 else 0.0
        if len(rows) < 2 or history < source.seconds("min_history"):  # its steps left out are counted when it trains
            report.waiting[host] = float(history)
            never = [sr.name for sr, seen in zip(source.series, (~np.isnan(values)).any(axis=1)) if not seen]
            if never and len(never) < len(source.series):  # no complete row can come before these answer
                report.never[host] = (never, entry.get("never") != never)  # (series, news since the last look)
            entry["never"] = never
            continue
        if missing:
            report.left_out[host] = left_out
            report.missing[host] = missing
        try:
            path = drop(spool_root, INCOMING, f"{name}.train-{_stamp(end)}", sidecar_text("name", name), _csv(source, rows))
        except OSError as e:
            report.refused[host] = f"cannot write its training file: {e.strerror} ({e.filename})"
            continue
        entry.update(model=name, scored_until=end, trained_at=end, gone=False, train_file=os.path.basename(path),
                     retry_at=None)
        names[name] = host
        report.trained[host] = (name, len(rows), path)

    for host in sorted(ready):
        entry = trained[host]
        window = earlier if host in back_again else recent
        if host not in window.hosts:
            if not entry.get("gone"):  # said once, when it goes
                report.gone[host] = entry.get("last_seen")
            entry["gone"] = True
            continue
        start = starts[host]
        if start > entry["scored_until"] + step:
            report.skipped_s[host] = start - entry["scored_until"] - step
        lo = int(round((start - window.start) / step))
        rows, missing, left_out = _rows(window.hosts[host], window.times, source, lo)
        if missing:
            report.left_out[host] = left_out
            report.missing[host] = missing
        if len(rows):
            try:
                path = drop(spool_root, SCORE, f"{entry['model']}.{_stamp(rows[0, 0])}",
                            sidecar_text("model", entry["model"]), _csv(source, rows))
            except OSError as e:
                report.refused[host] = f"cannot write its chunk: {e.strerror} ({e.filename})"
                continue
            report.scored[host] = (entry["model"], len(rows), path)
            entry["last_seen"] = float(rows[-1, 0])
        entry["scored_until"] = end
        entry["gone"] = False

    horizon = now - source.seconds("train_window")
    for host in [h for h, e in hosts.items() if e.get("scored_until") is None and (e.get("seen_at") or 0) < horizon]:
        del hosts[host]
        report.forgotten.append(host)
    return report
