"""The journal's words for a model's incidents: one entry per event of a scored file's summary
(:mod:`opt_ds_ops.scoring.series`: ``incident-opened``, ``incident-escalated``, ``incident-closed``,
``regime-changed``, ``threshold-calibrated``),
with its priority (crit for what is critical, warning otherwise) and its fields. The daemon's
scoring slot (:mod:`opt_ds_ops.daemon.scoreslot`) sends them, each once; ``ds-ops status`` names
metrics the same way (:func:`top_text`)."""

from __future__ import annotations

import math

from .journal import LOG_CRIT, LOG_INFO, LOG_WARNING, safe_text


def num(v) -> str:
    return f"{v:.4g}" if isinstance(v, (int, float)) and not isinstance(v, bool) else "?"


def seconds(v: float) -> str:
    """``2640 s``; from two hours on with hours beside it: ``10320 s (2.9 h)`` (not ``1.032e+04 s``)."""
    return f"{v:.0f} s" + (f" ({v / 3600:.1f} h)" if v >= 7200 else "")


def top_text(top) -> str:
    """``disk_util 42%, cpu 30%`` from [{metric, share}] (share 0..1)."""
    parts = []
    for t in top or []:
        share = t.get("share")
        if isinstance(share, (int, float)) and share < 0.005:
            continue  # "34 0%": no part of the score worth naming
        metric = safe_text(str(t.get("metric")))  # a header's name: never a terminal's escape sequence
        parts.append(f"{metric} {share:.0%}" if isinstance(share, (int, float)) else metric)
    return ", ".join(parts) or "none"


KINDS = ("incident-opened", "incident-escalated", "incident-closed", "regime-changed", "threshold-calibrated")

# the events of a summary written before incidents (an anomaly segment each): a job scored by the old
# daemon and killed before it journaled them is replayed by the new one, which must still say them
LEGACY = {"anomaly-started": "incident-opened", "anomaly-ended": "incident-closed"}


