"""The daemon's clock: how long a tick lasts, what the watchdog is asked for, how intake backs off.

Seconds, all of them. Shared by the daemon's roles (:mod:`opt_ds_ops.daemon.service` and the modules it is
made of) and the scoring slot (:mod:`opt_ds_ops.daemon.scoreslot`), so that none of them imports the daemon.
"""

TICK_S = 0.5  # idle loop period (seconds): the latency of SIGTERM, SIGHUP and new files when idle
STEP_BUDGET_S = 120.0  # watchdog budget for one loop tick (seconds); the loop never waits on a job
STOP_EXTEND_S = 30.0  # EXTEND_TIMEOUT_USEC asked for while a job writes its checkpoint on SIGTERM
START_EXTEND_S = 300.0  # EXTEND_TIMEOUT_USEC while the forkserver imports torch at start-up
BACKOFF_S = (5.0, 300.0)  # first and longest pause of intake after a file system error (seconds)
METRICS_REFRESH_S = 60.0  # ds_ops.prom is rewritten at least this often (seconds), besides every state change
METRICS_MIN_GAP_S = 1.0  # scored chunks within this of the last write are written together (a fleet's, several a second)
HEALTH_LOG_TIMEOUT_S = 30.0  # the start-up health report gives up waiting on NVML after this (seconds)
GPU_CHECK_S = 2.0  # the daemon's NVML reading for job slots is reused for this long (seconds)
