"""The journal: fields handed to systemd-python's ``systemd.journal.send``, and plain lines elsewhere.

The real journal is checked by the package's end-to-end test (tests/e2e, it boots systemd); here the
library boundary is replaced, in-process and inside a real daemon process. The message catalog
(debian/ds-ops.catalog, ``journalctl -x``) is checked against MESSAGE_IDS and the fields the daemon
sends with each event, and by journalctl itself where it is installed.
"""

from __future__ import annotations

import ast
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import systemd.journal

from daemon_kit import Daemon, base_env, copy_smd, done_names, failed_names, spool_dir, write_config
from opt_ds_ops.commands import pull as pull_cmd
from opt_ds_ops.daemon import dispatch, duties, outcome, recovery, retrainer, scoreslot, service, slots
from opt_ds_ops.observe import journal
from opt_ds_ops.observe.journal import MESSAGE_IDS, ROUTINE, EventLog, field_name

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
    assert "line 2, column 2" in failed["DS_REASON"]  # the reason in a field of its own
    assert float(saved["DS_THRESHOLD"]) > 0  # the saved model's threshold
    # start-up health check, once, with the verdict and the device (device: cpu needs no driver: ok)
    (health,) = [e for e in entries if e["MESSAGE_ID"] == MESSAGE_IDS["health"]]
    assert health["PRIORITY"] == "6" and health["DS_VERDICT"] == "ok" and health["DS_DEVICE"] == "cpu"
    assert [e["DS_VERDICT"] for e in good if e["DS_STAGE"] == "health"] == ["ok"]


def test_a_suspect_model_is_saved_with_a_model_suspect_event_naming_the_column(tmp_path, smd_rows):
    capture = tmp_path / "journal.jsonl"
    conf = write_config(tmp_path, epochs=2)
    rows = smd_rows[:6000].copy()
    rows[5400:, 4] += 20 * rows[:5400, 4].std()  # column 5 steps in the validation split (the last 10 %)
    staged = tmp_path / "stepped.csv"
    np.savetxt(staged, rows, delimiter=",", fmt="%.6f")
    env = base_env(JOURNAL_STREAM="8:424242", JOURNAL_CAPTURE=str(capture))
    d = Daemon(conf, env=env, argv=[sys.executable, "-c", CAPTURE, "daemon", "--config", str(conf)])
    try:
        d.wait_until(lambda: capture.exists() and "daemon-started" in _events(capture), "the started event", 120)
        os.replace(staged, spool_dir(tmp_path, "incoming") / "stepped.csv")
        d.wait_until(lambda: done_names(tmp_path), "the job")
        assert d.stop()[0] == 0
    finally:
        d.kill()
    entries = [json.loads(line) for line in capture.read_text().splitlines()]
    (saved,) = [e for e in entries if e["MESSAGE_ID"] == MESSAGE_IDS["job-saved"]]
    assert "; stopped: epochs after 6 steps; suspect: 2 warning(s)" in saved["MESSAGE"]
    suspect = [e for e in entries if e["MESSAGE_ID"] == MESSAGE_IDS["model-suspect"]]
    assert len(suspect) == 2 and all(e["PRIORITY"] == "4" for e in suspect)
    assert "column 5 " in suspect[1]["MESSAGE"] and suspect[1]["DS_MODEL_DIR"] == saved["DS_MODEL_DIR"]


def _events(capture) -> str:
    ids = {v: k for k, v in MESSAGE_IDS.items()}
    return " ".join(ids.get(json.loads(line).get("MESSAGE_ID"), "?") for line in capture.read_text().splitlines())


# ---- the message catalog (journalctl -x) ----------------------------------------------------------

from conftest import REPO  # noqa: E402 - the repository root, whatever the folder of this file
CATALOG = REPO / "debian" / "ds-ops.catalog"
CATALOG_DIR = "usr/lib/systemd/catalog"     # where the package installs it (debian/ds-ops.install)
PLACEHOLDER = re.compile(r"@([A-Z0-9_]+)@")  # what journalctl replaces with the entry's field
HEADER = re.compile(r"^-- ([0-9a-fA-F]{32})(?: (\S+))?$")


