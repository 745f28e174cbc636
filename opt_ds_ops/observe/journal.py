"""The daemon's event log: journald with structured fields under systemd, plain lines elsewhere.

Under systemd (``JOURNAL_STREAM`` set, or the journal socket ``/run/systemd/journal/socket``
present) every event goes through systemd-python's ``systemd.journal.send`` with a fixed
``MESSAGE_ID`` per event type and ``DS_*`` fields, so that
``journalctl -u ds-trainer DS_DATASET=machine-1-2`` and ``journalctl MESSAGE_ID=<id>`` find them.
Field names follow journald's rules (uppercase letters, digits and ``_``; not starting with ``_``
or a digit; at most 64 characters). Elsewhere each event is one plain line on stderr. One event per
epoch, never per batch, and no progress bars.
"""

from __future__ import annotations

import os
import re
import sys
from datetime import datetime, timezone
from typing import TextIO

JOURNAL_SOCKET = "/run/systemd/journal/socket"
IDENTIFIER = "ds-trainer"

# syslog priorities (journald's PRIORITY field)
LOG_CRIT, LOG_ERR, LOG_WARNING, LOG_NOTICE, LOG_INFO, LOG_DEBUG = 2, 3, 4, 5, 6, 7
_LEVEL = {LOG_CRIT: "crit", LOG_ERR: "error", LOG_WARNING: "warning", LOG_NOTICE: "notice", LOG_INFO: "info", LOG_DEBUG: "debug"}

# One MESSAGE_ID per event type. Fixed forever: users put them in `journalctl MESSAGE_ID=...`.
MESSAGE_IDS = {
    "daemon-started": "7f5cc77452d1488e96d0ffc363f1bc17",
    "daemon-stopping": "0dd252817d19453e8fddcbde85ebb504",
    "config-reloaded": "c15aa3b7bc9240b29fbbd4bd09154ef6",
    "config-rejected": "a362d381ace24b4ba35360eaafda0aff",
    "watcher": "e5b929cbc8ff42bbb7bf35ff3ab5d169",
    "health": "9c1f0b7e2d4a4f4b8e6a5d3c2b1a0f9e",
    "job-claimed": "5138708e57404afe950773804e1013a9",
    "job-health": "276eec48a55843089ea3bf5c186f7cc6",
    "job-deferred": "2ba62a91b97e45c2ae85a7816effba35",
    "job-stacked": "6b41f1c25be044e184e63f18a88e32d1",
    "job-resumed": "ce04a20c531f4e14aa6d5cdba7b53f47",
    "job-epoch": "33ed51597bf2408bba956d9335c8aea7",
    "job-saved": "44fb644d49724e0996101682ba632d1f",
    "job-failed": "49ab32c640604d36bb2e9ed7d10b7724",
    "job-interrupted": "2321339924cc4c52be7c8277c6675969",
    "job-recovered": "824729265a4842c19b47b900b2ae86f5",
    "internal-error": "20d771dafd004cadbc26ab01f037b5c2",
    "intake-paused": "3d2bfc52c778469bb2fb97e50ccbb69f",
    "entry-ignored": "22f85b2436424bcb97758258bf9b5ee3",
    "entry-busy": "c9e71bfe82fe409ba54f59bfa2baf698",
    "entry-removed": "0ede7a68e90d4a33adc01d551c97b563",
    "job-crashed": "84733394dd9e48ae9dfa064d239fbc70",
    "failed-pruned": "698d943f89974410b6b9c40cb0ae0e58",
    "job-gpu-throttle": "c183b2cf20ed4a22ab23aed6f682eca5",
    # metrics, retention, report.png and refused sidecars
    "metrics": "66e2a7bc87cd4753948bcfd936ddfa3a",
    "model-pruned": "dc03cf1c701c4dfc8ab394ceda57ee35",
    "spool-pruned": "ab9635bf3fe34652aab8a3ae634cce4e",
    "report-failed": "50091f7c7c094ec080584c7cf9395808",
    "sidecar-refused": "ead42fa0486f4585a2bab83feedd4f77",
    # a feature the service's sandbox refuses
    "feature-refused": "0615d0ef11a546ed89164278f6df62ba",
    # a model published, but suspect
    "model-suspect": "0b1313adf7e84e408c8d906b8a880a57",
    # the scoring spool (opt_ds_ops.daemon.scoreslot)
    "incident-opened": "11b636a09ea044bcaf7b04b608e60491",
    "incident-escalated": "0ea40baf385a4975b8c0293bc985bfb1",
    "incident-closed": "035698f7f20a429f91bd6a0696bc5fe8",
    "regime-changed": "0302889c564747638597689a8ffb8b9c",
    "threshold-calibrated": "a7014d6e81a5441e90ef808c150b8823",
    "scored": "ea106cd2d0e8460dbd52a64a8af55cca",
    "score-reset": "a25b94c0f1a84ac0b75107a5f6d01c4b",
    "results-pruned": "3bf6754c0bcc476f9a68726f1e49a992",
    # retraining and promotion
    "model-held": "ab1fd8270a2240c6b903f567f487a500",
    "retrain-queued": "b79ac427389c43d5a69ed4988502186f",
    "retrain-backoff": "e63e0cdba38f43299d687c9a8da12c3d",
    "model-not-promoted": "a515b79e6a324719b5c77ded5882454e",
    # the same bytes dropped again (opt_ds_ops.spool.duplicate)
    "job-duplicate": "0c578f2a949b4dcc8d0bd5b1b8ddbc2f",
    # the puller (ds-ops pull, opt_ds_ops.sources): telemetry in from Prometheus
    "source-pulled": "bda322535a0c416994b7e82b3b3aebd3",
    "source-host": "bbd4cab5470841b1b0e8dcadb29a304d",
    "source-unavailable": "ac973f7bcef44c2a9ee1bf3417459dd2",
}

