"""Configuration: the conffile ``/etc/ds-ops/trainer.yaml``, parsed once and passed down.

Given a YAML file, :func:`load_config` returns a frozen :class:`Config`; every key has a type, an
allowed range and a default in one place (the ``_field`` calls below). The model's widths
and weight decay equal the seed lab script (hidden 24, latent 8, AdamW weight decay 1e-4); how long
and how fast it trains do not (chosen by docs/detection-protocol.md: until the validation loss
plateaus within at most 600 steps, batch 1024, lr 1e-2; the seed's 5 epochs at batch 2048 and lr
1e-3 are the benchmark's).
Command-line overrides go through :func:`with_overrides`, which validates the same way.
"""

from __future__ import annotations

import dataclasses
import math
import os
import reprlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import yaml

from .sizes import JOB_BASE_BYTES, mem_total_bytes, parse_size, size_ok
from .yamlload import ConfigLoader, UniqueKeyLoader
from .yamlpos import key_position, yaml_problem

DEFAULT_CONFIG_PATH = "/etc/ds-ops/trainer.yaml"


class ConfigError(ValueError):
    """A configuration file or override that cannot be used; the message names file, key and rule;
    ``key``: the mapping keys down to the one at fault (``("train", "epochs")``), () if none."""

    def __init__(self, message: str = "", key: tuple = ()):
        super().__init__(message)
        self.key = key


def _field(default: Any, check: Callable[[Any], bool] | None = None, allowed: str = "", help: str = ""):
    """Declare one config key: its default, a validity check and the words for what is allowed."""
    return field(default=default, metadata={"check": check, "allowed": allowed, "help": help})


def _positive(v) -> bool:
    return v > 0


def _non_negative(v) -> bool:
    return v >= 0


