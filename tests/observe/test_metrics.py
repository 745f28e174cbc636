"""metrics.py: what the daemon reads back of its own ds_ops.prom at a restart (the last results),
and that a file another user put in the textfile directory is never parsed (the hostile review of
the first-hour branch: a crafted 1 MB file kept prometheus_client's parser busy 12 s at start-up)."""

from __future__ import annotations

import os

from opt_ds_ops.observe.metrics import LAST_RESULTS, TEXTFILE, MetricsWriter

OTHER_UID = 12345


def _own_file(tmp_path) -> MetricsWriter:
    w = MetricsWriter(str(tmp_path), str(tmp_path / "models"))
    w.last_success, w.last_failure, w.last_job_s = 1.7e9, 1.6e9, 12.5
    w.write()
    return w


def test_a_restart_restores_the_last_results_from_its_own_file(tmp_path):
    _own_file(tmp_path)
    w = MetricsWriter(str(tmp_path), str(tmp_path / "models"))
    assert (w.last_success, w.last_failure, w.last_job_s) == (1.7e9, 1.6e9, 12.5)
    assert w.last_training_s is None  # never written: not made up


def test_a_file_of_another_uid_or_a_link_restores_nothing(tmp_path):
    _own_file(tmp_path)
    path = tmp_path / TEXTFILE
    os.chown(path, OTHER_UID, OTHER_UID)
    assert MetricsWriter(str(tmp_path), str(tmp_path / "models")).last_success is None
    os.chown(path, os.geteuid(), os.getegid())
    os.rename(path, tmp_path / "elsewhere.prom")
    os.symlink(tmp_path / "elsewhere.prom", path)
    assert MetricsWriter(str(tmp_path), str(tmp_path / "models")).last_success is None


def test_only_unlabelled_finite_last_lines_are_taken(tmp_path):
    name = next(iter(LAST_RESULTS))
    labels = ",".join(f'l{i}="{"x" * 20}"' for i in range(2000))  # what made the parser quadratic
    (tmp_path / TEXTFILE).write_text(f"{name}{{{labels}}} 5\n{name} nan\n{name} oops\n"
                                     "ds_ops_last_job_duration_seconds 3.5\n")
    w = MetricsWriter(str(tmp_path), str(tmp_path / "models"))
    assert w.last_success is None and w.last_job_s == 3.5


def _gauge(text: str, name: str) -> float:
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def test_progress_is_the_nearer_cap_steps_under_the_plateau_rule(tmp_path):
    """Under the plateau rule a job stops at max_steps long before its epochs cap: the ratio follows the steps."""
    w = MetricsWriter(str(tmp_path), str(tmp_path / "models"))
    w.jobs = [{"epoch": 12, "epochs": 1000, "steps": 132, "max_steps": 500}]
    w.write()
    assert _gauge((tmp_path / TEXTFILE).read_text(), "ds_ops_job_progress_ratio") == 132 / 500
    w.jobs = [{"epoch": 3, "epochs": 5}]  # stopping: epochs (no max_steps)
    w.write()
    assert _gauge((tmp_path / TEXTFILE).read_text(), "ds_ops_job_progress_ratio") == 3 / 5
