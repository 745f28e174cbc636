#!/usr/bin/env python3
"""Kept for old habits: the evaluation is now ``ds-ops evaluate`` (opt_ds_ops/scoring/evaluate.py).

Usage: scripts/eval_smd.py [DIR] [ds-ops evaluate options]; DIR defaults to ../shared/data/smd
beside the checkout when it exists, else the bundled data/smd.
"""

from __future__ import annotations

import os
import sys

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, REPO)

from opt_ds_ops.cli import main  # noqa: E402


def default_smd_dir() -> str:
    shared = os.path.join(REPO, "..", "shared", "data", "smd")
    return shared if os.path.isdir(os.path.join(shared, "train")) else os.path.join(REPO, "data", "smd")


if __name__ == "__main__":
    args = sys.argv[1:]
    if not args or args[0].startswith("-"):
        args = [default_smd_dir()] + args
    sys.exit(main(["evaluate"] + args))