# Routine progress: no catalog entry, so `journalctl -x` prints nothing under each of these lines
# (one a second of training); debian/ds-ops.catalog explains every other MESSAGE_ID.
ROUTINE = frozenset({"job-epoch"})

# DS_STAGE of each job event (claimed/health/training/saved/failed).
STAGES = {
    "job-claimed": "claimed",
    "job-health": "health",
    "job-deferred": "health",
    "job-stacked": "claimed",
    "job-resumed": "training",
    "job-epoch": "training",
    "job-gpu-throttle": "training",
    "job-interrupted": "training",
    "job-saved": "saved",
    "job-recovered": "saved",
    "job-failed": "failed",
    "job-crashed": "crashed",
    "entry-ignored": "spool",
    "entry-busy": "spool",
    "entry-removed": "spool",
}

_FIELD_BAD = re.compile(r"[^A-Z0-9_]")


def under_systemd(environ=None, socket_path: str = JOURNAL_SOCKET) -> bool:
    """Return True if logging should go to the journal: JOURNAL_STREAM is set or the socket exists."""
    environ = os.environ if environ is None else environ
    return bool(environ.get("JOURNAL_STREAM")) or os.path.exists(socket_path)


def field_name(name: str) -> str | None:
    """Return name as a valid journald field name, or None if nothing usable is left.

    journald accepts ``[A-Z0-9_]``, not starting with ``_`` (reserved for trusted fields) or a
    digit, at most 64 characters: ``ds-epoch`` -> ``DS_EPOCH``, ``_x`` -> ``X``, ``1a`` -> ``F_1A``.
    """
    cleaned = _FIELD_BAD.sub("_", name.upper()).lstrip("_")
    if not cleaned:
        return None
    if cleaned[0].isdigit():
        cleaned = "F_" + cleaned
    return cleaned[:64]


def safe_text(text: str) -> str:
    """Return text printable on one line: undecodable file-name bytes and control characters escaped."""
    text = text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def _value(v) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, str):
        return safe_text(v)
    return str(v)


class EventLog:
    """Where the daemon's events go: the journal (structured) or a text stream (one line each).

    ``journal``: True/False forces the choice; None decides with :func:`under_systemd`. If
    systemd-python cannot be imported or a send fails, the line goes to ``stream`` instead.
    """

    def __init__(self, *, journal: bool | None = None, stream: TextIO | None = None, identifier: str = IDENTIFIER):
        self.stream = stream or sys.stderr
        self.identifier = identifier
        self._journal = None
        if journal is None:
            journal = under_systemd()
        if journal:
            try:
                import systemd.journal

                self._journal = systemd.journal
            except ImportError as e:
                self._line(LOG_WARNING, f"systemd-python is not importable ({e}); logging to stderr")

    def event(self, event: str, message: str, *, priority: int = LOG_INFO, **fields) -> None:
        """Log one event of type ``event`` (a key of MESSAGE_IDS) with ``DS_*`` fields.

        Field keys are given lower-case without the prefix (``job_id=`` -> ``DS_JOB_ID``); None
        values are left out; floats are written with 6 significant digits. ``DS_STAGE`` is filled
        in from :data:`STAGES` for job events unless given. Raises KeyError for an unknown event.
        """
        message_id = MESSAGE_IDS[event]
        if "stage" not in fields and event in STAGES:
            fields["stage"] = STAGES[event]
        message = safe_text(message)
        if self._journal is None:
            self._line(priority, message)
            return
        journal_fields = {}
        for key, value in fields.items():
            name = field_name("ds_" + key)
            if name is not None and value is not None:
                journal_fields[name] = _value(value)
        caller = sys._getframe(1)
        try:
            self._journal.send(
                message,
                MESSAGE_ID=message_id,
                PRIORITY=str(priority),
                SYSLOG_IDENTIFIER=self.identifier,
                CODE_FILE=caller.f_code.co_filename,
                CODE_LINE=caller.f_lineno,
                CODE_FUNC=caller.f_code.co_name,
                **journal_fields,
            )
        except OSError as e:
            self._line(LOG_WARNING, f"journal send failed ({e.strerror or e}); this event follows on stderr")
            self._line(priority, message)

    def _line(self, priority: int, message: str) -> None:
        stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        try:
            print(f"{stamp} {self.identifier}[{os.getpid()}] {_LEVEL.get(priority, 'info')}: {message}",
                  file=self.stream, flush=True)
        except (OSError, ValueError):
            pass  # stderr closed or gone: nothing better to do with a log line
