"""The journal: fields handed to systemd-python's ``systemd.journal.send``, and plain lines elsewhere.

The real journal is checked by the packaging issue's end-to-end test (it boots systemd); here the
library boundary is replaced, in-process and inside a real daemon process.
"""

from __future__ import annotations

import io
import json
import re
import sys

import pytest
import systemd.journal

from daemon_kit import Daemon, base_env, copy_smd, done_names, failed_names, spool_dir, write_config
from opt_ds_ops import journal
from opt_ds_ops.journal import MESSAGE_IDS, EventLog, field_name

FIELD_RULE = re.compile(r"^[A-Z][A-Z0-9_]{0,63}$")  # journald: no leading '_' or digit, <= 64 chars


@pytest.fixture
def sent(monkeypatch) -> list[dict]:
    calls = []

    def fake_send(MESSAGE, **fields):
        calls.append(dict(fields, MESSAGE=MESSAGE))

    monkeypatch.setattr(systemd.journal, "send", fake_send)
    return calls


@pytest.mark.parametrize("raw, expected", [
    ("ds_epoch", "DS_EPOCH"), ("ds-val-loss", "DS_VAL_LOSS"), ("_private", "PRIVATE"), ("1st", "F_1ST"),
    ("dé.jà vu", "D__J__VU"), ("x" * 80, "X" * 64), ("___", None), ("", None),
])
def test_field_names_follow_journald_rules(raw, expected):
    assert field_name(raw) == expected
    if expected:
        assert FIELD_RULE.match(expected)


def test_message_ids_are_distinct_uuid_hex():
    ids = list(MESSAGE_IDS.values())
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)


def test_under_systemd_when_journal_stream_is_set_or_the_socket_exists(tmp_path):
    assert journal.under_systemd({"JOURNAL_STREAM": "8:1234"}, str(tmp_path / "none"))
    assert not journal.under_systemd({}, str(tmp_path / "none"))
    (tmp_path / "socket").touch()
    assert journal.under_systemd({}, str(tmp_path / "socket"))


def test_an_epoch_event_hands_structured_fields_to_the_journal(sent):
    log = EventLog(journal=True)
    log.event("job-epoch", "m.csv: epoch 2/5 loss=0.5", job_id="20261130T000000Z-abc", dataset="machine-1-2",
              epoch=2, loss=0.123456789, val_loss=None, samples_per_s=700000.0, device="cuda:0", amp_dtype="bf16")
    (call,) = sent
    assert call["MESSAGE"] == "m.csv: epoch 2/5 loss=0.5"
    assert call["MESSAGE_ID"] == MESSAGE_IDS["job-epoch"]
    assert call["PRIORITY"] == "6" and call["SYSLOG_IDENTIFIER"] == "ds-trainer"
    assert call["DS_STAGE"] == "training" and call["DS_EPOCH"] == "2" and call["DS_LOSS"] == "0.123457"
    assert call["DS_DATASET"] == "machine-1-2" and call["DS_DEVICE"] == "cuda:0" and call["DS_AMP_DTYPE"] == "bf16"
    assert call["DS_SAMPLES_PER_S"] == "700000" and "DS_VAL_LOSS" not in call
    assert call["CODE_FUNC"] == "test_an_epoch_event_hands_structured_fields_to_the_journal"


def test_undecodable_file_names_reach_the_journal_escaped(sent):
    name = b"bad-\xff.csv".decode("utf-8", "surrogateescape")
    EventLog(journal=True).event("job-failed", f"{name}: failed", dataset_file=name)
    assert sent[0]["MESSAGE"] == "bad-\\xff.csv: failed" and sent[0]["DS_DATASET_FILE"] == "bad-\\xff.csv"
    assert sent[0]["DS_STAGE"] == "failed"


def test_a_failing_journal_send_falls_back_to_stderr(monkeypatch):
    def broken(MESSAGE, **fields):
        raise OSError(2, "No such file or directory")

    monkeypatch.setattr(systemd.journal, "send", broken)
    out = io.StringIO()
    EventLog(journal=True, stream=out).event("job-saved", "m.csv: model saved")
    assert "journal send failed" in out.getvalue() and "m.csv: model saved" in out.getvalue()


