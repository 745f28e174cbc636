#!/usr/bin/env python3
"""Coverage-guided fuzzing of every reader entry point (``make fuzz``): atheris (libFuzzer) per target.

Each target of ``tests/fuzz/targets.py`` runs for ``--seconds`` in a process of its own, started
from its committed seed corpus ``tests/fuzz/corpus/TARGET/`` plus what earlier runs found
(``build/fuzz/corpus/TARGET/``, where new inputs go). ds-ops's own modules and PyYAML are
instrumented for coverage (``atheris.instrument_imports``), and the Python parts of the libraries
under a target (numpy's ``.npy`` header parser, zipfile, gzip, pickletools for a .pt's pickle);
the rest of numpy, pyarrow and torch is C and C++, reached through them. A finding is an exception other than DatasetError/ConfigError, a
broken promise of ``load_dataset`` (an AssertionError of the target), a crash of the process, an
input that takes more than ``--timeout`` seconds (10) or more than ``--rss-limit-mb`` of memory.
The container formats (``.csv.gz``, ``.npz``, ``.pt``) mutate mostly what is inside
(:func:`_container_mutator`); the YAML targets splice in the words of ``tests/fuzz/yaml.dict``.
After a finding, the target starts again from where it was for the time left (at most
``--max-findings`` findings a target), so one shallow bug does not hide the rest.

Per target it prints executions, libFuzzer's coverage figures (``cov``: edges of the
instrumented code and of the comparisons it traces, ``ft``: features) and findings; each new
finding's input is copied to ``tests/fuzz/regressions/TARGET/KIND-SHA1`` (one a kind) for
``tests/fuzz/test_regressions.py``, its log to ``build/fuzz/TARGET.log``. Exit 1 on any finding.

    python scripts/fuzz.py [--seconds 60] [--targets csv,npz] [--timeout 10] [--seed N] [--tolerate KIND,...]
"""

from __future__ import annotations

import argparse
import faulthandler
import gzip
import io
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import zipfile
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FUZZ = REPO / "tests" / "fuzz"
BUILD = REPO / "build" / "fuzz"
KINDS = ("crash", "timeout", "oom", "leak")  # libFuzzer's artifact prefixes (slow-unit-* is not a finding)


INNER_BYTES = 1 << 20  # the most a container mutator unpacks


def _unpack_gz(data: bytes) -> list[tuple[str, bytes]]:
    return [("", zlib.decompressobj(wbits=31).decompress(data, INNER_BYTES))]


def _pack_gz(members: list[tuple[str, bytes]], rng: random.Random) -> bytes:
    return gzip.compress(members[0][1], compresslevel=rng.choice((1, 6, 9)), mtime=0)


def _unpack_zip(data: bytes) -> list[tuple[str, bytes]]:
    members = []
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        for info in z.infolist()[:16]:
            with z.open(info) as m:
                members.append((info.filename, m.read(INNER_BYTES)))
    return members


def _pack_zip(members: list[tuple[str, bytes]], rng: random.Random) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, inner in members:
            how = rng.choice((zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED))
            z.writestr(zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0)), inner, compress_type=how)
    return buf.getvalue()


# a .csv.gz holds the text; an .npz its .npy; a .pt (torch.save) data.pkl, the storages and a few small records
CONTAINERS = {"csv_gz": (_unpack_gz, _pack_gz), "npz": (_unpack_zip, _pack_zip), "pt": (_unpack_zip, _pack_zip)}


def _container_mutator(atheris, unpack, pack):
    """A libFuzzer custom mutator for a container format: 4 times in 5 it mutates what is inside
    (the text of a .csv.gz, the .npy of an .npz, one member of a .pt) and packs it again, so that
    the reader behind the decompression is reached; else the container's own bytes (its headers,
    CRCs, lengths)."""

    def mutate(data: bytes, max_size: int, seed: int) -> bytes:
        rng = random.Random(seed)
        if rng.random() < 0.8:
            try:
                members = unpack(data)
            except Exception:  # noqa: BLE001 - not a valid container (any more): mutate its bytes
                members = []
            if members:
                i = rng.randrange(len(members))
                name, inner = members[i]
                members[i] = (name, atheris.Mutate(inner, max(2 * len(inner), 4096)))
                packed = pack(members, rng)
                if len(packed) <= max_size:
                    return packed
        return atheris.Mutate(data, max_size)

    return mutate


