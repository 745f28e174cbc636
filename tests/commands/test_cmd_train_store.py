"""``ds-ops train`` into a model store the user cannot write fails before training, not after
(a real process without CAP_DAC_OVERRIDE, as a group member without write access would be)."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO
from daemon_kit import base_env, drop_dac_capabilities


def test_an_unwritable_models_dir_fails_before_the_first_epoch(tmp_path, small_smd_csv):
    store = tmp_path / "models"
    store.mkdir(mode=0o555)
    p = subprocess.run([sys.executable, "-m", "opt_ds_ops.cli", "train", str(small_smd_csv), "--models-dir", str(store)],
                       capture_output=True, text=True, cwd=REPO, env=base_env(), preexec_fn=drop_dac_capabilities,
                       timeout=300)
    assert p.returncode == 1
    assert "epoch 1/" not in p.stdout and "Traceback" not in p.stderr
    assert p.stderr.strip() == (f"ds-ops: error: cannot write models under {store}: Permission denied (the service's "
                                "store: train as root or user ds-ops, or pass --models-dir DIR)")
    assert os.listdir(store) == []