def incident_entry(ev: dict, *, model: str, version, file: str) -> tuple[str, str, int, dict] | None:
    """Return (event, message, priority, fields) of one summary event of model's scored ``file``
    (scored with ``version``), or None for an event of another kind."""
    kind = ev.get("event")
    if kind in LEGACY:  # a summary scored before incidents, replayed after the upgrade: said as what it was
        ev = dict(ev, event=LEGACY[kind], incident=None, severity=ev.get("severity") or "warning",
                  started_row=ev.get("started_row", ev.get("row")), started_time=ev.get("started_time", ev.get("time")),
                  reason=ev.get("reason"), rows_flagged=ev.get("rows"))
        kind = ev["event"]
    row, at = ev.get("row"), ev.get("time")
    name = f"incident {ev.get('incident')}" if ev.get("incident") is not None else "anomaly (scored before incidents)"
    when = f"row {row}" + (f" ({at})" if at is not None else "")
    top = top_text(ev.get("top_metrics"))
    common = {"model": model, "incident": ev.get("incident"), "row": row, "time": at,
              "started_row": ev.get("started_row")}
    if kind == "incident-opened":
        sev = str(ev.get("severity") or "warning")
        began = ev.get("started_time") or f"row {ev.get('started_row')}"
        return (kind, f"{model}: {sev} {name} opened at {when} (flagged since {began}): score "
                      f"{num(ev.get('score'))} over threshold {num(ev.get('threshold'))} (version {version}); top "
                      f"metrics: {top}; in {file}",
                LOG_CRIT if sev == "critical" else LOG_WARNING,
                dict(common, version=version, severity=sev, started_time=ev.get("started_time"),
                     threshold=ev.get("threshold"), score=ev.get("score"), top_metrics=top))
    if kind == "incident-escalated":
        return (kind, f"{model}: {name} is critical at {when}: score {num(ev.get('score'))}, "
                      f"peak {num(ev.get('peak_score'))} over threshold {num(ev.get('threshold'))} (version "
                      f"{version}); top metrics: {top}; in {file}",
                LOG_CRIT,
                dict(common, version=version, severity="critical", started_time=ev.get("started_time"),
                     threshold=ev.get("threshold"), score=ev.get("score"), top_metrics=top))
    if kind == "incident-closed":
        flagged_by = ev.get("version") or version  # a reset by a new version: the old one flagged it
        lasted = f"{ev.get('rows')} rows" + (f", {seconds(ev['duration_s'])}" if isinstance(
            ev.get("duration_s"), (int, float)) else "")  # headerless data has no time: rows only
        why = {"reset": " (the series was reset)",
               "regime": " as a change of regime (see the next line)"}.get(ev.get("reason"), "")
        return (kind, f"{model}: {ev.get('severity') or 'warning'} {name} closed{why}: its "
                      f"last flagged row was {when}, after {lasted}, peak score {num(ev.get('peak_score'))} "
                      f"({ev.get('rows_flagged')} rows flagged, version {flagged_by}); top metrics: {top}; in {file}",
                LOG_WARNING,
                dict(common, version=flagged_by, severity=ev.get("severity"), duration_s=ev.get("duration_s"),
                     peak_score=ev.get("peak_score"), reason=ev.get("reason")))
    if kind == "regime-changed":
        moved = "; ".join(f"{safe_text(str(m.get('metric')))} {num(m.get('before'))} -> {num(m.get('after'))} "
                          f"({num(m.get('shift_sd'))} sd)" for m in (ev.get("metrics") or [])[:5])
        more = ev.get("metrics_shifted", 0) - min(5, len(ev.get("metrics") or []))
        more_text = f" and {more} more" if isinstance(more, int) and more > 0 else ""
        began = ev.get("started_time") or f"row {ev.get('started_row')}"
        return (kind, f"{model}: change of regime at {when}: since {began} {moved}{more_text} moved and stayed "
                      f"(version {ev.get('version') or version}); scored against the new levels from now on, "
                      f"and learned by a retraining once retrain.regime_learn_s of them are scored; in {file}",
                LOG_WARNING,
                dict(common, version=ev.get("version") or version, regime=ev.get("regime"),
                     started_time=ev.get("started_time"), metrics=moved))
    if kind == "threshold-calibrated":
        alarms = ev.get("alarms")
        if isinstance(ev.get("floor"), (int, float)):  # a floor raised since: the threshold lifted to it at once
            why = (f"the model's {num(ev.get('model_threshold'))}): lifted to scoring.alarm_budget_floor, "
                   f"{num(ev.get('floor'))} times the model's, the floor in force")
        elif ev.get("capped"):
            why = (f"capped at 1024 times the model's {num(ev.get('model_threshold'))}: its last {num(ev.get('days'))} "
                   f"days scored give {alarms} alarms even there, over {num(ev.get('budget_per_day'))} a day; the model "
                   "alarms on almost everything")
        else:
            why = (f"the model's {num(ev.get('model_threshold'))}): the lowest at which its last "
                   f"{_count(ev.get('days'), 'day')} scored give at most {num(ev.get('budget_per_day'))} alarms a day"
                   + (f" ({_count(alarms, 'alarm')} in them at this threshold{_allowed(ev)})"
                      if isinstance(alarms, int) and "wanted" not in ev else ""))
        if isinstance(ev.get("seeded_rows"), int):  # a new version's start, from the rows scored before it
            why += f", counting the {ev['seeded_rows']} rows scored before this version as it scores them"
            if isinstance(ev.get("seeded_left_out"), int) and ev["seeded_left_out"]:
                why += (f" ({ev['seeded_left_out']} of them in or near what the versions before flagged, "
                        "their runs not counted)")
        if isinstance(ev.get("wanted"), (int, float)):
            there = f" ({alarms} alarms there)" if isinstance(alarms, int) else ""
            why += (f"; the budget asked for {num(ev.get('wanted'))}{there}, held to {num(ev.get('bound'))} times the "
                    "threshold in force for one day")
        far_move = ev.get("far") is True
        return (kind, f"{model}: threshold {num(ev.get('threshold'))} from {when} on (was {num(ev.get('previous'))}; "
                      + why + ("" if not ev.get("capped") else ")")
                      + f" (version {ev.get('version') or version}); in {file}",
                LOG_WARNING if ev.get("capped") or far_move else LOG_INFO,
                dict(common, version=ev.get("version") or version, threshold=ev.get("threshold"),
                     previous=ev.get("previous"), seeded_rows=ev.get("seeded_rows"),
                     seeded_left_out=ev.get("seeded_left_out"), wanted=ev.get("wanted")))
    return None


def _count(n, noun: str) -> str:
    """``n`` and the noun, plural unless ``n`` is 1 ("1 day", "3.5 days", "0 alarms")."""
    return f"{num(n)} {noun}" + ("" if n == 1 else "s")


def _allowed(ev: dict) -> str:
    """", N allowed": the alarms the budget allows over the days a threshold-calibrated event rests on
    (its ``allowed``, :func:`opt_ds_ops.model.calibration.budget_threshold`; for events written
    before it, ``floor(budget_per_day x days)``), or ""."""
    if isinstance(ev.get("allowed"), int) and not isinstance(ev.get("allowed"), bool) and ev["allowed"] >= 0:
        return f", {ev['allowed']} allowed"
    per_day, days = ev.get("budget_per_day"), ev.get("days")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
               for v in (per_day, days)):
        return ""
    return f", {math.floor(per_day * days + 1e-9)} allowed"


def removed_message(view: dict) -> str:
    """The message of the ``incident-closed`` entry (reason ``removed``) of a model whose scoring
    series went (``ds-ops models rm NAME``, or by hand) while an incident was open: ``view`` is what
    the daemon last showed of it (:func:`opt_ds_ops.scoring.results.model_view`)."""
    name = f"incident {view['incident']}" if view.get("incident") is not None else "incident"
    version = f" (version {view['version']})" if view.get("version") else ""
    return (f"{view.get('model')}: {view.get('severity') or 'warning'} {name} closed: the model's scoring series was "
            f"removed (ds-ops models rm, or by hand) while it was open; top metrics: "
            f"{top_text(view.get('top_metrics'))}{version}")
