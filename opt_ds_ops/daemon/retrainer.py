"""When to retrain (docs/retraining.md), the daemon's side: after each scored file, decide whether its model
is due (``retrain.every`` since its current version was trained, or drift: the share of rows
flagged over the last ``retrain.drift_window`` above ``retrain.drift_rate`` times the design rate)
and queue a training job of kind ``retrain`` whose dataset is a copy of the model's scoring
history (:mod:`opt_ds_ops.lifecycle.history`).

The daemon never parses data: the figures come from the scoring job's summary (``drift``, JSON),
the history is copied as bytes into ``processing/JOB/dataset.npz``, and the job process
(:func:`opt_ds_ops.daemon.worker.job_main`) cuts it to its normal rows
(:func:`opt_ds_ops.lifecycle.retrain_data.write_history_dataset`) and trains it through the normal path,
promotion gate included. One retraining of a model at a time (none is queued while one is in
the queue or running); ``every`` counts from the newest version, promoted or not, so a
challenger the gate refused is followed by another one ``every`` later, by the data's own clock
where the rows have times (:func:`due`; each version's data end capped at its training's end,
each file's last row at now), else by the wall clock; ``drift`` fires once per current version
(a refused challenger does not start another until current changes). A failed retraining backs
off (one hour, doubled after each failure in a row, a day at most: :func:`backing_off`), by the
data's clock where the rows have times, else by the wall clock.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from datetime import datetime, timezone

from ..config.conffile import parse_window
from ..fsutil import fsync_dir, read_small, utc_now, write_atomic
from ..lifecycle.history import history_path
from ..observe.journal import LOG_NOTICE, LOG_WARNING, safe_text
from ..observe.metrics import _utc_seconds
from ..spool import new_job_id, save_record
from ..store.model_dir import StoreError, current_metadata, list_versions, name_dir_of, read_metadata

KIND = "retrain"
# What a version says of how to read the data it scores (metadata.json ``dataset``): a retraining's
# version inherits these from the version it retrains, since its own dataset (the history, a
# headerless matrix of the model's features in the model's order) has none of them.
READS_AS = ("header", "time", "left_out", "feature_columns", "options")
DATA_FILE = "dataset.npz"
HELD_FILE = "held_back.npy"  # the history's newest rows, for the promotion gate only
FAILED_FILE = "retrain-failed.json"  # RESULTS/NAME/: the last failed retraining, until one is saved
# After a failed retraining the next try waits this back-off, doubled after each failure in a row up
# to a day: a failure is not repeated after every scored chunk (each try copies the history, up to
# retrain.max_history_bytes, to failed/), and a failure after a shift (its history all flagged,
# say) does not hold the next try back for a whole retrain.every (7 days as shipped). Counted on
# the data's clock where the rows have times (a replay or a backfill), else on the wall clock.
BACKOFF_FIRST_S, BACKOFF_MAX_S = 3600.0, 86400.0


def trained_at_s(md: dict | None) -> float | None:
    """The UTC seconds a version's training ended (metadata ``ended_at``), or None."""
    return _utc_seconds((md or {}).get("ended_at"))


def data_end_s(md: dict | None) -> float | None:
    """The data time (UTC seconds) of the newest row a version was made from: a retraining's
    held-back rows' last time (``excluded.held_back.to_time_s``: the newest of its history),
    else its dataset's last time (``dataset.time.last``); None for data without times (a
    retraining whose history had none: its ``dataset.time`` is its parent's way of reading)."""
    md = md or {}
    held = (md.get("excluded") or {}).get("held_back")
    if isinstance(held, dict):
        t = held.get("to_time_s")
        return float(t) if isinstance(t, (int, float)) and math.isfinite(t) else None
    return _utc_seconds(((md.get("dataset") or {}).get("time") or {}).get("last"))


def last_trained(models_dir: str, name: str) -> tuple[float | None, float | None]:
    """(The UTC seconds the newest version of model ``name`` finished training, the newest data
    time any version was made from (:func:`data_end_s`)), promoted or not (a challenger the gate
    refused counts), each None where unknown; what ``retrain.every`` counts from."""
    try:
        name_dir = name_dir_of(models_dir, name)
        mds = [read_metadata(os.path.join(name_dir, v)) for v in list_versions(name_dir)]
    except (OSError, ValueError, StoreError):
        return None, None
    pairs = [(trained_at_s(md), data_end_s(md)) for md in mds]
    ends = [t for t, _ in pairs if t is not None]
    # a version's data cannot end after its training did: far-future rows (a clock glitch, or a
    # member's version that lost the name) would otherwise stop retrain.every for good
    data = [min(d, t) if t is not None else d for t, d in pairs if d is not None]
    return (max(ends) if ends else None), (max(data) if data else None)