def parse_catalog(text: str) -> dict[str, dict]:
    """Return {message id: {"lang", "fields" (header lines), "text" (the whole entry), "line"}}.

    systemd's rules (catalog.c): lines starting with '#' or ';' are comments; ``-- ID [LANG]``
    opens an entry where it follows a blank line or starts the file; header lines (``Key: value``)
    run up to the first blank line. Raises ValueError for text before the first entry and for an
    ID defined twice.
    """
    entries: dict[str, dict] = {}
    current = None
    blank = True
    for n, line in enumerate(text.splitlines(), 1):
        if not line:
            blank = True
            if current is not None:
                current["lines"].append("")
            continue
        if line[0] in "#;":
            continue
        m = HEADER.match(line)
        if blank and m:
            mid = m.group(1).lower()
            if mid in entries:
                raise ValueError(f"line {n}: {mid} is defined twice")
            current = entries[mid] = {"lang": m.group(2), "lines": [], "line": n}
        elif current is None:
            raise ValueError(f"line {n}: text before the first '-- MESSAGE_ID' line")
        else:
            current["lines"].append(line)
        blank = False
    for e in entries.values():
        lines = e.pop("lines")
        head = []
        for line in lines:
            if not line:
                break
            head.append(line)
        e["fields"] = dict(h.split(": ", 1) for h in head if ": " in h)
        e["text"] = "\n".join(lines).strip()
    return entries


def _event_calls() -> dict[str, list[set[str]]]:
    """Return {event: [keyword names of each ``self.log.event(event, ...)`` call in the daemon's
    modules (service.py and the roles it is made of, scoreslot.py and retrainer.py: ``self.d.log.event``
    and ``log.event``) and the puller's (commands/pull.py: ``self.log.event``)]}.

    ``**job_fields(record)`` (and ``**fields`` where every ``fields = `` is that call) counts as
    the keys of job_fields's returned dict; ``priority`` is not a field. Any other ``**`` fails: the
    test cannot know its keys.
    """
    own = [ast.parse(Path(m.__file__).read_text()) for m in (service, slots, dispatch, outcome, recovery, duties)]
    trees = own + [ast.parse(Path(scoreslot.__file__).read_text()),  # the scoring slot's events
                   ast.parse(Path(retrainer.__file__).read_text()),  # retraining's
                   ast.parse(Path(pull_cmd.__file__).read_text())]  # the puller's (ds-ops pull)

    def is_fields_call(node) -> bool:
        return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "job_fields"

    (fields_fn,) = [n for tree in own for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "job_fields"]
    returns = [n.value for n in ast.walk(fields_fn) if isinstance(n, ast.Return)]
    assert len(returns) == 1 and isinstance(returns[0], ast.Dict), "job_fields must return a dict literal"
    record_keys = {k.value for k in returns[0].keys}
    assigns = [n.value for tree in own for n in ast.walk(tree) if isinstance(n, ast.Assign)
               and any(isinstance(t, ast.Name) and t.id == "fields" for t in n.targets)]
    assert assigns and all(is_fields_call(v) for v in assigns), "a 'fields =' of the daemon is not job_fields(...)"
    calls: dict[str, list[set[str]]] = {}
    for node in (n for t in trees for n in ast.walk(t)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "event"
                and (isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "log"
                     or isinstance(node.func.value, ast.Name) and node.func.value.id == "log")):
            continue
        event = node.args[0]
        if _is_incident_entry_call(node):  # the scoring slot sends what incident_entry returns
            explicit = {kw.arg for kw in node.keywords if kw.arg not in (None, "priority")}
            for name, keys in _incident_entry_fields().items():
                calls.setdefault(name, []).append(keys | explicit)
            continue
        assert isinstance(event, ast.Constant) and isinstance(event.value, str), f"line {node.lineno}: event name"
        keys = set()
        for kw in node.keywords:
            if kw.arg is None:
                if is_fields_call(kw.value) or (isinstance(kw.value, ast.Name) and kw.value.id == "fields"):
                    keys |= record_keys
                else:
                    raise AssertionError(f"line {node.lineno}: unknown fields **{ast.unparse(kw.value)}")
            elif kw.arg != "priority":
                keys.add(kw.arg)
        calls.setdefault(event.value, []).append(keys)
    return calls


