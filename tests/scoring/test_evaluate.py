"""``ds-ops evaluate``: the baselines' figures against scikit-learn, ``ds-ops score`` reproducing
them, causal scores, old models, the metric rankings and HitRate."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from sklearn.metrics import average_precision_score, precision_recall_curve, roc_auc_score

from conftest import SMD, SMD_LABELS, SMD_TEST, SMD_TRAIN, run_cli
from opt_ds_ops.config.conffile import Config, TrainConfig
from opt_ds_ops.health.device import plan_device
from opt_ds_ops.scoring.evaluate import EvaluateError, evaluate_machine, smd_machines
from opt_ds_ops.model.detection import (
    ScoreError,
    best_f1,
    contributions,
    false_alarms_per_day,
    segments_flagged,
    flagged_segments,
    hit_rate,
    in_memory_model,
    segment_hit_rate,
    load_interpretation,
    pca_cells,
    score_rows,
    score_with_cells,
)
from opt_ds_ops.store.versions import StoreError, load_model, model_payload, save_model
from opt_ds_ops.training.fit import train

CPU = plan_device("cpu", "off")


def ema_by_filter(x: np.ndarray, alpha: float) -> np.ndarray:
    """The weighted mean of rows 0..t with weights (1 - alpha)**(t - k), by scipy's IIR filter."""
    from scipy.signal import lfilter

    pole = [1.0, -(1 - alpha)]
    return lfilter([1.0], pole, x) / lfilter([1.0], pole, np.ones_like(x))


@pytest.fixture(scope="module")
def machine(tmp_path_factory):
    """machine-1-2 (bundled) evaluated once: the result (with scores) and its models folder."""
    models = tmp_path_factory.mktemp("models")
    files = smd_machines(str(SMD), ["machine-1-2"])[0]
    return evaluate_machine(files, Config(), CPU, models_dir=str(models), keep_scores=True)


def test_baseline_figures_match_scikit_learn_on_independently_computed_scores(machine):
    labels = machine["_labels"]
    train_rows = np.loadtxt(SMD_TRAIN, delimiter=",")
    test_rows = np.loadtxt(SMD_TEST, delimiter=",")
    std = train_rows.std(axis=0)
    std[std == 0] = 1
    z2 = (((test_rows - train_rows.mean(axis=0)) / std) ** 2).mean(axis=1)
    z_ema = ema_by_filter(z2, 2 / 11)
    np.testing.assert_allclose(z_ema, machine["_scores"]["z-ema"], rtol=1e-6)  # float32 parse of the file
    stored = load_model(machine["model_dir"])
    x = torch.from_numpy(((test_rows - stored.mean.numpy()) / stored.std.double().numpy()).astype(np.float32))
    x = x.clamp(-stored.input_clip, stored.input_clip)
    # The shipped model (train.input_differences true, round 10) reads each metric's change beside its
    # level: [d_t, z_t], d_t = ((z_t - z_(t-1)) - diff_mean) / diff_std clipped like the levels, row 0's
    # change that of a repeated row (0); seed-mse is the MSE over all 2 x 38 of those inputs.
    assert stored.diff is not None and stored.model.n_features == 2 * 38
    z = x.double().numpy()
    change = np.diff(z, axis=0, prepend=z[:1])
    d = (change - stored.diff[0].double().numpy()) / stored.diff[1].double().numpy()
    d = np.clip(d, -stored.input_clip, stored.input_clip)
    x = torch.cat([torch.from_numpy(d.astype(np.float32)), x], dim=1)
    with torch.no_grad():
        seed = ((stored.model(x) - x) ** 2).mean(dim=1).double().numpy()
    np.testing.assert_allclose(seed, machine["_scores"]["seed-mse"], rtol=1e-4)
    for name, scores in (("z-ema", z_ema), ("seed-mse", seed), ("ds-ops", machine["_scores"]["ds-ops"])):
        assert machine[name]["roc_auc"] == pytest.approx(roc_auc_score(labels, scores), abs=1e-6), name
        assert machine[name]["pr_auc"] == pytest.approx(average_precision_score(labels, scores), abs=1e-6), name
    assert roc_auc_score(labels, z2) == pytest.approx(0.868, abs=0.002)  # the per-row z-score's known figure


