"""Is a trained model suspect? The validation split against the training split (docs/detection.md).

A model is published whatever its validation loss; these checks say when it should not be
trusted without a look, in metadata.json's ``warnings``, the journal and report.png:

* the final model's validation loss over its training loss (both eval-mode mean squared errors
  of standardised cells) above ``train.suspect_loss_ratio``: the recent stretch the threshold is
  set on is not what the model learned;
* columns whose validation mean lies more than ``train.suspect_shift_sd`` training standard
  deviations from the training mean: a step change in the last ``val_fraction`` of the file
  (the error scale then mutes that column). Named, the largest shifts first, at most
  :data:`MAX_NAMED`, each header name cut to :data:`MAX_NAME_CHARS` characters and each warning
  to :data:`MAX_WARNING_CHARS`.
"""

from __future__ import annotations

import numpy as np

from ..model.scaling import fit_scaler

MAX_NAMED = 8  # columns a shift warning names, at most
MAX_NAME_CHARS = 80  # a header name in a warning is cut to this (a header is the user's bytes)
MAX_WARNING_CHARS = 1200  # one warning (journal line, metadata.json, report.png) is cut to this


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def column_shift_sd(train_mean: np.ndarray, train_std: np.ndarray, val_rows: np.ndarray) -> np.ndarray:
    """Return |validation mean - training mean| / training std per column, (D,) float64.

    val_rows: (n >= 1, D), any real dtype (a memmap is read in place, in float64 blocks); the
    training std is :func:`opt_ds_ops.model.scaling.fit_scaler`'s (a constant column's is 1)."""
    val_mean, _ = fit_scaler(val_rows)
    return np.abs(val_mean - np.asarray(train_mean, dtype=np.float64)) / np.asarray(train_std, dtype=np.float64)


def column_name(c: int, header: list[str] | None, feature_columns: list[int] | None) -> str:
    """Return how a warning names feature c (0-based): ``column 5 ('cpu')``, with the file's
    1-based column number (the feature's position in the file when columns were left out)."""
    number = (feature_columns[c] + 1) if feature_columns is not None else c + 1
    name = header[c] if header is not None and c < len(header) else None
    return f"column {number}" + (f" ({_clip(name, MAX_NAME_CHARS)!r})" if name else "")


def split_warnings(check: dict, loss_ratio: float, shift_sd: float, header: list[str] | None = None,
                   feature_columns: list[int] | None = None) -> list[str]:
    """Given :func:`opt_ds_ops.training.fit.split_check`'s figures, return the warnings (empty: none).

    ``loss_ratio``: the bound on validation / training loss; ``shift_sd``: on a column's shift."""
    if not check:
        return []
    out = []
    train_loss, val_loss = check["train_loss"], check["val_loss"]
    if train_loss > 0 and val_loss / train_loss > loss_ratio:
        out.append(f"validation loss {val_loss:.4g} is {val_loss / train_loss:.1f}x the training loss "
                   f"{train_loss:.4g} (bound {loss_ratio:g}): the validation split does not look like the training split")
    shifts = np.asarray(check["shift_sd"], dtype=np.float64)
    moved = [int(c) for c in np.argsort(-shifts, kind="stable") if shifts[c] > shift_sd]
    if moved:
        named = ", ".join(f"{column_name(c, header, feature_columns)} {shifts[c]:.1f} sd" for c in moved[:MAX_NAMED])
        more = f" and {len(moved) - MAX_NAMED} more" if len(moved) > MAX_NAMED else ""
        out.append(f"{len(moved)} column(s) moved more than {shift_sd:g} training standard deviations in the "
                   f"validation split: {named}{more}")
    return [_clip(w, MAX_WARNING_CHARS) for w in out]