def _instrument_module(atheris, module) -> None:
    """Instrument the functions and methods defined in an imported module (atheris.instrument_func)."""
    for obj in vars(module).values():
        if getattr(obj, "__module__", None) != module.__name__:
            continue
        funcs = [obj] if callable(obj) and hasattr(obj, "__code__") else []
        if isinstance(obj, type):
            funcs = [f for f in vars(obj).values() if hasattr(f, "__code__")]
        for f in funcs:
            atheris.instrument_func(f)


def child(target: str, seconds: int, timeout_s: int, rss_limit_mb: int, artifacts: str, seed: int | None) -> None:
    """Fuzz one target in this process (does not return: libFuzzer exits)."""
    import atheris

    # C/C++ libraries first, outside the instrumentation: only Python code gains from it
    import numpy  # noqa: F401
    import pyarrow  # noqa: F401
    import pyarrow.csv  # noqa: F401
    import pyarrow.parquet  # noqa: F401

    # the Python parts of the libraries under a target are traced too: numpy's .npy header parser,
    # zipfile and gzip, pickletools (a .pt's pickle)
    if target in ("npy", "npz"):
        import numpy.lib.format

        _instrument_module(atheris, numpy.lib.format)
    if target in ("npz", "pt"):
        _instrument_module(atheris, zipfile)
    if target == "csv_gz":
        _instrument_module(atheris, gzip)
    if target == "pt":  # ds-ops runs the pickle itself (opt_ds_ops.dataset.torchfile): pickletools parses it
        import pickletools

        _instrument_module(atheris, pickletools)

    sys.path.insert(0, str(FUZZ))
    with atheris.instrument_imports(include=["opt_ds_ops", "yaml"]):
        import yaml  # noqa: F401
        import opt_ds_ops.dataset.arrays  # noqa: F401 - imported lazily by load_dataset, so name them here
        import opt_ds_ops.dataset.columnar  # noqa: F401
        import opt_ds_ops.dataset.text  # noqa: F401
        import opt_ds_ops.dataset.timeindex  # noqa: F401
        import opt_ds_ops.dataset.torchfile  # noqa: F401
        import opt_ds_ops.training.stream  # noqa: F401
        import targets

    fn = targets.TARGETS[target]
    tolerated = {k for k in os.environ.get("FUZZ_TOLERATE", "").split(",") if k}

    def test_one_input(data: bytes) -> None:
        if not faulthandler.is_enabled():  # now, after libFuzzer's handlers: a crash prints the Python stack, then theirs
            faulthandler.enable()
        try:
            fn(data)
        except Exception as e:
            if _where(e) not in tolerated:
                raise

    corpus = BUILD / "corpus" / target
    corpus.mkdir(parents=True, exist_ok=True)
    argv = [sys.argv[0], f"-max_total_time={seconds}", f"-timeout={timeout_s}", f"-rss_limit_mb={rss_limit_mb}",
            f"-artifact_prefix={artifacts}/", "-max_len=16384", "-print_final_stats=1", "-print_pcs=0",
            str(corpus), str(FUZZ / "corpus" / target)]
    if seed is not None:
        argv.insert(1, f"-seed={seed}")
    if target in ("sidecar", "config"):
        argv.insert(1, f"-dict={FUZZ / 'yaml.dict'}")  # keys, values and YAML syntax to splice in
    mutator = _container_mutator(atheris, *CONTAINERS[target]) if target in CONTAINERS else None
    atheris.Setup(argv, test_one_input, custom_mutator=mutator)
    atheris.Fuzz()


def _where(e: BaseException) -> str:
    """An exception's kind: ``TYPE@FILE:FUNCTION`` of its innermost frame in ds-ops (or its last)."""
    tb = traceback.extract_tb(e.__traceback__)
    frames = [f for f in tb if "opt_ds_ops" in f.filename] or tb[-1:]
    return f"{type(e).__name__}@{os.path.basename(frames[-1].filename)}:{frames[-1].name}" if frames else type(e).__name__


def _stats(log: str) -> dict:
    """Executions and the last coverage figures of one libFuzzer run, from its log."""
    runs = re.findall(r"stat::number_of_executed_units:\s*(\d+)", log)
    progress = re.findall(r"^#(\d+)\s+\w+\s+cov: (\d+) ft: (\d+)", log, re.M)
    execs = int(runs[-1]) if runs else (int(progress[-1][0]) if progress else 0)
    cov, ft = (int(progress[-1][1]), int(progress[-1][2])) if progress else (0, 0)
    return {"execs": execs, "cov": cov, "ft": ft}