def pca_by_svd(train_rows: np.ndarray, rows: np.ndarray, variance: float = 0.95) -> tuple[np.ndarray, int]:
    """Each row's mean squared reconstruction error by the principal axes of 95 % of the
    standardised training variance, computed by numpy's SVD of the training matrix."""
    mean, std = train_rows.mean(axis=0), train_rows.std(axis=0)
    std[std == 0] = 1
    z_train = (train_rows - mean) / std
    _, s, vt = np.linalg.svd(z_train, full_matrices=False)
    share = np.cumsum(s**2) / np.sum(s**2)
    k = int(np.argmax(share >= variance - 1e-12)) + 1
    z = (rows - mean) / std
    return ((z - z @ vt[:k].T @ vt[:k]) ** 2).mean(axis=1), k


def test_pca_baseline_matches_an_independent_svd_and_scikit_learn(machine):
    labels = machine["_labels"]
    train_rows = np.loadtxt(SMD_TRAIN, delimiter=",")
    test_rows = np.loadtxt(SMD_TEST, delimiter=",")
    err, k = pca_by_svd(train_rows, test_rows)
    assert 1 < k < 38  # machine-1-2 needs some but not all of its 38 axes for 95 %
    pca_ema = ema_by_filter(err, 2 / 11)
    np.testing.assert_allclose(pca_ema, machine["_scores"]["pca-ema"], rtol=1e-5, atol=1e-9)
    assert machine["pca-ema"]["roc_auc"] == pytest.approx(roc_auc_score(labels, pca_ema), abs=1e-6)
    assert machine["pca-ema"]["pr_auc"] == pytest.approx(average_precision_score(labels, pca_ema), abs=1e-6)


def test_pca_cells_keep_the_fewest_components_for_95_percent_of_the_variance():
    rng = np.random.default_rng(0)
    basis = rng.normal(size=(2, 6))
    train_rows = rng.normal(size=(500, 2)) @ basis + 0.01 * rng.normal(size=(500, 6))  # two axes hold it all
    test_rows = rng.normal(size=(50, 2)) @ basis
    test_rows[7] += 5 * rng.normal(size=6)  # off the plane: a large reconstruction error
    cells, k = pca_cells(train_rows, test_rows)
    err, k_svd = pca_by_svd(train_rows, test_rows)
    assert k == k_svd == 2
    np.testing.assert_allclose(cells.mean(axis=1), err, rtol=1e-8, atol=1e-12)
    assert int(np.argmax(err)) == 7


def test_ds_ops_score_reproduces_evaluate_for_the_same_model(machine, tmp_path):
    out = tmp_path / "scores.csv"
    p = run_cli("score", machine["model_dir"], str(SMD_TEST), "--labels", str(SMD_LABELS), "--json", "--output", str(out))
    assert p.returncode == 3, p.stderr  # rows flagged
    ev = json.loads(p.stdout)["evaluation"]
    ours = machine["ds-ops"]
    assert (ev["roc_auc"], ev["pr_auc"], ev["f1"], ev["threshold"]) == (ours["roc_auc"], ours["pr_auc"], ours["f1"], ours["threshold"])
    written = np.loadtxt(out, delimiter=",", skiprows=1, usecols=1)
    np.testing.assert_allclose(written, machine["_scores"]["ds-ops"], rtol=1e-5)  # %.6g in the file


@pytest.mark.parametrize("smoothing, window, how", [("ema", 1, "last"), ("mean", 1, "last"), ("ema", 4, "last"),
                                                    ("ema", 4, "window")])
def test_appending_rows_never_changes_earlier_scores(smd_rows, smoothing, window, how):
    # One-row inputs: the shipped differences beside levels; windowed inputs cannot read differences.
    levels = {"input_differences": False} if window > 1 else {}
    r = train(smd_rows[:3000], TrainConfig(epochs=1, score_smoothing=smoothing, input_window=window,
                                           window_error=how, **levels), CPU)
    stored = in_memory_model(r)
    full = score_rows(stored, smd_rows[3000:9000])
    for n in (1, 29, 1000, 5999):
        assert np.array_equal(score_rows(stored, smd_rows[3000 : 3000 + n]), full[:n]), n
    changed = smd_rows[3000:9000].copy()
    changed[4000:] += 5  # a change after row 1000 leaves rows before it alone
    assert np.array_equal(score_rows(stored, changed)[:1000], full[:1000])
    assert not np.array_equal(score_rows(stored, changed)[1000:], full[1000:])


