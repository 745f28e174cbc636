"""Observability: where the journal and the metrics get written.

:mod:`.journal` writes each event to journald with ``MESSAGE_ID`` and ``DS_*`` fields (plain
lines outside systemd); its catalog is ``debian/ds-ops.catalog``. :mod:`.metrics` writes
``ds_ops.prom`` for node_exporter's textfile collector, atomically. Both are written by the
daemon; neither reads the spool or imports the store (the daemon passes in what they report).
"""
