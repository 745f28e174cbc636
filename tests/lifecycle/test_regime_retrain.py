"""Learning a change of regime (opt_ds_ops.lifecycle.retrain_data.rebased_history and the gate's
champion_shift): the history's rows before the change are moved to the new levels, and a challenger
is judged against the champion as its series scores now, re-baselined."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from opt_ds_ops.config.conffile import TrainConfig
from opt_ds_ops.health.device import plan_device
from opt_ds_ops.lifecycle.history import History
from opt_ds_ops.lifecycle.promotion import gate
from opt_ds_ops.lifecycle.retrain_data import rebased_history
from opt_ds_ops.store.versions import model_payload, save_model
from opt_ds_ops.training.fit import train


def test_the_rows_before_a_change_of_regime_are_moved_to_its_levels():
    values = np.arange(20, dtype=np.float64).reshape(10, 2)
    h = History(values=values - 5.0, offset=np.array([5.0, 5.0]), flags=np.zeros(10, bool), times=np.arange(10.0))
    moved, info = rebased_history(h, {"rows": 4, "shift": [[1, 100.0]]})
    rows = moved.rows()
    assert info == {"rows": 4, "rows_moved": 6, "shift": [[1, 100.0]]}
    np.testing.assert_array_equal(rows[:6, 1], values[:6, 1] + 100)  # the old regime's rows, moved
    np.testing.assert_array_equal(rows[6:], values[6:])  # the new regime's, as scored
    np.testing.assert_array_equal(rows[:, 0], values[:, 0])  # other metrics untouched
    for bad in ([[2, 1.0]], [[0, float("nan")]], [["0", 1.0]], [[0]]):
        with pytest.raises(ValueError, match="shift"):
            rebased_history(h, {"rows": 4, "shift": bad})


def test_the_gate_judges_the_champion_as_its_series_scores_now(tmp_path, smd_rows):
    """Rows of a new regime (one metric moved): the champion flags them all as stored, but its series
    scores them re-baselined and flags few; a challenger is compared with the second."""
    # The score this test was written for (levels alone, smoothed over 30 rows), whose champion flags all
    # of a 12-SD move of one metric. The shipped score (round 10) counts that metric's level as half of its
    # term, beside its change (0 after the move), and its threshold, of a 10-row smoothing, is higher
    # (5.2 against 3.7): it flagged 3.8 % of the moved rows, and this test is about the re-baselining.
    old_score = TrainConfig(input_differences=False, score_window=30)
    torch.manual_seed(0)
    champion = train(smd_rows[12000:15000], old_score, plan_device("cpu", "off"))
    save_model(str(tmp_path), "m", model_payload(champion), {"dataset": {"file": "m.csv"}})
    rows = smd_rows[15000:16000].astype(np.float64).copy()
    delta = 12 * float(smd_rows[12000:15000, 3].std())
    rows[:, 3] += delta

    torch.manual_seed(1)
    chal = train(np.r_[smd_rows[12000:15000], rows.astype(np.float32)], old_score, plan_device("cpu", "off"))
    md = {"final_train_loss": 0.1, "final_val_loss": 0.1, "threshold_quantile": 0.99}
    plain = gate("if-not-worse", chal, md, str(tmp_path), "m", rows, None, None, flag_tolerance=0.01,
                 pr_auc_tolerance=0.05, rows_from="test")
    rebased = gate("if-not-worse", chal, md, str(tmp_path), "m", rows, None, None, flag_tolerance=0.01,
                   pr_auc_tolerance=0.05, rows_from="test", champion_shift=[[3, delta]])
    assert plain["champion"]["flagged_share"] > 0.9 and "rebased_by" not in plain["champion"]
    assert rebased["champion"]["flagged_share"] < 0.05 and rebased["champion"]["rebased_by"] == [[3, delta]]
    assert rebased["challenger"] == plain["challenger"] or rebased["challenger"]["flagged_share"] == \
        plain["challenger"]["flagged_share"]
    if rebased["challenger"]["flagged_share"] > rebased["champion"]["flagged_share"] + 0.01:
        assert rebased["failed"] == "flagged-vs-champion"
    assert plain["failed"] != "flagged-vs-champion"