@pytest.mark.parametrize("window", [1, 4])
def test_score_rows_and_score_with_cells_agree_to_the_bit(smd_rows, window):
    # One-row inputs: the shipped differences beside levels; windowed inputs cannot read differences.
    levels = {"input_differences": False} if window > 1 else {}
    stored = in_memory_model(train(smd_rows[:3000], TrainConfig(epochs=1, input_window=window, **levels), CPU))
    data = smd_rows[3000:6000]
    scores, cells = score_with_cells(stored, data, batch_rows=700)
    assert np.array_equal(score_rows(stored, data, batch_rows=700), scores)
    assert np.array_equal(score_rows(stored, data), scores) and cells.shape == (3000, 38)
    if window > 1:  # batches of 700 rows get the rows before them as context: the same windows
        np.testing.assert_allclose(score_rows(stored, data, batch_rows=2), scores, rtol=1e-6)
    np.testing.assert_allclose(contributions(stored, cells).mean(axis=1), scores, rtol=1e-5)  # shares add up


def test_a_model_saved_before_score_smoothing_was_stored_scores_with_its_old_trailing_mean(smd_rows, tmp_path):
    # A model saved before the score's settings were stored read levels alone (differences came later,
    # stored with their own keys): pinned so the payload is one such a ds-ops could have written.
    r = train(smd_rows[:3000], TrainConfig(epochs=1, score_smoothing="mean", score_window=15, input_clip=0.0,
                                           input_differences=False), CPU)
    payload = model_payload(r)
    for key in ("score_smoothing", "input_clip", "threshold_method", "input_window", "window_error"):
        del payload[key]
    save_model(str(tmp_path), "old", payload, {})
    old = load_model(str(tmp_path / "old"))
    assert (old.score_smoothing, old.input_clip, old.input_window, old.window_error) == ("mean", 0.0, 1, "last")
    np.testing.assert_array_equal(score_rows(old, smd_rows[3000:4000]), score_rows(in_memory_model(r), smd_rows[3000:4000]))
    payload["score_smoothing"] = "median"
    save_model(str(tmp_path), "future", payload, {})
    with pytest.raises(StoreError, match="unknown score_smoothing 'median'"):
        load_model(str(tmp_path / "future"))
    payload.update(score_smoothing="ema", input_window=5)  # 38 inputs are not windows of 5 rows
    save_model(str(tmp_path), "odd", payload, {})
    with pytest.raises(StoreError, match="input_window 5"):
        load_model(str(tmp_path / "odd"))


def test_ds_ops_score_reproduces_evaluate_for_a_windowed_model(tmp_path):
    cfg = Config(train=TrainConfig(epochs=1, input_window=4, input_differences=False))  # windows read levels alone
    files = smd_machines(str(SMD), ["machine-1-2"])[0]
    r = evaluate_machine(files, cfg, CPU, models_dir=str(tmp_path / "models"), keep_scores=True)
    p = run_cli("score", r["model_dir"], str(SMD_TEST), "--labels", str(SMD_LABELS), "--json")
    assert p.returncode == 3, p.stderr
    out = json.loads(p.stdout)
    ev, ours = out["evaluation"], r["ds-ops"]
    assert (out["input_window"], out["window_error"]) == (4, "last")
    assert (ev["roc_auc"], ev["pr_auc"], ev["f1"], ev["threshold"]) == (ours["roc_auc"], ours["pr_auc"], ours["f1"], ours["threshold"])


def test_best_f1_is_the_maximum_over_scikit_learns_precision_recall_curve():
    rng = np.random.default_rng(3)
    labels = rng.random(500) < 0.2
    scores = rng.integers(0, 40, 500) + 3 * labels
    p, r, _ = precision_recall_curve(labels, scores)
    f1 = np.where(p + r > 0, 2 * p * r / np.maximum(p + r, 1e-300), 0)
    assert best_f1(scores.astype(float), labels) == pytest.approx(f1.max())


