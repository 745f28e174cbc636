"""The promotion gate (docs/retraining.md): a new version (the challenger) becomes ``current`` only if it is
not worse than the version that is current now (the champion) on recent rows neither trained on.

Given ``store.promote``:

* ``always``: every new version becomes current (as before the gate existed); the figures are still
  measured and recorded.
* ``if-not-worse`` (the default): the challenger and the champion score the same held-back rows.
  For a retraining these are the newest tenth of the model's scoring history, held back BEFORE
  its flagged segments are cut (:func:`opt_ds_ops.lifecycle.retrain_data.write_history_dataset`): neither
  model trained on them, the challenger's threshold was fit on its own validation rows, not on
  these, and they keep the rows the champion flagged. The champion is judged as live scoring
  judged it: its flags are those its series gave these rows when it scored them (the threshold
  in force, the smoothing carried across chunks), not a new scoring from a cold start. For a dropped training file they are its
  validation split (its most recent rows, which the challenger's weights never saw), or with the
  sidecar's ``exclude_flagged`` its newest tenth, held back before the cut likewise. It is
  promoted only if

  1. ``finite-losses``: its final training and validation losses are finite;
  2. ``flagged-vs-champion``: its flagged share of all the held-back rows is not above the
     champion's by more than ``store.promote_flag_tolerance`` (an absolute share, 0.01 = one point);
     ``flagged-most``: and it flags at most half of them (:data:`MOST_FLAGGED`), whatever the
     champion flags: a model that calls most rows anomalies is no model, and a champion that does
     too (after a change of regime it never learned) is no reason to promote another;
  3. ``flagged-vs-design``: its flagged share of the held-back rows the champion did NOT flag
     (all of them without a champion) is not above the design rate (the share the threshold was
     set for: :func:`design_rate`) by more than the same tolerance. A real incident in the
     held-back rows that both models flag is no reason to refuse (unless it covers over half of
     them, ``flagged-most``): it counts in test 2 for both,
     and test 3 asks only whether the challenger flags the champion's normal rows at about the
     rate it was designed for;
  4. ``seeded-threshold`` (only with ``store.promote_max_seeded_factor`` over 0 and a new
     version's alarm budget seeded from the series' history, ``scoring.alarm_budget_history``):
     the threshold that seed would put in force at its first row (:func:`seeded_threshold`: the
     series' last ``scoring.alarm_budget_days`` days scored by the challenger, the runs in or near
     what the versions before flagged not counted, as live scoring seeds it) is at most that factor
     times the challenger's own threshold. A version that scores its series' normal rows that far
     above the threshold its training chose misdescribes the series: the budget would lift its
     threshold over the incidents it must page (one metric whose error scale fell to
     ``train.error_floor`` in the retraining can do it);
  5. ``pr-auc`` (only where labels for those rows exist: the sidecar's ``incidents``, row ranges
     of the file, or ``NAME.labels`` beside the data file the job reads (the spool takes none from
     incoming/), one 0/1 per row of the file, SMD's test_label format): its PR-AUC is not lower
     than the champion's by more than ``store.promote_pr_auc_tolerance``.
* ``manual``: every new version is kept, never made current by a job; ``ds-ops models promote``.

The gate runs in the job process (it parses the data and the labels), never in the daemon; its
figures go into the version's metadata.json (``promotion``) and the store reads its verdict under
its lock when it publishes (:func:`opt_ds_ops.store.versions.publish_job`), so recovery replays it too.
"""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np

from ..dataset import dataset_stem
from ..model import calibration as calib
from ..model.calibration import CalibrationPolicy
from ..model.detection import ScoreError, average_precision, in_memory_model, load_labels, score_rows
from ..model.trained import sample_period_s
from ..store.versions import CURRENT, StoreError, load_model, safe_model_name
from .history import history_path as series_history_path
from .history import read_history

MODES = ("always", "if-not-worse", "manual")
LABELS_SUFFIX = ".labels"
MAX_GATE_ROWS = 200_000  # the most recent rows scored by both models: bounded time and memory
WARM_WINDOWS = 3  # judged live, the first this many smoothing windows of held-back rows warm the challenger up
MOST_FLAGGED = 0.5  # a challenger that flags more of the held-back rows than this is refused (flagged-most)