def _device_ok(v: str) -> bool:
    return v in ("auto", "cpu", "cuda", "mps") or (v.startswith("cuda:") and v[5:].isdigit())


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of one training job (defaults: docs/detection-protocol.md's choices, rounds 1 and 2)."""

    # Train until the validation loss stops improving (opt_ds_ops.training.stopping); epochs is a cap.
    # Defaults chosen on two fleets by the protocol of docs/detection-protocol.md.
    epochs: int = _field(1000, _positive, "an integer >= 1")
    stopping: str = _field("plateau", lambda v: v in ("plateau", "epochs"), "one of plateau, epochs")
    eval_every_steps: int = _field(25, _positive, "an integer >= 1 (optimizer steps)")
    patience: int = _field(6, _positive, "an integer >= 1 (evaluations)")
    min_delta: float = _field(0.002, lambda v: 0 <= v < 1, "a number in [0, 1) (relative)")
    min_steps: int = _field(100, _non_negative, "an integer >= 0 (optimizer steps)")
    max_steps: int = _field(600, _positive, "an integer >= 1 (optimizer steps)")
    # Warn when the validation split does not look like the training split (opt_ds_ops.training.suspect)
    suspect_loss_ratio: float = _field(3.0, _positive, "a number > 0 (validation / training loss)")
    suspect_shift_sd: float = _field(6.0, _positive, "a number > 0 (training standard deviations)")
    batch_size: int = _field(1024, lambda v: v >= 2, "an integer >= 2 (BatchNorm1d needs 2 rows)")
    lr: float = _field(1e-2, _positive, "a number > 0")
    weight_decay: float = _field(1e-4, _non_negative, "a number >= 0")
    hidden: int = _field(24, _positive, "an integer >= 1")
    latent: int = _field(8, _positive, "an integer >= 1")
    val_fraction: float = _field(0.1, lambda v: 0 <= v < 0.9, "a number in [0, 0.9)")
    threshold_quantile: float = _field(0.99, lambda v: 0 < v < 1, "a number in (0, 1)")
    # Score and threshold: smoothing, input clip, windowed inputs (docs/detection.md, how the default score was chosen).
    score_window: int = _field(5, _positive, "an integer >= 1 (rows; 1 = no smoothing)")
    score_smoothing: str = _field("ema", lambda v: v in ("ema", "mean"), "one of ema, mean")
    input_clip: float = _field(20.0, _non_negative, "a number >= 0 (standard deviations; 0 = no clipping)")
    error_floor: float = _field(0.01, _positive, "a number > 0")
    input_window: int = _field(1, lambda v: 1 <= v <= 256, "an integer in 1..256 (rows; 1 = one row per input)")
    window_error: str = _field("last", lambda v: v in ("last", "window"), "one of last, window")
    # Each metric's change since the previous row, standardised like the levels, read beside its level
    # (opt_ds_ops.model.network.with_differences; needs input_window 1): the model's input is 2 x D wide.
    input_differences: bool = _field(True, None, "true or false")
    # With input_differences: a metric's term is the mean, or the larger (max), of its change's and its level's
    difference_term: str = _field("mean", lambda v: v in ("mean", "max"), "one of mean, max")
    threshold_method: str = _field("quantile", lambda v: v in ("quantile", "alarm_rate", "spot"),
                                   "one of quantile, alarm_rate, spot")
    alarms_per_day: float = _field(1.0, _non_negative, "a number >= 0 (alarms per day)")
    sample_period_s: float = _field(60.0, _positive, "seconds > 0")
    spot_risk: float = _field(1e-4, lambda v: 0 < v < 0.5, "a number in (0, 0.5)")
    spot_level: float = _field(0.98, lambda v: 0.5 <= v < 1, "a number in [0.5, 1)")
    seed: int = _field(0, _non_negative, "an integer >= 0")
    # Record the training step in a CUDA graph on a GPU (opt_ds_ops.training.step); false: eager steps
    cuda_graphs: bool = _field(True, None, "true or false")


@dataclass(frozen=True)
class SpoolConfig:
    """The daemon's spool directory and how it watches it (docs/operating.md)."""

    dir: str = _field("/var/spool/ds-ops", os.path.isabs, "an absolute path")
    settle_s: float = _field(2.0, _non_negative, "seconds >= 0")
    scan_interval_s: float = _field(30.0, _positive, "seconds > 0")
    max_dataset_bytes: int = _field(4 * 1024**3, _positive, "bytes > 0")
    watcher: str = _field("inotify", lambda v: v in ("inotify", "poll"), "one of inotify, poll")
    max_crashes: int = _field(3, _positive, "an integer >= 1")
    quiet_s: float = _field(60.0, _non_negative, "seconds >= 0")
    max_failed: int = _field(1000, _positive, "an integer >= 1")
    # Retention of done/ and failed/: datasets (with their JSON) older than max_age_days
    # are removed, then the oldest until the directory holds at most max_bytes; 0 = no limit.
    done_max_age_days: float = _field(30.0, _non_negative, "days >= 0 (0: keep forever)")
    done_max_bytes: int = _field(0, _non_negative, "bytes >= 0 (0: no limit)")
    failed_max_age_days: float = _field(0.0, _non_negative, "days >= 0 (0: keep forever)")
    failed_max_bytes: int = _field(0, _non_negative, "bytes >= 0 (0: no limit)")


@dataclass(frozen=True)
class StoreConfig:
    """The model store's retention: ``keep_versions`` newest versions of each model are kept after
    each job, besides ``current`` and pinned versions (``ds-ops models pin``); 0 keeps all.
    ``promote``: whether a daemon job's new version becomes current (always, if-not-worse: the
    gate of :mod:`opt_ds_ops.lifecycle.promotion` with its tolerances and seeded factor, manual)."""

    keep_versions: int = _field(10, _non_negative, "an integer >= 0 (0: keep every version)")
    # The promotion gate of a daemon job's new version (opt_ds_ops.lifecycle.promotion)
    promote: str = _field("if-not-worse", lambda v: v in ("always", "if-not-worse", "manual"),
                          "one of always, if-not-worse, manual")
    promote_flag_tolerance: float = _field(0.01, lambda v: 0 <= v <= 1, "a share in [0, 1]")
    promote_pr_auc_tolerance: float = _field(0.05, lambda v: 0 <= v <= 1, "a number in [0, 1]")
    promote_max_seeded_factor: float = _field(32.0, lambda v: v == 0 or v >= 1, "0 (not judged) or a factor >= 1")


@dataclass(frozen=True)
class MetricsConfig:
    """Prometheus metrics in the node_exporter textfile way: ``ds_ops.prom`` is written into
    ``textfile_dir`` after every job and state change; when that directory does not exist (no
    node-exporter installed) metrics are off, said once at start. Empty: off."""

    textfile_dir: str = _field("/var/lib/prometheus/node-exporter", lambda v: v == "" or os.path.isabs(v),
                               "an absolute path, or empty for off")


@dataclass(frozen=True)
class ScoringConfig:
    """The scoring spool (docs/scoring.md): telemetry dropped in ``spool.dir``/score/ is scored by its
    model's ``current`` version, as one series per model across files.

    ``results_dir``: per model, the scored files' per-row scores and JSON summaries and the
    series' carried state (``RESULTS/NAME/``). ``max_gap_periods``: the carried state is reset
    when the gap between the previous chunk's last time and this chunk's first time is more than
    this many sample periods (the model's ``sample_period_s``); 0 = never by gap.
    ``results_max_age_days``/``results_max_bytes``: retention of each model's results, as for done/.
    ``incident_open_window_s``, ``incident_open_share``, ``incident_quiet_s``,
    ``incident_critical_ratio``: what pages (:mod:`opt_ds_ops.scoring.incidents`): an incident opens
    when at least open_share of the rows of the last open_window_s seconds are flagged, closes after
    quiet_s seconds of unflagged rows, and is critical once its peak score reaches critical_ratio
    times the threshold (chosen in docs/detection-protocol.md, round 4). ``regime_after_s``,
    ``regime_shift_sd``, ``regime_explains``: an incident open this long whose alarm is explained
    (``share``: the moved metrics carry half its error; ``model``: moved back, its last rows would
    not stay flagged) by metrics that moved at least this many training SDs and stayed is a change
    of regime (:mod:`opt_ds_ops.scoring.regime`): said once, then re-baselined (0 s: off). ``alarm_budget_per_day``,
    ``alarm_budget_days``: each series sets its threshold, at each day of the data, to the lowest
    that gave at most this many alarms a day over the last days scored (:mod:`opt_ds_ops.model.calibration`; 0: off;
    0.5 as shipped, round 17), once alarm_budget_min_days days are kept. ``alarm_budget_history``: a new version's budget starts from the
    series' scored history (its last alarm_budget_days days, less what the versions before flagged, unless learns all), scored again by the new version,
    instead of from nothing (:func:`opt_ds_ops.model.calibration.seed`). ``alarm_budget_learns``:
    whose runs the budget counts (``all``; ``warnings``: not those of an incident that was or became
    critical; ``normal``: none inside an incident). ``alarm_budget_floor``: the lowest it sets, times the model's.
    """

    results_dir: str = _field("/var/lib/ds-ops/scores", os.path.isabs, "an absolute path")
    max_gap_periods: float = _field(10.0, _non_negative, "a number >= 0 (sample periods; 0: never)")
    results_max_age_days: float = _field(30.0, _non_negative, "days >= 0 (0: keep forever)")
    results_max_bytes: int = _field(0, _non_negative, "bytes >= 0 (0: no limit)")
    incident_open_window_s: float = _field(300.0, lambda v: _non_negative(v) and math.isfinite(v),
                                           "seconds >= 0 (0: one flagged row opens)")
    incident_open_share: float = _field(0.5, lambda v: 0 < v <= 1, "a number in (0, 1]")
    incident_quiet_s: float = _field(1800.0, lambda v: _non_negative(v) and math.isfinite(v),
                                     "seconds >= 0 (0: the first unflagged row closes)")
    incident_critical_ratio: float = _field(2.0, lambda v: 1 <= v < math.inf, "a number >= 1 (times the threshold)")
    regime_after_s: float = _field(21600.0, lambda v: _non_negative(v) and math.isfinite(v),
                                   "seconds >= 0 (0: a change of regime is never recognised)")
    regime_shift_sd: float = _field(3.0, lambda v: 0 < v < math.inf, "a number > 0 (training standard deviations)")
    regime_explains: str = _field("model", lambda v: v in ("share", "model"), "share or model")
    alarm_budget_per_day: float = _field(0.5, lambda v: 0 <= v <= 1e6, "alarms a day in [0, 1000000] (0: off)")
    alarm_budget_days: float = _field(14.0, lambda v: 1 <= v <= 365, "days in [1, 365]")
    alarm_budget_min_days: float = _field(1.0, lambda v: 1 <= v <= 365, "days in [1, 365]")
    alarm_budget_history: bool = _field(True, None, "true or false")
    alarm_budget_learns: str = _field("warnings", lambda v: v in ("all", "warnings", "normal"),
                                      "one of all, warnings, normal")
    alarm_budget_floor: float = _field(1.0, lambda v: 0.0625 <= v <= 1, "a number in [0.0625, 1] (times the model's threshold)")


def _auto_or_at_least(low: int):
    """A text key's check: ``auto`` or an integer >= ``low``."""
    return lambda v: v == "auto" or (v.isdigit() and int(v) >= low)


@dataclass(frozen=True)
class DaemonConfig:
    """How many jobs the daemon runs at once, on which GPUs, and which datasets train on several.

    ``max_jobs``: ``auto`` (one job per GPU that passes the daemon's NVML health check, each job
    seeing only its GPU through ``CUDA_VISIBLE_DEVICES``; 1 on a host without a usable GPU and
    under ``device: cpu``, ``mps`` or ``cuda:N``) or an integer N >= 1: at most N jobs, spread over
    the healthy GPUs (the GPU with the fewest jobs first); on a CPU host N jobs share the cores.
    Kept as text (an integer in the file is read as its digits); :meth:`max_jobs_limit` gives the
    number.

    ``distributed_min_bytes``: a dataset file of at least this many bytes trains as one job on
    several processes, DistributedDataParallel under torchrun (:mod:`opt_ds_ops.training.distributed`),
    once no other job runs and with no other job beside it; 0 (the default): never.
    ``distributed_nproc``: its processes: ``auto``, one per GPU that passes the daemon's NVML check
    (all of them visible to the job, nccl), and none on a host without GPUs, where such a dataset
    trains in one process (gloo ranks on two cores measured 5x slower than one process, README); or
    an integer N >= 2: N ranks, on the first N healthy GPUs, or on the CPU (gloo) without GPUs.
    Fewer than 2 healthy GPUs, a dataset that streams (over the job's matrix budget) or
    ``train.input_window`` > 1: one process, and metadata.json's notes say why.

    ``stack_max``: when at least ``stack_min`` dataset files wait in incoming/, up to ``stack_max``
    of them (each at most ``stack_max_bytes``, a plain training drop that never crashed a job) are
    claimed together and trained in ONE job process as one stacked model
    (:mod:`opt_ds_ops.training.stacked`, :mod:`opt_ds_ops.daemon.jobstack`): those of the most common
    shape (rows x columns, in memory) train together, each with its own result, model, version and
    journal lines; the others, and all of them when fewer than two share a shape, go back to the
    queue and train one job at a time. 0 or 1: never. A stack keeps no checkpoint and takes one job
    slot; it is claimed only when the oldest waiting file is small enough to join it.
    """

    max_jobs: str = _field("auto", _auto_or_at_least(1), "auto or an integer >= 1")
    distributed_min_bytes: int = _field(0, _non_negative, "bytes >= 0 (0: never)")
    distributed_nproc: str = _field("auto", _auto_or_at_least(2), "auto or an integer >= 2")
    stack_max: int = _field(16, _non_negative, "an integer >= 0 (0 or 1: never)")
    stack_min: int = _field(4, lambda v: v >= 2, "an integer >= 2")
    stack_max_bytes: int = _field(8 * 1024**2, _positive, "bytes > 0")

    def max_jobs_limit(self) -> int | None:
        """Return max_jobs as an integer, or None for ``auto``."""
        return None if self.max_jobs == "auto" else int(self.max_jobs)

    def distributed_ranks(self) -> int | None:
        """Return distributed_nproc as an integer, or None for ``auto``."""
        return None if self.distributed_nproc == "auto" else int(self.distributed_nproc)


@dataclass(frozen=True)
class JobConfig:
    """Limits of one training job, which runs in its own process under the daemon.

    ``memory_max``: the job process's memory (``RLIMIT_DATA``; systemd's size forms: bytes, ``8G``
    or a percentage of RAM). ``max_decompressed_bytes``: bytes a compressed dataset (``.gz``,
    ``.npz`` member) may inflate to. ``max_columns``: metrics per row (the model's weights grow
    with it). ``max_matrix_bytes``: the float32 matrix (rows x columns x 4 bytes); 0 = a quarter
    of what ``memory_max`` leaves beside the job's own data segment (measured in the job, at least
    :data:`JOB_BASE_BYTES`): text parses into a float32 matrix
    (peak up to 2x the matrix, measured) and training adds about 2.4x (the standardised training
    split and the epoch's shuffled copy), so a quarter leaves room for both. A larger dataset is
    streamed instead (:mod:`opt_ds_ops.training.stream`; text, Parquet and Arrow after one conversion to a
    ``.npy``, :mod:`opt_ds_ops.dataset.core`), which needs about 300 MiB beside the base. ``stall_timeout_s``: a job that
    reports nothing for this long (no epoch, no batch) is killed. ``health_timeout_s``: the
    health gate (NVML) may take this long before the job is deferred as hung.
    """

    memory_max: str = _field("50%", size_ok, "bytes, a size like 8G, or a percentage of RAM like 50%")
    max_decompressed_bytes: int = _field(16 * 1024**3, _positive, "bytes > 0")
    max_columns: int = _field(4096, _positive, "an integer >= 1")
    max_matrix_bytes: int = _field(0, _non_negative, "bytes >= 0 (0: a quarter of memory_max beyond the job's own memory)")
    stall_timeout_s: float = _field(600.0, _positive, "seconds > 0")
    health_timeout_s: float = _field(30.0, _positive, "seconds > 0")

    def memory_max_bytes(self) -> int:
        """Return ``memory_max`` in bytes (a percentage is of this machine's RAM)."""
        return parse_size(self.memory_max, mem_total_bytes())

    def matrix_budget_bytes(self, base_bytes: int = JOB_BASE_BYTES) -> int:
        """Return the largest float32 matrix (bytes) a job may load: ``max_matrix_bytes``, or a quarter
        of ``memory_max`` beyond ``base_bytes`` (what the job holds already: at least
        :data:`JOB_BASE_BYTES`; a job passes its own :func:`data_segment_bytes`), at least 1 MiB."""
        base = max(base_bytes, JOB_BASE_BYTES)
        return self.max_matrix_bytes or max(self.memory_max_bytes() - base, 4 * 1024**2) // 4


@dataclass(frozen=True)
class HealthConfig:
    """GPU health policy and thresholds, judged in :mod:`opt_ds_ops.health.policy`.

    ``on_fail``: what a job gets when no GPU passes: cpu (train on the CPU), defer (stay queued,
    retry after ``retry_s`` seconds) or refuse (move to failed/). ``temp_margin_c`` (degC): warn
    within this margin of the GPU's slowdown temperature, fail within it of the shutdown
    temperature; 5 is a ds-ops choice (DCGM's thermal watch has no margin, it reports throttling
    after the fact). ``retired_pages_warn``/``retired_pages_fail``: retired-page counts (pre-A100
    page retirement) for warn and fail; defaults DCGM_LIMIT_MAX_RETIRED_PAGES_SOFT_LIMIT (15) and
    DCGM_LIMIT_MAX_RETIRED_PAGES (63; 60 before DCGM aligned it with NVIDIA's field diagnostic) from
    DCGM's dcgm_gpu_hardware_limits.h, used by its memory health watch. ``smoke_timeout_s``: the
    CUDA smoke test (:mod:`opt_ds_ops.health.smoke`: one forward and backward on the job's GPU) must end
    within this many seconds or the GPU fails; the work itself is meant to take about 2 s, and 5 s
    leaves room for the first CUDA context of a fresh process on a loaded host (a ds-ops choice).
    """

    on_fail: str = _field("cpu", lambda v: v in ("cpu", "defer", "refuse"), "one of cpu, defer, refuse")
    retry_s: float = _field(300.0, _positive, "seconds > 0")
    temp_margin_c: int = _field(5, lambda v: 0 <= v <= 30, "degrees Celsius in [0, 30]")
    retired_pages_warn: int = _field(15, lambda v: 1 <= v <= 1000, "an integer in [1, 1000]")
    retired_pages_fail: int = _field(63, lambda v: 1 <= v <= 1000, "an integer in [1, 1000]")
    smoke_timeout_s: float = _field(5.0, lambda v: 0 < v <= 600, "seconds in (0, 600]")


TIME_ORDERS = ("sort", "refuse")


def _names_ok(v: tuple) -> bool:
    return all(isinstance(x, (str, int)) and not isinstance(x, bool) and str(x).strip() for x in v)


def _ranges_ok(v: tuple) -> bool:  # [[first, last], ...]: 1-based rows, inclusive, at most 10,000 ranges
    return len(v) <= 10_000 and all(isinstance(r, tuple) and len(r) == 2 and all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 1 for i in r) and r[0] <= r[1] for r in v)


