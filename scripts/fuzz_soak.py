#!/usr/bin/env python3
"""Daemon fuzz soak: hostile drops and good datasets while the ds-trainer daemon is SIGKILLed at random.

Built on scripts/soak.py (its daemon, spool, kill schedule, good datasets and checks), with a second
member of group ds-ops who drops everything docs/development-soak.md names:

* The daemon runs as root without CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH and CAP_FOWNER (as the
  unit's user would). Good datasets (``--good``, small real SMD slices as in soak.py, 1 epoch) are
  dropped the safe ways by ``--writers`` threads as uid 12345; ``--hostile`` items by
  ``--hostile-writers`` threads as uid 12346, both members of the spool's group.
* Hostile kinds, in equal shares (each item is ``fzNNNN...``; its kind and variant are recorded):
  ``flip`` and ``truncate`` (byte-flipped / cut copies of a good file of every format the readers
  take: .csv .csv.gz .tsv .txt .npy .npz .pt .parquet .feather .arrow), ``random`` bytes under a
  dataset suffix, ``sidecar`` (a random ``NAME.yaml`` from a small YAML grammar: mixed key types,
  deep nesting, unknown keys, wrong types, over 64 KiB, aliases, tags, non-UTF-8, tricky ``name:``;
  then its dataset), ``directory``, ``fifo`` and ``symlink`` (under a dataset's or a sidecar's
  name), ``foreign-0600`` (a good file of the other uid, mode 0600), ``oversize`` (over
  ``spool.max_dataset_bytes``), ``held-open`` (a good file another process keeps open for 1-20 s),
  ``stalled-writer`` (a good file written under its final name with a 0.5-8 s stall mid-write),
  ``bad-name`` (unknown or wrong suffix, spaces, newline, non-ASCII, 250 bytes), ``future-mtime``
  (random bytes dated 2100, which must not age out anyone else's failures), ``sparse`` (almost 4
  MiB of hole and one line: the daemon's copy in failed/ must keep the hole), and ``squat``:
  before the writers start, the hostile member drops ``soakNNNN.yaml`` (options, ``name:``, bad
  YAML, a directory or a FIFO) for good datasets that are dropped later by the other member.
* Two kinds in the scoring spool, drawn apart (``--score-squats``, ``--failed-retrains``):
  ``score-squat``: the hostile member creates in score/ the sidecar name the other member's next
  chunk will use (``fzNNNN-<stamp>.yaml``, docs/alerts.md's exporter naming: ``model:`` of a good
  model, of a model that does not exist, or random YAML), then the other member's chunk arrives
  without its own sidecar (its ``mv`` was refused by the sticky bit); the chunk must be refused
  into failed/ saying the sidecar is another member's, never scored under any model, and the
  squatting sidecar refused beside it. ``failed-retrain``: the hostile member trains a model of
  its own, then drops four chunks in a row into score/ that it flags from end to end (an
  incident shorter than ``retrain.exclude_max_rows``, so a retraining leaves no normal row); with
  the soak's ``retrain.every: 1s``, the first chunk queues a retraining that fails, and the
  failure must back off: at most two failed retrainings of that model (one more only if a kill
  fell between the failure and its record), every chunk scored, a ``retrain-failed.json`` beside
  its results.
* The daemon is SIGKILLed ``--kills`` times on soak.py's schedule and started again at once; every
  10 kills ``ds-ops status --json`` must answer. Then the last daemon drains the spool.

Checks at the end: every good dataset trained exactly once (soak.py's result and model checks:
sha256, model name, rows and columns, one version, ``current`` loads) whatever was squatted on its
sidecar name; every hostile regular file handled exactly once, in done/ or in failed/ with an
error.json reason; every hostile entry that is not a regular file still in incoming/ and listed
by ``ds-ops status`` as ignored; a squatted sidecar taken with its dataset or left and listed; no
other entry in done/, failed/ or incoming/; no daemon exited but by the harness's kills (each was
alive when killed, the last one answers ``ds-ops status`` with its pid and exits 0 on SIGTERM);
processing/ empty, no ``.tmp-*``/``.current-*`` under the spool, models/ or the metrics directory,
nothing left in the daemons' TMPDIR, no process of any daemon's session after the stop; the peak
RSS (VmHWM) of every daemon under ``--max-rss-mib``.

Prints the seed, items per kind, good datasets, kills, outcomes per kind and the peak RSS; exits 1
with one line per failure (root kept) on any failure. Deterministic given ``--seed`` (the items,
their bytes, the kill delays); the interleaving with the daemon is real time.

Usage: scripts/fuzz_soak.py [--hostile 500] [--kills 50] [--good 30] [--seed 18] [--max-rss-mib 1024]
                            [--max-jobs 2] [--timeout-s 900] [--root DIR] [--keep] [soak.py's kill options]
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak import (  # noqa: E402 - this directory first
    OTHER_UID, READY_TIMEOUT_S, REPO, Daemon, Datasets, SoakFailure, Writers, add_common_arguments,
    check_common_arguments, check_models, check_results, daemon_env, died_before_kill, kill_phase_estimate_s,
    kill_everything, kill_schedule, peak_rss_kib, session_processes, soak_root, timed_kill, write_config,
)

HOSTILE_UID = OTHER_UID + 1  # the member who drops the hostile items (not the good datasets' owner)
MAX_DATASET_BYTES = 4 * 1024 * 1024  # spool.max_dataset_bytes of the soak (the largest good one is ~0.7 MB)
SEED_FORMATS = (".csv", ".csv.gz", ".tsv", ".txt", ".npy", ".npz", ".pt", ".parquet", ".feather", ".arrow")
KINDS = ("flip", "truncate", "random", "sidecar", "directory", "fifo", "symlink", "foreign-0600", "oversize",
         "held-open", "stalled-writer", "bad-name", "future-mtime", "sparse")  # and "squat", drawn apart (it needs a good dataset)
SQUAT_SHARE = 0.2  # of the good datasets get a squatted sidecar
SCORE_KINDS = ("score-squat", "failed-retrain")  # drawn apart: counts --score-squats, --failed-retrains
RETRAIN_CHUNKS = 4  # chunks a failed-retrain item drops, one after the other
RETRAIN_CHUNK_ROWS = 60  # rows of a flagged chunk
# seconds between a flagged chunk's rows: the four chunks span 40 min of data, inside the first
# back-off (counted on the data's clock, an hour), so a second failed retraining means the back-off
# did not hold (or a kill fell between a failure and its record), not that the data outran it
RETRAIN_STEP_S = 10
SCORE_WAIT_S = 600.0  # how long a scoring item waits for its model, or for its chunk to be taken (and never past --timeout-s)
STATUS_TIMEOUT_S = 60.0
STATUS_EVERY_KILLS = 10
SETTLED_S = 3.0  # the drain is over when the spool stayed settled this long
DS_OPS_TEMPS = ("ds-ops", ".tmp-", ".probe-")  # what ds-ops itself may leave in TMPDIR
MAX_SELF_EXITS = 3  # a daemon that exits by itself this often while draining is in a restart loop
HOLD_SRC = "import os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY | os.O_NONBLOCK); time.sleep(float(sys.argv[2]))"


# ---- the hostile items -------------------------------------------------------------------------

def seed_files(matrix: np.ndarray) -> dict[str, bytes]:
    """A good file of every format the readers take: 300 SMD rows x 8 columns (plus a time column
    where the format has names); the bytes the flipped and truncated items start from."""
    import pyarrow as pa
    import pyarrow.feather as feather
    import pyarrow.parquet as pq
    import torch

    m = np.ascontiguousarray(matrix[:300, :8], dtype=np.float32)
    stamps = [f"2024-01-01T00:{i // 60:02d}:{i % 60:02d}Z" for i in range(len(m))]
    header = ",".join(["timestamp"] + [f"m{c}" for c in range(m.shape[1])])
    rows = [",".join([t] + [f"{v:.6g}" for v in row]) for t, row in zip(stamps, m)]
    csv = ("\n".join([header] + rows) + "\n").encode()
    out = {".csv": csv, ".csv.gz": gzip.compress(csv, mtime=0), ".tsv": csv.replace(b",", b"\t"),
           ".txt": ("\n".join(" ".join(f"{v:.6g}" for v in row) for row in m) + "\n").encode()}
    buf = io.BytesIO()
    np.save(buf, m)
    out[".npy"] = buf.getvalue()
    buf = io.BytesIO()
    np.savez(buf, data=m)
    out[".npz"] = buf.getvalue()
    buf = io.BytesIO()
    torch.save(torch.from_numpy(m.copy()), buf)
    out[".pt"] = buf.getvalue()
    table = pa.table({"timestamp": pa.array(stamps), **{f"m{c}": pa.array(m[:, c]) for c in range(m.shape[1])}})
    for suffix, write in ((".parquet", pq.write_table), (".feather", feather.write_feather)):
        sink = pa.BufferOutputStream()
        write(table, sink)
        out[suffix] = sink.getvalue().to_pybytes()
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table, max_chunksize=100)
    out[".arrow"] = sink.getvalue().to_pybytes()
    return out


def _yaml(obj) -> bytes:
    import yaml
    return yaml.safe_dump(obj, sort_keys=False, allow_unicode=True).encode()


def _word(rng: random.Random) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrtuvwxyz_0123456789") for _ in range(rng.randint(1, 12)))


def _wrong_value(rng: random.Random):
    return rng.choice([[1, [2, [3]]], {"a": {"b": 1}}, 10 ** 100, -1, 1.5e308, float("nan"), True, None, "",
                       "x" * rng.randint(1, 5000), [None], {1: 2, "k": [True]}])


def random_sidecar(rng: random.Random) -> tuple[str, bytes]:
    """(variant, bytes) of a random sidecar from a small grammar of what a member may write."""
    variant = rng.choice(("valid", "mixed-keys", "deep-list", "deep-map", "unknown-key", "wrong-type", "huge",
                          "aliases", "non-utf8", "tags", "multi-doc", "name-tricks", "not-a-mapping", "empty"))
    valid = {"time_column": rng.choice(["auto", "none", "timestamp", "1", 1]),
             "columns": rng.sample(["m0", "m1", "m2", "m3", 2, 3], rng.randint(0, 4)),
             "exclude_columns": rng.sample(["m4", "m5", 6], rng.randint(0, 2)),
             "time_order": rng.choice(["sort", "refuse"]), "name": f"fz-{_word(rng)}"}
    chosen = dict(rng.sample(sorted(valid.items(), key=str), rng.randint(0, len(valid))))
    if variant == "valid":
        data = _yaml(chosen)
    elif variant == "mixed-keys":
        keys = [1, "foo", True, None, 1.5, "name", -3]
        data = _yaml({k: _word(rng) for k in rng.sample(keys, rng.randint(2, len(keys)))})
        if rng.random() < 0.3:
            data += b"? [a, b]\n: c\n"  # a sequence as a key
    elif variant == "deep-list":
        n = rng.choice([50, 1000, 5000, 20000, 60000])
        data = b"columns: " + b"[" * n + (b"]" * n if rng.random() < 0.5 else b"")
    elif variant == "deep-map":
        n = rng.choice([50, 1000, 5000, 20000])
        data = b"columns: " + b"{a: " * n + b"1" + b"}" * n
    elif variant == "unknown-key":
        data = _yaml(dict(chosen, **{_word(rng): _wrong_value(rng) for _ in range(rng.randint(1, 5))}))
    elif variant == "wrong-type":
        key = rng.choice(["time_column", "columns", "exclude_columns", "time_order", "name"])
        data = _yaml(dict(chosen, **{key: _wrong_value(rng)}))
    elif variant == "huge":
        n = rng.randint(7000, 30000)
        data = ("columns: [" + ", ".join(f"c{i}" for i in range(n)) + "]\n").encode()
    elif variant == "aliases":  # a "billion laughs" kept to at most 8**6 (262144) leaves
        levels, width = rng.randint(3, 6), rng.randint(4, 8)
        lines = ["a0: &a0 [x]"] + [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]" for i in range(1, levels + 1)]
        data = ("\n".join(lines) + f"\nname: *a{levels}\ncolumns: *a{levels}\n").encode()
    elif variant == "non-utf8":
        data = b"name: \xff\xfe" + rng.randbytes(rng.randint(1, 200))
    elif variant == "tags":
        data = rng.choice([b"name: !!python/object/apply:os.system ['true']\n", b"columns: !!binary aGVsbG8=\n",
                           b"columns: !!set {a, b}\n", b"name: !!timestamp 2001-12-14\n", b"time_column: !custom x\n"])
    elif variant == "multi-doc":
        data = _yaml(chosen) + b"---\n" + _yaml({"name": f"fz-{_word(rng)}"})
    elif variant == "name-tricks":
        data = _yaml(dict(chosen, name=rng.choice(["../../etc/x", "a/b", ".", "..", "-rf", "x" * 1000, "名前",
                                                   " ", "\t", 12345, "fz\nnl", ".hidden", "CON", "fz:colon"])))
    elif variant == "not-a-mapping":
        data = rng.choice([b"just text\n", b"- a\n- b\n", b"42\n", b"[1, 2\n", b"{a: 1\n", b"\x00\x01\x02"])
    else:
        data = rng.choice([b"", b"# only a comment\n", b"\n\n", b"~\n"])
    return variant, data.replace(b"soak", b"so_k")  # a hostile name never lands on a good dataset's model


def _flip(data: bytes, rng: random.Random) -> bytes:
    out = bytearray(data)
    for _ in range(rng.choice([1, 2, 4, 16, 64])):
        i = rng.randrange(len(out))
        out[i] ^= rng.randint(1, 255)
    return bytes(out)


class Hostile:
    """The hostile member: the plan of every item (deterministic given the seed), the threads that
    drop them, the processes that hold files open and the writers that stall."""

    def __init__(self, count: int, squat_targets: list[dict], seed: int, seeds: dict[str, bytes], dirs: dict[str, Path],
                 threads: int, mean_gap_s: float, score_kinds: dict[str, int] | None = None,
                 good_models: list[str] = ()):
        self.seeds, self.dirs, self.mean_gap_s, self.good_models = seeds, dirs, mean_gap_s, list(good_models)
        rng = random.Random(seed * 31 + 5)
        self.squats = [{"index": i, "kind": "squat", "target": t["name"]} for i, t in enumerate(squat_targets)]
        apart = [k for k, n in (score_kinds or {}).items() for _ in range(n)]
        kinds = [KINDS[i % len(KINDS)] for i in range(max(0, count - len(self.squats) - len(apart)))] + apart
        rng.shuffle(kinds)
        self.stop_event = threading.Event()
        self.deadline = float("inf")  # time.monotonic() past which a scoring item stops waiting (main sets it)
        self.items = self.squats + [{"index": len(self.squats) + i, "kind": k} for i, k in enumerate(kinds)]
        self.seeds_by_item = {it["index"]: seed * 100003 + it["index"] for it in self.items}
        self.errors: list[str] = []
        self.holders: list[subprocess.Popen] = []
        self.stallers: list[threading.Thread] = []
        self._lock = threading.Lock()
        order = [it for it in self.items if it["kind"] != "squat"]
        self.threads = [threading.Thread(target=self._run, args=(order[w::threads], seed * 1000 + 500 + w),
                                         name=f"hostile-{w}", daemon=True) for w in range(threads)]

    # the drops ---------------------------------------------------------------------------------
    def _own(self, path: Path, mode: int = 0o640, uid: int = HOSTILE_UID) -> None:
        """Give path to uid (the hostile member by default) with mode (a symlink keeps its mode)."""
        if not path.is_symlink():
            os.chmod(path, mode)
        if os.geteuid() == 0:
            os.lchown(path, uid, -1)

    def _drop_file(self, name: str, data: bytes, mode: int = 0o640, mtime: float | None = None,
                   where: str = "incoming", uid: int = HOSTILE_UID) -> None:
        """Write under a hidden name in ``where`` (incoming or score), give it to uid (``mtime``:
        dated so), rename to NAME (the safe way)."""
        tmp = self.dirs[where] / f".fz-tmp-{os.getpid()}-{threading.get_ident()}"
        tmp.write_bytes(data)
        if mtime is not None:
            os.utime(tmp, (mtime, mtime))
        self._own(tmp, mode, uid)
        os.rename(tmp, self.dirs[where] / name)

    def _stalled_write(self, name: str, data: bytes, cut: int, stall_s: float) -> None:
        try:
            fd = os.open(self.dirs["incoming"] / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
            try:
                if os.geteuid() == 0:
                    os.fchown(fd, HOSTILE_UID, -1)
                os.write(fd, data[:cut])
                time.sleep(stall_s)
                os.write(fd, data[cut:])
            finally:
                os.close(fd)
        except OSError as e:
            with self._lock:
                self.errors.append(f"stalled writer of {name}: {e}")

    def drop_squats(self) -> None:
        """The squatted sidecars, before any good dataset is dropped."""
        for it in self.squats:
            rng = random.Random(self.seeds_by_item[it["index"]])
            stem = it["target"].split(".")[0]
            name = f"{stem}{rng.choice(['.yaml', '.yml'])}"
            how = rng.choice(["options", "redirect", "options", "random", "directory", "fifo"])
            path = self.dirs["incoming"] / name
            if how == "directory":
                path.mkdir()
                self._own(path, 0o755)
            elif how == "fifo":
                os.mkfifo(path)
                self._own(path, 0o660)
            else:
                data = {"options": _yaml({"columns": [1], "time_order": "refuse"}),
                        "redirect": _yaml({"name": f"fz-stolen-{it['index']}"}),
                        "random": random_sidecar(rng)[1]}[how]
                self._drop_file(name, data)
            it.update(variant=how, entries=[name], regular=[] if how in ("directory", "fifo") else [name],
                      dataset=None, sidecar=name, dropped_at=time.time())

    def make(self, it: dict) -> None:
        """Drop item it into incoming/; record its entries (names), which are regular files, its
        dataset (the regular file a job is expected for) and sidecar."""
        rng = random.Random(self.seeds_by_item[it["index"]])
        kind, stem = it["kind"], f"fz{it['index']:04d}"
        inc = self.dirs["incoming"]
        good_csv = self.seeds[".csv"]
        fmt = rng.choice(SEED_FORMATS)
        entries, regular, dataset, sidecar, variant = [], [], None, None, fmt
        if kind in ("flip", "truncate"):
            data = self.seeds[fmt]
            data = _flip(data, rng) if kind == "flip" else data[:rng.randint(1, len(data) - 1)]
            dataset = stem + fmt
            self._drop_file(dataset, data)
        elif kind == "random":
            dataset = stem + fmt
            self._drop_file(dataset, rng.randbytes(rng.randint(1, 8192)))
        elif kind == "sidecar":
            variant, side = random_sidecar(rng)
            sidecar, dataset = f"{stem}{rng.choice(['.yaml', '.yml'])}", stem + ".csv"
            self._drop_file(sidecar, side)
            self._drop_file(dataset, good_csv)
        elif kind in ("directory", "fifo", "symlink"):
            variant = rng.choice(["dataset", "dataset", "sidecar"])
            as_sidecar = variant == "sidecar"
            name = stem + (".yaml" if as_sidecar else fmt)
            path = inc / name
            if kind == "directory":
                path.mkdir()
                (path / "inside.csv").write_bytes(good_csv)
                self._own(path / "inside.csv")
                self._own(path, rng.choice([0o700, 0o755, 0o3770]))
            elif kind == "fifo":
                os.mkfifo(path)
                self._own(path, 0o660)
            else:
                target = rng.choice([str(self.dirs["staging"] / "good.csv"), "/etc/shadow", "../done", "nowhere",
                                     name, "/dev/zero", "/proc/self/mem", "../processing"])
                os.symlink(target, path)
                self._own(path)
                variant += f" -> {target}"
            entries.append(name)
            if as_sidecar:  # a non-regular sidecar, then its dataset
                sidecar, dataset = name, stem + ".csv"
                self._drop_file(dataset, good_csv)
        elif kind == "foreign-0600":
            dataset = stem + fmt
            self._drop_file(dataset, self.seeds[fmt], mode=0o600)
        elif kind == "oversize":
            dataset = stem + rng.choice([".csv", ".npy", ".parquet"])
            tmp = inc / f".fz-big-{it['index']}"
            with open(tmp, "wb") as f:
                f.write(good_csv)
                f.truncate(MAX_DATASET_BYTES + rng.randint(1, 1 << 20))  # sparse: no disk spent
            self._own(tmp)
            os.rename(tmp, inc / dataset)
        elif kind == "held-open":
            dataset = stem + fmt
            self._drop_file(dataset, self.seeds[fmt])
            hold_s = rng.uniform(1, 20)
            variant += f" held {hold_s:.1f} s"
            self.holders.append(subprocess.Popen(
                [sys.executable, "-c", HOLD_SRC, str(inc / dataset), f"{hold_s:.2f}"], stdin=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, **({"user": HOSTILE_UID} if os.geteuid() == 0 else {})))
        elif kind == "stalled-writer":
            dataset = stem + fmt
            data = self.seeds[fmt]
            stall_s = rng.uniform(0.5, 8)
            variant += f" stalled {stall_s:.1f} s"
            t = threading.Thread(target=self._stalled_write, args=(dataset, data, rng.randint(1, len(data) - 1), stall_s),
                                 daemon=True)
            self.stallers.append(t)
            t.start()
        elif kind == "bad-name":
            variant = rng.choice(["unknown-suffix", "no-suffix", "space", "newline", "non-ascii", "long",
                                  "upper-suffix", "wrong-format", "double-suffix"])
            dataset = {"unknown-suffix": f"{stem}.xlsx", "no-suffix": stem, "space": f"{stem} with space.csv",
                       "newline": f"{stem}\nline.csv", "non-ascii": f"{stem}-ünïcødé-数据.csv",
                       "long": f"{stem}-" + "x" * (250 - len(stem) - 5) + ".csv", "upper-suffix": f"{stem}.CSV",
                       "wrong-format": f"{stem}{rng.choice(['.npy', '.parquet', '.pt', '.csv.gz'])}",
                       "double-suffix": f"{stem}.yaml.csv"}[variant]
            self._drop_file(dataset, good_csv)
        elif kind == "future-mtime":  # a failing file dated 2100: it must not age out anyone else's failures
            dataset = stem + fmt
            self._drop_file(dataset, rng.randbytes(rng.randint(1, 4096)), mtime=4_102_444_800.0)
        elif kind == "sparse":  # almost all hole, within max_dataset_bytes: the daemon's copy keeps the holes
            dataset = stem + ".csv"
            tmp = inc / f".fz-sparse-{it['index']}"
            with open(tmp, "wb") as f:
                f.truncate(MAX_DATASET_BYTES - 4096)
                f.seek(0, os.SEEK_END)
                f.write(b"1,2\n")
            self._own(tmp)
            os.rename(tmp, inc / dataset)
        elif kind == "score-squat":
            variant, sidecar, dataset = self._score_squat(stem, rng)
            entries += [sidecar, dataset]
            regular += [sidecar, dataset]
            it.update(variant=variant, entries=entries, regular=regular, dataset=dataset, sidecar=sidecar,
                      drop="score", dropped_at=time.time())
            return
        elif kind == "failed-retrain":
            dataset = stem + ".csv"
            self._drop_file(dataset, good_csv)  # its own model, trained from a good file
            t = threading.Thread(target=self._flagged_chunks, args=(stem, it), daemon=True)
            self.stallers.append(t)
            t.start()
            variant = f"{RETRAIN_CHUNKS} chunks flagged end to end"
        if dataset is not None:
            entries.append(dataset)
            regular.append(dataset)
        if sidecar is not None and sidecar not in entries:
            entries.append(sidecar)
            regular.append(sidecar)
        it.update(variant=variant, entries=entries, regular=regular, dataset=dataset, sidecar=sidecar,
                  dropped_at=time.time())

    def _chunk_csv(self, rows: int, shift: float = 0.0, start_s: int = 0, step_s: int = 60) -> bytes:
        """A chunk of the good CSV's columns (a time column and m0..m7), its rows shifted by
        ``shift``, timed from 2024-01-01 plus ``start_s``, ``step_s`` apart."""
        lines = self.seeds[".csv"].decode().splitlines()
        out = [lines[0]]
        for i, line in enumerate(lines[1 : rows + 1]):
            cells = line.split(",")
            t = start_s + i * step_s
            out.append(",".join([f"2024-01-{1 + t // 86400:02d}T{t // 3600 % 24:02d}:{t // 60 % 60:02d}:{t % 60:02d}Z"]
                                + [f"{float(v) + shift:.6g}" for v in cells[1:]]))
        return ("\n".join(out) + "\n").encode()

    def _score_squat(self, stem: str, rng: random.Random) -> tuple[str, str, str]:
        """The hostile member takes the other member's next sidecar name in score/; the other member's
        chunk comes without it (its mv refused). Return (variant, sidecar name, chunk name)."""
        base = f"{stem}-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}"
        variant = rng.choice(["good-model", "no-such-model", "random"])
        side = {"good-model": _yaml({"model": rng.choice(self.good_models or ["soak0000"])}),
                "no-such-model": _yaml({"model": f"fz-stolen-{stem}"}),
                "random": random_sidecar(rng)[1]}[variant]
        self._drop_file(base + ".yaml", side, where="score")
        time.sleep(rng.uniform(0.0, 0.3))  # the other member's exporter, a moment later
        self._drop_file(base + ".csv", self._chunk_csv(5), where="score", uid=OTHER_UID)
        return variant, base + ".yaml", base + ".csv"

    def _flagged_chunks(self, stem: str, it: dict) -> None:
        """Once model stem is current, drop RETRAIN_CHUNKS chunks that it flags end to end, each
        after the one before was taken; record the chunks dropped in it["chunks"]."""
        current = self.dirs["models"] / stem / "current"
        it["chunks"] = 0
        limit = min(time.monotonic() + SCORE_WAIT_S, self.deadline)
        try:
            while not current.exists():
                if self.stop_event.is_set() or time.monotonic() > limit:
                    raise OSError(f"model {stem} was not trained in time (--timeout-s, or {SCORE_WAIT_S:.0f} s)")
                time.sleep(0.2)
            for c in range(RETRAIN_CHUNKS):
                chunk = self.dirs["score"] / f"{stem}.csv"
                limit = min(time.monotonic() + SCORE_WAIT_S, self.deadline)
                while chunk.exists():
                    if self.stop_event.is_set() or time.monotonic() > limit:
                        raise OSError(f"score/{chunk.name} was not taken in time (--timeout-s, or {SCORE_WAIT_S:.0f} s)")
                    time.sleep(0.1)
                start_s = 36000 + c * RETRAIN_CHUNK_ROWS * RETRAIN_STEP_S
                self._drop_file(chunk.name, self._chunk_csv(RETRAIN_CHUNK_ROWS, shift=1000.0, start_s=start_s,
                                                            step_s=RETRAIN_STEP_S), where="score")
                it["chunks"] = c + 1
        except OSError as e:
            with self._lock:
                self.errors.append(f"failed-retrain item {stem}: {e}")

    def _run(self, items: list[dict], seed: int) -> None:
        rng = random.Random(seed)
        for it in items:
            time.sleep(0.0 if rng.random() < 0.2 else rng.uniform(0, 2 * self.mean_gap_s))
            try:
                self.make(it)
            except Exception as e:  # noqa: BLE001 - the soak's own fault: reported as a failure
                with self._lock:
                    self.errors.append(f"hostile item {it['index']} ({it['kind']}): {type(e).__name__}: {e}")

    def start(self) -> None:
        (self.dirs["staging"] / "good.csv").write_bytes(self.seeds[".csv"])  # a symlink's readable target
        for t in self.threads:
            t.start()

    def join(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for t in self.threads + self.stallers:
            t.join(max(0.0, deadline - time.monotonic()))
        for p in self.holders:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise SoakFailure(f"a holder process ({p.pid}) still runs after {timeout_s:.0f} s") from None
        if any(t.is_alive() for t in self.threads + self.stallers):
            raise SoakFailure(f"hostile writers still running after {timeout_s:.0f} s")

    def stop(self) -> None:
        self.stop_event.set()
        for p in self.holders:
            if p.poll() is None:
                p.kill()
                p.wait()


# ---- the checks --------------------------------------------------------------------------------

def status_json(conf: Path) -> dict:
    """``ds-ops status --json`` as a member would run it; raise SoakFailure if it does not answer."""
    try:
        proc = subprocess.run([sys.executable, "-m", "opt_ds_ops.cli", "status", "--config", str(conf), "--json"],
                              capture_output=True, text=True, cwd=REPO, env=daemon_env(), timeout=STATUS_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise SoakFailure(f"ds-ops status did not answer within {STATUS_TIMEOUT_S:.0f} s") from None
    if proc.returncode != 0:
        raise SoakFailure(f"ds-ops status exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
    try:
        return json.loads(proc.stdout)
    except ValueError:
        raise SoakFailure(f"ds-ops status --json printed no JSON: {proc.stdout[:300]!r}") from None


def finished_docs(dirs: dict[str, Path]) -> tuple[dict[str, list[tuple[str, dict]]], list[str]]:
    """{dataset name: [(done|failed, its JSON)]} from every result.json and error.json; and the
    failures found on the way (an entry without its JSON, a JSON without a reason, a hidden file)."""
    from opt_ds_ops.spool import ERROR_SUFFIX, RESULT_SUFFIX, SIDECAR_SUFFIX, sidecar_name

    by_name: dict[str, list[tuple[str, dict]]] = defaultdict(list)
    fails = []
    for which, suffix in (("done", RESULT_SUFFIX), ("failed", ERROR_SUFFIX)):
        entries = set(os.listdir(dirs[which]))
        for n in sorted(entries):
            if n.startswith("."):
                fails.append(f"{which}/{n} left behind (a write cut short, never cleaned up)")
            elif n.endswith(suffix):
                try:
                    doc = json.loads((dirs[which] / n).read_text())
                except (OSError, ValueError) as e:
                    fails.append(f"{which}/{n} unreadable: {e}")
                    continue
                by_name[str(doc.get("dataset"))].append((which, doc))
                if which == "failed" and not (isinstance(doc.get("reason"), str) and doc["reason"].strip()):
                    fails.append(f"failed/{n}: no reason ({doc})")
            elif not n.endswith(SIDECAR_SUFFIX) and sidecar_name(n, suffix) not in entries:
                fails.append(f"{which}/{n} has no {sidecar_name(n, suffix)} beside it (a dataset without its reason)")
    return by_name, fails


def check_hostile(dirs: dict[str, Path], hostile: Hostile, good_names: set[str], status: dict) -> tuple[list[str], dict]:
    """Every hostile item accounted for (see the module docstring); return (failures, outcomes per kind)."""
    fails: list[str] = []
    by_name, doc_fails = finished_docs(dirs)
    fails += doc_fails
    scored = scored_sources(dirs["scores"])
    listed_ignored = {e.get("name") for e in status.get("ignored", [])}
    listed_queue = set(status.get("queue", []))
    left = set(os.listdir(dirs["incoming"]))
    outcomes: dict[str, Counter] = defaultdict(Counter)
    expected_left: set[str] = set()
    for it in hostile.items:
        if "entries" not in it:
            fails.append(f"hostile item {it['index']} ({it['kind']}) was never dropped")
            continue
        what = f"hostile item {it['index']} ({it['kind']}, {it['variant']})"
        reasons = " ".join(str(d.get("reason")) for _, d in by_name.get(str(it.get("dataset")), []))
        for name in it["entries"]:
            if name in it["regular"]:
                continue
            expected_left.add(name)  # not a regular file: left where it is, and reported
            if name not in left:
                fails.append(f"{what}: incoming/{name!r} ({it['kind']}) is gone; it must be left and reported")
            elif name in listed_ignored:
                outcomes[it["kind"]]["left, listed ignored"] += 1
            elif name == it["sidecar"] and name in reasons:
                outcomes[it["kind"]]["left, named in its dataset's reason"] += 1
            else:
                fails.append(f"{what}: incoming/{name!r} is left but ds-ops status does not list it as ignored")
        if it["kind"] == "score-squat":
            fails += check_score_squat(what, it, by_name, scored, outcomes)
            continue
        if it["kind"] == "failed-retrain":
            fails += check_failed_retrain(what, it, by_name, scored, dirs, outcomes)
        if it["kind"] == "squat" and it["regular"]:
            name = it["sidecar"]
            if len(by_name.get(name, [])) == 1:  # refused on its own, with a reason
                outcomes["squat"][by_name[name][0][0]] += 1
            elif name in left:
                expected_left.add(name)
                if name in listed_queue or name in listed_ignored:
                    outcomes["squat"]["left, listed"] += 1
                else:
                    fails.append(f"{what}: incoming/{name} is left but ds-ops status does not list it")
            else:
                outcomes["squat"]["taken"] += 1
            continue
        if it["dataset"] is None:
            continue
        docs = by_name.get(it["dataset"], [])
        if it["dataset"] in left:
            expected_left.add(it["dataset"])
            fails.append(f"{what}: incoming/{it['dataset']!r} was never taken")
        elif len(docs) != 1:
            fails.append(f"{what}: {it['dataset']!r} has {len(docs)} results in done/ and failed/ (want exactly 1): "
                         f"{[(w, d.get('job_id'), d.get('reason')) for w, d in docs]}")
        else:
            outcomes[it["kind"]][docs[0][0]] += 1
            kept = dirs[docs[0][0]] / it["dataset"]
            if it["kind"] == "sparse" and kept.exists() and os.stat(kept).st_blocks * 512 > 1 << 20:
                fails.append(f"{what}: {docs[0][0]}/{it['dataset']} takes {os.stat(kept).st_blocks * 512} bytes on "
                             "disk for one line: the daemon's copy filled the holes")
        if it["sidecar"] is not None and it["sidecar"] in it["regular"] and it["sidecar"] in left:
            expected_left.add(it["sidecar"])
            fails.append(f"{what}: its sidecar incoming/{it['sidecar']} was never taken with its dataset")
    retrainings = {f"{it['dataset'].split('.')[0]}.history.npz" for it in hostile.items
                   if it["kind"] == "failed-retrain" and it.get("dataset")}
    unknown = sorted(set(by_name) - good_names - retrainings - {n for it in hostile.items for n in it.get("regular", [])})
    if unknown:
        fails.append(f"done/ and failed/ hold {len(unknown)} datasets nobody dropped (renamed? duplicated?): "
                     f"{unknown[:10]}")
    stray = sorted(left - expected_left)
    if stray:
        fails.append(f"incoming/ still holds {len(stray)} entries nothing accounts for: {stray[:10]}")
    for name in good_names:
        if len(by_name.get(name, [])) > 1:
            fails.append(f"{name}: {len(by_name[name])} results (want 1): a good dataset was trained twice")
    return fails, {k: dict(v) for k, v in sorted(outcomes.items())}


def scored_sources(scores: Path) -> Counter:
    """How often each chunk name was scored: the ``source`` of every result's summary.json."""
    found: Counter = Counter()
    for summary in scores.glob("*/*/summary.json") if scores.is_dir() else []:
        try:
            found[os.path.basename(str(json.loads(summary.read_text()).get("source")))] += 1
        except (OSError, ValueError):
            continue
    return found


