"""The TelemetryAutoencoder, exactly as the seed lab script defines it, and its anomaly score."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from .scaling import fit_scaler


class TelemetryAutoencoder(nn.Module):
    """Dense autoencoder D -> hidden -> latent -> hidden -> D (seed: 32 -> 24 -> 8 -> 24 -> 32).

    With windowed inputs (``input_window`` w > 1, :func:`window_rows`) ``n_features`` is D * w:
    the same network, reconstructing the window of w rows.

    Encoder: Linear(D, hidden), BatchNorm1d(hidden), LeakyReLU(0.2), Linear(hidden, latent),
    LeakyReLU(0.2). Decoder: Linear(latent, hidden), BatchNorm1d(hidden), LeakyReLU(0.2),
    Linear(hidden, D). Trained with MSELoss on standardised rows.

    Input and output: float tensors of shape (batch, D); in training mode batch must be >= 2
    (BatchNorm1d raises ValueError on a single row).
    """

    def __init__(self, n_features: int = 32, hidden: int = 24, latent: int = 8):
        super().__init__()
        self.n_features, self.hidden, self.latent = n_features, hidden, latent
        self.encoder = nn.Sequential(
            nn.Linear(n_features, hidden),
            nn.BatchNorm1d(hidden),
            nn.LeakyReLU(0.2),
            nn.Linear(hidden, latent),
            nn.LeakyReLU(0.2),
        )
        self.decoder = nn.Sequential(
            nn.Linear(latent, hidden),
            nn.BatchNorm1d(hidden),
            nn.LeakyReLU(0.2),
            nn.Linear(hidden, n_features),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Reconstruct x: (batch, D) -> (batch, D), same dtype (or the autocast dtype)."""
        return self.decoder(self.encoder(x))

    def model_args(self) -> dict:
        """The constructor arguments, stored beside the state_dict so a model loads alone."""
        return {"n_features": self.n_features, "hidden": self.hidden, "latent": self.latent}


# Every forward pass of scoring runs on exactly :func:`score_block_rows` rows for a given width, the
# last block padded with zeros: a matrix product's last bit may depend on how many rows it
# multiplies (a one-row product takes BLAS's gemv path; with the weights of the default learning
# rate 1e-2, 2 rows and 6,000 rows differed too, measured with a 152-wide windowed input), and a row's
# error must not depend on how many rows are scored with it (appending rows never changes earlier
# scores). Rows are independent in eval mode (BatchNorm uses its running statistics), so the
# padding changes nothing else. The block holds at most SCORE_BLOCK_CELLS cells (4 MiB of float32),
# so a small call stays cheap (1,024 rows of 38 metrics) and a wide model's block stays small.
SCORE_BLOCK_CELLS = 1 << 20


def score_block_rows(width: int) -> int:
    """Return the rows of every scoring forward pass for inputs of ``width`` columns: a power of two,
    16..1024, with at most SCORE_BLOCK_CELLS cells (wider inputs: 16 rows)."""
    rows = 1024
    while rows > 16 and rows * width > SCORE_BLOCK_CELLS:
        rows //= 2
    return rows