def test_false_alarms_per_day_counts_flagged_runs_without_a_labelled_row():
    flags = np.array([1, 1, 0, 0, 1, 0, 1, 1, 0, 0], bool)
    labels = np.array([0, 0, 0, 0, 1, 0, 0, 0, 0, 0], bool)
    # runs 0-1 and 6-7 are false; 9 normal rows of 9600 s = 1/9 day
    assert false_alarms_per_day(flags, labels, 9600.0) == pytest.approx(2 / (9 * 9600 / 86400))


def test_segments_flagged_is_the_share_of_labelled_runs_touched_by_a_flag():
    labels = np.array([0, 1, 1, 0, 0, 1, 0, 1, 1, 1], bool)  # three segments: 1-2, 5, 7-9
    flags = np.array([1, 0, 1, 0, 0, 0, 1, 0, 0, 1], bool)  # touches 1-2 (row 2) and 7-9 (row 9), not 5
    assert segments_flagged(flags, labels) == pytest.approx(2 / 3)
    assert segments_flagged(np.zeros(10, bool), labels) == 0.0
    assert segments_flagged(flags, np.zeros(10, bool)) is None


def test_hit_rate_counts_the_true_columns_among_the_top_k():
    contrib = np.array([[5.0, 4, 3, 0], [0, 1, 9, 8]])
    truth = [(0, 2, [0, 2])]  # both rows; the anomaly touched columns 0 and 2
    # row 0: top 2 = {0, 1} -> 1 of 2; row 1: top 2 = {2, 3} -> 1 of 2; @150 %: k = 3
    assert hit_rate(contrib, truth, 100) == pytest.approx(0.5)
    assert hit_rate(contrib, truth, 150) == pytest.approx((2 / 2 + 1 / 2) / 2)
    assert hit_rate(contrib, [], 150) is None


def test_segment_hit_rate_ranks_by_the_segments_summed_terms():
    cells = np.array([[5.0, 4, 3, 0], [0, 1, 9, 8], [1, 1, 1, 1]])
    # rows 0-1 sum to [5, 5, 12, 8]: ranking 2, 3, then 0 and 1 tied (first column first)
    assert segment_hit_rate(cells, [(0, 2, [0, 2])], 100) == pytest.approx(1 / 2)
    assert segment_hit_rate(cells, [(0, 2, [0, 2])], 150) == 1.0  # k = 3: {2, 3, 0} holds both
    # row 2 alone: all tied, ranking 0, 1, 2, 3; k = floor(1.5 * 1) = 1: {0} misses column 3
    assert segment_hit_rate(cells, [(0, 2, [0, 2]), (2, 3, [3])], 150) == pytest.approx((1 + 0) / 2)
    assert segment_hit_rate(cells, [], 150) is None


def test_interpretation_labels_are_read_and_checked(tmp_path):
    f = tmp_path / "i.txt"
    f.write_text("3-5:1,4\n\n7-9:2\n")
    assert load_interpretation(str(f), 10, 4) == [(3, 5, [0, 3]), (7, 9, [1])]
    f.write_text("3-5:1,5\n")
    with pytest.raises(ScoreError, match="line 1: rows 3-5 or columns outside 10 rows x 4 columns"):
        load_interpretation(str(f), 10, 4)
    f.write_text("3:5\n")
    with pytest.raises(ScoreError, match="line 1: expected 'start-end:col,col,...'"):
        load_interpretation(str(f), 10, 4)