def ago(seconds: float) -> str:
    """``42 s``, ``17.5 min``, ``3.2 h``, ``2.0 d``: a duration for a journal line."""
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= 2 * size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"


def failure_path(results_dir: str, name: str) -> str:
    return os.path.join(results_dir, name, FAILED_FILE)


def read_failure(results_dir: str, name: str) -> dict | None:
    """The last failed retraining of model ``name`` (``failed_at_s``, ``failures`` in a row,
    ``reason``, ``job_id``), or None since the last one saved (or none failed)."""
    try:
        doc = json.loads(read_small(failure_path(results_dir, name)))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("failed_at_s"), (int, float)) else None


def backoff_s(failure: dict) -> float:
    """The doubling back-off after a model's failed retraining(s) in a row (seconds)."""
    doublings = min(10, max(0, int(failure.get("failures") or 1) - 1))  # 2**10 h is past the cap already
    return min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** doublings)


def next_try_s(rcfg, failure: dict | None) -> float | None:
    """The UTC seconds before which no retraining of a model whose last one failed is queued (the
    doubling back-off after the failure, wall clock), or None without a failure."""
    if failure is None:
        return None
    return float(failure["failed_at_s"]) + backoff_s(failure)


def backing_off(failure: dict | None, now_s: float, data_s: float | None) -> bool:
    """Whether a model whose last retraining failed still waits: on the data's clock where both the
    failure (its ``data_s``: the newest scored row's time when it was queued) and the newest scored
    row (``data_s``) have one, else on the wall clock (:func:`next_try_s`)."""
    if failure is None:
        return False
    failed_data = failure.get("data_s")
    if isinstance(failed_data, (int, float)) and isinstance(data_s, (int, float)):
        return data_s < float(failed_data) + backoff_s(failure)
    return now_s < float(failure["failed_at_s"]) + backoff_s(failure)


def due(rcfg, summary: dict, trained_s: float | None, now_s: float,
        data_s: float | None = None) -> tuple[str, str] | None:
    """Return (trigger ``drift`` or ``every``, why in words) if the model of a scored file's
    summary is due for retraining, else None. ``retrain.every`` counts the telemetry's own clock
    where both the file's last row (``last_time``) and the newest version's data (``data_s``)
    have a time: a backfill or a replay retrains by data time, however fast it is fed. Otherwise
    it counts the wall clock from ``trained_s`` to ``now_s``."""
    d = summary.get("drift") or {}
    ratio = d.get("drift_ratio")
    if rcfg.drift_rate > 0 and isinstance(ratio, (int, float)) and ratio > rcfg.drift_rate:
        rows, _ = parse_window(rcfg.drift_window)
        # a full window of the current version's own rows (``full``), not its first few rows
        if d.get("full", True) and (not rows or d.get("rows", 0) >= rows):
            return "drift", (f"{d['flagged_share']:.2%} of the last {d['rows']} rows flagged, {ratio:.1f} x the "
                             f"design rate {d['design_rate']:.2%} (retrain.drift_rate {rcfg.drift_rate:g})")
    chunk_s = _utc_seconds(summary.get("last_time"))
    if chunk_s is not None:
        chunk_s = min(chunk_s, now_s)  # a row from the future counts as now
    if rcfg.every and data_s is not None and chunk_s is not None:
        if chunk_s - data_s >= rcfg.every_s:
            return "every", (f"the newest version's data ends {ago(chunk_s - data_s)} before this file's last row "
                             f"(retrain.every {rcfg.every}, by the data's clock)")
        return None
    if rcfg.every and trained_s is not None:
        if now_s - trained_s >= rcfg.every_s:
            return "every", f"the newest version was trained {ago(now_s - trained_s)} ago (retrain.every {rcfg.every})"
    return None


