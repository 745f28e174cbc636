"""ds-ops: a self-running training appliance for telemetry anomaly detection.

Data flows one way, one module per stage: spool -> dataset -> health/device -> train -> store
-> journal. ``job`` runs one dataset through dataset, device, train and store; ``cli`` is the
``ds-ops`` command.
"""

__version__ = "0.1.0"
