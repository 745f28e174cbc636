"""The spool: a dataset moves ``incoming/`` -> ``processing/<job id>/`` -> ``done/`` or ``failed/``.

Layout under ``spool.dir`` (default ``/var/spool/ds-ops``)::

    incoming/          group ds-ops drops datasets; '.NAME', NAME.part and NAME.tmp are ignored;
                       STEM.yaml (or .yml) is the sidecar of dataset STEM.<ext>, taken with it
    score/             the same for telemetry to score (:mod:`opt_ds_ops.daemon.scoreslot`): the
                       same claim (``drop=SCORE``), a job of kind ``score``; no copy kept in done/
    processing/JOB/    one directory per job, the daemon's own (0750): job.json (the record),
                       dataset.<ext> (the daemon's 0600 copy of the bytes), sidecar.yaml, checkpoint.pt
    done/              NAME, NAME.result.json (model directory, sha256, losses, threshold, ...)
                       and NAME.sidecar.yaml if it had one
    failed/            NAME, NAME.error.json (reason, stage, time, exception type), NAME.sidecar.yaml

**Daemon-owned names.** Job state lives in ``processing/<job id>/`` under fixed names that no
user file name can collide with. done/ and failed/ are written by the daemon only; their JSON
files are read with :func:`opt_ds_ops.fsutil.read_small` (no link followed, no FIFO opened).

Where each stage lives (the names of the first six are importable from ``opt_ds_ops.spool`` too):

* :mod:`~opt_ds_ops.spool.layout`: the directories and fixed names, :class:`Spool`,
  :func:`open_spool`, the single-daemon lock, job ids and JSON files;
* :mod:`~opt_ds_ops.spool.claiming`: taking a dropped file and its sidecar into a job directory
  (:func:`claim`), and finishing a claim a SIGKILL interrupted (:func:`recover_claim`);
* :mod:`~opt_ds_ops.spool.processing`: a job's directory and record (``job.json``), its lock and
  checkpoint, whether its process runs, the start-up clean-up of processing/;
* :mod:`~opt_ds_ops.spool.filing`: a job's end, its dataset to done/ or failed/ (:func:`finish`),
  and back from failed/ to the queue (:func:`requeue`);
* :mod:`~opt_ds_ops.spool.retention`: what done/ and failed/ keep, and for how long;
* :mod:`~opt_ds_ops.spool.status`: what ``ds-ops status`` shows, read from the files alone;
* :mod:`~opt_ds_ops.spool.watcher`: when a file dropped in incoming/ or score/ is complete
  (inotify through watchdog, rescans, the settle and quiet times);
* :mod:`~opt_ds_ops.spool.duplicate`: a drop whose bytes a version of its model already holds.
"""

from .claiming import Claim, claim, list_incoming, recover_claim, take_sidecar
from .filing import finish, requeue
from .layout import (
    CHECKPOINT_FILE, COPY_CHUNK, DAEMON_LOCK, DATA_PREFIX, DONE, ERROR_SUFFIX, FAILED, IGNORED_SUFFIXES, INCOMING,
    JOB_FILE, LOCK_FILE, NAME_MAX_BYTES, PROCESSING, RESULT_SUFFIX, SCORE, SIDECAR_FILE, SIDECAR_SOURCE, SIDECAR_SUFFIX,
    SOURCE_FILE, STORAGE_ERRNOS, SUBDIRS, Spool, SpoolError, check_writable_dir, daemon_pid, data_suffix, is_ignored,
    is_job_id, is_storage_error, kind_of, lock_spool, new_job_id, open_spool, read_json, sidecar_name, sidecar_names,
    write_json,
)
from .processing import (
    boot_id, discard_job, job_ids, load_checkpoint, lock_job, migrate_legacy, process_alive, process_start_ticks,
    read_record, remove_stale_temps, save_checkpoint, save_record,
)
from .retention import prune_failed, prune_retention
from .status import ignored_entries, spool_status

__all__ = [
    "CHECKPOINT_FILE", "COPY_CHUNK", "DAEMON_LOCK", "DATA_PREFIX", "DONE", "ERROR_SUFFIX", "FAILED", "IGNORED_SUFFIXES",
    "INCOMING", "JOB_FILE", "LOCK_FILE", "NAME_MAX_BYTES", "PROCESSING", "RESULT_SUFFIX", "SCORE", "SIDECAR_FILE",
    "SIDECAR_SOURCE", "SIDECAR_SUFFIX", "SOURCE_FILE", "STORAGE_ERRNOS", "SUBDIRS", "Claim", "Spool", "SpoolError",
    "boot_id", "check_writable_dir", "claim", "daemon_pid", "data_suffix", "discard_job", "finish", "ignored_entries",
    "is_ignored", "is_job_id", "is_storage_error", "job_ids", "kind_of", "list_incoming", "load_checkpoint", "lock_job",
    "lock_spool", "migrate_legacy", "new_job_id", "open_spool", "process_alive", "process_start_ticks", "prune_failed",
    "prune_retention", "read_json", "read_record", "recover_claim", "remove_stale_temps", "requeue", "save_checkpoint",
    "save_record", "sidecar_name", "sidecar_names", "spool_status", "take_sidecar", "write_json",
]
