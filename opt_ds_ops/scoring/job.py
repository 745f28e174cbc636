"""One scoring job: a claimed chunk of telemetry -> its model's series -> results on disk.

Runs in a job process (the daemon never parses a user's bytes): :func:`score_job` reads the job
directory the daemon claimed (``job.json``, the copy ``dataset.<ext>``, ``sidecar.yaml``), names
the model as training does (a sidecar's ``name:`` or ``model:``, else the file's stem), loads its
``current`` version, reads the chunk with the model's dataset options and the training limits,
checks its columns against the model's, scores it as the continuation of the model's series
(:func:`opt_ds_ops.scoring.series.score_chunk`) and writes, under ``scoring.results_dir``::

    NAME/state.json                     the series' carried state (SeriesState), last_job = the job
    NAME/<UTC stamp>-<job id>/rows.csv  row,time,score,anomaly,incident,top_metrics (series rows)
    NAME/<UTC stamp>-<job id>/summary.json

The result directory is written hidden (``.tmp-<job id>``) and renamed into place, then
``state.json`` is replaced atomically: a reader never sees half a result, and a SIGKILL at any
instant leaves either no result and the old state (the job runs again from scratch: a leftover
result directory of the same job is removed first) or the result and the old state (removed and
redone), or both (a replay returns the kept summary). Directories are 0750, files 0640 (group
ds-ops reads them). The caller runs one scoring job of a model at a time; nothing here locks.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
import shutil
import zipfile
from datetime import datetime, timezone

import numpy as np

from ..config.conffile import Config, ConfigError, DatasetConfig
from ..config.sidecar import SIDECAR_MAX_BYTES, parse_sidecar
from ..dataset import DatasetError, DatasetLimits, dataset_stem, load_dataset
from ..dataset.core import iso_utc
from ..fsutil import fsync_dir, read_small, write_atomic
from ..lifecycle.history import HISTORY_FILE, chunk_drift, read_history, record_chunk, sent_again
from ..lifecycle.promotion import design_rate, seed_scores
from ..model.calibration import CalibrationPolicy
from ..model.detection import ScoreError
from ..store.model_dir import model_lineage
from ..store.versions import CURRENT, StoreError, load_model, safe_model_name
from .incidents import IncidentPolicy
from .regime import RegimePolicy
from .results import remove_series
from .series import (SeriesState, active_top_metrics, finite_or_none, fresh_state, model_metric_names, model_version,
                     sample_period_s, score_chunk)

STATE_FILE, ROWS_FILE, SUMMARY_FILE = "state.json", "rows.csv", "summary.json"
JOB_FILE, SIDECAR_FILE = "job.json", "sidecar.yaml"
MAX_EVENTS = 200  # events kept in a summary: the first and the last half of them
MAX_NAME_CHARS = 200  # a user-given name (file, model, metric) in a summary is cut to this
DIR_MODE, FILE_MODE = 0o750, 0o640


class ScoringError(ValueError):
    """A chunk that cannot be scored; the message says why (the daemon moves it to failed/)."""


def _clip(text, limit: int = MAX_NAME_CHARS) -> str:
    text = str(text)
    return text if len(text) <= limit else text[:limit] + "..."


def name_chunk(job_dir: str, record: dict, base) -> tuple[str, bool]:
    """Return (model name, explicit) of a scoring job: its sidecar's ``name:``/``model:``, else the
    file's stem made safe. Raises ScoringError for a sidecar that could not be taken or is invalid,
    or a file name no model name can be made from."""
    if record.get("sidecar_error"):
        raise ScoringError(f"sidecar {record['sidecar_error']}")
    name = None
    path = os.path.join(job_dir, SIDECAR_FILE)
    if record.get("sidecar") and os.path.lexists(path):
        name = _sidecar(path, record["sidecar"], base)[1]
    try:
        return safe_model_name(name or dataset_stem(record["dataset"])), name is not None
    except StoreError as e:
        raise ScoringError(f"no model name can be made from this file name: {e}") from None


def _sidecar(path: str, label: str, base):
    try:
        return parse_sidecar(read_small(path, SIDECAR_MAX_BYTES), label, base)
    except OSError as e:
        raise ScoringError(f"sidecar {label}: cannot read it: {e.strerror or e}") from None
    except ConfigError as e:
        raise ScoringError(f"sidecar {e}") from None


def match_columns(stored, ds, *, extra_ok: bool = False) -> None:
    """Check ds's feature columns against the model's and put them in the model's order: by header
    name where both have names, else by count. Raises ScoringError naming the columns the model
    needs and the file lacks and (unless ``extra_ok``: they are dropped) those it has besides."""
    names = (stored.metadata.get("dataset") or {}).get("header")
    if names and ds.header:
        names = [str(n) for n in names]
        missing = [n for n in names if n not in ds.header]
        extra = [] if extra_ok else [n for n in ds.header if n not in names]
        if missing or extra:
            def shown(cols):
                more = f", ... ({len(cols)} in all)" if len(cols) > 5 else ""
                return ", ".join(repr(_clip(n, 60)) for n in cols[:5]) + more
            parts = ([f"lacks the model's columns {shown(missing)}"] if missing else []) + \
                    ([f"has columns the model was not trained on: {shown(extra)}"] if extra else [])
            raise ScoringError(f"{ds.path}: the columns do not match the model's: this file {'; and '.join(parts)}")
        if names != list(ds.header):
            order = [ds.header.index(n) for n in names]
            ds.data = np.ascontiguousarray(np.asarray(ds.data)[:, order])
            ds.offset = ds.offset[order] if ds.offset is not None else None
            ds.header = names
        return
    if ds.features != stored.n_features:
        raise ScoringError(f"{ds.path}: {ds.features} feature columns; model expects {stored.n_features}")


def stored_options(stored, cfg) -> DatasetConfig:
    """The column options the model's dataset was read with (metadata.json ``dataset.options``; a
    sidecar's included), so new data is read the same way; models from before them: the conffile's."""
    saved = (stored.metadata.get("dataset") or {}).get("options")
    if not isinstance(saved, dict):
        return cfg.dataset
    try:
        return DatasetConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})
    except TypeError:
        return cfg.dataset


def pinned_options(stored, options: DatasetConfig) -> DatasetConfig:
    """Return options that read a headerless chunk's columns as the model's training file was read.

    ``time_column: auto`` and the row-index rule look at the values, so a short chunk (one row; an
    index that starts at 3000) could be read otherwise than the training file was. For a model
    without header names whose training left columns out, the time column and the feature
    columns are pinned to the training file's numbers (metadata.json ``dataset.time.column``,
    ``dataset.feature_columns``), unless the options name columns themselves."""
    ds = stored.metadata.get("dataset") or {}
    cols, time = ds.get("feature_columns"), (ds.get("time") or {}).get("column")
    if ds.get("header") or not isinstance(cols, list) or not ds.get("left_out") or options.columns:
        return options
    pin = {"columns": tuple(str(c) for c in cols), "exclude_columns": ()}
    if options.time_column.strip().casefold() == "auto":
        number = str(time).removeprefix("column ").strip() if isinstance(time, str) else ""
        pin["time_column"] = number if number.isdigit() else "none"
    return dataclasses.replace(options, **pin)


def _check_width(stored, ds) -> None:
    """Raise ScoringError if a pinned headerless chunk has another number of columns than the
    model's training file (``feature_columns`` plus ``left_out``)."""
    md = stored.metadata.get("dataset") or {}
    if md.get("header") or not md.get("left_out") or not isinstance(md.get("feature_columns"), list):
        return
    want, got = len(md["feature_columns"]) + len(md["left_out"]), ds.features + len(ds.left_out)
    if want != got:
        raise ScoringError(f"{ds.path}: {got} columns; the model's training file had {want} "
                           f"({len(md['feature_columns'])} features)")