class Retrainer:
    """The daemon's retraining hook: ``on_scored(summary)`` after each scored file."""

    def __init__(self, daemon):
        self.d = daemon
        self.drift_for: dict[str, str] = {}  # model -> the current version a drift retraining was queued for
        self.drift: dict[str, float] = {}  # model -> the last drift ratio (metrics)
        self.regime_for: dict[str, tuple] = {}  # model -> (current version, change of regime) a retraining was queued for

    def on_scored(self, summary: dict) -> str | None:
        """Queue a retraining of the summary's model if it is due; return its job id or None."""
        name, version = str(summary.get("model") or ""), summary.get("version")
        ratio = (summary.get("drift") or {}).get("drift_ratio")
        if isinstance(ratio, (int, float)):
            self.drift[name] = float(ratio)
        cfg = self.d.cfg
        if not name or any(r.get("kind") == KIND and r.get("model") == name for r in self.d.records.values()):
            return None  # its retraining is queued or running (also one recovered from processing/)
        if self.drift_for.get(name) == version:
            summary = {k: v for k, v in summary.items() if k != "drift"}  # drift tried for this current
        newest_s = _utc_seconds(summary.get("last_time"))  # the newest scored row's time, or None
        if backing_off(read_failure(cfg.scoring.results_dir, name), time.time(), newest_s):
            return None  # the last retraining failed: its back-off first
        hist = history_path(cfg.scoring.results_dir, name)
        regime = summary.get("regime")
        if isinstance(regime, dict) and cfg.retrain.regime_learn_s > 0:
            key = (version, regime.get("id"))
            if self.regime_for.get(name) != key:  # a change of regime not yet learned: its rows first, then the rest
                if not regime.get("learn_due") or not os.path.isfile(hist):
                    return None
                metrics = ", ".join(str(m) for m in (regime.get("metrics") or [])[:5])
                why = (f"a change of regime ({metrics}) since {regime.get('started_time') or 'series row'}: "
                       f"{regime.get('rows')} rows of it scored (retrain.regime_learn_s {cfg.retrain.regime_learn_s:g})")
                job_id = self.queue(name, hist, "regime", why,
                                    regime={"rows": int(regime.get("rows") or 0), "shift": regime.get("shift") or []},
                                    data_s=newest_s)
                self.regime_for[name] = key
                return job_id
        trained_s, data_s = last_trained(cfg.models_dir, name)
        why = due(cfg.retrain, summary, trained_s, time.time(), data_s)
        if why is None or not os.path.isfile(hist):
            return None
        job_id = self.queue(name, hist, *why, data_s=newest_s)
        if why[0] == "drift":
            self.drift_for[name] = version
        return job_id

    def on_failed(self, record: dict, reason: str) -> None:
        """A retraining job failed: note it beside the model's results (``retrain-failed.json``),
        so that the next try waits (:func:`next_try_s`, also across a restart) and ``ds-ops
        status`` says so; journal when that is."""
        name = str(record.get("model") or "")
        if current_metadata(self.d.cfg.models_dir, name) is None:
            return  # the model was removed: its next owner starts from nothing, no back-off of the old one's
        last = read_failure(self.d.cfg.scoring.results_dir, name) or {}
        doc = {"failed_at": utc_now(), "failed_at_s": time.time(), "failures": int(last.get("failures") or 0) + 1,
               "reason": reason, "job_id": record.get("job_id")}
        if isinstance(record.get("data_s"), (int, float)):
            doc["data_s"] = float(record["data_s"])  # the back-off counts on the data's clock from here
        path = failure_path(self.d.cfg.scoring.results_dir, name)
        os.makedirs(os.path.dirname(path), 0o750, exist_ok=True)
        write_atomic(path, (json.dumps(doc, sort_keys=True) + "\n").encode(), mode=0o640)
        if "data_s" in doc:
            at = datetime.fromtimestamp(doc["data_s"] + backoff_s(doc), timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
            when = f"before rows of {at} (data time) are scored"
        else:
            at = datetime.fromtimestamp(next_try_s(self.d.cfg.retrain, doc), timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
            when = f"before {at}"
        self.d.log.event("retrain-backoff", f"{safe_text(name)}: retraining failed ({doc['failures']} in a row); the "
                         f"next one is not queued {when}", priority=LOG_WARNING, model=name, reason=reason,
                         job_id=record.get("job_id"))

    def on_saved(self, record: dict) -> None:
        """A retraining job saved a version (promoted or not): its model's failures are over."""
        try:
            os.unlink(failure_path(self.d.cfg.scoring.results_dir, str(record.get("model") or "")))
        except FileNotFoundError:
            pass

    def queue(self, name: str, hist: str, trigger: str, why: str, regime: dict | None = None,
              data_s: float | None = None) -> str:
        """Make processing/JOB (a copy of the history, its record) and put it in the training
        queue; journal ``retrain-queued``. ``regime``: a change of regime to learn (``rows``: the
        history's newest rows are its; ``shift``: ``[[column, delta]]``, data units): the older rows
        are moved to its levels before training (:func:`opt_ds_ops.lifecycle.retrain_data.rebased_history`).
        Raises OSError."""
        spool, job_id = self.d.spool, new_job_id()
        jdir = spool.job_dir(job_id)
        os.mkdir(jdir, 0o750)
        tmp = os.path.join(jdir, f".{DATA_FILE}")
        shutil.copyfile(hist, tmp)  # bytes only: the job process parses it
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.rename(tmp, os.path.join(jdir, DATA_FILE))
        record = {"job_id": job_id, "kind": KIND, "model": name, "dataset": f"{name}.history.npz",
                  "data_file": DATA_FILE, "state": "claimed", "claimed_at": utc_now(), "trigger": trigger,
                  "why": why, "uploader_uid": None, "window": self.d.cfg.retrain.window}
        if regime:
            record["regime"] = regime
        if data_s is not None:
            record["data_s"] = data_s  # the newest scored row's time: a failure's back-off counts from it
        save_record(spool, record)
        fsync_dir(jdir)
        self.d.records[job_id] = record
        self.d.pending.append(job_id)
        self.d.log.event("retrain-queued", f"{safe_text(name)}: retraining queued as job {job_id} ({trigger}): "
                         f"{safe_text(why)}", priority=LOG_NOTICE, model=name, trigger=trigger, reason=why,
                         job_id=job_id, dataset_file=record["dataset"])
        return job_id


def job_options(cfg, name: str):
    """In the job process: the dataset options of a retraining job of model ``name``: the
    conffile's, with the current version's metric names (the history has no header, and a version
    without them names its metrics by column number in alerts and the journal: its header's, else
    the file columns its features came from, as scoring names them) and no column selection (the
    history's columns are the model's features already: ``dataset.columns`` or
    ``exclude_columns`` would pick among them a second time; an array has no named time column;
    its rows are the normal ones already, so no second ``exclude_flagged``)."""
    import dataclasses

    from ..scoring.series import stored_metric_names

    md = current_metadata(cfg.models_dir, name) or {}
    d = (md.get("dataset") or {}).get("columns") if isinstance(md.get("dataset"), dict) else None
    names = stored_metric_names(md, d) if isinstance(d, int) else None
    return dataclasses.replace(cfg.dataset, columns=(), exclude_columns=(), time_column="auto", exclude_flagged=False,
                               metric_names=tuple(names or ()))


def job_dataset(spool, job_id: str, record: dict, cfg) -> tuple[str, dict, str, str]:
    """In the job process: cut a retraining job's history copy to its normal rows as
    ``processing/JOB/normal.npy``, its newest tenth held back first, whole, as
    ``processing/JOB/held_back.npy`` (:func:`opt_ds_ops.lifecycle.retrain_data.write_history_dataset`);
    return (the dataset's path, the metadata to add: ``retrain``, ``excluded`` with its
    ``held_back`` range, ``reads_as``: how current reads the data it scores (:data:`READS_AS`:
    column names and order, the time column and sample period, the columns left out, the options
    a sidecar gave), which the new version keeps; the dataset file name the version keeps:
    current's, so that files named after it still score and train as that model; the held-back
    rows' path, for the gate). Raises
    ValueError for a history that leaves too little to train on."""
    from ..lifecycle.retrain_data import write_history_dataset
    from ..store.model_dir import dataset_file_of

    parent = current_metadata(cfg.models_dir, record["model"])
    if parent is None:  # removed (ds-ops models rm) since it was queued: no version of no one's is made
        raise ValueError(f"model {record['model']} has no current version any more (removed since this retraining "
                         "was queued?); not retrained")
    out, held = spool.job_path(job_id, "normal.npy"), spool.job_path(job_id, HELD_FILE)
    regime = record.get("regime") if isinstance(record.get("regime"), dict) else None
    info = write_history_dataset(spool.job_path(job_id, DATA_FILE), out, cfg.retrain.exclude_margin,
                                 cfg.retrain.exclude_max_rows, held_path=held, regime=regime)
    meta = {"retrain": {k: record.get(k) for k in ("trigger", "why", "window", "claimed_at", "regime")},
            "excluded": info}
    reads = parent.get("dataset") or {}
    meta["reads_as"] = {k: reads.get(k) for k in READS_AS if k in reads}
    meta["reads_as"]["inherited_from"] = parent.get("version")
    name = dataset_file_of(cfg.models_dir, record["model"]) or record["dataset"]
    return out, json.loads(json.dumps(meta)), name, held