@dataclass(frozen=True)
class DatasetConfig:
    """Which columns of a tabular dataset (CSV, Parquet, Arrow) are features and which is time.

    ``time_column``: ``auto`` (a column named like time, timestamp, date, epoch, ... or holding
    ISO 8601 timestamps; see :mod:`opt_ds_ops.dataset.columns`), ``none``, or a column's header
    name or 1-based number. ``columns``: the feature columns to use (names or 1-based numbers;
    empty: every numeric column). ``exclude_columns``: columns left out. ``time_order``: rows out
    of time order are sorted (``sort``, said in the journal and metadata.json) or refused.
    Set per deployment here, per dataset in a sidecar ``NAME.yaml`` (:func:`parse_sidecar`).
    """

    time_column: str = _field("auto", lambda v: bool(v.strip()), "auto, none, a column name or a 1-based number")
    columns: tuple = _field((), _names_ok, "a list of column names or 1-based numbers")
    exclude_columns: tuple = _field((), _names_ok, "a list of column names or 1-based numbers")
    time_order: str = _field("sort", lambda v: v in TIME_ORDERS, "one of sort, refuse")
    # Names of the features of headerless data (a .npy, or CSV without a header), in
    # feature order; stored with the model so that alerts, results and ``score`` name metrics.
    metric_names: tuple = _field((), _names_ok, "a list of metric names, one per feature, in order")
    # Leave out the rows the model's current version flags (plus retrain.exclude_margin
    # rows each side) before training on this file (opt_ds_ops.lifecycle.retrain_data)
    exclude_flagged: bool = _field(False, None, "true or false")
    # Labelled incidents of this file (a sidecar's), for the promotion gate's PR-AUC test
    incidents: tuple = _field((), _ranges_ok, "a list of [first, last] data rows (1-based, inclusive)")