def check_score_squat(what: str, it: dict, by_name: dict, scored: Counter, outcomes: dict) -> list[str]:
    """The chunk refused into failed/ saying its sidecar is another member's, never scored; the
    squatting sidecar refused beside it."""
    fails = []
    chunk, side = it["dataset"], it["sidecar"]
    docs = by_name.get(chunk, [])
    if [w for w, _ in docs] != ["failed"] or "belongs to another member" not in str(docs[0][1].get("reason")):
        fails.append(f"{what}: the chunk score/{chunk} must be refused once, saying its sidecar belongs to another "
                     f"member: {[(w, d.get('reason')) for w, d in docs]}")
    if scored.get(chunk):
        fails.append(f"{what}: the chunk {chunk} was scored {scored[chunk]} time(s) under a squatted sidecar")
    side_docs = by_name.get(side, [])
    if [w for w, _ in side_docs] != ["failed"]:
        fails.append(f"{what}: the squatting sidecar score/{side} must be refused once: "
                     f"{[(w, d.get('reason')) for w, d in side_docs]}")
    if not fails:
        outcomes["score-squat"]["chunk and sidecar refused"] += 1
    return fails


def check_failed_retrain(what: str, it: dict, by_name: dict, scored: Counter, dirs: dict[str, Path],
                         outcomes: dict) -> list[str]:
    """Every flagged chunk scored once; the retraining it triggered failed, backed off (at most two
    failures: a second only if a kill fell between the failure and its record), and left its
    ``retrain-failed.json``."""
    from opt_ds_ops.daemon.retrainer import FAILED_FILE

    fails = []
    stem = it["dataset"].split(".")[0]
    if it.get("chunks") != RETRAIN_CHUNKS or scored.get(it["dataset"], 0) != RETRAIN_CHUNKS:
        fails.append(f"{what}: {it.get('chunks')} chunks dropped, {scored.get(it['dataset'], 0)} scored "
                     f"(want {RETRAIN_CHUNKS} and {RETRAIN_CHUNKS})")
    retrains = by_name.get(f"{stem}.history.npz", [])
    if not 1 <= len(retrains) <= 2 or any(w != "failed" for w, _ in retrains):
        fails.append(f"{what}: {len(retrains)} retrainings of {stem} (want 1, or 2 after a kill at the wrong moment; "
                     f"all failed): {[(w, d.get('reason')) for w, d in retrains]}")
    if not (dirs["scores"] / stem / FAILED_FILE).is_file():
        fails.append(f"{what}: no {FAILED_FILE} beside the results of {stem}: its failure does not back off")
    if not fails:
        outcomes["failed-retrain"][f"{len(retrains)} failed retraining(s) for {RETRAIN_CHUNKS} chunks"] += 1
    return fails


