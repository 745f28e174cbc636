"""report.png of each model version: drawn by the job, valid PNG, redrawn by ``ds-ops report``,
and a failure to draw it is a warning, never a failed job."""

from __future__ import annotations

import json
import os
import struct
import zlib

from conftest import run_cli

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(path) -> tuple[int, int]:
    """Read a PNG back: check the signature and every chunk's CRC; return (width, height)."""
    data = open(path, "rb").read()
    assert data[:8] == PNG_MAGIC, "not a PNG"
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, f"bad CRC in chunk {kind!r}"
        chunks.append(kind)
        pos += 12 + length
    assert chunks[0] == b"IHDR" and chunks[-1] == b"IEND" and b"IDAT" in chunks
    return struct.unpack(">II", data[16:24])


def test_train_writes_report_png_and_ds_ops_report_redraws_it(tmp_path, small_smd_csv):
    models = tmp_path / "models"
    p = run_cli("train", str(small_smd_csv), "--models-dir", str(models), "--epochs", "2", "--json")
    assert p.returncode == 0, p.stderr
    assert "warning" not in p.stderr
    model_dir = json.loads(p.stdout)["model_dir"]
    report = os.path.join(model_dir, "report.png")
    width, height = png_size(report)
    assert (width, height) == (1440, 414)
    md = json.load(open(os.path.join(model_dir, "metadata.json")))
    vs = md["validation_scores"]
    assert vs["rows"] == 300 and sum(vs["counts"]) == 300 and len(vs["edges"]) == 61
    out = tmp_path / "again.png"
    p = run_cli("report", str(models / "machine-small"), "-o", str(out))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == str(out) and png_size(out) == (1440, 414)
    p = run_cli("report", "machine-small", "--config", str(_conf(tmp_path, models)))
    assert p.returncode == 0 and p.stdout.strip() == os.path.realpath(report)
    p = run_cli("report", str(tmp_path))
    assert p.returncode == 1 and p.stderr.strip() == f"ds-ops: error: {tmp_path}: not a model directory (metadata.json missing)"


def _conf(tmp_path, models):
    conf = tmp_path / "trainer.yaml"
    conf.write_text(f"models_dir: {models}\n")
    return conf


def test_a_report_that_cannot_be_drawn_is_a_warning_and_the_model_is_saved(tmp_path, small_smd_csv):
    models = tmp_path / "models"
    # MPLBACKEND names a backend that does not exist: matplotlib fails at import in the job
    p = run_cli("train", str(small_smd_csv), "--models-dir", str(models), "--epochs", "1", "--json",
                env={"MPLBACKEND": "no-such-backend"})
    assert p.returncode == 0, p.stderr
    model_dir = json.loads(p.stdout)["model_dir"]
    assert os.path.isfile(os.path.join(model_dir, "model.pt"))
    assert not os.path.exists(os.path.join(model_dir, "report.png"))
    assert p.stderr.startswith("ds-ops: warning: ") and "Traceback" not in p.stderr


def test_score_plot_draws_the_score_with_threshold_and_labels(tmp_path, small_smd_csv):
    from conftest import SMD_LABELS, SMD_TEST

    models = tmp_path / "models"
    p = run_cli("train", str(small_smd_csv), "--models-dir", str(models), "--epochs", "1", "--json")
    assert p.returncode == 0, p.stderr
    out = tmp_path / "score.png"
    p = run_cli("score", json.loads(p.stdout)["model_dir"], str(SMD_TEST), "--labels", str(SMD_LABELS),
                "--plot", str(out))
    assert p.returncode == 3, p.stderr  # rows flagged
    assert f"plot: {out}" in p.stdout and png_size(out) == (1260, 324)
    p = run_cli("score", str(models / "machine-small"), str(SMD_TEST), "--plot", str(tmp_path / "no" / "x.png"))
    assert p.returncode == 1 and "cannot write plot" in p.stderr and "Traceback" not in p.stderr