def parse_window(v: str) -> tuple[int, float]:
    """``100000`` -> (100000 rows, 0 s); ``7d``, ``36h``, ``90m`` -> (0, seconds). Raises ValueError."""
    v = str(v).strip()
    units = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}
    if v[-1:] in units:
        seconds = float(v[:-1]) * units[v[-1]]
        if not seconds > 0:
            raise ValueError(v)
        return 0, seconds
    rows = int(v)
    if rows < 1:
        raise ValueError(v)
    return rows, 0.0


def _window_ok(v: str) -> bool:
    try:
        parse_window(v)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class RetrainConfig:
    """Retraining on the rows a model scored (docs/retraining.md; opt_ds_ops.lifecycle.history,
    opt_ds_ops.lifecycle.retrain_data).

    ``window``: the history kept per model, rows (``100000``) or a duration (``7d``, ``36h``: by
    the rows' time column); ``max_history_bytes`` bounds its file. ``exclude_margin``: rows left
    out before and after each flagged segment of a retraining dataset; a segment longer than
    ``exclude_max_rows`` is kept (a change of regime, not an incident; 0: every one left out).
    ``every``: retrain each model this long after its current version was trained (empty: off);
    ``drift_rate``: retrain when the share of rows flagged over the last ``drift_window`` is
    above this multiple of the design rate (0: off); ``regime_learn_s``: retrain a model on the rows
    of a change of regime once this many seconds of them were scored (0: never; the re-baseline
    stays until another version)."""

    window: str = _field("100000", _window_ok, "a number of rows >= 1 or a duration like 7d, 36h, 90m")
    max_history_bytes: int = _field(64 << 20, _positive, "bytes > 0")
    exclude_margin: int = _field(30, _non_negative, "rows >= 0")
    exclude_max_rows: int = _field(1440, _non_negative, "rows >= 0 (0: no limit)")
    every: str = _field("7d", lambda v: v == "" or (_window_ok(v) and parse_window(v)[1] > 0),
                        "empty (off) or a duration like 24h, 7d")
    drift_window: str = _field("1440", _window_ok, "a number of rows >= 1 or a duration like 24h")
    drift_rate: float = _field(10.0, _non_negative, "a multiple of the design rate >= 0 (0: off)")
    regime_learn_s: float = _field(172800.0, lambda v: _non_negative(v) and math.isfinite(v),
                                   "seconds >= 0 (0: a change of regime is not retrained on)")

    @property
    def every_s(self) -> float:
        """``every`` in seconds; 0.0 when it is off."""
        return parse_window(self.every)[1] if self.every else 0.0