def read_state(path: str) -> tuple[SeriesState | None, str | None]:
    """Return (the series state in path or None if there is none, a note if it could not be read)."""
    try:
        with open(path, encoding="utf-8") as f:
            return SeriesState.from_dict(json.load(f)), None
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError, TypeError, OverflowError, KeyError) as e:
        return None, f"the series state {path} could not be read ({_clip(e)}): the series starts again"


def _write_file(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(path, FILE_MODE)


def rows_csv(result, times: np.ndarray | None) -> bytes:
    """Return rows.csv: ``row,time,score,anomaly,incident,top_metrics`` (``time`` only with a time
    index): ``anomaly`` 1 for a flagged row, ``incident`` the id of the incident the row belongs to
    (empty when none), ``top_metrics`` a flagged row's own top metrics."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["row"] + (["time"] if times is not None else []) + ["score", "anomaly", "incident", "top_metrics"])
    for i, (s, a, k) in enumerate(zip(result.scores.tolist(), result.flags.tolist(), result.incident.tolist())):
        w.writerow([result.first_row + i] + ([iso_utc(float(times[i]))] if times is not None else [])
                   + [f"{s:.6g}", int(a), k or "", result.top[i]])
    return buf.getvalue().encode("utf-8")


def json_safe(obj):
    """Return obj with every NaN or infinite float replaced by None (strict JSON)."""
    if isinstance(obj, float):
        return finite_or_none(obj)
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [json_safe(v) for v in obj]
    return obj


def regime_summary(state, period_s: float | None, learn_s: float, std) -> dict | None:
    """The summary's ``regime``: the series' change of regime not yet learned (None without one):
    ``id``, ``time`` (when it was said), ``started_time``, ``metrics`` (the shifted metrics, named),
    ``rows`` (rows of the new regime scored so far, from the incident's first row), ``shift``
    (``[[column, delta]]``: the series' whole re-baseline in the data's units, ``std`` the model's
    scaling), ``learn_due`` (at least ``retrain.regime_learn_s`` seconds of rows of it: the daemon
    retrains on them, :mod:`opt_ds_ops.daemon.retrainer`)."""
    reg = state.regime
    if not reg:
        return None
    rows = max(0, int(state.next_row) - int(reg.get("start_row") or 0))
    due = bool(learn_s > 0 and rows * (period_s or 60.0) >= learn_s)
    sd = np.asarray(std, dtype=np.float64)
    shift = [[j, float(v * sd[j])] for j, v in enumerate(state.rebase or []) if v and j < sd.shape[0]]
    return {"id": reg.get("id"), "time": reg.get("time"), "started_time": reg.get("start_time"),
            "metrics": [m.get("metric") for m in reg.get("metrics") or []][:20], "rows": rows, "learn_due": due,
            "shift": shift}


def _clip_events(events: list[dict]) -> tuple[list[dict], int]:
    if len(events) <= MAX_EVENTS:
        return events, 0
    half = MAX_EVENTS // 2
    return events[:half] + events[-half:], len(events) - MAX_EVENTS


def _result_dirs(model_dir: str, job_id: str) -> list[str]:
    try:
        return sorted(e for e in os.listdir(model_dir) if e.endswith("-" + job_id) or e == f".tmp-{job_id}")
    except FileNotFoundError:
        return []


def load_chunk(job_dir: str, record: dict, stored, cfg: Config):
    """Return the job's chunk as a Dataset read as the model's training file was (its options, a
    sidecar's over them, :func:`pinned_options`; the training limits, one row allowed), its
    columns checked and put in the model's order (:func:`match_columns`). Messages name the
    dropped file, never the job's copy. Raises DatasetError or ScoringError."""
    options = stored_options(stored, cfg)
    if record.get("sidecar") and os.path.lexists(os.path.join(job_dir, SIDECAR_FILE)):
        options = _sidecar(os.path.join(job_dir, SIDECAR_FILE), record["sidecar"], options)[0]
    path, source = os.path.join(job_dir, str(record.get("data_file") or "")), _clip(record["dataset"])
    limits = dataclasses.replace(DatasetLimits.from_config(cfg.job, cfg.spool.max_dataset_bytes), min_rows=1)
    try:
        pinned = pinned_options(stored, options)
        try:
            ds = load_dataset(path, limits, pinned)
        except DatasetError:
            if pinned == options:
                raise
            _check_width(stored, load_dataset(path, limits, options))  # the reason in the file's own terms
            raise
        ds.path = source
        _check_width(stored, ds)
        match_columns(stored, ds)
    except (DatasetError, ScoringError) as e:
        raise type(e)(str(e).replace(path, source)) from None
    return ds


def _write_result(model_dir: str, job_id: str, summary: dict, rows: bytes) -> None:
    """Write rows.csv and summary.json into ``.tmp-JOB``, fsync, rename it to the summary's
    ``result_dir``; a failure removes the temporary directory. Raises OSError."""
    tmp = os.path.join(model_dir, f".tmp-{job_id}")
    os.mkdir(tmp, DIR_MODE)
    try:
        os.chmod(tmp, DIR_MODE)
        _write_file(os.path.join(tmp, ROWS_FILE), rows)
        _write_file(os.path.join(tmp, SUMMARY_FILE), (json.dumps(summary, indent=1, sort_keys=True, allow_nan=False) + "\n").encode())
        fsync_dir(tmp)
        os.rename(tmp, summary["result_dir"])
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(model_dir)


def history_seed(model_dir: str, stored, policy: CalibrationPolicy, job_id: str, chunk_rows: int,
                 timed: bool, margin: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray] | None:
    """Return (scores, times or None, normal) of the series' history (``model_dir``'s ``history.npz``: the
    rows the versions before scored), its last ``policy.days`` days scored by ``stored``, for a new
    version's alarm budget (:func:`opt_ds_ops.model.calibration.seed`): by the rows' times where
    the chunk has them (``timed``), else by rows. ``normal``: the rows outside what the versions
    before flagged and ``margin`` rows on each side of it
    (:func:`opt_ds_ops.lifecycle.retrain_data.exclusion_mask`). The ``chunk_rows`` rows job ``job_id`` appended
    before a kill are not the history's (the job is scored again). None, and the budget starts from
    the model's threshold, where there is no history, it cannot be read or scored by this version
    (other columns), its times are not all known while the chunk's are, or the version learned a
    change of regime (the history before it is at the old levels: :mod:`opt_ds_ops.scoring.regime`)."""
    if ((stored.metadata or {}).get("retrain") or {}).get("regime"):
        return None
    try:
        h = read_history(os.path.join(model_dir, HISTORY_FILE))
        if h is None:
            return None
        n = h.values.shape[0] - (chunk_rows if h.last_job == job_id else 0)
        times = h.times[:max(n, 0)].astype(np.float64)
        if n <= 0 or (timed and not np.isfinite(times).all()):
            return None
        return seed_scores(h, n, stored, policy, timed, margin)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, ScoreError):
        return None


def score_job(job_dir: str, cfg: Config) -> dict:
    """Given a claimed scoring job's directory (``job.json``: ``job_id``, ``dataset`` (the file's
    name), ``data_file``, ``sidecar``, ``uploader_uid``), score it and return its summary (JSON
    types, bounded size; see docs/scoring.md): ``model``, ``version``, ``model_dir``, ``source``,
    ``job_id``, ``rows``, ``first_row``, ``last_row``, ``first_time``, ``last_time``, ``flagged``,
    ``events``, ``events_left_out``, ``notes`` (the file's, e.g. rows sorted), ``resets`` (why the
    carried state was reset), ``active`` (an incident is open), ``severity`` (the open incident's,
    or None), ``top_metrics`` (the open incident's), ``threshold`` (in force at the last row:
    the model's, or the alarm budget's), ``model_threshold``, ``last_score``, ``rows_scored``,
    ``rows_flagged``, ``incidents`` (the series'),
    ``result_dir``, ``scored_at``, ``drift`` (the history's flagged share against the design rate, for
    retraining), ``replayed`` (True: the job had been scored before a restart).

    Raises ScoringError for a job without a record, a sidecar that is invalid, a model without a
    ``current`` version (or one the file's owner may not use), columns that do not match the
    model's, a row whose score is not finite; DatasetError (the file's own faults, named by the file's name) or ScoreError; OSError
    when the results cannot be written. Nothing is written then and the series state stays as it was.
    """
    from ..training.job import JobError, check_model_name

    try:
        record = json.loads(read_small(os.path.join(job_dir, JOB_FILE)))
        job_id, source = str(record.get("job_id") or os.path.basename(job_dir)), str(record["dataset"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ScoringError(f"{job_dir}: no readable job record ({JOB_FILE}): {e}") from None
    name, explicit = name_chunk(job_dir, record, cfg.dataset)
    squatted = record.get("sidecar_squatted") if not explicit else None  # its own sidecar could not come in
    try:
        check_model_name(cfg.models_dir, name, source, explicit, record.get("uploader_uid"))
    except JobError as e:
        raise ScoringError(f"sidecar {squatted}" if squatted else str(e)) from None
    current = os.path.join(cfg.models_dir, name, CURRENT)
    if squatted and not os.path.lexists(current):
        raise ScoringError(f"sidecar {squatted}")
    if not os.path.lexists(current):
        raise ScoringError(f"{_clip(source)}: model {name} has no current version (train it first, or name the "
                           f"model in a sidecar {_clip(dataset_stem(source))}.yaml: model: NAME)")
    model_dir = os.path.join(cfg.scoring.results_dir, name)
    state_path = os.path.join(model_dir, STATE_FILE)
    state, state_note = read_state(state_path)
    lineage = model_lineage(os.path.join(cfg.models_dir, name))
    if state is not None and state.lineage and lineage and state.lineage != lineage:
        # an earlier model of this name (removed since, its series left by a kill or a race): not this one's
        remove_series(cfg.scoring.results_dir, name)
        state, state_note = None, (f"the scoring series under {name} was an earlier model's of that name (removed "
                                   "since): removed, and this model's series starts afresh")
    if state is not None and state.last_job == job_id and state.last_result:  # scored before a restart
        try:
            with open(os.path.join(model_dir, state.last_result, SUMMARY_FILE), encoding="utf-8") as f:
                return dict(json.load(f), replayed=True)
        except (OSError, ValueError):  # removed since (retention): never score it twice
            return {"model": name, "job_id": job_id, "source": _clip(source), "replayed": True, "result_dir": None,
                    "rows_scored": state.rows_scored, "rows_flagged": state.rows_flagged, "incidents": state.incidents,
                    "active": state.open_incident is not None, "events": [], "notes": ["the kept summary is gone"]}
    for leftover in _result_dirs(model_dir, job_id):  # a kill after the result's rename, before the state's
        shutil.rmtree(os.path.join(model_dir, leftover))
    try:
        stored = load_model(current)
    except StoreError as e:
        raise ScoringError(f"model {name}: {e}") from None
    ds = load_chunk(job_dir, record, stored, cfg)
    names = [_clip(n) for n in model_metric_names(stored, ds.metric_labels())]
    resets = [state_note] if state_note else []  # why the carried state was not continued (journaled)
    notes = list(ds.notes)  # the file's own (rows sorted, repeated times): in the summary and the scored line
    calibration = CalibrationPolicy.from_config(cfg.scoring)
    times = ds.time.seconds if ds.time is not None else None
    data = np.asarray(ds.data)
    if state is not None and times is not None and state.last_time is not None and len(times) \
            and times[0] <= state.last_time and state.version == model_version(stored):
        k = sent_again(read_history(os.path.join(model_dir, HISTORY_FILE)), data, ds.offset, times, state.last_time)
        if k == len(times):
            raise ScoringError(f"{_clip(source)}: its {k} rows ({iso_utc(float(times[0]))} to "
                               f"{iso_utc(float(times[-1]))}) were scored already (the same times and values are in "
                               "the series' history: a chunk sent again); not scored twice")
        if k:
            notes.append(f"{k} row(s) from {iso_utc(float(times[0]))} to {iso_utc(float(times[k - 1]))} were scored "
                         "already (the same times and values are in the series' history: a chunk sent again); "
                         "scored from the next row on, not twice")
            data, times = data[k:], times[k:]
    seed = (history_seed(model_dir, stored, calibration, job_id, ds.rows, times is not None, cfg.retrain.exclude_margin)
            if calibration.on and calibration.from_history and state is not None
            and state.version != model_version(stored) else None)
    if data.shape[0] != ds.rows:
        seed = None  # a chunk sent again continues its own version's series: nothing to seed  # a new version of a series scored before
    state = state or fresh_state(name, stored)
    result = score_chunk(stored, data, ds.offset, times, state, names=names,
                         max_gap_periods=cfg.scoring.max_gap_periods,
                         policy=IncidentPolicy.from_config(cfg.scoring), regime=RegimePolicy.from_config(cfg.scoring),
                         calibration=calibration, calibration_seed=seed)
    bad = np.flatnonzero(~np.isfinite(result.scores))
    if bad.size:  # an inf would stay in the carried smoothing for good: refused before anything is written
        raise ScoringError(f"{_clip(source)}: data row {int(bad[0]) + 1 + ds.rows - data.shape[0]} scores {float(result.scores[bad[0]])} (not "
                           "finite): its values are too far outside the training data's range (train.input_clip 0 "
                           "does not bound them); the file is not scored and the series state is unchanged")
    resets.extend(result.notes)
    events, left_out = _clip_events(result.events)
    now = datetime.now(timezone.utc)
    result_name = f"{now.strftime('%Y%m%dT%H%M%S.%fZ')}-{job_id}"
    n = int(result.scores.shape[0])
    new = result.state
    summary = {
        "model": name, "version": model_version(stored), "model_dir": stored.path, "source": _clip(source),
        "job_id": job_id, "rows": n, "first_row": result.first_row, "last_row": result.first_row + n - 1,
        "first_time": iso_utc(float(times[0])) if times is not None and n else None,
        "last_time": iso_utc(float(times[-1])) if times is not None and n else None,
        "flagged": int(result.flags.sum()), "events": events, "events_left_out": left_out,
        "notes": [_clip(x, 400) for x in notes[:20]], "resets": [_clip(x, 400) for x in resets[:20]],
        "active": result.active, "severity": (new.open_incident or {}).get("severity"),
        "top_metrics": active_top_metrics(new, names), "threshold": float(new.threshold),
        "model_threshold": float(stored.threshold),
        "last_score": finite_or_none(new.last_score), "rows_scored": new.rows_scored,
        "rows_flagged": new.rows_flagged, "incidents": new.incidents, "critical_incidents": new.critical_incidents,
        "result_dir": os.path.join(model_dir, result_name), "scored_at": now.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        "replayed": False,
    }
    summary["regime"] = regime_summary(new, sample_period_s(stored), cfg.retrain.regime_learn_s,
                                       stored.std.double().numpy())
    summary["drift"] = chunk_drift(model_dir, job_id, result.flags, times, cfg.retrain.drift_window,  # for retraining
                                   design_rate(stored.metadata), own_rows=new.version_rows,
                                   period_s=sample_period_s(stored))
    summary = json_safe(summary)
    os.makedirs(model_dir, DIR_MODE, exist_ok=True)
    _write_result(model_dir, job_id, summary, rows_csv(result, times))
    note = record_chunk(model_dir, job_id, data, ds.offset, result.flags, times,  # rows to retrain from
                        cfg.retrain.window, cfg.retrain.max_history_bytes)
    summary["notes"] += [note] if note else []
    new.last_job, new.last_result, new.lineage = job_id, result_name, lineage
    new.scored_at, new.top_metrics = summary["scored_at"], summary["top_metrics"]
    write_atomic(state_path, (json.dumps(new.to_dict(), sort_keys=True, allow_nan=False) + "\n").encode(), mode=FILE_MODE)
    now_lineage = model_lineage(os.path.join(cfg.models_dir, name))
    if not os.path.lexists(current) or (lineage and now_lineage and now_lineage != lineage):
        # `ds-ops models rm NAME` while this chunk was scored (and maybe a new NAME since): the series goes with it
        remove_series(cfg.scoring.results_dir, name)
        raise ScoringError(f"{_clip(source)}: model {name} was removed while the file was scored; its scoring "
                           "series (results, state, history) is removed with it, so the name's next owner starts "
                           "from nothing")
    return summary


def series_status(results_dir: str) -> list[dict]:
    """Return, per model with a series under results_dir (name order), what ``ds-ops status``
    shows: ``model``, ``version``, ``scored_at`` (the last chunk's scoring time), ``last_time``
    (its last row's time, ISO UTC or None), ``rows_scored``, ``rows_flagged``, ``incidents``,
    ``active``, ``severity``, ``top_metrics`` (the open incident's), ``last_score``, ``threshold``,
    ``last_job``; or ``{"model", "error"}`` for a state that cannot be read. Never raises."""
    out = []
    try:
        names = sorted(e for e in os.listdir(results_dir) if not e.startswith("."))
    except OSError:
        return out
    for name in names:
        path = os.path.join(results_dir, name, STATE_FILE)
        if not os.path.isfile(path):
            continue
        state, why = read_state(path)
        if state is None:
            out.append({"model": name, "error": why})
            continue
        out.append({"model": name, "version": state.version, "scored_at": state.scored_at,
                    "last_time": iso_utc(state.last_time) if state.last_time is not None else None,
                    "rows_scored": state.rows_scored, "rows_flagged": state.rows_flagged,
                    "incidents": state.incidents, "active": state.open_incident is not None,
                    "severity": (state.open_incident or {}).get("severity"),
                    "top_metrics": state.top_metrics if state.open_incident is not None else [],
                    "last_score": finite_or_none(state.last_score), "threshold": state.threshold,
                    "last_job": state.last_job})
    return out
