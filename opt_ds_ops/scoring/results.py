"""The scored models' results on disk, ``RESULTS/NAME/`` (docs/scoring.md): each model's
``state.json`` and its last result's ``summary.json`` read back as the view that ``ds-ops status``
and the daemon's metrics show (:func:`model_view`), the retention of old results
(:func:`prune_results`) and the removal of a whole series (:func:`remove_series`, ``ds-ops models rm``). Written by :mod:`opt_ds_ops.scoring.job`; read here without torch or
numpy, so ``ds-ops status`` starts in a fraction of a second.
"""

from __future__ import annotations

import os
import secrets
import shutil
import stat
import time

from ..fsutil import fsync_dir

# the largest legal state.json: input_window 256 - 1 context rows x job.max_columns 4096 float32
# values as JSON (~21 bytes each, 22 MB) plus the open incident's sums: 64 MiB leaves room
STATE_MAX_BYTES = 64 << 20
STATE_FILE, SUMMARY_FILE = "state.json", "summary.json"  # RESULTS/NAME/state.json, RESULTS/NAME/<result>/summary.json


def _read_json(path: str, max_bytes: int = 1 << 20) -> dict | None:
    """Return the JSON object in path (read with :func:`opt_ds_ops.fsutil.read_small`: no link
    followed, no FIFO opened, max_bytes at most), or None if missing, unreadable or not an object."""
    import json

    from ..fsutil import read_small

    try:
        obj = json.loads(read_small(path, max_bytes))
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def read_model(results_dir: str, name: str) -> tuple[dict | None, dict | None]:
    """Return (RESULTS/NAME/state.json, the summary.json of the result it names as ``last_result``),
    each None where missing or unreadable."""
    state = _read_json(os.path.join(results_dir, name, STATE_FILE), STATE_MAX_BYTES)
    last = (state or {}).get("last_result")
    ok = isinstance(last, str) and last and "/" not in last and not last.startswith(".")
    return state, _read_json(os.path.join(results_dir, name, last, SUMMARY_FILE)) if ok else None


def _first(*values):
    return next((v for v in values if v is not None), None)


def _count(v) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0


def model_view(name: str, state: dict | None, summary: dict | None = None) -> dict:
    """Given a model's state.json (or None) and the summary of its last scored file (or None),
    return what the metrics and ``ds-ops status`` show: ``model``, ``version``, ``scored_at``
    (Unix seconds), ``rows_total``, ``flagged_total``, ``incidents_total``, ``critical_total`` (the
    series' counters, state.json's ``rows_scored``, ``rows_flagged``, ``incidents``,
    ``critical_incidents``: they survive a restart),
    ``active`` (an incident is open), ``incident`` (its id in the series, or None), ``severity`` (its severity, or None), ``threshold``,
    ``last_score``, ``top_metrics`` ([{metric, share}], the open incident's),
    ``last_time`` (the last scored row's data time, Unix seconds, or None), ``regime_total``
    (changes of regime said in the series), ``regime`` (the one not yet learned, or None). state.json's own ``scored_at`` and ``top_metrics`` come first, the summary's where it has none."""
    from ..observe.metrics import _utc_seconds

    st, s = state or {}, summary or {}
    inc = st.get("incident") if isinstance(st.get("incident"), dict) else None
    opened = inc.get("open") if inc is not None and isinstance(inc.get("open"), dict) else None
    if "incident" in st:
        active, severity = opened is not None, (opened or {}).get("severity")
    elif "segment" in st:  # a state.json written before incidents (format 1), until the model's next chunk
        active, severity = st["segment"] is not None, None
    else:
        active, severity = bool(s.get("active")), s.get("severity")
    top = _first(st.get("top_metrics"), s.get("top_metrics")) if active else []
    top = top if isinstance(top, list) else []
    return {
        "model": name,
        "version": _first(st.get("version"), s.get("version")),
        "scored_at": _utc_seconds(_first(st.get("scored_at"), s.get("scored_at"))),
        "rows_total": _count(_first(st.get("rows_scored"), s.get("rows_scored"))),
        "flagged_total": _count(_first(st.get("rows_flagged"), s.get("rows_flagged"))),
        "incidents_total": _count(_first(st.get("incidents"), st.get("segments"), s.get("incidents"))),
        "critical_total": _count(_first(st.get("critical_incidents"), s.get("critical_incidents"))),
        "active": active,
        "incident": (opened or {}).get("id") if isinstance((opened or {}).get("id"), int) else None,  # the open one's
        "severity": severity if active and severity in ("warning", "critical") else None,
        "threshold": _first(st.get("threshold"), s.get("threshold")),
        "last_score": _first(st.get("last_score"), s.get("last_score")),
        "top_metrics": [t for t in top if isinstance(t, dict)][:3],
        "drift_ratio": (s.get("drift") or {}).get("drift_ratio"),  # the last scored file's
        "last_time": st.get("last_time") if isinstance(st.get("last_time"), (int, float)) else None,  # data time
        "regime_total": _count(st.get("regime_changes")),
        "regime": _regime_view(st.get("regime")),
    }