@dataclass(frozen=True)
class Config:
    """The whole conffile. ``source`` is the file it came from (for messages), not a key."""

    models_dir: str = _field("/var/models", os.path.isabs, "an absolute path")
    device: str = _field("auto", _device_ok, "auto, cpu, mps, cuda or cuda:N")
    amp: str = _field("auto", lambda v: v in ("auto", "bf16", "fp16", "off"), "one of auto, bf16, fp16, off")
    train: TrainConfig = field(default_factory=TrainConfig)
    spool: SpoolConfig = field(default_factory=SpoolConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    job: JobConfig = field(default_factory=JobConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    # TF32 matmuls for fp32 work (amp off) on a CUDA GPU of compute capability >= 8.0 (see device.py).
    tf32: bool = _field(False, None, "true or false")
    store: StoreConfig = field(default_factory=StoreConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    daemon: DaemonConfig = field(default_factory=DaemonConfig)
    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    retrain: RetrainConfig = field(default_factory=RetrainConfig)
    source: str = field(default="<defaults>", compare=False)


_SECTIONS = {"train": TrainConfig, "spool": SpoolConfig, "health": HealthConfig, "job": JobConfig,
             "dataset": DatasetConfig, "store": StoreConfig, "metrics": MetricsConfig,
             "daemon": DaemonConfig, "scoring": ScoringConfig, "retrain": RetrainConfig}


_SHORT = reprlib.Repr()  # keyword arguments only from Python 3.12
_SHORT.maxlevel, _SHORT.maxtuple, _SHORT.maxlist, _SHORT.maxdict, _SHORT.maxset = 3, 6, 6, 6, 6
_SHORT.maxstring = _SHORT.maxother = 120


def _shown(value: Any) -> str:
    """Return value's repr for a message, bounded: a value may be nested deeply or, through YAML
    aliases, stand for millions of values in a few hundred bytes (a full repr would never end)."""
    text = _SHORT.repr(value)
    return text if len(text) <= 300 else text[:296] + " ..."


def _coerce(value: Any, typ: type, where: str, key: str, allowed: str) -> Any:
    """Return value as typ (an int is accepted where a float is asked), or raise ConfigError."""
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is str and isinstance(value, int) and not isinstance(value, bool):
        return str(value)  # a size given as a plain number of bytes
    if typ is tuple and isinstance(value, (list, tuple)):
        # pairs ([first, last]) become tuples; a longer inner list stays a list for the check to refuse
        # (YAML aliases can make 10,000 references to one list of 10,000: never copy those)
        return tuple(tuple(x) if isinstance(x, list) and len(x) <= 2 else x for x in value)
    if typ in (int, float) and (isinstance(value, bool) or (isinstance(value, float) and not math.isfinite(value))):
        raise ConfigError(f"{where}: key '{key}' must be {allowed}, got {_shown(value)}", tuple(key.split(".")))
    if not isinstance(value, typ):
        raise ConfigError(
            f"{where}: key '{key}' must be {allowed or typ.__name__} ({'list' if typ is tuple else typ.__name__}), "
            f"got {_shown(value)}", tuple(key.split("."))  # known keys: identifiers, no dot of their own
        )
    return value


def _build(cls, raw: Mapping[str, Any], where: str, prefix: str = "", also: tuple[str, ...] = ()):
    """Given a mapping, return an instance of the dataclass cls; raise ConfigError on any bad key
    (an unknown key's error lists cls's keys and ``also``, keys its caller takes out first)."""
    parts = tuple(prefix.rstrip(".").split(".")) if prefix else ()
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: '{prefix.rstrip('.') or 'top level'}' must be a mapping, got {_shown(raw)}", parts)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "source"}
    unknown = _sorted_keys(set(raw) - set(fields))
    if unknown:
        raise ConfigError(
            f"{where}: unknown key '{prefix}{unknown[0]}' (allowed: {', '.join(prefix + k for k in (*fields, *also))})",
            (*parts, unknown[0]))
    values = {}
    hints = {f.name: f.type for f in dataclasses.fields(cls)}
    for name, value in raw.items():
        key = prefix + name
        if name in _SECTIONS and cls is Config:
            values[name] = _build(_SECTIONS[name], value or {}, where, key + ".")
            continue
        meta = fields[name].metadata
        typ = {"int": int, "float": float, "str": str, "bool": bool, "tuple": tuple}[hints[name]]
        value = _coerce(value, typ, where, key, meta.get("allowed", ""))
        check = meta.get("check")
        if check is not None and not check(value):
            raise ConfigError(f"{where}: key '{key}' must be {meta['allowed']}, got {_shown(value)}", (*parts, name))
        values[name] = value
    if cls is TrainConfig and values.get("input_window", 1) != 1 and "input_differences" not in values:
        values["input_differences"] = False  # windowed inputs (a conffile from before round 10) read levels
    if cls is TrainConfig and values.get("input_differences") and values.get("input_window", 1) != 1:
        raise ConfigError(f"{where}: key '{prefix}input_differences' reads each row beside the one before it and needs "
                          f"'{prefix}input_window' 1, got {values['input_window']}; set it false for windowed inputs",
                          (*parts, "input_differences"))
    low, days = (values.get(k, getattr(cls, k, 0.0)) for k in ("alarm_budget_min_days", "alarm_budget_days"))
    if cls is ScoringConfig and low > days:  # each key's default where the file does not set it
        raise ConfigError(f"{where}: key '{prefix}alarm_budget_min_days' ({low:g}) must be at most "
                          f"'{prefix}alarm_budget_days' ({days:g})", (*parts, "alarm_budget_min_days"))
    return cls(**values)


def _sorted_keys(keys) -> list:
    """Return YAML mapping keys sorted, text first: they may be of any type (``1: a`` beside ``foo: b``)."""
    return sorted(keys, key=lambda k: (not isinstance(k, str), type(k).__name__, str(k)))


def _parse_yaml(text: str, where: str, unique_keys: bool = False) -> Any:
    """Return the YAML document in text (read as :mod:`.yamlload` says: ``1e-3`` is a number); raise
    ConfigError for invalid YAML, naming where. Nesting deeper than the parser's recursion (20,000
    ``[``) is invalid too, and so is a tagged scalar that PyYAML's constructors fail on with an error
    of their own (``!!float t``: ValueError, ``!!float ''``: IndexError). With ``unique_keys``, a key
    given twice in one mapping is invalid."""
    try:
        return yaml.load(text, Loader=UniqueKeyLoader if unique_keys else ConfigLoader)  # noqa: S506 - SafeLoader's
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: invalid YAML: {yaml_problem(e)}") from None
    except RecursionError:
        raise ConfigError(f"{where}: invalid YAML: nested too deeply") from None
    except Exception as e:  # noqa: BLE001 - text in, a document or an error out: any other is PyYAML's constructor
        raise ConfigError(f"{where}: invalid YAML: a value cannot be read ({type(e).__name__}: {_shown(str(e))})") from None


def _parse_yaml_bytes(text: bytes, where: str, max_bytes: int, what: str, unique_keys: bool = False) -> Any:
    """Return the YAML document in the bytes of file ``where`` (a ``what``: "sidecar", "source
    file"); ConfigError for more than ``max_bytes``, text that is not UTF-8, or invalid YAML
    (with ``unique_keys``: a key given twice in one mapping too)."""
    if len(text) > max_bytes:
        raise ConfigError(f"{where}: {len(text)} bytes; a {what} may hold at most {max_bytes}")
    try:
        return _parse_yaml(text.decode("utf-8"), where, unique_keys)
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: not UTF-8 text") from None


def _build_guarded(cls, raw: Any, where: str, text: str = "", also: tuple[str, ...] = ()):
    """:func:`_build`; a value nested too deeply is a ConfigError, a key's names its line in ``text``."""
    try:
        return _build(cls, raw, where, also=also)
    except RecursionError:
        raise ConfigError(f"{where}: a value is nested too deeply") from None
    except ConfigError as e:
        raise ConfigError(str(e).replace(f"{where}: ", f"{where}: {key_position(text, e.key)}", 1), e.key) from None


def load_config(path: str | None = DEFAULT_CONFIG_PATH, *, missing_ok: bool = False) -> Config:
    """Given the path of a YAML conffile, return the validated :class:`Config`.

    An empty file means all defaults. With ``missing_ok``, a missing file also means all defaults
    (the command line uses this for the default path on a machine without the package).

    Raises ConfigError naming the file and key for: unreadable file, text that is not UTF-8,
    invalid YAML (nested too deeply too), unknown key (of any type),
    wrong type or out-of-range value.
    """
    if path is None:
        return Config()
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8")
    except FileNotFoundError:
        if missing_ok:
            return Config()
        raise ConfigError(f"{path}: configuration file not found") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read configuration: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    cfg = _build_guarded(Config, _parse_yaml(text, path) or {}, path, text)
    if cfg.dataset.incidents:  # one file's rows: in the conffile they would label every file dropped
        raise ConfigError(f"{path}: key 'dataset.incidents' labels the rows of one file: give it in that file's "
                          "sidecar, not here", ("dataset", "incidents"))
    return dataclasses.replace(cfg, source=path)


def with_overrides(cfg: Config, overrides: Mapping[str, Any]) -> Config:
    """Return cfg with dotted keys replaced (``{"train.epochs": 3, "models_dir": "/x"}``).

    None values are ignored (an option not given on the command line). Raises ConfigError, naming
    the command line as the source, for an unknown key or a value that fails validation.
    """
    raw = config_to_dict(cfg)
    for dotted, value in overrides.items():
        if value is None:
            continue
        node = raw
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    where = "command line" if cfg.source == "<defaults>" else f"command line (over {cfg.source})"
    return dataclasses.replace(_build(Config, raw, where), source=cfg.source)


def config_to_dict(cfg: Config) -> dict:
    """Return the configuration as plain nested dicts (for metadata.json and ``--json``)."""
    d = dataclasses.asdict(cfg)
    d.pop("source", None)
    return d
