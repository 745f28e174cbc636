"""Scoring: where a chunk of telemetry is scored against a model's current version.

:mod:`.job` is one scoring job, in the job process: it names the model, loads its current
version, reads the chunk and writes the model's results (``rows.csv``, ``summary.json``,
``state.json``) whole or not at all. :mod:`.series` scores a chunk as the continuation of the
model's series (smoothing, open anomalies, drift). :mod:`.evaluate` is ``ds-ops evaluate``:
train and score labelled machines and compare with the baselines. The daemon's side of scoring
(one chunk at a time, the alerts) is :mod:`opt_ds_ops.daemon.scoreslot`.
"""
