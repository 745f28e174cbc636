"""ds-ops: a self-running training appliance for telemetry anomaly detection.

Data flows one way, one module per stage: spool -> dataset -> health/device -> train -> store
-> journal. ``job`` runs one dataset through dataset, device, train and store; ``cli`` is the
``ds-ops`` command.
"""

__version__ = "0.1.0"

# Stop signals (SIGTERM, SIGINT) that reached ``ds-ops daemon`` while it was still importing torch
# (seconds): held here by :mod:`opt_ds_ops.cli` and honoured by the daemon once it runs, so a stop
# during start-up is a clean exit 0, not a death by signal.
EARLY_STOP: list[int] = []
