"""A model's life after its first training: the scored history, retraining and the promotion gate.

:mod:`.history` keeps the rows a model scored (``history.npz``), bounded; :mod:`.retrain_data`
turns that history into a retraining's dataset (normal rows only); :mod:`.promotion` is the gate
that judges a retrained model against the one it would replace, before it may become
``current``. When a retraining is due is decided by the daemon
(:mod:`opt_ds_ops.daemon.retrainer`); the training itself is :mod:`opt_ds_ops.training`.
"""
