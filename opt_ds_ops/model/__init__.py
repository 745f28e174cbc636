"""The model: the ``TelemetryAutoencoder`` and what a trained one computes.

:mod:`.network` is the network (D->24->8->24->D, BatchNorm1d, LeakyReLU(0.2)) and its
per-feature reconstruction error; :mod:`.scaling` standardises and clips inputs;
:mod:`.threshold` sets the anomaly-score threshold from validation scores; :mod:`.trained` is a
trained model as scoring needs it; :mod:`.detection` scores rows against one and measures how
well scores find labelled anomalies (ROC-AUC, PR-AUC, the baselines). Training, scoring jobs,
the store and the promotion gate all build on this folder; it imports none of them.
"""
