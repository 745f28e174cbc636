"""Standardisation of telemetry rows: per-column float64 statistics, the scaled float32 copy, clipping.

Shared by every trainer (:mod:`opt_ds_ops.training.fit` in memory, :mod:`opt_ds_ops.training.stream` streamed,
:mod:`opt_ds_ops.training.distributed` across ranks) and by :mod:`opt_ds_ops.training.suspect`. Statistics are
computed in float64 block by block (``BLOCK_BYTES``) and only the result is float32: a column of
1e8 + N(0, 1) keeps its signal, and a memory-mapped dataset is read in place.
"""

from __future__ import annotations

import numpy as np
import torch

BLOCK_BYTES = 8 * 1024**2  # float64 temporaries of fit_scaler and standardise (bytes)


def float64_blocks(rows: np.ndarray):
    """Yield (start row, a float64 copy of the block) over rows (N, D), blocks of about BLOCK_BYTES."""
    step = max(1, BLOCK_BYTES // (8 * max(rows.shape[1], 1)))
    for start in range(0, rows.shape[0], step):
        yield start, np.array(rows[start : start + step], dtype=np.float64)  # a copy: callers modify it


def fit_scaler(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Return per-column (mean, std) of rows (N >= 1, D), any real dtype, as float64 (D,).

    Two passes over float64 blocks (the mean, then the squared deviations from it): no temporary
    the size of rows, and a memmap is read in place. A std of 0 (a constant column) becomes 1, so
    the column passes through centred, not divided by 0.
    """
    total = np.zeros(rows.shape[1], dtype=np.float64)
    for _, block in float64_blocks(rows):
        total += block.sum(axis=0)
    mean = total / rows.shape[0]
    squares = np.zeros_like(mean)
    for _, block in float64_blocks(rows):
        block -= mean
        squares += np.einsum("ij,ij->j", block, block)
    std = np.sqrt(squares / rows.shape[0])
    std[std == 0] = 1.0
    return mean, std


def standardise(rows: np.ndarray, mean: np.ndarray, std: np.ndarray) -> torch.Tensor:
    """Return (rows - mean) / std as a new (N, D) float32 CPU tensor (the one copy of rows).

    rows: (N, D) any real dtype (a memmap is read in place); mean, std: (D,). Computed in float64
    block by block, then cast.
    """
    mean, std = np.asarray(mean, dtype=np.float64), np.asarray(std, dtype=np.float64)
    out = np.empty(rows.shape, dtype=np.float32)
    for start, block in float64_blocks(rows):
        block -= mean
        block /= std
        out[start : start + len(block)] = block
    return torch.from_numpy(out)


def clip_inputs(x: torch.Tensor, clip: float) -> torch.Tensor:
    """Return standardised rows x (N, D) clipped in place to [-clip, clip] (clip 0: unchanged).

    Robust clipping: one value of 1e6 standard deviations neither dominates a training batch nor a
    row's score. ds-ops's default 20 was chosen on five SMD machines (README, detection quality).
    """
    return x.clamp_(-clip, clip) if clip > 0 else x
