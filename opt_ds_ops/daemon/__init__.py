"""The daemon: ``ds-ops daemon``, the one process that owns the spool, its job slots and the journal.

:mod:`.service` is the main loop (one thread), its signals and ``sd_notify``; around it, one role
per module, each an object given what it needs: :mod:`.dispatch` claims a dropped file and
starts its job, then reads the job's messages; :mod:`.outcome` decides a job's end (done,
failed, deferred, a crash) and files it; :mod:`.recovery` adopts or ends what a previous daemon
left in processing/ (:mod:`.breadcrumb` remembers the job in hand across a death);
:mod:`.duties` writes metrics, prunes and reloads. Job slots and GPUs are :mod:`.slots`, the
memory each job may take :mod:`.budget`, the process a job runs in :mod:`.worker` (several
small datasets in one process, as one stacked model: :mod:`.jobstack`), the
systemd side :mod:`.notify` and :mod:`.sandbox`, the shared timing :mod:`.pacing`. The daemon's
sides of scoring (:mod:`.scoreslot`: one chunk at a time, its alerts) and of retraining
(:mod:`.retrainer`: when a model is due) are here too; what their jobs compute is in
:mod:`opt_ds_ops.scoring` and :mod:`opt_ds_ops.lifecycle`.
"""
