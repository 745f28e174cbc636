"""What the journal says of a summary's events (opt_ds_ops.observe.incident_entries): the threshold's moves."""

from __future__ import annotations

from opt_ds_ops.observe.incident_entries import incident_entry
from opt_ds_ops.observe.journal import LOG_INFO, LOG_WARNING

EVENT = {"event": "threshold-calibrated", "row": 0, "time": "2026-12-01T00:00:00Z", "version": "v2",
         "threshold": 2.5, "previous": 1.5, "model_threshold": 1.2, "days": 3.0, "alarms": 2, "budget_per_day": 1.0}


def test_a_calibrated_threshold_says_the_days_and_alarms_it_rests_on():
    kind, message, priority, fields = incident_entry(EVENT, model="host1", version="v2", file="host1.csv")
    assert kind == "threshold-calibrated" and priority == LOG_INFO
    assert "threshold 2.5 from" in message and "(was 1.5;" in message and "last 3 days scored" in message
    assert "(2 alarms in them at this threshold, 3 allowed)" in message and "rows scored before" not in message
    assert fields["threshold"] == 2.5 and fields["previous"] == 1.5


def test_a_threshold_that_moves_twice_as_high_or_half_as_high_in_a_day_is_a_warning():
    """A day's move of the bound (2 x either way: the event's ``far``, opt_ds_ops.model.calibration)
    says so at warning level, with what the budget wanted where the bound held it back."""
    from opt_ds_ops.model.calibration import _said

    for prev, new in ((1.25, 2.5), (5.0, 2.5)):
        _, message, priority, _ = incident_entry(_said(dict(EVENT, previous=prev, threshold=new)), model="host1",
                                                 version="v2", file="host1.csv")
        assert priority == LOG_WARNING, (prev, new)
    _, message, priority, fields = incident_entry(_said(dict(EVENT, previous=1.25, threshold=2.5, wanted=40.0)),
                                                  model="host1", version="v2", file="host1.csv")
    assert priority == LOG_WARNING and "the budget asked for 40 (2 alarms there), held to 2 times" in message
    assert "(2 alarms in them" not in message  # the count is the asked-for threshold's, not the one in force
    assert fields["wanted"] == 40.0
    _, _, priority, _ = incident_entry(_said(EVENT), model="host1", version="v2", file="host1.csv")
    assert priority == LOG_INFO  # 1.5 -> 2.5: under the bound


def test_a_new_versions_start_from_the_history_says_so():
    _, message, priority, _ = incident_entry(dict(EVENT, seeded_rows=4320), model="host1", version="v2",
                                             file="host1.csv")
    assert priority == LOG_INFO
    assert "counting the 4320 rows scored before this version as it scores them" in message
    assert "not counted" not in message  # none left out: nothing said
    _, message, _, fields = incident_entry(dict(EVENT, seeded_rows=4320, seeded_left_out=934), model="host1",
                                           version="v2", file="host1.csv")
    assert ("as it scores them (934 of them in or near what the versions before flagged, their runs not counted)"
            in message) and fields["seeded_left_out"] == 934


def test_a_capped_threshold_is_a_warning():
    _, message, priority, _ = incident_entry(dict(EVENT, capped=True, threshold=1228.8), model="host1", version="v2",
                                             file="host1.csv")
    assert priority == LOG_WARNING and "capped at 1024 times" in message


def test_the_allowance_is_the_budgets_over_the_days_kept():
    """At 0.25 a day (shipped in rounds 14-16) 3 days allow no alarm: the line says so, beside the count."""
    _, message, _, _ = incident_entry(dict(EVENT, budget_per_day=0.25, alarms=0), model="host1", version="v2",
                                      file="host1.csv")
    assert "(0 alarms in them at this threshold, 0 allowed)" in message
    _, message, _, _ = incident_entry(dict(EVENT, budget_per_day=None), model="host1", version="v2", file="host1.csv")
    assert "(2 alarms in them at this threshold)" in message
    # the budget's own count where the event carries it (days are rounded: 4.0 days of 10-second rows may be 3.9999)
    _, message, _, _ = incident_entry(dict(EVENT, budget_per_day=0.25, days=4.0, alarms=0, allowed=0), model="host1",
                                      version="v2", file="host1.csv")
    assert "(0 alarms in them at this threshold, 0 allowed)" in message


def test_one_day_and_one_alarm_are_said_in_the_singular():
    _, message, _, _ = incident_entry(dict(EVENT, days=1.0, alarms=1, allowed=1), model="host1", version="v2",
                                      file="host1.csv")
    assert "its last 1 day scored give" in message and "(1 alarm in them at this threshold, 1 allowed)" in message
    assert "last 3 days scored" in incident_entry(EVENT, model="h", version="v2", file="f")[1]