def leftovers(root: Path, dirs: dict[str, Path]) -> list[str]:
    """Temporaries no one cleaned up: ``.tmp-*``/``.current-*`` anywhere, a job directory, ds-ops's
    own files in the daemons' TMPDIR (a SIGKILLed forkserver's ``pymp-*`` and torch's caches are
    not ds-ops's: the unit's PrivateTmp= removes them)."""
    found = [str(p.relative_to(root)) for top in (dirs["spool"], dirs["models"], root / "metrics")
             for p in top.rglob("*") if p.name.startswith((".tmp-", ".current-", ".ds_ops.prom.tmp-"))]
    found += [f"processing/{n}" for n in os.listdir(dirs["processing"])]
    found += [f"score/{n}" for n in os.listdir(dirs["score"])]
    found += [f"tmp/{n}" for n in os.listdir(root / "tmp") if n.startswith(DS_OPS_TEMPS)]
    return found


def all_settled(dirs: dict[str, Path], good: set[str]) -> bool:
    """True when the last daemon has nothing left to do: no job, every good dataset finished and no
    regular file in incoming/ but sidecars (a squatted one, or one left behind: check_hostile judges)."""
    from opt_ds_ops.config.sidecar import SIDECAR_SUFFIXES

    if os.listdir(dirs["processing"]) or os.listdir(dirs["score"]):
        return False
    finished = set(os.listdir(dirs["done"])) | set(os.listdir(dirs["failed"]))
    if not good <= finished:
        return False
    for e in os.scandir(dirs["incoming"]):
        try:
            regular = e.is_file(follow_symlinks=False)
        except OSError:
            continue
        if regular and not e.name.endswith(SIDECAR_SUFFIXES) and not e.name.startswith("."):
            return False
    return True