def _is_incident_entry_call(node: ast.Call) -> bool:
    """``log.event(name, message, priority=priority, ..., **fields)`` where name, message, priority
    and fields unpack :func:`opt_ds_ops.observe.incident_entries.incident_entry` (scoreslot)."""
    return (isinstance(node.args[0], ast.Name) and node.args[0].id == "name"
            and any(kw.arg is None and isinstance(kw.value, ast.Name) and kw.value.id == "fields" for kw in node.keywords))


def _incident_entry_fields() -> dict[str, set[str]]:
    """{event: the field names incident_entry gives it}, from a summary event of each kind."""
    from opt_ds_ops.observe.incident_entries import KINDS, incident_entry

    out = {}
    for kind in KINDS:
        name, _message, _priority, fields = incident_entry({"event": kind, "incident": 1, "row": 5}, model="m",
                                                           version="v", file="f.csv")
        assert name == kind
        out[name] = set(fields)
    return out


def sent_fields() -> dict[str, set[str]]:
    """Return {event: journal fields sent with every one of its events}: what EventLog.event really
    sends (MESSAGE, MESSAGE_ID, PRIORITY, SYSLOG_IDENTIFIER, CODE_*, DS_STAGE for job events) given
    the keywords that every call of that event in the daemon's modules passes. A field passed by only some
    calls is left out: where it is missing journalctl prints the placeholder's bare name. (A keyword
    whose value is None at run time is left out by EventLog too, which this cannot see: the catalog
    names such fields in plain text, without @...@.)"""
    calls = _event_calls()
    assert set(calls) <= set(MESSAGE_IDS), set(calls) - set(MESSAGE_IDS)
    allowed = {}
    for event in MESSAGE_IDS:
        keys = set.intersection(*calls[event]) if event in calls else set()
        got = []
        log = EventLog(journal=False)
        log._journal = type("Capture", (), {"send": staticmethod(lambda MESSAGE, **f: got.append(f))})
        log.event(event, "message", **{k: "x" for k in keys})
        allowed[event] = set(got[0]) | {"MESSAGE"}
    return allowed


def catalog_problems(entries: dict[str, dict], allowed: dict[str, set[str]]) -> list[str]:
    """Return what is wrong with the parsed catalog, one line each (empty: nothing)."""
    problems = []
    names = {mid: event for event, mid in MESSAGE_IDS.items()}
    for event, mid in MESSAGE_IDS.items():
        if mid not in entries and event not in ROUTINE:
            problems.append(f"{event} ({mid}): no catalog entry")
        elif mid in entries and event in ROUTINE:  # journalctl -x would repeat it under every line
            problems.append(f"{event} ({mid}): routine progress has a catalog entry")
    for mid, e in entries.items():
        event = names.get(mid)
        if event is None:
            problems.append(f"{mid}: not a MESSAGE_ID of opt_ds_ops/observe/journal.py")
            continue
        if not e["fields"].get("Subject", "").strip():
            problems.append(f"{event}: no Subject")
        if e["fields"].get("Defined-By") != "ds-ops":
            problems.append(f"{event}: Defined-By is not ds-ops")
        if "man:ds-ops(1)" not in e["fields"].get("Support", ""):
            problems.append(f"{event}: Support does not name man:ds-ops(1)")
        if e["lang"] is not None:
            problems.append(f"{event}: has a language ({e['lang']}); this file is the untranslated one")
        for name in sorted(set(PLACEHOLDER.findall(e["text"])) - allowed[event]):
            problems.append(f"{event}: @{name}@ is not sent with this event (sent: {sorted(allowed[event])})")
    return problems


def test_the_catalog_explains_every_message_id_with_fields_the_daemon_sends():
    entries = parse_catalog(CATALOG.read_text(encoding="utf-8"))
    assert catalog_problems(entries, sent_fields()) == []


