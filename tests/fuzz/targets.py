"""Fuzz targets: each reader entry point of ds-ops as a function of one input's bytes.

Shared by the coverage-guided fuzzer (``scripts/fuzz.py``, atheris) and the regression test
(``tests/fuzz/test_regressions.py``), so a committed input runs through exactly the code the
fuzzer ran. A target returns normally when the input was read or refused with the reader's own
error (DatasetError for datasets, ConfigError for sidecars and the conffile); anything else it
raises (TypeError, RecursionError, a broken promise of :func:`load_dataset`, ...) is a finding.

| target | entry point | input written as |
|---|---|---|
| csv, csv_gz | :func:`opt_ds_ops.dataset.load_dataset` (text reader) | ``fuzz.csv``, ``fuzz.csv.gz`` |
| npy, npz, pt | the same (array readers) | ``fuzz.npy``, ``fuzz.npz``, ``fuzz.pt`` |
| parquet, arrow | the same (pyarrow readers; ``.arrow``: IPC file, stream or Feather v2) | ``fuzz.parquet``, ``fuzz.arrow`` |
| sidecar | :func:`opt_ds_ops.config.sidecar.parse_sidecar`, then its options on a small CSV with a header | bytes in memory |
| config | :func:`opt_ds_ops.config.conffile.load_config` | ``trainer.yaml`` |

Datasets are read under :data:`LIMITS`: small budgets (1 MiB decompressed, 64 columns, a 4 KiB
matrix: 1,024 values, the largest seed holds 456) so that every limit and what a training job does
with a dataset over its matrix budget (a ``.npy`` streamed, other formats spilled to a ``.npy``)
are within reach of a few KB of input; the spill goes to the per-process temporary directory,
emptied before each input.

Run as a script (``python tests/fuzz/targets.py TARGET FILE...``), it runs each file named and
prints ``start FILE`` and then ``ok FILE: what came of it`` or ``FAILED FILE`` with the traceback; exit 1 if any
failed. Each input has :data:`TIMEOUT_S` seconds: a hang prints ``Timeout`` and the stacks and
exits 1 (faulthandler), a crash kills the process; the caller sees the last ``start`` line.
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import shutil
import sys
import tempfile
import traceback

import numpy as np

from opt_ds_ops.config.conffile import ConfigError, DatasetConfig, load_config
from opt_ds_ops.config.sidecar import parse_sidecar
from opt_ds_ops.dataset import DatasetError, DatasetLimits, load_dataset

TIMEOUT_S = 10  # the most one input may take before it counts as a hang

_WORK = tempfile.mkdtemp(prefix="ds-ops-fuzz-")
_SPILL = os.path.join(_WORK, "spill")
atexit.register(shutil.rmtree, _WORK, True)
LIMITS = DatasetLimits(max_decompressed_bytes=1 << 20, max_columns=64, max_matrix_bytes=4096,
                       stream_large_npy=True, spill_dir=_SPILL)

# The table a sidecar's options are tried on: a time column, two numeric columns and a text one.
SIDECAR_TABLE = (b"timestamp,host,cpu,load\n2024-05-18T12:00:00Z,gpu1,0.93,1.5\n"
                 b"2024-05-18T12:00:01Z,gpu1,0.91,1.4\n2024-05-18T12:00:02Z,gpu1,0.95,1.6\n")


def _write(name: str, data: bytes) -> str:
    """Write data to a fresh file ``name`` in this process's work directory; return its path."""
    shutil.rmtree(_SPILL, ignore_errors=True)
    os.makedirs(_SPILL)
    path = os.path.join(_WORK, name)
    with open(path, "wb") as f:
        f.write(data)
    return path


def _check_dataset(ds) -> None:
    """Assert what :func:`load_dataset` promises of a dataset it returns: 2-D float32, >= 2 rows,
    >= 1 column, finite (an array in memory is checked whole; a streamed one by its first rows)."""
    rows, cols = ds.data.shape
    assert rows >= 2 and cols >= 1, f"load_dataset returned shape {ds.data.shape}"
    head = np.asarray(ds.data[:2] if hasattr(ds.data, "select") else ds.data)
    assert head.dtype == np.float32, f"load_dataset returned dtype {head.dtype}"
    assert np.isfinite(head).all(), "load_dataset returned a non-finite value"
    if ds.offset is not None:
        assert ds.offset.shape == (cols,) and np.isfinite(ds.offset).all(), f"bad offset {ds.offset!r}"


def _dataset_target(name: str):
    def target(data: bytes) -> str:
        path = _write(name, data)
        try:
            ds = load_dataset(path, LIMITS, DatasetConfig())
        except DatasetError as e:
            return f"refused: {e}"
        _check_dataset(ds)
        return f"read {ds.rows} x {ds.features}"

    target.__name__ = f"load_{name.replace('.', '_')}"
    target.__doc__ = f"Read the input as a dataset file {name} (load_dataset, LIMITS)."
    return target


def sidecar(data: bytes) -> str:
    """Parse the input as a sidecar; apply the options it gives to :data:`SIDECAR_TABLE`."""
    try:
        options, name = parse_sidecar(data, "fuzz.yaml", DatasetConfig())
    except ConfigError as e:
        return f"refused: {e}"
    try:
        ds = load_dataset(_write("table.csv", SIDECAR_TABLE), LIMITS, options)
    except DatasetError as e:
        return f"parsed (name {name!r}); the table refused: {e}"
    _check_dataset(ds)
    return f"parsed (name {name!r}); the table read as {ds.rows} x {ds.features}"


def config(data: bytes) -> str:
    """Load the input as the conffile (``trainer.yaml``)."""
    try:
        load_config(_write("trainer.yaml", data))
    except ConfigError as e:
        return f"refused: {e}"
    return "loaded"


TARGETS = {
    "csv": _dataset_target("fuzz.csv"),
    "csv_gz": _dataset_target("fuzz.csv.gz"),
    "npy": _dataset_target("fuzz.npy"),
    "npz": _dataset_target("fuzz.npz"),
    "pt": _dataset_target("fuzz.pt"),
    "parquet": _dataset_target("fuzz.parquet"),
    "arrow": _dataset_target("fuzz.arrow"),
    "sidecar": sidecar,
    "config": config,
}


def run_files(target: str, paths: list[str]) -> int:
    """Run TARGETS[target] on each file; print one line each; return how many failed."""
    fn, failed = TARGETS[target], 0
    for path in paths:
        with open(path, "rb") as f:
            data = f.read()
        print(f"start {path}", flush=True)
        faulthandler.dump_traceback_later(TIMEOUT_S, exit=True)
        try:
            outcome = fn(data)
        except BaseException:  # noqa: BLE001 - any exception that got out of the target is the finding
            failed += 1
            print(f"FAILED {path}\n{traceback.format_exc()}", flush=True)
        else:
            print(f"ok {path}: {outcome[:300]}", flush=True)
        finally:
            faulthandler.cancel_dump_traceback_later()
    return failed


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in TARGETS:
        print(f"usage: targets.py TARGET FILE... (TARGET: {', '.join(TARGETS)})", file=sys.stderr)
        return 2
    return 1 if run_files(argv[0], argv[1:]) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
