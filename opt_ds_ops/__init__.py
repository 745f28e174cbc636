"""ds-ops: a self-running training appliance for telemetry anomaly detection.

Data flows one way: a file dropped in the spool (:mod:`.spool`) becomes a job of the daemon
(:mod:`.daemon`), which runs it in a process of its own: a scoring job (:mod:`.scoring`) or a
training job (:mod:`.training`); retrained models are judged in :mod:`.lifecycle`; versions are
kept in :mod:`.store`; the health gate is :mod:`.health`, the network and its arithmetic
:mod:`.model`, the readers of a dataset :mod:`.dataset`; everything is said in the journal and the
metrics (:mod:`.observe`); :mod:`.config` is the conffile, parsed once and passed down. :mod:`.cli`
and :mod:`.commands` are the ``ds-ops`` command. In that order (commands, daemon, spool, scoring,
training, lifecycle, store, health, model, dataset, observe, config) a folder imports only the
folders after it (docs/architecture.md, "Folders"; tests/test_layout.py checks it).
"""

__version__ = "0.1.0"

# Stop signals (SIGTERM, SIGINT) that reached ``ds-ops daemon`` while it was still starting
# (its imports, the forkserver's start): held here by :mod:`opt_ds_ops.cli` and honoured by the daemon once it runs, so a stop
# during start-up is a clean exit 0, not a death by signal.
EARLY_STOP: list[int] = []
