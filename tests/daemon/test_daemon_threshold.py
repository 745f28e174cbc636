"""A threshold that holds, through the real daemon with the shipped conffile (only paths and the
spool's pace are the test's): a day of loud bursts does not raise the threshold that must page a
shift the day after; the same incident twice, three days apart, is paged twice (two known gaps of
the shipped conffile, reported as xfailed: test (b)'s docstring); a sustained level shift leaves
alarm within a bound and a real incident after it is paged; chunks across a short
gap score as the whole file does. Marked slow (make test-slow, run once in CI): each trains with the
shipped stopping rule and scores days of chunks."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from daemon_kit import Daemon, spool_dir, versions, write_config

pytestmark = pytest.mark.slow

T0 = 1_790_000_000.0  # 2026-09-21T14:13:20Z: one row a minute from here
DAY, CHUNK = 1440, 720
NAMES = [f"m{j}" for j in range(38)]


def write_rows(path, rows: np.ndarray, first: int, times: np.ndarray | None = None) -> None:
    """rows as a CSV with a time column (one row a minute from T0 + first minutes, or ``times``), by
    rename, as the puller writes them."""
    t = T0 + 60.0 * (first + np.arange(rows.shape[0])) if times is None else times
    part = path.with_name(path.name + ".part")
    with open(part, "w") as f:
        f.write("time," + ",".join(NAMES) + "\n")
        for ti, r in zip(t, rows):
            f.write(",".join([str(int(ti))] + [repr(float(v)) for v in r]) + "\n")
    os.rename(part, path)


class Series:
    """A daemon with model m trained on a quiet stretch of machine-1-2; score() drops a chunk and
    returns its summary."""

    def __init__(self, tmp_path, smd_rows, keys: tuple[str, ...] = ()):
        """``keys``: ``SECTION.KEY: VALUE`` on top of the shipped conffile."""
        self.tmp, self.keys = tmp_path, keys
        sections = {"scoring": [f"results_dir: {tmp_path / 'scores'}"]}
        for k in keys:
            section, _, rest = k.partition(".")
            sections.setdefault(section, []).append(rest)
        extra = [line for section, lines in sections.items() for line in [f"{section}:", *(f"  {x}" for x in lines)]]
        conf = write_config(tmp_path, shipped_training=True, scan_interval_s=0.5, extra=extra)
        self.train = smd_rows[12000:15000]
        self.std = self.train.std(axis=0) + 1e-3
        self.d = Daemon(conf)
        self.summaries = []
        self.d.wait_until(lambda: "ds-trainer ready" in self.d.log(), "the daemon to be ready", timeout_s=120)
        write_rows(spool_dir(tmp_path, "incoming") / "m.csv", self.train, 0)
        self.d.wait_until(lambda: len(versions(tmp_path, "m")) == 1, "the first model", timeout_s=300)
        self.at = self.train.shape[0]

    def score(self, rows: np.ndarray, times: np.ndarray | None = None) -> dict:
        write_rows(spool_dir(self.tmp, "score") / "m.csv", rows, self.at, times)
        self.d.wait_until(lambda: self.d.log().count(" scored with version ") > len(self.summaries)
                          or "failed in stage" in self.d.log(), "the chunk to be scored")
        assert "failed in stage" not in self.d.log(), self.d.log()
        self.d.wait_until(lambda: not any(spool_dir(self.tmp, "processing").iterdir()), "its jobs to end",
                          timeout_s=300)  # a retraining it made due ends before the next chunk: data time decides
        results = sorted(p for p in (self.tmp / "scores" / "m").iterdir() if p.is_dir() and not p.name.startswith("."))
        s = json.loads((results[-1] / "summary.json").read_text())
        self.summaries.append(s)
        self.at += rows.shape[0] if times is None else 0
        return s

    def opened_in(self, s: dict, lo: int, hi: int) -> list[dict]:
        """The chunk's incident-opened events at chunk rows lo..hi."""
        return [e for e in s["events"] if e["event"] == "incident-opened" and lo <= e["row"] - s["first_row"] <= hi]

    def close(self) -> None:
        rc, _ = self.d.stop()
        assert rc == 0, self.d.log()