@torch.no_grad()
def feature_errors(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Return the squared reconstruction error per cell, (rows, D) float32 on x's device.

    x: standardised rows, (rows, D) float32. The model is put in eval mode (BatchNorm uses its
    running statistics) and run in fp32 so a threshold does not depend on the AMP dtype, on
    blocks of exactly :func:`score_block_rows` rows (the block size depends only on D, so that a
    row's error is the same however many rows come with it; callers bound their memory by the
    rows they pass).
    """
    model.eval()
    out = torch.empty_like(x, dtype=torch.float32)
    block = score_block_rows(x.shape[1])
    for start in range(0, x.shape[0], block):
        xb = x[start : start + block].float()
        n = xb.shape[0]
        if n < block:
            pad = torch.zeros((block, x.shape[1]), dtype=torch.float32, device=x.device)
            pad[:n] = xb
            out[start : start + n] = (model(pad).float()[:n] - xb).pow_(2)
            continue
        out[start : start + n] = (model(xb).float() - xb).pow_(2)
    return out


def row_errors(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Return the per-row reconstruction error (MSE over the D features), (rows,) float32."""
    return feature_errors(model, x).mean(dim=1)


WINDOW_ERRORS = ("last", "window", "max")


def window_rows(x: torch.Tensor, window: int, context: torch.Tensor | None = None) -> torch.Tensor:
    """Return causal windows of rows: (rows, D) -> (rows, D * window), same dtype and device.

    Row t of the result is rows t-window+1 .. t of x concatenated, oldest first, so its last D
    columns are row t itself. Before the first row there is no history: a window reaching back
    past row 0 repeats row 0 (rows -3, -2, -1 are row 0), so every row, the first included, is
    scored and the first window-1 rows see a flat past. ``context``: (k, D), the rows just before
    x (the end of the previous batch of the same stream, k <= window - 1 used); with it, a stream
    windowed in batches equals the whole stream windowed at once. ``window`` 1 returns x itself.
    Causal: row t depends on rows <= t only.
    """
    if window <= 1:
        return x
    k = 0
    if context is not None and context.shape[0]:
        context = context[-(window - 1):]
        k = context.shape[0]
        x = torch.cat([context.to(x.dtype), x])
    n, d = x.shape
    idx = torch.arange(n, device=x.device)[:, None] + torch.arange(1 - window, 1, device=x.device)[None, :]
    idx.clamp_min_(0)
    return x[idx[k:]].reshape(n - k, d * window)


def with_differences(xw: torch.Tensor, diff_mean: torch.Tensor, diff_std: torch.Tensor, clip: float = 0.0) -> torch.Tensor:
    """Return the inputs of a model that reads each metric's change beside its level: from windows
    of two rows ``[z_(t-1), z_t]`` (rows, 2D) of standardised, clipped levels (:func:`window_rows`)
    to ``[d_t, z_t]`` (rows, 2D), where ``d_t = ((z_t - z_(t-1)) - diff_mean) / diff_std`` is the
    first difference standardised like the levels (its training rows' mean and std, (D,) each) and
    clipped to +-clip (0: not clipped). Row 0 without context has no previous row: its difference
    is that of a repeated row (0 before standardising). The level's columns come last, so the
    model's last D outputs are the levels' reconstruction, as for every window."""
    d = xw.shape[1] // 2
    prev, cur = xw[:, :d], xw[:, d:]
    change = (cur - prev).sub_(diff_mean.to(xw.dtype)).div_(diff_std.to(xw.dtype))
    if clip > 0:
        change.clamp_(-clip, clip)
    return torch.cat([change, cur], dim=1)


def model_inputs(x: torch.Tensor, window: int, context: torch.Tensor | None = None, diff=None,
                 clip: float = 0.0) -> torch.Tensor:
    """Return what the model reads for standardised, clipped rows x (rows, D): causal windows of
    ``window`` rows (:func:`window_rows`, ``context`` the rows before x), and for a model that reads
    differences (``diff``: its ``(diff_mean, diff_std)``, window 2) each metric's change beside its
    level (:func:`with_differences`). Without ``diff``, :func:`window_rows` itself."""
    xw = window_rows(x, window, context=context)
    if diff is None:
        return xw
    return with_differences(xw, diff[0], diff[1], clip)


def difference_scaler(x: torch.Tensor, clip: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Return (mean, std), (D,) float64 each, of the first differences ``z_t - z_(t-1)`` of
    standardised, clipped training rows x (rows, D): the scaler of a model's difference inputs
    (:func:`with_differences`). A std of 0 (a constant column) becomes 1; fewer than 2 rows give
    (0, 1)."""
    d = x.shape[1]
    if x.shape[0] < 2:
        return np.zeros(d), np.ones(d)
    return fit_scaler((x[1:].double() - x[:-1].double()).cpu().numpy())  # a std of 0 becomes 1 there too


def fold_window(cells: torch.Tensor, window: int, how: str) -> torch.Tensor:
    """Return per-row, per-feature terms (rows, D) from a window's terms (rows, D * window).

    ``how``: ``"last"``: the window's last row (row t's own cells); ``"window"``: the mean over the
    window's rows of each feature's term; ``"max"``: the largest of them (for a model reading
    differences, the larger of a metric's change term and level term, so a level that stays moved
    keeps its full weight). Window 1 returns cells. Raises ValueError for another how.
    """
    if how not in WINDOW_ERRORS:
        raise ValueError(f"unknown window error {how!r} (one of {', '.join(WINDOW_ERRORS)})")
    if window <= 1:
        return cells
    folded = cells.reshape(cells.shape[0], window, cells.shape[1] // window)
    if how == "last":
        return folded[:, -1]
    return folded.amax(dim=1) if how == "max" else folded.mean(dim=1)


def anomaly_scores(cell_errors: torch.Tensor, error_scale: torch.Tensor, window: int = 1,
                   how: str = "last") -> torch.Tensor:
    """Return per-row anomaly scores (rows,) from squared cell errors (rows, D * window) and
    their (D * window,) scale.

    Each cell's squared error is divided by its mean squared error on the validation split, so a
    metric the model always reconstructs poorly does not drown the others; the windowed terms are
    folded to (rows, D) by :func:`fold_window` (``window``, ``how``); the row score is the mean.
    """
    return fold_window(cell_errors / error_scale, window, how).mean(dim=1)


def smooth_scores(scores: torch.Tensor, window: int) -> torch.Tensor:
    """Return the trailing mean of scores (rows,) over the last ``window`` rows (fewer at the start).

    Causal: row i depends on rows i-window+1 .. i only, so a live stream can be scored the same
    way. Anomalies in telemetry last minutes, not one sample; on the ten SMD machines a 15-row
    window raised the mean ROC-AUC from 0.779 to 0.850 (scripts/eval_smd.py).
    """
    if window <= 1:
        return scores
    c = torch.cat([scores.new_zeros(1, dtype=torch.float64), torch.cumsum(scores.double(), 0)])
    i = torch.arange(scores.shape[0], device=scores.device)
    lo = (i - window + 1).clamp_min(0)
    return ((c[i + 1] - c[lo]) / (i + 1 - lo)).to(scores.dtype)


SMOOTHINGS = ("ema", "mean")


def ema_scores(scores: np.ndarray, window: int) -> np.ndarray:
    """Return the exponential moving average of scores along rows: same shape, float64.

    scores: (rows,) or (rows, D), any real dtype. ``alpha = 2 / (window + 1)`` (the "span"
    convention); row t is the weighted mean of rows 0..t with weights ``(1 - alpha) ** (t - k)``,
    as pandas' ``ewm(span=window, adjust=True).mean()`` computes it: the first rows are a plain
    mean of what there is (no start-up transient from weighting row 0 by 1), later rows the usual
    ``alpha * x[t] + (1 - alpha) * s[t-1]``. Causal: row t depends on rows <= t only, and
    appending rows never changes earlier rows' values. A window <= 1 returns the scores unchanged.
    One Python step per row (a (D,) vector operation each): about 1 s per million rows here.
    """
    x = np.asarray(scores, dtype=np.float64)
    if window <= 1 or x.shape[0] == 0:
        return x.copy()
    keep = 1.0 - 2.0 / (window + 1)
    out = np.empty_like(x)
    if x.ndim == 1:
        num = den = 0.0
        for i, v in enumerate(x.tolist()):
            num = v + keep * num
            den = 1.0 + keep * den
            out[i] = num / den
        return out
    num, den = np.zeros_like(x[0]), 0.0
    for i in range(x.shape[0]):
        num *= keep
        num += x[i]
        den = 1.0 + keep * den
        out[i] = num / den
    return out


def smooth(scores: np.ndarray, window: int, how: str) -> np.ndarray:
    """Return scores (rows,) or (rows, D) smoothed causally over ``window`` rows, float64.

    ``how``: ``"ema"`` (:func:`ema_scores`, ds-ops's default) or ``"mean"`` (the trailing mean of
    :func:`smooth_scores`, the score of models saved before ds-ops stored ``score_smoothing``).
    Raises ValueError for another ``how``.
    """
    if how == "ema":
        return ema_scores(scores, window)
    if how == "mean":
        t = torch.from_numpy(np.asarray(scores, dtype=np.float64))
        if t.ndim == 1:
            return smooth_scores(t, window).numpy()
        return np.stack([smooth_scores(t[:, j], window).numpy() for j in range(t.shape[1])], axis=1)
    raise ValueError(f"unknown score smoothing {how!r} (one of {', '.join(SMOOTHINGS)})")