def design_rate(payload_or_md: dict) -> float:
    """Return the share of normal rows a model's threshold was set to flag: ``1 - threshold_quantile``
    for ``quantile``, ``spot_risk`` for ``spot``, and for ``alarm_rate`` its alarms per day
    times ``score_window`` rows per alarm (a run lasts about one smoothing window) over the rows of a day."""
    method = payload_or_md.get("threshold_method", "quantile")
    train = payload_or_md.get("train") or (payload_or_md.get("config") or {}).get("train") or {}
    if method == "spot":
        return float(train.get("spot_risk", 1e-4))
    if method == "alarm_rate":
        per_day = 86400.0 / float(train.get("sample_period_s", 60.0))
        return min(1.0, float(train.get("alarms_per_day", 1.0)) * float(payload_or_md.get("score_window", 1)) / per_day)
    return 1.0 - float(payload_or_md.get("threshold_quantile", 0.99))


def find_labels(data_path: str) -> str | None:
    """Return ``NAME.labels`` beside the dataset ``NAME.<ext>``, or None if there is none."""
    path = os.path.join(os.path.dirname(data_path), dataset_stem(data_path) + LABELS_SUFFIX)
    return path if os.path.isfile(path) else None


def _share(scores: np.ndarray, threshold: float) -> float:
    return float(np.mean(scores > threshold)) if scores.size else 0.0