def known_gap(what: str) -> None:
    """End a test of the shipped conffile as xfailed where it misses what the test asks (the score,
    docs/detection-protocol.md "Round 12: applied"; the budget, round 18): visible in every run, and
    a test that passes (the gap closed) needs no change to say so."""
    pytest.xfail(f"known gap of the shipped conffile: {what}")


@pytest.fixture
def series(tmp_path, smd_rows, request):
    s = Series(tmp_path, smd_rows, getattr(request, "param", ()))
    try:
        yield s
    finally:
        s.d.kill()


# The shipped score and budget before round 10 chose today's (levels alone, EMA 30, the budget learns
# every run, 1 alarm a day, no change of regime, no seed, one flagged row opens): what a conffile kept from then runs.
BEFORE_ROUND_10 = ("train.input_differences: false", "train.score_window: 30", "scoring.alarm_budget_learns: all",
                   "scoring.alarm_budget_per_day: 1", "scoring.regime_after_s: 0", "scoring.alarm_budget_history: false",
                   "scoring.incident_open_window_s: 0")
# A detection round's candidate on top of the shipped conffile (docs/detection-protocol.md): e.g.
# DS_OPS_THRESHOLD_KEYS='train.difference_term: max; train.score_window: 5' adds a configuration
# "candidate" to the bursts and repeat tests, judged as the shipped one is.
CANDIDATE = tuple(k.strip() for k in os.environ.get("DS_OPS_THRESHOLD_KEYS", "").split(";") if k.strip())
CONFIGS = [(), BEFORE_ROUND_10] + ([CANDIDATE] if CANDIDATE else [])
IDS = ["shipped", "before-round-10"] + (["candidate"] if CANDIDATE else [])