def test_without_systemd_each_event_is_one_plain_line():
    out = io.StringIO()
    EventLog(journal=False, stream=out).event("job-epoch", "a\nb.csv: epoch 1/1", epoch=1)
    (line,) = out.getvalue().splitlines()
    assert re.fullmatch(r"\S+Z ds-trainer\[\d+\] info: a\\nb\.csv: epoch 1/1", line)


# ---- inside the real daemon -----------------------------------------------------------------------

CAPTURE = """
import json, os, sys
import systemd.journal
out = open(os.environ["JOURNAL_CAPTURE"], "a")
def send(MESSAGE, **fields):
    out.write(json.dumps(dict(fields, MESSAGE=MESSAGE)) + "\\n")
    out.flush()
systemd.journal.send = send
from opt_ds_ops.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_the_daemon_logs_each_job_stage_with_fields_journalctl_can_match(tmp_path):
    capture = tmp_path / "journal.jsonl"
    conf = write_config(tmp_path, epochs=3)
    env = base_env(JOURNAL_STREAM="8:424242", JOURNAL_CAPTURE=str(capture))
    d = Daemon(conf, env=env, argv=[sys.executable, "-c", CAPTURE, "daemon", "--config", str(conf)])
    try:
        d.wait_until(lambda: capture.exists() and "daemon-started" in _events(capture), "the started event", 120)
        copy_smd(spool_dir(tmp_path, "incoming") / "machine-1-2.txt.gz")
        (spool_dir(tmp_path, "incoming") / "broken.csv").write_text("1,2\n3,x\n")
        d.wait_until(lambda: done_names(tmp_path) and failed_names(tmp_path), "both jobs")
        assert d.stop()[0] == 0
    finally:
        d.kill()
    entries = [json.loads(line) for line in capture.read_text().splitlines()]
    assert d.log() == ""  # everything went to the journal, nothing to stderr
    for e in entries:
        assert all(FIELD_RULE.match(k) for k in e), e
        assert e["MESSAGE_ID"] in MESSAGE_IDS.values() and e["SYSLOG_IDENTIFIER"] == "ds-trainer"
    good = [e for e in entries if e.get("DS_DATASET") == "machine-1-2"]
    assert [e["DS_STAGE"] for e in good] == ["claimed", "health", "training", "training", "training", "saved"]
    epochs = [e for e in good if e["MESSAGE_ID"] == MESSAGE_IDS["job-epoch"]]
    assert [e["DS_EPOCH"] for e in epochs] == ["1", "2", "3"]
    for e in epochs:
        assert float(e["DS_LOSS"]) > 0 and float(e["DS_VAL_LOSS"]) > 0 and float(e["DS_SAMPLES_PER_S"]) > 0
        assert e["DS_DEVICE"] == "cpu" and e["DS_AMP_DTYPE"] == "off"
    saved = good[-1]
    assert saved["MESSAGE_ID"] == MESSAGE_IDS["job-saved"]
    assert saved["DS_MODEL_DIR"].startswith(str(tmp_path / "models" / "machine-1-2"))
    assert len({e["DS_JOB_ID"] for e in good}) == 1 and saved["DS_DATASET_FILE"] == "machine-1-2.txt.gz"
    (failed,) = [e for e in entries if e.get("DS_DATASET") == "broken" and e["DS_STAGE"] == "failed"]
    assert failed["MESSAGE_ID"] == MESSAGE_IDS["job-failed"] and failed["PRIORITY"] == "3"
    assert failed["DS_FAILED_STAGE"] == "dataset" and "line 2, column 2" in failed["MESSAGE"]
    # start-up health check, once, with the verdict and the device (device: cpu needs no driver: ok)
    (health,) = [e for e in entries if e["MESSAGE_ID"] == MESSAGE_IDS["health"]]
    assert health["PRIORITY"] == "6" and health["DS_VERDICT"] == "ok" and health["DS_DEVICE"] == "cpu"
    assert [e["DS_VERDICT"] for e in good if e["DS_STAGE"] == "health"] == ["ok"]


def _events(capture) -> str:
    ids = {v: k for k, v in MESSAGE_IDS.items()}
    return " ".join(ids.get(json.loads(line).get("MESSAGE_ID"), "?") for line in capture.read_text().splitlines())
