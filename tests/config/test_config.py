"""Configuration: the shipped conffile, validation messages, command-line overrides."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from conftest import REPO
from opt_ds_ops.config.conffile import Config, ConfigError, DatasetConfig, config_to_dict, load_config, with_overrides
from opt_ds_ops.config.sidecar import parse_sidecar

CONFFILE = REPO / "etc" / "ds-ops" / "trainer.yaml"


def test_shipped_conffile_equals_the_built_in_defaults():
    cfg = load_config(str(CONFFILE))
    assert dataclasses.replace(cfg, source="<defaults>") == Config()
    # docs/detection-protocol.md, round 2: batch 1024, lr 1e-2, at most 600 steps; epochs is a cap
    assert (cfg.train.batch_size, cfg.train.lr, cfg.train.weight_decay) == (1024, 1e-2, 1e-4)
    assert (cfg.train.max_steps, cfg.train.min_steps, cfg.train.eval_every_steps, cfg.train.patience) == (600, 100, 25, 6)
    assert (cfg.train.stopping, cfg.train.epochs) == ("plateau", 1000)
    assert (cfg.train.hidden, cfg.train.latent, cfg.models_dir) == (24, 8, "/var/models")


def test_every_key_of_the_conffile_is_commented():
    lines = CONFFILE.read_text().splitlines()
    for i, line in enumerate(lines):
        stripped = line.strip()
        if stripped and not stripped.startswith("#") and not stripped.endswith(":"):
            assert lines[i - 1].strip().startswith("#") or lines[i - 2].strip().startswith("#"), line


def test_empty_and_missing_files(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_config(str(empty)) == Config()
    assert load_config(str(tmp_path / "nope.yaml"), missing_ok=True) == Config()
    with pytest.raises(ConfigError, match="nope.yaml: configuration file not found"):
        load_config(str(tmp_path / "nope.yaml"))


@pytest.mark.parametrize(
    "text, message",
    [
        ("epochs: 3\n", "unknown key 'epochs' (allowed: models_dir, device, amp, train, spool, health"),
        ("train:\n  epoch: 3\n", "unknown key 'train.epoch' (allowed: train.epochs"),
        ("train:\n  epochs: three\n", "key 'train.epochs' must be an integer >= 1 (int), got 'three'"),
        ("train:\n  epochs: 0\n", "key 'train.epochs' must be an integer >= 1, got 0"),
        ("train:\n  epochs: true\n", "key 'train.epochs' must be an integer >= 1, got True"),
        ("train:\n  batch_size: 1\n", "key 'train.batch_size' must be an integer >= 2"),
        ("train:\n  lr: -1\n", "key 'train.lr' must be a number > 0, got -1.0"),
        ("device: gpu\n", "key 'device' must be auto, cpu, mps, cuda or cuda:N, got 'gpu'"),
        ("amp: fp8\n", "key 'amp' must be one of auto, bf16, fp16, off, got 'fp8'"),
        ("models_dir: models\n", "key 'models_dir' must be an absolute path, got 'models'"),
        ("train: 5\n", "'train' must be a mapping"),
        ("- a\n- b\n", "'top level' must be a mapping"),
        ("train: [1\n", "invalid YAML"),
        ("health:\n  on_fail: ignore\n", "key 'health.on_fail' must be one of cpu, defer, refuse"),
        ("train:\n  input_window: 0\n", "key 'train.input_window' must be an integer in 1..256 (rows; 1 = one row per input), got 0"),
        ("train:\n  window_error: max\n", "key 'train.window_error' must be one of last, window, got 'max'"),
    ],
)
def test_invalid_files_name_file_key_and_rule(tmp_path, text, message):
    path = tmp_path / "trainer.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    assert str(err.value).startswith(str(path) + ": ")
    assert message in str(err.value)


def test_int_is_accepted_for_a_float_key(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text("train:\n  lr: 1\n  weight_decay: 0\n")
    cfg = load_config(str(path))
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)


@pytest.mark.parametrize("text, value", [("1e-3", 0.001), ("5E-3", 0.005), ("1e3", 1000.0), (".5e3", 500.0),
                                         ("1.5e3", 1500.0), ("+2e-2", 0.02), ("1.0e-3", 0.001)])
def test_a_number_in_exponent_notation_is_a_number(tmp_path, text, value):
    """YAML 1.1 (PyYAML) reads 1e-3 as text; YAML 1.2 and the user read a number, and so does ds-ops."""
    if text != "1.0e-3":
        assert isinstance(yaml.safe_load(f"x: {text}")["x"], str)  # PyYAML alone, unchanged: text
    p = tmp_path / "c.yaml"
    p.write_text(f"train:\n  lr: {text}\n  weight_decay: 0\nscoring:\n  alarm_budget_history: off\n")
    cfg = load_config(str(p))
    assert cfg.train.lr == value and cfg.train.weight_decay == 0.0 and cfg.scoring.alarm_budget_history is False
    p.write_text("train:\n  lr: 1e-3x\n")  # not a number in any YAML: refused as before, naming the key
    with pytest.raises(ConfigError, match=r"line 2, column 3: key 'train.lr' must be a number > 0 \(float\), got '1e-3x'"):
        load_config(str(p))
    # a sidecar reads it so too; a name that YAML reads as a number must be quoted to stay a name
    with pytest.raises(ConfigError, match=r"key 'name' must be a model name \(text\), got 1000.0"):
        parse_sidecar(b"name: 1e3\n", "s.yaml", DatasetConfig())
    assert parse_sidecar(b"name: '1e3'\n", "s.yaml", DatasetConfig())[1] == "1e3"


@pytest.mark.parametrize("text", ["1e999", "-1e999", ".inf", ".nan"])
def test_a_number_beyond_any_float_is_refused(tmp_path, text):
    """1e999 reads as inf: refused with the key and its rule, as a wrong type is, not trained with."""
    p = tmp_path / "c.yaml"
    p.write_text(f"train:\n  lr: {text}\n")
    with pytest.raises(ConfigError, match=r"line 2, column 3: key 'train.lr' must be a number > 0, got"):
        load_config(str(p))


def test_overrides_replace_validate_and_ignore_none():
    cfg = with_overrides(Config(), {"train.epochs": 2, "models_dir": "/tmp/m", "device": None})
    assert cfg.train.epochs == 2 and cfg.models_dir == "/tmp/m" and cfg.device == "auto"
    with pytest.raises(ConfigError, match="^command line: key 'train.epochs' must be an integer >= 1, got -3"):
        with_overrides(Config(), {"train.epochs": -3})
    assert config_to_dict(cfg)["train"]["epochs"] == 2


@pytest.mark.parametrize("value, limit", [("auto", None), ("1", 1), ("4", 4)])
def test_daemon_max_jobs_takes_auto_or_a_positive_integer(tmp_path, value, limit):
    path = tmp_path / "trainer.yaml"
    path.write_text(f"daemon:\n  max_jobs: {value}\n")  # a YAML integer and the word auto
    assert load_config(str(path)).daemon.max_jobs_limit() == limit


@pytest.mark.parametrize("value", ["0", "-2", "many", "1.5", "true"])
def test_daemon_max_jobs_refuses_anything_else_with_the_key_and_the_rule(tmp_path, value):
    path = tmp_path / "trainer.yaml"
    path.write_text(f"daemon:\n  max_jobs: {value}\n")
    with pytest.raises(ConfigError, match="key 'daemon.max_jobs' must be auto or an integer >= 1"):
        load_config(str(path))


def test_the_matrix_budget_leaves_the_jobs_own_measured_memory_aside():
    """A quarter of memory_max beyond what the process holds: VmData (read from /proc, as a job
    does; this test process has torch and numpy loaded, more than 100 MiB), never less than
    JOB_BASE_BYTES; an explicit max_matrix_bytes wins."""
    from opt_ds_ops.config.conffile import JobConfig
    from opt_ds_ops.config.sizes import JOB_BASE_BYTES, data_segment_bytes

    held = data_segment_bytes()
    assert held > 100 * 1024**2
    job = JobConfig(memory_max="8G")
    assert job.matrix_budget_bytes() == (8 * 1024**3 - JOB_BASE_BYTES) // 4
    assert job.matrix_budget_bytes(2 * 1024**3) == 6 * 1024**3 // 4
    assert job.matrix_budget_bytes(1024) == job.matrix_budget_bytes()
    assert JobConfig(memory_max="8G", max_matrix_bytes=12345).matrix_budget_bytes(held) == 12345


# What the fuzzer (tests/fuzz) found; each must be a ConfigError naming the file, never another exception
def test_sidecar_with_keys_of_mixed_types_names_the_unknown_key():
    from opt_ds_ops.config.conffile import DatasetConfig
    from opt_ds_ops.config.sidecar import parse_sidecar

    for text in (b"1: a\nfoo: b\n", b"~: a\ntime_column: none\n", b"2024-05-18: x\n1.5: y\n"):
        with pytest.raises(ConfigError, match=r"x\.yaml: unknown key"):
            parse_sidecar(text, "x.yaml", DatasetConfig())



def test_incidents_in_the_conffile_are_refused(tmp_path):
    path = tmp_path / "trainer.yaml"
    path.write_text("dataset:\n  incidents: [[1, 5]]\n")
    with pytest.raises(ConfigError, match="'dataset.incidents' labels the rows of one file"):
        load_config(str(path))


def test_a_sidecars_incidents_are_row_ranges():
    from opt_ds_ops.config.conffile import DatasetConfig
    from opt_ds_ops.config.sidecar import parse_sidecar

    opts, _ = parse_sidecar(b"incidents: [[1, 5], [90, 90]]\n", "x.yaml", DatasetConfig())
    assert opts.incidents == ((1, 5), (90, 90))
    for bad in (b"incidents: [[5, 1]]", b"incidents: [[0, 3]]", b"incidents: [3]", b"incidents: [[1, 2, 3]]",
                b"incidents: [[true, 2]]", b"incidents: [[1.5, 2]]", b"incidents: 7",
                # an alias bomb in 64 KiB: 5,000 references to one list of 5,000 numbers, refused without a copy
                b"incidents: [&a [" + b"1," * 4999 + b"1], " + b"*a," * 4999 + b"*a]"):
        with pytest.raises(ConfigError, match="key 'incidents' must be"):
            parse_sidecar(bad, "x.yaml", DatasetConfig())


def test_sidecar_nested_20000_deep_is_refused():
    from opt_ds_ops.config.conffile import DatasetConfig
    from opt_ds_ops.config.sidecar import parse_sidecar

    for text in (b"[" * 20_000, b"columns: " + b"[" * 20_000 + b"]" * 20_000, b"{a: " * 10_000):
        with pytest.raises(ConfigError, match=r"x\.yaml: .*nested too deeply"):
            parse_sidecar(text, "x.yaml", DatasetConfig())


@pytest.mark.parametrize(
    "text, where",
    [
        ("# the conffile\ntrain:\n  epochs: 3\n  lr: fast\n", "line 4, column 3: key 'train.lr'"),
        ("train:\n  epochs: 3\nspool:\n    dir: /x\n    bogus: 1\n", "line 5, column 5: unknown key 'spool.bogus'"),
        ("train: {epochs: 2, epochs: zero}\n", "line 1, column 20: key 'train.epochs'"),  # the last of repeated keys
        ("amp: fp8\n", "line 1, column 1: key 'amp'"),
        ("\n\ntrain: 5\n", "line 3, column 1: 'train' must be a mapping"),
        ("train:\n  1: a\n", "line 2, column 3: unknown key 'train.1'"),
    ],
)
def test_a_bad_key_is_named_with_its_line_and_column(tmp_path, text, where):
    path = tmp_path / "trainer.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    assert str(err.value).startswith(f"{path}: {where}")


def test_conffile_with_keys_of_mixed_types_or_nested_too_deeply_is_refused(tmp_path):
    path = tmp_path / "trainer.yaml"
    for text, message in ((b"1: a\nfoo: b\n", "unknown key 'foo'"), (b"train:\n  1: a\n  epochs: 2\n", "unknown key 'train.1'"),
                          (b"[" * 20_000, "nested too deeply"), (b"dataset:\n  columns: " + b"[" * 900 + b"]" * 900, "")):
        path.write_bytes(text)
        with pytest.raises(ConfigError, match=f"{path}: .*{message}"):
            load_config(str(path))


def test_conffile_that_is_not_utf8_is_refused(tmp_path):
    path = tmp_path / "trainer.yaml"
    path.write_bytes(b"models_dir: /var/models\xfadevice: cpu\n")
    with pytest.raises(ConfigError, match=f"{path}: not UTF-8 text"):
        load_config(str(path))


def test_a_size_beyond_any_number_is_refused(tmp_path):
    path = tmp_path / "trainer.yaml"
    for size in ("infG", "1e400K", "-infM"):
        path.write_text(f"job:\n  memory_max: {size}\n")
        with pytest.raises(ConfigError, match="job.memory_max"):
            load_config(str(path))


def test_sidecar_with_a_tagged_value_yaml_cannot_build_is_refused():
    from opt_ds_ops.config.conffile import DatasetConfig
    from opt_ds_ops.config.sidecar import parse_sidecar

    for text in (b"!!float ", b"!!float t", b"columns: [!!int a*ae~]\n", b"time_column: !!float ''\n"):
        with pytest.raises(ConfigError, match=r"x\.yaml: invalid YAML"):
            parse_sidecar(text, "x.yaml", DatasetConfig())


def _laughs(levels: int = 9) -> bytes:
    """A sidecar of 9 levels of aliases, 9 each: 300 bytes that stand for 9**9 (387 million) values."""
    lines = ["columns:", "  - &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"  - &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    return ("\n".join(lines) + "\n").encode()


def test_sidecar_of_aliases_that_stand_for_millions_of_values_is_refused_in_a_short_message():
    import time

    from opt_ds_ops.config.conffile import DatasetConfig
    from opt_ds_ops.config.sidecar import parse_sidecar

    for text in (_laughs(), _laughs().replace(b"columns:", b"time_column:"), b"name:" + _laughs()[len(b"columns:"):]):
        t0 = time.monotonic()
        with pytest.raises(ConfigError, match=r"x\.yaml: key '(columns|time_column|name)' must be") as e:
            parse_sidecar(text, "x.yaml", DatasetConfig())
        assert time.monotonic() - t0 < 5 and len(str(e.value)) < 1000, str(e.value)[:300]


def test_inputs_of_differences_with_a_window_are_refused_by_check_config_not_by_every_job(tmp_path):
    """train.input_differences needs input_window 1: the conffile (and so check-config and a reload)
    says so, naming the key and its line, instead of every training job failing later."""
    conf = tmp_path / "trainer.yaml"
    conf.write_text("train:\n  input_differences: true\n  input_window: 3\n")
    with pytest.raises(ConfigError, match=r"line 2, column 3: key 'train.input_differences' .* needs "
                                          r"'train.input_window' 1, got 3"):
        load_config(str(conf))
    conf.write_text("train:\n  input_differences: true\n")
    assert load_config(str(conf)).train.input_differences


def test_a_conffile_with_a_window_from_before_the_differences_default_still_loads_and_reads_levels(tmp_path):
    """train.input_differences is true as shipped (round 10); a conffile kept from before with
    input_window 4 and no input_differences (dpkg keeps an edited conffile) loads, windows of levels
    as before, instead of stopping the daemon at the upgrade."""
    conf = tmp_path / "trainer.yaml"
    conf.write_text("train:\n  input_window: 4\n")
    train = load_config(str(conf)).train
    assert train.input_window == 4 and train.input_differences is False
    assert load_config(str(tmp_path / "none.yaml"), missing_ok=True).train.input_differences is True


def test_an_alarm_budget_that_waits_longer_than_it_keeps_is_refused(tmp_path):
    """scoring.alarm_budget_min_days over alarm_budget_days would keep the model's threshold for
    good (a threshold rests on the last alarm_budget_days days): refused, naming the key."""
    conf = tmp_path / "trainer.yaml"
    conf.write_text("scoring:\n  alarm_budget_days: 3\n  alarm_budget_min_days: 4\n")
    with pytest.raises(ConfigError, match=r"line 3, column 3: key 'scoring.alarm_budget_min_days' \(4\) must be at "
                                          r"most 'scoring.alarm_budget_days' \(3\)"):
        load_config(str(conf))
    conf.write_text("scoring:\n  alarm_budget_days: 3\n  alarm_budget_min_days: 3\n")
    assert load_config(str(conf)).scoring.alarm_budget_min_days == 3


def test_the_change_of_regime_rule_is_read_from_the_conffile_and_a_bad_one_refused(tmp_path):
    from opt_ds_ops.scoring.regime import RegimePolicy

    conf = tmp_path / "c.yaml"
    conf.write_text("scoring:\n  regime_explains: model\n  regime_after_s: 3600\n")
    assert RegimePolicy.from_config(load_config(str(conf)).scoring) == RegimePolicy(3600.0, 3.0, "model")
    assert RegimePolicy.from_config(Config().scoring).explains == "model"  # as shipped since round 14
    conf.write_text("scoring:\n  regime_explains: both\n")
    with pytest.raises(ConfigError, match=r"line 2, column 3: key 'scoring.regime_explains'.*share or model"):
        load_config(str(conf))


def test_the_budgets_floor_is_read_from_the_conffile_and_one_out_of_range_refused(tmp_path):
    from opt_ds_ops.model.calibration import CalibrationPolicy

    conf = tmp_path / "c.yaml"
    conf.write_text("scoring:\n  alarm_budget_floor: 0.25\n")
    assert CalibrationPolicy.from_config(load_config(str(conf)).scoring).floor == 0.25
    assert CalibrationPolicy.from_config(Config().scoring).floor == 1.0  # as shipped: never under the model's
    for bad in ("0.05", "1.5", "0"):
        conf.write_text(f"scoring:\n  alarm_budget_floor: {bad}\n")
        with pytest.raises(ConfigError, match=r"line 2, column 3: key 'scoring.alarm_budget_floor'.*0.0625, 1"):
            load_config(str(conf))


def test_round_20s_gate_factor_is_the_shipped_one_a_kept_0_stays_and_a_factor_under_1_is_refused(tmp_path):
    """Round 20 of docs/detection-protocol.md: the gate refuses a version whose seeded budget starts
    over 32 times its own threshold; 0 (before round 20) does not judge it; a factor in (0, 1) would
    refuse every seeded version (the budget never starts under the model's threshold)."""
    assert Config().store.promote_max_seeded_factor == 32.0
    conf = tmp_path / "c.yaml"
    conf.write_text("store:\n  promote_max_seeded_factor: 0\n")
    assert load_config(str(conf)).store.promote_max_seeded_factor == 0.0
    for bad in ("0.5", "-1"):
        conf.write_text(f"store:\n  promote_max_seeded_factor: {bad}\n")
        with pytest.raises(ConfigError, match=r"key 'store.promote_max_seeded_factor'.*0 \(not judged\) or a factor >= 1"):
            load_config(str(conf))


def test_round_17s_budget_is_the_shipped_one_and_a_kept_conffile_keeps_its_own(tmp_path):
    """Round 17 of docs/detection-protocol.md: 0.5 alarms a day, a new version seeded from the
    history (0.25 and no seed in rounds 14-16); a conffile that says the old values keeps them."""
    from opt_ds_ops.model.calibration import CalibrationPolicy

    shipped = CalibrationPolicy.from_config(Config().scoring)
    assert (shipped.budget_per_day, shipped.from_history, shipped.learns) == (0.5, True, "warnings")
    conf = tmp_path / "c.yaml"
    conf.write_text("scoring:\n  alarm_budget_per_day: 0.25\n  alarm_budget_history: false\n")
    kept = CalibrationPolicy.from_config(load_config(str(conf)).scoring)
    assert (kept.budget_per_day, kept.from_history) == (0.25, False)