def _signature(log: str) -> tuple[str, str]:
    """The finding's kind: (a key, the same for one bug: :func:`_where`'s ``TYPE@FILE:FUNCTION``;
    one line that says it, with the exception's message and line)."""
    tb = log.split("=== Uncaught Python exception: ===", 1)
    if len(tb) == 2:
        lines = [ln.strip() for ln in tb[1].splitlines() if ln.strip()]
        frames = [re.match(r'File "(.*)", line (\d+), in (\S+)', ln) for ln in lines if ln.startswith("File ")]
        frames = [m for m in frames if m and "opt_ds_ops" in m.group(1)] or [m for m in frames if m][-1:]
        exc = next((ln for ln in lines if re.match(r"^[A-Za-z_.]+(Error|Exception|Exit|Interrupt)\b", ln)), lines[0])
        name = exc.split(":", 1)[0].rsplit(".", 1)[-1]
        if not frames:
            return name, exc[:200]
        f = frames[-1]
        return (f"{name}@{os.path.basename(f.group(1))}:{f.group(3)}",
                f"{exc[:200]} ({os.path.relpath(f.group(1), REPO)}, line {f.group(2)}, in {f.group(3)})")
    m = re.search(r"Fatal Python error: (\w[^\n]*)\n(.*?)\n\n", log, re.S)
    if m:  # faulthandler's stack of a crash, most recent call first
        frames = re.findall(r'File "(.*opt_ds_ops.*)", line (\d+) in (\S+)', m.group(2))
        if frames:
            path, line, func = frames[0]
            return (f"{m.group(1)}@{os.path.basename(path)}:{func}",
                    f"{m.group(1)} ({os.path.relpath(path, REPO)}, line {line}, in {func})")
    m = re.search(r"ALARM: working on the last Unit for (\d+) seconds", log)
    if m:  # atheris prints the stack first, most recent call first
        stack = re.search(r"=== Timeout: .*?===\n(.*?)ALARM", log, re.S)
        frames = re.findall(r'File "(.*opt_ds_ops.*)", line (\d+) in (\S+)', stack.group(1) if stack else "")
        if frames:
            path, line, func = frames[0]
            return (f"timeout@{os.path.basename(path)}:{func}",
                    f"timeout: an input ran {m.group(1)} s ({os.path.relpath(path, REPO)}, line {line}, in {func})")
        return "timeout", f"timeout (an input ran {m.group(1)} s)"
    m = re.search(r"==\d+== ERROR: libFuzzer: ([^\n]+)", log)
    if m:
        return m.group(1).split("(")[0].strip(), m.group(1)
    m = re.search(r"(Fatal Python error: [^\n]+|Segmentation fault|Aborted)", log)
    return (m.group(1), m.group(1)) if m else ("error", "the fuzzing process ended with an error")


def fuzz_target(target: str, seconds: int, args) -> dict:
    """Run one target for ``seconds`` (restarted after each finding); return its figures and findings."""
    BUILD.mkdir(parents=True, exist_ok=True)
    log_path = BUILD / f"{target}.log"
    totals = {"target": target, "execs": 0, "cov": 0, "ft": 0, "findings": [], "runs": 0}
    deadline = time.monotonic() + seconds
    with open(log_path, "w") as log_file:
        while True:
            left = int(deadline - time.monotonic())
            if left < 3 or len(totals["findings"]) >= args.max_findings:
                break
            artifacts = tempfile.mkdtemp(prefix=f"artifacts-{target}-", dir=BUILD)
            scratch = tempfile.mkdtemp(prefix=f"tmp-{target}-", dir=BUILD)  # targets' temp files land here
            env = dict(os.environ, PYTHONPATH=str(REPO), TMPDIR=scratch, FUZZ_TOLERATE=args.tolerate)
            cmd = [sys.executable, __file__, "--child", target, "--seconds", str(left), "--timeout", str(args.timeout),
                   "--rss-limit-mb", str(args.rss_limit_mb), "--artifacts", artifacts]
            if args.seed is not None:  # the k-th restart after a finding goes on from seed + k, not the same path
                cmd += ["--seed", str(args.seed + totals["runs"])]
            try:
                p = subprocess.run(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   errors="replace", timeout=left + args.timeout + 120)
                out, rc = p.stdout, p.returncode
            except subprocess.TimeoutExpired as e:
                out, rc = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or ""), -9
            log_file.write(f"--- run {totals['runs'] + 1}: {' '.join(cmd)} (exit {rc})\n{out}\n")
            log_file.flush()
            totals["runs"] += 1
            st = _stats(out)
            totals["execs"] += st["execs"]
            totals["cov"], totals["ft"] = max(totals["cov"], st["cov"]), max(totals["ft"], st["ft"])
            found = [f for f in sorted(os.listdir(artifacts)) if f.split("-", 1)[0] in KINDS]
            if rc != 0 and not found:
                found = [None]  # died without an artifact (killed from outside?): still a finding
            key, why = _signature(out)
            for name in found:
                totals["findings"].append(dict(_keep(target, artifacts, name, key, why), key=key))
            shutil.rmtree(artifacts, ignore_errors=True)
            shutil.rmtree(scratch, ignore_errors=True)
            if rc == 0:
                break
    return totals