def test_the_catalog_check_finds_a_missing_entry_a_missing_subject_and_an_unsent_field():
    allowed = sent_fields()
    # the derivation sees the daemon's calls: _fields's keys, per-call keywords, DS_STAGE of job events
    assert {"DS_JOB_ID", "DS_DATASET", "DS_DATASET_FILE", "DS_FAILED_STAGE", "DS_STAGE"} <= allowed["job-failed"]
    assert {"DS_EPOCH", "DS_EPOCHS", "DS_LOSS"} <= allowed["job-epoch"]
    assert {"DS_SPOOL", "DS_MODEL_DIR"} <= allowed["daemon-started"]
    assert not {f for f in allowed["watcher"] if f.startswith("DS_")}
    assert "DS_JOB_ID" not in allowed["job-claimed"]     # the older-ds-ops requeue sends only the file name
    assert "DS_VERDICT" not in allowed["health"]         # not when the check failed or hung
    assert {"MESSAGE", "MESSAGE_ID", "PRIORITY", "SYSLOG_IDENTIFIER", "CODE_FILE"} <= allowed["watcher"]
    ids = MESSAGE_IDS
    good = {e: f"-- {mid}\nSubject: s\nDefined-By: ds-ops\nSupport: man:ds-ops(1)\n\nText @MESSAGE_ID@.\n"
            for e, mid in ids.items() if e not in ROUTINE}
    text = "# comment\n\n" + "\n".join(good.values())
    assert catalog_problems(parse_catalog(text), allowed) == []
    missing = "\n".join(v for e, v in good.items() if e != "entry-busy")
    assert catalog_problems(parse_catalog(missing), allowed) == [f"entry-busy ({ids['entry-busy']}): no catalog entry"]
    no_subject = text.replace(f"-- {ids['job-saved']}\nSubject: s\n", f"-- {ids['job-saved']}\n")
    assert catalog_problems(parse_catalog(no_subject), allowed) == ["job-saved: no Subject"]
    unsent = text.replace(f"-- {ids['job-claimed']}\nSubject: s", f"-- {ids['job-claimed']}\nSubject: @DS_JOB_ID@")
    (problem,) = catalog_problems(parse_catalog(unsent), allowed)
    assert problem.startswith("job-claimed: @DS_JOB_ID@ is not sent with this event")
    epoch = text + f"\n-- {ids['job-epoch']}\nSubject: s\nDefined-By: ds-ops\nSupport: man:ds-ops(1)\n\nText.\n"
    assert catalog_problems(parse_catalog(epoch), allowed) == [
        f"job-epoch ({ids['job-epoch']}): routine progress has a catalog entry"]
    with pytest.raises(ValueError, match="before the first"):
        parse_catalog("Subject: s\n")


def test_the_package_installs_the_catalog_where_systemds_trigger_looks():
    # systemd's dpkg trigger: 'interest-noawait /usr/lib/systemd/catalog' -> journalctl --update-catalog
    install = (REPO / "debian" / "ds-ops.install").read_text().splitlines()
    assert f"debian/ds-ops.catalog {CATALOG_DIR}/" in install


def test_journalctl_accepts_the_catalog(tmp_path):
    """journalctl --update-catalog builds the database from the file (as the dpkg trigger does on
    install) under a temporary root, and --list-catalog shows every entry with its Subject."""
    journalctl = shutil.which("journalctl")
    if journalctl is None:
        pytest.skip("journalctl is not installed here (Debian package systemd); the catalog's own parse "
                    "is checked above, journalctl's only where systemd is installed")
    (tmp_path / CATALOG_DIR).mkdir(parents=True)
    shutil.copy(CATALOG, tmp_path / CATALOG_DIR / "ds-ops.catalog")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYSTEMD_")}
    r = subprocess.run([journalctl, f"--root={tmp_path}", "--update-catalog"], capture_output=True, text=True,
                       env=env, timeout=60)
    assert (r.returncode, r.stderr) == (0, ""), r.stderr
    assert (tmp_path / "var/lib/systemd/catalog/database").is_file()
    r = subprocess.run([journalctl, f"--root={tmp_path}", "--list-catalog", "--no-pager"], capture_output=True,
                       text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    listed = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    subjects = {mid: e["fields"]["Subject"] for mid, e in parse_catalog(CATALOG.read_text(encoding="utf-8")).items()}
    assert listed == {mid: f"ds-ops: {subjects[mid]}" for e, mid in MESSAGE_IDS.items() if e not in ROUTINE}