@pytest.mark.parametrize("series", CONFIGS, ids=IDS, indirect=True)
def test_a_day_of_loud_bursts_does_not_hide_a_shift_the_next_day(series, smd_rows):
    """Twelve 10-row bursts of 30 training SDs on ten metrics in one day (anyone who can load a
    host can make them) page; before, the alarm budget learned them and raised the threshold 318
    times in a day, until a 5-hour shift of three metrics the next day paged nothing. Now no day
    moves the threshold by more than 2 times, and a move that large is journalled at warning level.
    With the score and budget shipped before round 10 (levels, EMA 30, learns all) two days of
    bursts raise it 3.7 times and the shift is missed. With the shipped budget (learns
    ``warnings``) each burst opens as a warning (its first rows' smoothed score under twice the threshold) and
    escalates to critical rows later; until
    round 11's correction its first rows' runs, counted before the escalation, were learned, the
    threshold rose 1.9 times and the shift was missed: now those runs are held until the day ends
    and taken back when the incident escalates, and the shift is paged."""
    quiet = smd_rows[15000:15000 + 4 * DAY].copy()
    for b in range(12):
        i = 2 * DAY + b * 120 + 30
        quiet[i:i + 10, 0:10] += 30 * series.std[0:10]
    s0 = 3 * DAY + 120
    quiet[s0:s0 + 300, [3, 9, 20]] += 4 * series.std[[3, 9, 20]]
    summaries = [series.score(quiet[c:c + CHUNK]) for c in range(0, quiet.shape[0], CHUNK)]
    moves = [e for s in summaries for e in s["events"] if e["event"] == "threshold-calibrated"]
    print("threshold moves:", [(e["row"], round(e["previous"], 2), round(e["threshold"], 2), e.get("wanted")) for e in moves])
    assert all(max(e["threshold"] / e["previous"], e["previous"] / e["threshold"]) <= 2 + 1e-9 for e in moves), moves
    bursts = [e for s in summaries[4:6] for e in s["events"] if e["event"] == "incident-opened"]
    assert len(bursts) >= 6, bursts  # the bursts paged: the day the budget would learn them from
    shift = summaries[s0 // CHUNK]
    paged = series.opened_in(shift, s0 % CHUNK, s0 % CHUNK + 300)
    if series.keys != BEFORE_ROUND_10:
        assert paged, (shift["threshold"], shift["events"], moves)
    else:  # the budget before round 10 learns the bursts: bounded, and the bound's move said at warning level
        assert moves and any(e["far"] for e in moves), moves
        assert "held to 2 times" in series.d.log()
        assert not paged, "the budget before round 10 no longer learns the bursts: this test's expectation must change"
    series.close()


@pytest.mark.parametrize("sd", [6, 24], ids=["6sd", "24sd"])
@pytest.mark.parametrize("series", CONFIGS, ids=IDS, indirect=True)
def test_the_same_incident_three_days_apart_is_paged_both_times(series, smd_rows, sd):
    """A failure of 40 minutes on four metrics, ``sd`` training SDs, then the same failure three days
    later: before round 9, the first one's peak raised the next day's threshold near it and the
    repeat paged nobody for 14 days. With the score before round 10 both are paged, at 6 and 24 SDs.

    At 6 SDs the shipped score (round 21: the mean of a metric's change and level terms, EMA 5)
    does not page the first: it stays under the threshold in force (9.04; the model's 6.39). With
    rounds 12-20's larger term, measured: its scores (6-10) were under the model's own threshold, the 0.99
    quantile of its validation scores, which one event at the end of the training rows sets
    (machine-1-2's rows 14800-14811, m16 and m17 moved 57 and 121 SDs: the trainer warns the model
    suspect), and under the threshold the budget sets over day 0's scores (16.39 on the failure's
    day: none allowed on the first day). A floor under the model's (``scoring.alarm_budget_floor``)
    does not close that gap (round 16). A known gap, reported as xfailed.

    At 24 SDs the first is paged, as a warning (its peak under twice the threshold), and under the
    shipped ``alarm_budget_learns: warnings`` the budget learns a warning's runs: the next day's
    threshold rises from 16.39 to 23.18 with the larger term (10.30 to 12.25 with the mean), and
    the repeat pages nobody. A known gap of the shipped
    budget, reported as xfailed: the two rules that page it (``alarm_budget_learns: normal``, and
    ``incident_critical_ratio: 1.5``, whose incidents are critical and never learned) each took
    SMD over one false page a day in round 18 (1.87 and 1.77), and were not chosen."""
    quiet = smd_rows[15000:15000 + 5 * DAY].copy()
    for start in (DAY + 300, 4 * DAY + 300):
        quiet[start:start + 40, [4, 12, 16, 22]] += sd * series.std[[4, 12, 16, 22]]
    summaries = [series.score(quiet[c:c + CHUNK]) for c in range(0, quiet.shape[0], CHUNK)]
    first, again = (summaries[start // CHUNK] for start in (DAY + 300, 4 * DAY + 300))
    paged = [series.opened_in(s, start % CHUNK, start % CHUNK + 40) for s, start in ((first, DAY + 300),
                                                                                     (again, 4 * DAY + 300))]
    print(f"{sd} SDs: thresholds at the failures {first['threshold']:.2f}, {again['threshold']:.2f}; paged",
          [len(p) for p in paged])
    old = series.keys == BEFORE_ROUND_10
    if not paged[0] and not old and sd == 6:
        series.close()
        known_gap(f"the score (round 12): the failure at row {DAY + 300} is not paged at the threshold "
                  f"{first['threshold']:.2f}")
    assert paged[0], (first["threshold"], first["events"])
    # the known gap of the shipped budget, and only it: the first failure stayed a warning (an escalation
    # takes its runs back: a repeat missed then is a regression), and a day's calibration after it
    # raised the threshold over the one that paged it
    between = [e for s in summaries[(DAY + 300) // CHUNK:(4 * DAY + 300) // CHUNK + 1] for e in s["events"]]
    learned = [e for e in between if e["event"] == "threshold-calibrated" and e["row"] > DAY + 300
               and e["threshold"] > paged[0][0]["threshold"]]
    escalated = [e for e in between if e["event"] == "incident-escalated" and e["incident"] == paged[0][0]["incident"]]
    learns = dict(k.replace(" ", "").split(":", 1) for k in series.keys).get("scoring.alarm_budget_learns", "warnings")
    if not paged[1] and not old and sd == 24 and learns == "warnings" and not escalated and learned:
        series.close()
        known_gap(f"the budget (round 18): the repeat meets a threshold of {again['threshold']:.2f}, raised by the "
                  f"first failure, a warning (alarm_budget_learns: warnings learns its runs): {learned}")
    assert paged[1], ("the repeat three days later", again["threshold"], again["events"])  # the bug this test is for
    series.close()


def test_a_sustained_level_shift_leaves_alarm_within_two_days_and_a_real_incident_after_it_pages(series, smd_rows):
    """Three metrics move for good. Within two days of data the series is out of alarm and a real
    incident on the new levels, after a quiet stretch, is paged: the change of regime
    (``scoring.regime_after_s``, 6 hours as shipped since round 10) re-baselines the series. Before
    round 10 (regime off) the series left alarm too (the drift trigger retrained on the new levels
    within 1.75 days), but the version retrained on both levels missed this incident: round 9's note."""
    rows = smd_rows[15000:15000 + 5 * DAY + CHUNK].copy()
    rows[DAY // 2:, [3, 9, 20]] += 8 * series.std[[3, 9, 20]]  # from half a day in, for good
    summaries = [series.score(rows[c:c + CHUNK]) for c in range(0, 4 * DAY, CHUNK)]
    print("per chunk (flagged, active, version):", [(s["flagged"], s["active"], s["version"][-8:]) for s in summaries])
    quiet_from = next((k for k, s in enumerate(summaries) if k >= 1 and not s["active"] and s["flagged"] < 0.05 * CHUNK),
                      None)
    assert quiet_from is not None and quiet_from * CHUNK - DAY // 2 <= 2 * DAY, "still in alarm two days on"
    assert all(not s["active"] for s in summaries[quiet_from:]), "back in alarm on the new levels"
    burst = rows[4 * DAY:5 * DAY].copy()
    burst[CHUNK + 300:CHUNK + 330] += 6 * series.std  # a real incident on the new levels
    calm = series.score(burst[:CHUNK])
    assert not calm["active"], calm["events"]
    s = series.score(burst[CHUNK:])
    print("burst chunk first_row", s["first_row"], [(e["event"], e["row"] - s["first_row"], e.get("severity"))
                                                     for e in s["events"]])
    assert not series.opened_in(s, 0, 294), s["events"]  # nothing open before it: the incident is its own
    assert series.opened_in(s, 295, 330), s["events"]
    series.close()


def test_chunks_across_a_short_gap_score_as_the_whole_file(tmp_path, smd_rows):
    """Four chunks with five rows missing between the second and the third (under
    scoring.max_gap_periods) score as the same rows in one file (rows.csv's 6 significant digits), whatever the model reads."""
    rows = smd_rows[15000:15000 + 2 * DAY]
    times = T0 + 60.0 * (3000 + np.arange(rows.shape[0]))
    times[DAY:] += 300.0
    got = {}
    for how in ("chunks", "whole"):
        root = tmp_path / how
        root.mkdir()
        s = Series(root, smd_rows)
        try:
            parts = [slice(0, CHUNK), slice(CHUNK, DAY), slice(DAY, DAY + CHUNK), slice(DAY + CHUNK, 2 * DAY)]
            for p in parts if how == "chunks" else [slice(0, 2 * DAY)]:
                summary = s.score(rows[p], times[p])
                assert summary["resets"] == [], summary["resets"]
            s.close()
        finally:
            s.d.kill()
        scores = []
        for res in sorted(p for p in (root / "scores" / "m").iterdir() if p.is_dir() and not p.name.startswith(".")):
            with open(res / "rows.csv") as f:
                scores += [float(line.split(",")[2]) for line in f.read().splitlines()[1:]]
        got[how] = np.array(scores)
    assert got["chunks"].shape == got["whole"].shape == (2 * DAY,)
    np.testing.assert_allclose(got["chunks"], got["whole"], rtol=1e-5, atol=1e-6)  # rows.csv: 6 significant digits