def gate(mode: str, result, metadata: dict, models_dir: str, name: str, rows: np.ndarray,
         offset: np.ndarray | None, labels: np.ndarray | None, *, flag_tolerance: float,
         pr_auc_tolerance: float, rows_from: str, held_range: dict | None = None, labels_from: str | None = None,
         champion_shift=None, champion_flags: np.ndarray | None = None, seeded: dict | None = None,
         max_seeded_factor: float = 0.0) -> dict:
    """Given the challenger (a TrainResult and its metadata), the held-back ``rows`` (n, D; the
    data's ``offset``), their ``labels`` (n,) bool or None, return the ``promotion`` record:
    ``{mode, promote, failed, reason, rows, rows_from, design_rate, challenger: {...}, champion:
    {...} or None, tolerances, held_back: held_range}``; the challenger's ``flagged_share_of_normal``
    is its share of the ``normal_rows`` the champion did not flag (test 3). ``promote`` False
    says the version is kept, not made current;
    ``failed`` names the first test it failed (None if none). A champion that cannot score these
    rows (other columns, unreadable) is no obstacle: the reason says so. Raises nothing for bad
    models; ScoreError only for rows of the wrong shape for the challenger. ``champion_shift``
    ``[[column, delta]]`` (data units): the champion scores the rows moved back by it, as its series
    scores them now (a change of regime's re-baseline, :mod:`opt_ds_ops.scoring.regime`): a challenger
    must beat the champion as it runs, not as it ran before the change. ``champion_flags`` (n,) bool:
    what the model's series flagged on these rows when it scored them (a retraining's held-back
    history rows): the champion is judged by them, as live scoring judged (its threshold in force,
    smoothing carried across chunks), not by scoring the rows again from a cold start at its
    training threshold, which can flag all of them where live scoring flagged none. The challenger's
    scores then start cold at the first held-back row while the series' were warm: both are judged
    on the rows after the first :data:`WARM_WINDOWS` smoothing windows (a quarter of the rows at
    most), once the challenger's smoothing has forgotten its start (``warm_up_rows``). ``seeded``: what
    the challenger's alarm budget would be seeded with (:func:`seeded_threshold`), judged against
    ``max_seeded_factor`` (0: not judged) and kept as the challenger's ``seeded``."""
    rows = rows[-MAX_GATE_ROWS:]
    if champion_flags is not None:
        champion_flags = np.asarray(champion_flags, dtype=bool)[-rows.shape[0]:]
        if champion_flags.shape != (rows.shape[0],):
            champion_flags = None  # not these rows' flags: the champion is scored again, as without them
    if labels is not None:
        labels = labels[-rows.shape[0]:]
    design = design_rate(dict(metadata, threshold_method=result.threshold_method,
                              threshold_quantile=result.threshold_quantile, score_window=result.score_window))
    challenger = in_memory_model(result)
    c_scores = score_rows(challenger, rows, offset=offset)
    warm = min(WARM_WINDOWS * challenger.score_window, rows.shape[0] // 4) if champion_flags is not None else 0
    c_scores, champion_flags = c_scores[warm:], (champion_flags[warm:] if champion_flags is not None else None)
    labels = labels[warm:] if labels is not None else None
    c_flags = c_scores > challenger.threshold
    chal = {"flagged_share": _share(c_scores, challenger.threshold), "threshold": challenger.threshold,
            "final_train_loss": metadata.get("final_train_loss"), "final_val_loss": metadata.get("final_val_loss"),
            "seeded": seeded}
    champ, champ_note = None, None
    try:
        stored = load_model(os.path.join(models_dir, safe_model_name(name), CURRENT))
        s = score_rows(stored, _moved_back(rows, champion_shift), offset=offset)[warm:]
        champ = {"version": stored.metadata.get("version"), "flagged_share": _share(s, stored.threshold),
                 "threshold": stored.threshold}
        if champion_shift:
            champ["rebased_by"] = [[int(j), float(v)] for j, v in champion_shift]
        normal = s <= stored.threshold
        if champion_flags is not None:  # live scoring's verdict on these rows, not a cold rescoring's
            champ.update(flagged_share=float(champion_flags.mean()), judged_by="live",
                         flagged_share_rescored=_share(s, stored.threshold))
            normal = ~champion_flags
    except (StoreError, ScoreError, OSError) as e:
        champ_note = f"no champion to compare with ({str(e).splitlines()[0][:200]})"
        s, normal = None, np.ones(c_scores.shape[0], dtype=bool)
    # test 3's figure: the challenger's share of the rows the champion did not flag
    chal["flagged_share_of_normal"] = float(c_flags[normal].mean()) if normal.any() else 0.0
    chal["normal_rows"] = int(normal.sum())
    if labels is not None and labels.any():
        chal["pr_auc"] = average_precision(c_scores, labels)
        if champ is not None and s is not None:
            champ["pr_auc"] = average_precision(s, labels)
    elif labels is not None:  # labelled incidents elsewhere in the file: say that the PR-AUC test did not run
        champ_note = "; ".join(filter(None, [champ_note, f"no labelled row among the {rows.shape[0]} held-back rows "
                                                         "(the newest): the PR-AUC test did not run"]))
    doc = {"mode": mode, "rows": int(c_scores.shape[0]), "warm_up_rows": warm, "rows_from": rows_from, "held_back": held_range,
           "design_rate": design,
           "labels": bool(labels is not None), "labels_from": labels_from, "challenger": chal, "champion": champ,
           "tolerances": {"flag": flag_tolerance, "pr_auc": pr_auc_tolerance, "seeded_factor": max_seeded_factor},
           "note": champ_note}
    failed, reason = _verdict(chal, champ, design, flag_tolerance, pr_auc_tolerance, max_seeded_factor)
    if mode == "always":
        promote, reason = True, (f"store.promote is always (the gate would have said: {reason})" if failed else reason)
    elif mode == "manual":
        promote, reason = False, f"store.promote is manual: kept for ds-ops models promote ({reason})"
    else:
        promote = failed is None
    return dict(doc, promote=promote, failed=failed, reason=reason)


def _moved_back(rows: np.ndarray, shift) -> np.ndarray:
    """rows with each ``[column, delta]`` of shift taken off (a copy), or rows as they are."""
    if not shift:
        return rows
    out = np.array(rows, dtype=np.float64, copy=True)
    for j, delta in shift:
        if isinstance(j, int) and 0 <= j < out.shape[1] and isinstance(delta, (int, float)) and math.isfinite(delta):
            out[:, j] -= float(delta)
    return out


def seed_scores(h, n: int, stored, policy, timed: bool, margin: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """Return (scores, times or None, normal) of the newest rows a new version's alarm budget is
    seeded from (:func:`opt_ds_ops.model.calibration.seed`): of the first ``n`` rows of the scoring
    History ``h``, those of its last ``policy.days`` days (by their times with ``timed``, else by
    rows at the version's sample period), scored by ``stored``; ``normal``: the rows outside what
    the versions before flagged and ``margin`` rows on each side of it
    (:func:`opt_ds_ops.lifecycle.retrain_data.exclusion_mask`). Raises ScoreError for rows ``stored``
    cannot score (other columns)."""
    from .retrain_data import exclusion_mask

    times = h.times[:n].astype(np.float64)
    k = calib.seed_rows(times if timed else None, n, policy, sample_period_s(stored) or 60.0)
    scores = score_rows(stored, h.values[n - k:n], offset=h.offset)
    normal = exclusion_mask(h.flags[:n], margin)[0][n - k:]
    return scores, (times[n - k:] if timed else None), normal


def seeded_threshold(history_path: str, challenger, policy, margin: int) -> dict | None:
    """Return what a new version's alarm budget would be seeded with at its first row, as live
    scoring seeds it (:func:`opt_ds_ops.scoring.job.history_seed`) when the next chunk follows the
    history at once, on the clock of the history's last row (by the rows' times where it has one,
    else by rows): ``{"threshold", "factor" (times the challenger's own), "rows" (the history's
    rows seeded from), "left_out" (those whose runs are not counted: in or within ``margin`` rows
    of what the versions before flagged; 0 when ``policy.learns`` is all)}``.
    ``history_path``: the series' scoring history (a retraining's copy of it, taken when it was
    queued); ``challenger``: the StoredModel, its metadata.json's (its sample period; a change of
    regime it learned); ``policy``: the CalibrationPolicy. None where no seed would run: the budget
    off or not seeded from history, no history, one that cannot be read (a truncated or foreign
    file included) or scored by the challenger (other columns, a score not finite), a timed
    history with rows of unknown time, a version that learned a change of regime (the history is
    at the old levels), a threshold that cannot be scaled. Raises nothing: a figure the gate
    cannot compute is no reason to fail a trained job."""
    if not (policy.on and policy.from_history) or ((challenger.metadata or {}).get("retrain") or {}).get("regime") \
            or not calib.usable(challenger.threshold):
        return None
    try:
        h = read_history(history_path)
        n = h.values.shape[0] if h is not None else 0
        if not n:
            return None
        known = np.isfinite(h.times)
        timed = bool(known[-1])  # the clock of the last chunk scored, as the next one's is likely to be
        if timed and not known.all():
            return None  # live scoring does not seed a timed chunk from rows of unknown time
        scores, times, normal = seed_scores(h, n, challenger, policy, timed, margin)
        if not np.isfinite(scores).all():
            return None
        period = sample_period_s(challenger) or 60.0
        cal = calib.fresh(challenger.threshold)
        first_day = calib.day_of(float(times[-1]) + period if timed else None, 0, period)
        calib.seed(cal, scores, times, normal, period, policy, first_day, "time" if timed else "rows")
    except Exception:  # noqa: BLE001 - any history (a member's, a truncated file) gives a figure or none
        return None
    return {"threshold": float(cal["threshold"]), "factor": float(cal["threshold"]) / float(challenger.threshold),
            "rows": int(scores.shape[0]), "left_out": 0 if policy.learns == "all" else int((~normal).sum())}


def _verdict(chal: dict, champ: dict | None, design: float, tol: float, auc_tol: float,
             seed_factor: float = 0.0) -> tuple[str | None, str]:
    """Return (the first test failed or None, the figures in words)."""
    losses = [chal.get("final_train_loss"), chal.get("final_val_loss")]
    if not all(v is None or (isinstance(v, (int, float)) and math.isfinite(v)) for v in losses):
        return "finite-losses", f"a loss is not finite (train {losses[0]}, validation {losses[1]})"
    c = chal["flagged_share"]
    if champ is not None and c > champ["flagged_share"] + tol:
        return "flagged-vs-champion", (f"it flags {c:.2%} of the held-back rows, the champion "
                                       f"{champ['flagged_share']:.2%} (tolerance {tol:.2%})")
    if c > MOST_FLAGGED:
        return "flagged-most", (f"it flags {c:.2%} of the held-back rows, over {MOST_FLAGGED:.0%}: a model that calls "
                                "most rows anomalies is refused, whatever the champion flags"
                                + (f" ({champ['flagged_share']:.2%})" if champ is not None else ""))
    cn = chal.get("flagged_share_of_normal", c)
    if cn > design + tol:
        return "flagged-vs-design", (f"it flags {cn:.2%} of the {chal.get('normal_rows')} held-back rows the champion "
                                     f"did not flag, design rate {design:.2%} (tolerance {tol:.2%})")
    sd = chal.get("seeded") or {}
    if seed_factor > 0 and sd.get("factor", 0) > seed_factor:
        return "seeded-threshold", (f"its alarm budget, seeded from the series' last {sd['rows']} rows scored ("
                                    f"{sd['left_out']} of them in or near what was flagged, not counted), would put "
                                    f"its threshold at {sd['threshold']:.4g}, {sd['factor']:.1f} times its own "
                                    f"{chal['threshold']:.4g} (store.promote_max_seeded_factor {seed_factor:g}): it "
                                    "scores the series' normal rows far above the threshold its training chose")
    ca, pa = chal.get("pr_auc"), (champ or {}).get("pr_auc")
    if isinstance(ca, float) and isinstance(pa, float) and ca < pa - auc_tol:
        return "pr-auc", f"its PR-AUC on the labelled held-back rows is {ca:.3f}, the champion's {pa:.3f} (tolerance {auc_tol:.3f})"
    vs = f", champion {champ['flagged_share']:.2%}" if champ is not None else ""
    auc = f"; PR-AUC {ca:.3f} vs {pa:.3f}" if isinstance(ca, float) and isinstance(pa, float) else ""
    return None, (f"not worse: flags {c:.2%} of the held-back rows{vs}; {cn:.2%} of those the champion did not "
                  f"flag, design rate {design:.2%}{auc}")


def incident_labels(incidents, rows: int) -> np.ndarray:
    """Return (rows,) bool, True on a sidecar's ``incidents``: ``[first, last]`` data rows, 1-based
    and inclusive, as the dataset holds them (in time order). Raises ScoreError for a range past them."""
    labels = np.zeros(rows, dtype=bool)
    for first, last in incidents:
        if last > rows:
            raise ScoreError(f"the sidecar's incidents: rows {first}-{last} are past the dataset's {rows} rows")
        labels[first - 1:last] = True
    return labels


def file_labels(data_path: str, rows: int, incidents=()) -> tuple[np.ndarray | None, str | None]:
    """Return (the labels of a dataset's ``rows`` file rows or None, where they come from): the
    sidecar's ``incidents``, else ``NAME.labels`` beside the data. Raises ScoreError for labels
    that do not fit, or given both ways."""
    path = find_labels(data_path)
    if incidents and path:
        raise ScoreError(f"labels given twice: the sidecar's incidents and {os.path.basename(path)}; give one")
    if incidents:
        return incident_labels(incidents, rows), "the sidecar's incidents"
    return (load_labels(path, rows), os.path.basename(path)) if path else (None, None)


def held_back(data: np.ndarray, rows_val: int, labels: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None, str]:
    """Return (the held-back rows: the last ``rows_val`` rows of data, their labels or None, where
    they come from). ``labels``: one per row of data (:func:`file_labels`), or None."""
    n = data.shape[0]
    k = rows_val if rows_val > 0 else max(1, n // 10)
    if labels is not None:
        labels = labels[n - k:]
    return np.asarray(data[n - k:]), labels, ("the dataset's validation split (its last rows)" if rows_val > 0
                                              else "the dataset's last tenth (no validation split)")


def held_back_file(path: str) -> np.ndarray:
    """Return the held-back rows a retraining job wrote (a float64 ``.npy``, (k, D)). Raises
    ScoreError for a file that is not a 2-D matrix of rows, OSError if it cannot be read."""
    try:
        rows = np.load(path, allow_pickle=False)
    except ValueError as e:
        raise ScoreError(f"{path}: not a matrix of held-back rows ({e})") from None
    if rows.ndim != 2 or rows.shape[0] < 1:
        raise ScoreError(f"{path}: not a matrix of held-back rows (shape {rows.shape})")
    return rows


def held_back_flags(held_back_path: str, rows: int) -> np.ndarray | None:
    """Return what the series flagged on a retraining's held-back rows when it scored them (the
    file :func:`opt_ds_ops.lifecycle.retrain_data.held_flags_path` names), or None where there is
    none (a job queued before they were kept) or it does not fit the rows."""
    from .retrain_data import held_flags_path

    try:
        flags = np.load(held_flags_path(held_back_path), allow_pickle=False)
    except (OSError, ValueError):
        return None
    return flags.astype(bool) if flags.shape == (rows,) and flags.dtype == np.bool_ else None


def promotion_record(cfg, result, metadata: dict, name: str, ds, data_path: str, held_rows=None,
                     held_back_path: str | None = None, incidents=(), history_path: str | None = None) -> dict:
    """Return the ``promotion`` record of a daemon job's new version (:func:`gate` on the held-back
    rows of dataset ``ds`` loaded from ``data_path``, whose labels are the sidecar's ``incidents``
    or ``NAME.labels`` beside it (:func:`file_labels`);
    ``held_rows``: the file's newest rows :func:`opt_ds_ops.lifecycle.retrain_data.exclude_flagged` held back
    before it cut the flagged ones (judged on instead; their range is metadata's ``excluded.held_back``);
    ``held_back_path``: a retraining job's held-back history rows, judged on instead, their range
    from metadata's ``excluded.held_back``; ``history_path``: its copy of the series' scoring history,
    which the challenger's seeded alarm budget is computed from (:func:`seeded_threshold`; without
    it, the series' own ``history.npz`` under ``scoring.results_dir``). A gate that cannot run (labels that do not fit, rows it
    cannot score) keeps the version without promoting it, unless ``store.promote`` is always; the
    reason says why. Raises nothing."""
    mode = cfg.store.promote
    try:
        held_range, offset, labels_from, live = None, ds.offset, None, None
        if held_back_path is not None and os.path.isfile(held_back_path):
            rows, labels, offset = held_back_file(held_back_path), None, None  # the rows' values as they are
            live = held_back_flags(held_back_path, rows.shape[0])
            held_range = (metadata.get("excluded") or {}).get("held_back")
            where = "the newest rows of the scoring history, held back before the flagged segments were cut"
        elif held_rows is not None:
            held_range = (metadata.get("excluded") or {}).get("held_back") or {}
            labels, labels_from = file_labels(data_path, held_range.get("history_rows", 0), incidents)
            rows, labels = held_rows, (labels[held_range["from_row"]:] if labels is not None else None)
            where = "the file's newest rows, held back before the rows the current version flags were cut"
        else:
            labels, labels_from = file_labels(data_path, ds.data.shape[0], incidents)
            rows, labels, where = held_back(ds.data, int(getattr(result, "rows_val", 0) or 0), labels)
        regime = (metadata.get("retrain") or {}).get("regime") or {}
        seeded = seeded_threshold(history_path or series_history_path(cfg.scoring.results_dir, name),
                                  dataclasses.replace(in_memory_model(result), metadata=metadata),
                                  CalibrationPolicy.from_config(cfg.scoring), cfg.retrain.exclude_margin)
        return gate(mode, result, metadata, cfg.models_dir, name, rows, offset, labels,
                    flag_tolerance=cfg.store.promote_flag_tolerance,
                    pr_auc_tolerance=cfg.store.promote_pr_auc_tolerance, rows_from=where, held_range=held_range,
                    labels_from=labels_from, champion_shift=regime.get("shift") if held_back_path else None,
                    champion_flags=live, seeded=seeded, max_seeded_factor=cfg.store.promote_max_seeded_factor)
    except (ScoreError, ValueError, MemoryError, OSError) as e:
        return {"mode": mode, "promote": mode == "always", "failed": "gate-error",
                "reason": f"the gate could not run: {str(e).splitlines()[0][:300]}"}