def drain(dirs: dict[str, Path], good: set[str], daemon: Daemon, restart, stall_s: float, deadline: float,
          fails: list[str]) -> Daemon:
    """Let the last daemon work until the spool is settled (all_settled, SETTLED_S in a row); return
    the daemon then running. A daemon that exits by itself is a failure (appended to fails) and is
    started again (restart()), as systemd would, MAX_SELF_EXITS times at most. Raise SoakFailure
    on no progress for stall_s, past the deadline, or at the last self-exit."""
    self_exits = 0
    progress, last_change, settled_since = None, time.monotonic(), None
    while settled_since is None or time.monotonic() - settled_since < SETTLED_S:
        if not daemon.alive():
            self_exits += 1
            fails.append(f"daemon-{daemon.number:03d} exited by itself ({daemon.proc.returncode}) while draining: "
                         f"{daemon.log_path}: {daemon.log().splitlines()[-2:]}")
            if self_exits >= MAX_SELF_EXITS:
                raise SoakFailure(f"the daemon exited by itself {self_exits} times in a row while draining "
                                  "(a restart loop: systemd's start limit would leave the unit failed)")
            daemon = restart()
            if daemon.wait_ready(READY_TIMEOUT_S) is None:
                continue
        if not all_settled(dirs, good):
            settled_since = None
        elif settled_since is None:
            settled_since = time.monotonic()
        now = time.monotonic()
        state = tuple(tuple(sorted(os.listdir(dirs[w]))) for w in ("done", "failed", "processing", "incoming", "score"))
        if state != progress:
            progress, last_change = state, now
        elif now - last_change > stall_s and settled_since is None:
            raise SoakFailure(f"no progress for {stall_s:.0f} s while draining: processing/ {list(state[2])[:5]}, "
                              f"incoming/ {list(state[3])[:8]} (intake paused? a hang?): {daemon.log_path}: "
                              f"{daemon.log().splitlines()[-2:]}")
        if now > deadline:
            raise SoakFailure(f"--timeout-s exceeded while draining: {daemon.log_path}")
        time.sleep(0.25)
    return daemon


