"""Progress bars: ``ds-ops train`` and ``ds-ops evaluate`` draw one on a terminal (a real pty as
stderr) and never in a pipe."""

from __future__ import annotations

import fcntl
import gzip
import os
import struct
import subprocess
import sys
import termios

from conftest import REPO, SMD_LABELS, SMD_TEST, SMD_TRAIN
from daemon_kit import base_env


def run_with_stderr(argv: list[str], tty: bool) -> str:
    """Run ds-ops with stderr on a new pty (tty) or a pipe; return what stderr got."""
    cmd = [sys.executable, "-m", "opt_ds_ops.cli", *argv]
    if not tty:
        return subprocess.run(cmd, cwd=REPO, env=base_env(), capture_output=True, text=True, timeout=300).stderr
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a new pty is 0 columns wide
    p = subprocess.Popen(cmd, cwd=REPO, env=base_env(), stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the pty
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert p.wait(300) == 0
    return b"".join(chunks).decode(errors="replace")


def first_rows(src, dst, n: int = 3000):
    """The first n lines of a bundled gzipped SMD file, as a plain text file."""
    with gzip.open(src, "rt") as f:
        dst.write_text("".join(line for _, line in zip(range(n), f)))
    return dst


def test_evaluate_and_train_show_a_progress_bar_on_a_terminal_only(tmp_path):
    # the first 3,000 rows of the bundled machine: what is drawn does not depend on the length
    train, test, labels = (first_rows(src, tmp_path / name) for src, name in
                           ((SMD_TRAIN, "train.txt"), (SMD_TEST, "test.txt"), (SMD_LABELS, "labels.txt")))
    ev = ["evaluate", "--train", str(train), "--test", str(test), "--labels", str(labels), "--epochs", "1"]
    on_tty = run_with_stderr(ev, tty=True)
    assert "evaluating: 100%" in on_tty and "1/1" in on_tty, on_tty
    assert "evaluating" not in run_with_stderr(ev, tty=False)
    tr = ["train", str(train), "--models-dir", str(tmp_path / "m"), "--epochs", "2"]
    assert "training: 100%" in run_with_stderr(tr, tty=True)
    assert "training:" not in run_with_stderr(tr, tty=False)