def kind_slug(key: str) -> str:
    """A finding's kind as a file name: ``TokenError@arrays.py:_npy_header`` -> ``TokenError-arrays._npy_header``."""
    return re.sub(r"[^A-Za-z0-9_.]+", "-", key.replace(".py:", ".").replace("<", "").replace(">", "")).strip("-")


def _keep(target: str, artifacts: str, name: str | None, key: str, why: str) -> dict:
    """Copy a finding's input to tests/fuzz/regressions/TARGET/KIND-SHA1 unless an input of its kind
    is kept there already; describe it."""
    if name is None:
        return {"input": None, "why": why, "kept": False}
    slug, digest = kind_slug(key), name.split("-", 1)[1]
    folder = FUZZ / "regressions" / target
    before = sorted(folder.glob(f"{slug}-*")) if folder.is_dir() else []
    dest = before[0] if before else folder / f"{slug}-{digest[:12]}"
    if not before:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(os.path.join(artifacts, name), dest)
    return {"input": str(dest.relative_to(REPO)), "why": why, "kept": not before}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=int, default=int(os.environ.get("FUZZ_SECONDS", 60)),
                    help="seconds of fuzzing per target (default: $FUZZ_SECONDS or 60)")
    ap.add_argument("--targets", default="", help="comma-separated targets (default: all)")
    ap.add_argument("--timeout", type=int, default=10, help="seconds one input may take (default 10)")
    ap.add_argument("--rss-limit-mb", type=int, default=2048, help="memory of the fuzzing process (default 2048)")
    ap.add_argument("--max-findings", type=int, default=5, help="findings after which a target stops (default 5)")
    ap.add_argument("--tolerate", default="", metavar="KIND,...",
                    help="exploring only: exceptions of these kinds (TYPE@FILE:FUNCTION, as printed for a finding) "
                         "are not findings, so the fuzzer gets past a known bug")
    ap.add_argument("--seed", type=int, default=int(os.environ["FUZZ_SEED"]) if os.environ.get("FUZZ_SEED") else None,
                    help="libFuzzer's random seed (default: $FUZZ_SEED, else a new one each run); CI fixes it so "
                         "that its run is the same inputs each time, in the same order")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--artifacts", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.seconds, args.timeout, args.rss_limit_mb, args.artifacts, args.seed)
        return 0
    sys.path.insert(0, str(FUZZ))
    from targets import TARGETS  # noqa: E402 - the names only

    chosen = [t for t in args.targets.split(",") if t] or list(TARGETS)
    unknown = [t for t in chosen if t not in TARGETS]
    if unknown:
        ap.error(f"unknown target(s) {', '.join(unknown)} (targets: {', '.join(TARGETS)})")
    print(f"fuzzing {len(chosen)} target(s), {args.seconds} s each, {args.timeout} s an input", flush=True)
    results = []
    for target in chosen:
        r = fuzz_target(target, args.seconds, args)
        results.append(r)
        print(f"{target:8} {r['execs']:>9,} executions  cov {r['cov']:>6,}  ft {r['ft']:>7,}  "
              f"{len(r['findings'])} finding(s)" + (f" in {r['runs']} runs" if r["runs"] > 1 else ""), flush=True)
        for f in r["findings"]:
            kept = "kept as" if f["kept"] else "an input of this kind is kept already:"
            print(f"    {f['key']}: {f['why']}\n      {kept} {f['input'] or '(no input)'}", flush=True)
    findings = sum(len(r["findings"]) for r in results)
    print(f"{findings} finding(s); logs in {BUILD.relative_to(REPO)}/TARGET.log" if findings else "no findings")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