def test_a_segment_names_the_metric_that_jumped(tmp_path):
    rng = np.random.default_rng(0)
    names = [f"m{i}" for i in range(6)]
    base = rng.normal(size=(3000, 2)) @ rng.normal(size=(2, 6)) + 0.1 * rng.normal(size=(3000, 6))
    test = base[:600].copy()
    test[300:340, 4] += 8
    for name, rows in (("train.csv", base), ("test.csv", test)):
        (tmp_path / name).write_text(",".join(names) + "\n" + "\n".join(",".join(f"{v:.5f}" for v in r) for r in rows))
    models = tmp_path / "models"
    p = run_cli("train", str(tmp_path / "train.csv"), "--models-dir", str(models), "--json", "--epochs", "20")
    assert p.returncode == 0, p.stderr
    model_dir = json.loads(p.stdout)["model_dir"]
    out = tmp_path / "out.csv"
    p = run_cli("score", model_dir, str(tmp_path / "test.csv"), "--json", "--output", str(out), "--top", "2")
    assert p.returncode == 3, p.stderr
    segs = json.loads(p.stdout)["segments"]
    jump = [g for g in segs if g["start"] <= 320 <= g["end"]]
    assert len(jump) == 1 and jump[0]["top_metrics"][0]["metric"] == "m4" and jump[0]["top_metrics"][0]["share"] > 0.5
    lines = out.read_text().splitlines()
    assert lines[0] == "row,score,anomaly,top_metrics" and lines[321].split(",")[0] == "320"
    assert lines[321].split(",")[3].split(";")[0] == "m4"
    assert all((row.split(",")[3] != "") == (row.split(",")[2] == "1") for row in lines[1:])  # named iff flagged


def test_segments_fall_back_to_1_based_column_numbers():
    scores = np.array([0, 2, 3, 0, 5.0])
    contrib = np.array([[0, 0, 0], [1, 5, 0], [0, 4, 1], [0, 0, 0], [9, 0, 1.0]])
    segs = flagged_segments(scores, 1.0, contrib, ["1", "2", "3"], top=2)
    assert [(g["start"], g["end"], g["peak_row"]) for g in segs] == [(1, 2, 2), (4, 4, 4)]
    assert [m["metric"] for m in segs[0]["top_metrics"]] == ["2", "1"]
    assert segs[0]["top_metrics"][0]["share"] == pytest.approx(9 / 11)


def test_evaluate_command_prints_the_table_and_json_and_plot(tmp_path):
    smd = tmp_path / "smd"
    for folder in ("train", "test", "test_label"):
        shutil.copytree(SMD / folder, smd / folder)
    (smd / "interpretation_label").mkdir()
    (smd / "interpretation_label" / "machine-1-2.txt").write_text("4629-4688:9,10,11,13,15,18\n")
    png = tmp_path / "p.png"
    p = run_cli("evaluate", str(smd), "--epochs", "2", "--plot", str(png))
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert any(line.startswith("machine-1-2   ds-ops") for line in lines)
    assert any(line.strip().startswith("z-ema") for line in lines) and any("seed-mse" in line for line in lines)
    assert any(line.strip().startswith("pca-ema") for line in lines) and "ds-ops vs pca-ema: mean ROC-AUC" in p.stdout
    assert "HitRate@150%" in p.stdout
    assert any("alarms/d seg-hit" in line for line in lines) and "seg-hit: the share of labelled segments" in p.stdout
    assert " peak RSS " in lines[-1] and " MiB" in lines[-1]  # evaluate prints its cost
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    p = run_cli("evaluate", "--train", str(SMD_TRAIN), "--test", str(SMD_TEST), "--labels", str(SMD_LABELS),
                "--epochs", "2", "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["machines"][0]["machine"] == "machine-1-2" and set(doc["mean"]) == {"ds-ops", "z-ema", "pca-ema", "seed-mse"}
    assert doc["machines"][0]["ds-ops"]["hit_rate_150"] is None  # no interpretation file given
    assert 0 <= doc["machines"][0]["ds-ops"]["segments_flagged"] <= 1 and doc["peak_rss_bytes"] > 100 * 1024**2


def test_evaluate_errors_are_one_line(tmp_path):
    p = run_cli("evaluate", str(tmp_path))
    assert p.returncode == 1 and p.stderr.strip() == f"ds-ops: error: {tmp_path}: no train/ folder (an SMD-layout folder has train/ test/ test_label/)"
    p = run_cli("evaluate", str(SMD), "--machines", "machine-9-9")
    assert p.returncode == 1 and "no machine 'machine-9-9' in train/" in p.stderr and "Traceback" not in p.stderr
    p = run_cli("evaluate", "--train", str(SMD_TRAIN))
    assert p.returncode == 1 and "give DIR (SMD layout) or all of --train, --test and --labels" in p.stderr
    with pytest.raises(EvaluateError, match="has no file in test/"):
        (tmp_path / "train").mkdir()
        (tmp_path / "train" / "m.csv").write_text("1,2\n3,4\n")
        smd_machines(str(tmp_path))
