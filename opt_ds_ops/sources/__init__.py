"""Telemetry in from outside, ahead of the spool: the first stage of the flow.

A *source* (``/etc/ds-ops/sources/NAME.yaml``, root's configuration, checked by ``ds-ops
check-config --source``) names a Prometheus server, the series to read (PromQL, one column each,
named as alerts will say it), the label that makes one model per host and the clock: step,
training window, scoring interval. The puller (``ds-ops pull``, unit ``ds-pull@NAME.service``,
outside the daemon's sandbox, as the user ds-pull) is just a well-behaved member of group ds-ops:
it writes each host's training window into ``incoming/`` and each new interval into ``score/`` the
safe way (sidecar first, then the CSV, each renamed into place from a hidden temporary name),
with column names, a time column and the model's
name. Everything after the drop is the daemon's, unchanged.

* :mod:`~opt_ds_ops.sources.sourcefile`: the source file, parsed and validated once.
* :mod:`~opt_ds_ops.sources.prometheus`: ``/api/v1/query_range``, split to Prometheus's 11,000
  points per series and bounded in bytes.
* :mod:`~opt_ds_ops.sources.puller`: one pull (which hosts to train, which to score, from when to
  when), the rows per host with their gaps said, the drops, the puller's state.
"""