# ---- the run -----------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    """The fuzz soak's options (tests/test_soak.py reads the sizes a run was given from it)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hostile", type=int, default=500, help="hostile items to drop")
    ap.add_argument("--kills", type=int, default=50)
    ap.add_argument("--good", type=int, default=30, help="good datasets (trained exactly once each)")
    ap.add_argument("--writers", type=int, default=2, help="threads dropping the good datasets")
    ap.add_argument("--hostile-writers", type=int, default=2, help="threads dropping the hostile items")
    ap.add_argument("--max-jobs", type=int, default=2, help="daemon.max_jobs")
    ap.add_argument("--max-rss-mib", type=float, default=1024.0, help="fail if a daemon's VmHWM exceeds this")
    ap.add_argument("--score-squats", type=int, default=None,
                    help="score-squat items among --hostile (default: one in 50, at least 1)")
    ap.add_argument("--failed-retrains", type=int, default=None,
                    help="failed-retrain items among --hostile (default: one in 125, at least 1)")
    add_common_arguments(ap, seed=18, timeout_s=900.0, stall_s=120.0)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.hostile < 1 or args.good < 1 or args.kills < 0 or min(args.writers, args.hostile_writers, args.max_jobs) < 1:
        ap.error("--hostile, --good, --writers, --hostile-writers and --max-jobs must be >= 1, --kills >= 0")
    check_common_arguments(ap, args)
    score_kinds = {"score-squat": args.score_squats if args.score_squats is not None else max(1, args.hostile // 50),
                   "failed-retrain": args.failed_retrains if args.failed_retrains is not None else max(1, args.hostile // 125)}
    if os.geteuid() != 0:  # the squatter and the chunk's owner would be one uid: the sidecar is then the chunk's own
        score_kinds["score-squat"] = 0
    squats = min(args.hostile, max(1, round(SQUAT_SHARE * args.good)))
    if min(score_kinds.values()) < 0 or sum(score_kinds.values()) + squats > args.hostile:
        ap.error(f"--score-squats and --failed-retrains must be >= 0 and, with the {squats} squat items, at most --hostile")

    t_start = time.monotonic()
    deadline = t_start + args.timeout_s
    root, dirs = soak_root(ap, args, "ds-ops-fuzz-soak-")
    for extra in ("metrics", "tmp"):
        (root / extra).mkdir()
    dirs["score"] = dirs["spool"] / "score"
    dirs["score"].mkdir()
    os.chmod(dirs["score"], 0o3770)
    dirs["scores"] = root / "scores"
    conf = write_config(root, (f"  max_dataset_bytes: {MAX_DATASET_BYTES}", "daemon:", f"  max_jobs: {args.max_jobs}",
                               "metrics:", f"  textfile_dir: {root / 'metrics'}",
                               "scoring:", f"  results_dir: {dirs['scores']}",
                               "retrain:", "  every: 1s"))
    env = dict(daemon_env(), TMPDIR=str(root / "tmp"))
    print(f"fuzz soak: seed {args.seed}, {args.hostile} hostile items, {args.good} good datasets, {args.kills} kills, "
          f"max_jobs {args.max_jobs}; root {root}"
          f"{'' if os.geteuid() == 0 else ' (not root: the daemon keeps its capabilities, drops stay yours)'}",
          flush=True)
    print(f"  reproduce: scripts/fuzz_soak.py --seed {args.seed} --hostile {args.hostile} --good {args.good} "
          f"--kills {args.kills}", flush=True)

    datasets = Datasets(args.good, args.seed)
    kill_phase_s = kill_phase_estimate_s(args)
    writers = Writers(datasets, args.writers, args.seed, dirs["incoming"], dirs["staging"],
                      max(0.05, 0.8 * kill_phase_s / -(-args.good // args.writers)))
    squat_targets = random.Random(args.seed).sample(datasets.plans, squats)
    hostile = Hostile(args.hostile, squat_targets, args.seed, seed_files(datasets.matrix), dirs, args.hostile_writers,
                      max(0.01, 0.8 * kill_phase_s / -(-args.hostile // args.hostile_writers)), score_kinds,
                      [p["model_name"] for p in datasets.plans])
    hostile.deadline = deadline
    schedule = kill_schedule(args)

    kills: list[dict] = []
    fails: list[str] = []
    sessions: set[int] = set()
    rss_kib: list[int] = []
    status_answers = 0
    daemon: Daemon | None = None
    number = 0
    ok = False
    figures: dict = {}
    try:
        hostile.drop_squats()
        number += 1
        daemon = Daemon(conf, dirs["logs"], number, env)
        sessions.add(daemon.pid)
        writers.start()
        hostile.start()
        with open(root / "kills.jsonl", "w") as kill_log:
            for k, (anchor, delay) in enumerate(schedule, 1):
                if time.monotonic() > deadline:
                    raise SoakFailure(f"--timeout-s {args.timeout_s:.0f} exceeded during the kill phase ({k - 1} kills)")
                rec = timed_kill(dirs, daemon, k, anchor, delay)
                rss_kib.append(rec["peak_rss_kib"] or 0)
                if rec["died"]:
                    fails.append(died_before_kill(dirs, daemon, rec) + f"; its last lines: {rec['log_tail']}")
                kills.append(rec)
                kill_log.write(json.dumps(rec) + "\n")
                kill_log.flush()
                number += 1
                daemon = Daemon(conf, dirs["logs"], number, env)
                sessions.add(daemon.pid)
                if k % STATUS_EVERY_KILLS == 0 or k == args.kills:
                    status_json(conf)
                    status_answers += 1
                    print(f"  {k} kills, {len(writers.dropped)} good and "
                          f"{sum(1 for it in hostile.items if 'entries' in it)} hostile dropped, "
                          f"{len(os.listdir(dirs['done'])) // 2} done, {len(os.listdir(dirs['failed']))} in failed/, "
                          f"{time.monotonic() - t_start:.0f} s", flush=True)
        t_kills = time.monotonic() - t_start
        writers.join(max(0.0, deadline - time.monotonic()))
        hostile.join(max(0.0, deadline - time.monotonic()))
        fails += writers.errors + hostile.errors
        t_drops = time.monotonic() - t_start
        print(f"  kill phase over after {t_kills:.0f} s, drops done after {t_drops:.0f} s; "
              f"daemon-{daemon.number:03d} drains the spool", flush=True)

        good = {p["name"] for p in datasets.plans}

        started = [daemon]

        def restart() -> Daemon:
            started.append(Daemon(conf, dirs["logs"], started[-1].number + 1, env))
            sessions.add(started[-1].pid)
            return started[-1]

        try:
            drain(dirs, good, daemon, restart, args.stall_s, deadline, fails)
            drained = True
        except SoakFailure as e:  # still look at what is where, below
            fails.append(str(e))
            drained = False
        daemon, number = started[-1], started[-1].number
        status = status_json(conf)  # it reads the spool's files: it answers with the daemon down too
        status_answers += 1
        if daemon.alive() and status.get("daemon_pid") != daemon.pid:
            fails.append(f"ds-ops status names daemon pid {status.get('daemon_pid')}, the harness started {daemon.pid}")
        rss_kib.append(peak_rss_kib(daemon.pid) or 0)
        rc = daemon.stop() if daemon.alive() else daemon.proc.returncode
        if rc != 0 and drained:
            fails.append(f"the last daemon exited {rc} on SIGTERM (want 0): {daemon.log_path}")
        t_end = time.monotonic() - t_start
        gone_by = time.monotonic() + 30
        while (left := session_processes(sessions)) and time.monotonic() < gone_by:
            time.sleep(0.5)
        for pid, sid, cmd in left:
            fails.append(f"process {pid} of daemon session {sid} outlived the final stop: {cmd}")

        res_fails, results, stats = check_results(dirs, datasets.plans, writers.dropped)
        model_fails, version_counts, loaded = check_models(dirs, datasets.plans, results)
        absent = sorted(good - set(results))
        if absent:
            fails.append(f"{len(absent)} good datasets did not train: {absent[:10]}")
        hostile_fails, outcomes = check_hostile(dirs, hostile, good, status)
        fails += res_fails + model_fails + hostile_fails
        pauses = [line for log in sorted(dirs["logs"].glob("daemon-*.log"))
                  for line in log.read_text(errors="replace").splitlines() if "intake paused" in line]
        if pauses:  # the soak's file system is healthy: every pause is what a member dropped
            fails.append(f"intake paused {len(pauses)} times (a refusal must never pause intake), first: {pauses[0]}")
        left_over = leftovers(root, dirs)
        if left_over:
            fails.append(f"{len(left_over)} temporaries or job directories left: {left_over[:10]}")
        peak_mib = max(rss_kib, default=0) / 1024
        if peak_mib > args.max_rss_mib:
            fails.append(f"a daemon's peak RSS (VmHWM) was {peak_mib:.0f} MiB, over --max-rss-mib {args.max_rss_mib:.0f}")
        figures = {
            "seed": args.seed,
            "hostile_dropped": sum(1 for it in hostile.items if "entries" in it),
            "hostile_by_kind": dict(sorted(Counter(it["kind"] for it in hostile.items if "entries" in it).items())),
            "sidecar_variants": dict(sorted(Counter(it["variant"] for it in hostile.items if it["kind"] == "sidecar"
                                                    and "variant" in it).items())),
            "good_datasets": len(writers.dropped), "good_trained": len(results), "models_loaded": loaded,
            "versions_per_good_model": dict(sorted(version_counts.items())),
            "kills": len(kills), "daemon_starts": number, "status_answers": status_answers,
            "kills_by_moment": dict(Counter(k["where"] for k in kills).most_common()),
            "hostile_outcomes": outcomes,
            "hostile_outcome_totals": dict(sum((Counter(v) for v in outcomes.values()), Counter())),
            "good_results_with_restarts": sum(1 for r in stats["restarts"] if r > 0),
            "intake_pauses": len(pauses),
            "daemon_peak_rss_mib": round(peak_mib),
            "tmpdir_other_entries": sorted(n for n in os.listdir(root / "tmp") if not n.startswith(DS_OPS_TEMPS)),
            "kill_phase_s": round(t_kills, 1), "drops_s": round(t_drops, 1), "wall_s": round(t_end, 1),
        }
        print("figures:")
        for key, value in figures.items():
            print(f"  {key}: {value}")
        ok = not fails and drained
    except SoakFailure as e:
        fails.append(str(e))
    finally:
        hostile.stop()
        kill_everything(daemon, sessions)
        (root / "summary.json").write_text(json.dumps(
            {"args": vars(args), "figures": figures, "failures": fails,
             "items": [{k: v for k, v in it.items() if k != "dropped_at"} for it in hostile.items]},
            indent=2, default=str) + "\n")

    if ok:
        print(f"fuzz soak passed in {time.monotonic() - t_start:.0f} s (seed {args.seed})")
        if not args.keep:
            subprocess.run(["rm", "-rf", "--one-file-system", str(root)], check=False)
        return 0
    print(f"fuzz soak FAILED ({len(fails)} problems, seed {args.seed}); root kept: {root} "
          "(daemon logs in logs/, kills in kills.jsonl, items in summary.json)")
    for f in fails[:60]:
        print(f"  FAIL: {f}")
    if len(fails) > 60:
        print(f"  ... and {len(fails) - 60} more (summary.json)")
    return 1


if __name__ == "__main__":
    sys.exit(main())