def _restarted(old: dict, new: dict) -> bool:
    """Whether model view ``new`` is of a series made afresh since ``old``: its row count, which a
    series keeps through every reset, went down."""
    a, b = old.get("rows_total"), new.get("rows_total")
    return isinstance(a, int) and isinstance(b, int) and b < a


def _regime_view(reg) -> dict | None:
    """The series' change of regime not yet learned (state.json ``regime``) as status shows it:
    ``time``, ``started_time``, ``metrics`` [{metric, before, after, shift_sd}] (5 at most), or None."""
    if not isinstance(reg, dict):
        return None
    metrics = [m for m in reg.get("metrics") or [] if isinstance(m, dict)][:5]
    return {"id": reg.get("id"), "time": reg.get("time"), "started_time": reg.get("start_time"), "metrics": metrics}


def model_views(results_dir: str) -> dict[str, dict]:
    """Return {model: :func:`model_view`} for every RESULTS/NAME/ with a readable state.json."""
    try:
        names = sorted(n for n in os.listdir(results_dir) if not n.startswith("."))
    except OSError:
        return {}
    out = {}
    for n in names:
        state, summary = read_model(results_dir, n)
        if state is not None:
            out[n] = model_view(n, state, summary)
    return out


def prune_results(results_dir: str, max_age_days: float, max_bytes: int, now: float | None = None,
                  models: list[str] | None = None) -> list[str]:
    """Remove scored files' result directories (``RESULTS/NAME/<stamp>-<job>/``): those older than
    ``max_age_days`` (by the directory's mtime), then per model the oldest until its results total
    at most ``max_bytes``; 0 turns either rule off. ``state.json``, each model's newest result and
    hidden entries (a result being written) are never removed; no link is followed. ``models``: only
    these models' directories (None: every model's). Return ``NAME/<dir>`` of each removed."""
    if max_age_days <= 0 and max_bytes <= 0:
        return []
    now = time.time() if now is None else now
    removed = []
    try:
        names = sorted(n for n in os.listdir(results_dir) if not n.startswith(".")) if models is None else models
    except FileNotFoundError:
        return []
    for name in names:
        mdir = os.path.join(results_dir, name)
        try:
            if name.startswith(".") or "/" in name or not stat.S_ISDIR(os.lstat(mdir).st_mode):
                continue
        except FileNotFoundError:
            continue
        entries = []
        for e in os.scandir(mdir):
            if e.name.startswith(".") or not e.is_dir(follow_symlinks=False):
                continue
            size = sum(f.stat(follow_symlinks=False).st_size for f in os.scandir(e.path))
            entries.append((e.stat(follow_symlinks=False).st_mtime, size, e.name))
        entries.sort()
        total = sum(size for _, size, _ in entries)
        for mtime, size, entry in entries[:-1]:  # the newest stays: state.json's last_result, status
            if not ((max_age_days > 0 and now - mtime > max_age_days * 86400) or (max_bytes > 0 and total > max_bytes)):
                break
            shutil.rmtree(os.path.join(mdir, entry))
            total -= size
            removed.append(f"{name}/{entry}")
    return removed


def remove_series(results_dir: str, name: str) -> bool:
    """Remove model ``name``'s scoring series (``RESULTS/NAME``: its results, ``state.json``,
    ``history.npz``), as ``ds-ops models rm NAME`` does with the model: renamed to a hidden
    ``.rm-NAME-TOKEN`` first, then deleted, so the next owner of the name starts from nothing (no
    counters, drift or history of the old one). Return True if there was one (False also when
    another removal took it first). Raises OSError."""
    sweep_removed(results_dir)
    path = os.path.join(results_dir, name)
    if os.path.islink(path) or not os.path.isdir(path):
        return False
    hidden = os.path.join(results_dir, f"{REMOVED_PREFIX}{name}-{secrets.token_hex(6)}")
    try:
        os.rename(path, hidden)
    except FileNotFoundError:
        return False  # another removal (the operator's rm, a scoring job's) took it first
    fsync_dir(results_dir)
    shutil.rmtree(hidden, ignore_errors=True)  # what a kill leaves, the sweep takes
    return True


REMOVED_PREFIX = ".rm-"  # RESULTS/.rm-NAME-TOKEN: a series being removed
SWEEP_AFTER_S = 600.0  # a .rm-* renamed this long ago (its ctime) is a removal that was killed


def sweep_removed(results_dir: str, now: float | None = None) -> list[str]:
    """Delete what a removal killed midway left: ``.rm-*`` directories renamed over
    :data:`SWEEP_AFTER_S` ago (their ctime, which the rename set and no member can change; a
    removal at work is younger); return the names deleted. Called by :func:`remove_series` and
    the daemon's hourly sweep of results. Takes no lock a member could hold. Never raises: a
    sweep that cannot delete leaves it for the next."""
    now = time.time() if now is None else now
    gone = []
    try:
        names = [n for n in os.listdir(results_dir) if n.startswith(REMOVED_PREFIX)]
    except OSError:
        return gone
    for n in names:
        path = os.path.join(results_dir, n)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or now - st.st_ctime < SWEEP_AFTER_S:
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path):
            gone.append(n)
    return gone
