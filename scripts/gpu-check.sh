#!/bin/bash
# GPU check for ds-ops, for a machine with an NVIDIA GPU: about 2-3 minutes expected; every step has
# a timeout (60 s doctor, 2 x 30 s smoke test, 8 x 60 s train, 120 s streamed, 240 s stacked, 120 s
# step tests, 150 s bench, 120 s for each job through a unit or a daemon); expected 4-5 minutes.
#
# Usage: scripts/gpu-check.sh [WHEEL_DIR]
#   Runs from the source tree (PYTHONPATH), with the python3 on PATH or $PYTHON, which must have
#   torch (a CUDA build). Python packages ds-ops needs that this python lacks (numpy, PyYAML,
#   nvidia-ml-py, tqdm, watchdog) are installed from WHEEL_DIR without network
#   (`pip install --no-index --find-links WHEEL_DIR --target ...`, or by unpacking the wheels when
#   pip is missing) into the output folder, never into the system python. Make WHEEL_DIR on a
#   machine with network: pip download -d wheels numpy PyYAML nvidia-ml-py tqdm watchdog --only-binary=:all:
#   (same python version and platform as the GPU machine; versions as pinned in pyproject.toml)
#
# Steps: 1. ds-ops doctor (text and --json; it runs the CUDA smoke test in the gate);
# 2. the CUDA smoke test alone with bf16 and with fp16+GradScaler (python -m opt_ds_ops.health.smoke);
# 3. ds-ops train --device cuda with bf16 and with fp16+GradScaler on the bundled SMD machine and on
# a 1,000,000 x 32 synthetic file (GPU readings per epoch from metadata.json);
# 3a. ds-ops train with the shipped defaults (no --epochs), bf16 and fp16, with and without CUDA graphs;
# 3b'. scripts/bench_stacked.py: a fleet's hosts trained one at a time and as one stack, models/hour;
# 3b. tests/training/test_step.py: the training step replayed from a CUDA graph against eager steps, per AMP dtype;
# 4. scripts/bench_train.py --device cuda (the seed script's loop as written against ds-ops's trainer,
# eager and CUDA-graph steps, bf16 and fp16);
# 5. one job through the installed ds-trainer unit (its sandbox, its user) when systemd is PID 1
# and the unit is installed: the SMD file dropped into its spool, waited for in done/ (else the
# step says it was skipped); then one table of every figure.
# Everything is kept in $GPU_CHECK_OUT (default: a new folder under /tmp), printed at the end.
# Exit status: 0 every step passed (a skipped unit step is not a failure); 1 a step failed;
# 3 no usable CUDA GPU or missing packages.
# GPU_CHECK_DEVICE=cpu is the dry run on a machine without a GPU: the same steps on the CPU with a
# 20,000-row synthetic file, 2 epochs and a 20,000-row benchmark (1-2 minutes on 2 cores), every
# time limit times GPU_CHECK_TIMEOUT_SCALE (5); `make gpu-check-dry` runs it (tests/test_gpu_check.py).
set -uo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-python3}"
WHEELS="${1:-}"
DEVICE="${GPU_CHECK_DEVICE:-cuda}"
OUT="${GPU_CHECK_OUT:-$(mktemp -d /tmp/ds-ops-gpu-check.XXXXXX)}"
mkdir -p "$OUT/models"
cd "$REPO" || exit 1

say() { printf '== %s\n' "$*"; }
die() { printf 'gpu-check: %s\n' "$*" >&2; exit "${2:-3}"; }

command -v "$PY" >/dev/null || die "no $PY on PATH (set PYTHON=/path/to/python3)"
"$PY" -c 'import torch' 2>/dev/null || die "$PY has no torch; this check needs a python3 with a CUDA build of torch"

# --- Python packages: from the source tree, missing ones from WHEEL_DIR ---------------------------
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
missing=()
for pair in numpy:numpy yaml:PyYAML pynvml:nvidia-ml-py tqdm:tqdm watchdog:watchdog; do
    "$PY" -c "import ${pair%%:*}" 2>/dev/null || missing+=("${pair#*:}")
done
if ((${#missing[@]})); then
    [[ -n "$WHEELS" ]] || die "$PY lacks ${missing[*]}; give a folder of wheels: scripts/gpu-check.sh WHEEL_DIR"
    [[ -d "$WHEELS" ]] || die "wheel folder $WHEELS does not exist"
    say "installing ${missing[*]} from $WHEELS into $OUT/site"
    if "$PY" -m pip --version >/dev/null 2>&1; then
        "$PY" -m pip install --quiet --no-index --no-deps --find-links "$WHEELS" --target "$OUT/site" "${missing[@]}" \
            || die "pip could not install ${missing[*]} from $WHEELS"
    else
        for name in "${missing[@]}"; do  # no pip: a wheel is a zip file that unpacks to importable code
            whl=$(ls "$WHEELS"/*.whl 2>/dev/null | grep -i "/${name//-/_}-" | head -n1)
            [[ -n "$whl" ]] || die "no wheel for $name in $WHEELS"
            "$PY" -m zipfile -e "$whl" "$OUT/site" || die "cannot unpack $whl"
        done
    fi
    export PYTHONPATH="$OUT/site:$PYTHONPATH"
fi
DSOPS=("$PY" -m opt_ds_ops.cli)

if [[ "$DEVICE" == cpu ]]; then ROWS=20000 EPOCHS=2 BENCH_ROWS=20000; else ROWS=1000000 EPOCHS=5 BENCH_ROWS=500000; fi
# Every step's time limit is written for a GPU; the dry run multiplies them by GPU_CHECK_TIMEOUT_SCALE
# (default 5 on the CPU: the shipped defaults' fp16 training alone took 63 s of its 60 s on a loaded
# 2-core machine, fp16 autocast being emulated there), so a slow machine is not taken for a failed step.
if [[ "$DEVICE" == cpu ]]; then TSCALE="${GPU_CHECK_TIMEOUT_SCALE:-5}"; else TSCALE="${GPU_CHECK_TIMEOUT_SCALE:-1}"; fi
[[ "$TSCALE" =~ ^[1-9][0-9]*$ ]] || die "GPU_CHECK_TIMEOUT_SCALE must be a whole number >= 1, not '$TSCALE'"
t() { echo $(($1 * TSCALE)); }  # a step's limit in seconds, scaled
ROWS="${GPU_CHECK_ROWS:-$ROWS}"
mkdir -p "$OUT/steps"
# step NAME STATUS NOTE: a table row for a step with no figures (status ok, FAILED or skipped)
step() { printf '%s\t%s\t%s\n' "$1" "$2" "$3" >"$OUT/steps/$1.tsv"; }

# --- 1. doctor (the gate, with the CUDA smoke test on the chosen GPU) -------------------------------
say "ds-ops doctor"
timeout "$(t 30)" "${DSOPS[@]}" doctor | tee "$OUT/doctor.txt"
timeout "$(t 30)" "${DSOPS[@]}" doctor --json >"$OUT/doctor.json"
echo "$?" >"$OUT/doctor.rc"

[[ "$DEVICE" == cpu ]] || "$PY" - <<'EOF' || die "torch sees no CUDA GPU; see the doctor output above (driver, torch build) - stopping"
import sys, torch
ok = torch.cuda.is_available()
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, available={ok}, GPUs={torch.cuda.device_count()}")
sys.exit(0 if ok else 1)
EOF

# --- 2. the CUDA smoke test alone, bf16 and fp16 + GradScaler -------------------------------------
for amp in bf16 fp16; do
    say "python -m opt_ds_ops.health.smoke --device $DEVICE --amp $amp"
    timeout "$(t 30)" "$PY" -m opt_ds_ops.health.smoke --device "$DEVICE" --amp "$amp" --timeout-s "$(t 20)" | tee "$OUT/smoke-$amp.json"
done

# --- 3. training on $DEVICE with bf16 and fp16 + GradScaler ---------------------------------------
say "making a $ROWS x 32 synthetic dataset"
"$PY" - "$OUT/synthetic.npy" "$ROWS" <<'EOF' || die "cannot write the synthetic dataset" 1
import sys, numpy as np
rows = int(sys.argv[2])
rng = np.random.default_rng(0)
base = rng.standard_normal((rows, 8), dtype=np.float32)
mix = rng.standard_normal((8, 32), dtype=np.float32)
x = base @ mix + 0.1 * rng.standard_normal((rows, 32), dtype=np.float32)  # low-rank telemetry-like
np.save(sys.argv[1], x.astype(np.float32))
EOF

for amp in bf16 fp16; do
    for data in data/smd/train/machine-1-2.txt.gz "$OUT/synthetic.npy"; do
        base="$(basename "$data")"
        name="${base%%.*}-$amp"
        say "ds-ops train $data --device $DEVICE --amp $amp --epochs $EPOCHS"
        timeout "$(t 60)" "${DSOPS[@]}" train "$data" --device "$DEVICE" --amp "$amp" --epochs "$EPOCHS" --json \
            --name "$name" --models-dir "$OUT/models" >"$OUT/train-$name.json" 2>"$OUT/train-$name.err"
        rc=$?
        if ((rc)); then
            echo "ds-ops train exit status $rc (124: timed out after $(t 60) s)" >>"$OUT/train-$name.err"
            cat "$OUT/train-$name.err" >&2
        fi
    done
done

# a dataset over the job's memory budget: the same file streamed from disk (opt_ds_ops.training.stream)
say "ds-ops train $OUT/synthetic.npy streamed (job.max_matrix_bytes below its size) --amp bf16"
printf 'job:\n  max_matrix_bytes: %d\n' $((ROWS * 32 * 4 / 3)) >"$OUT/stream.yaml"
timeout "$(t 120)" "${DSOPS[@]}" train "$OUT/synthetic.npy" --config "$OUT/stream.yaml" --device "$DEVICE" --amp bf16 \
    --epochs "$EPOCHS" --json --name synthetic-streamed-bf16 --models-dir "$OUT/models" \
    >"$OUT/train-synthetic-streamed-bf16.json" 2>"$OUT/train-synthetic-streamed-bf16.err" \
    || { echo "ds-ops train (streamed) failed (124: timed out after $(t 120) s)" >>"$OUT/train-synthetic-streamed-bf16.err";
         cat "$OUT/train-synthetic-streamed-bf16.err" >&2; }

# --- 3a. the shipped defaults (no --epochs: the plateau rule, batch 1024, lr 1e-2, at most 600 steps,
# an evaluation every 25), bf16 and fp16, with and without CUDA graphs ------------------------------
for amp in bf16 fp16; do
    for graphs in true false; do
        name="defaults-machine-1-2-$amp-$([[ $graphs == true ]] && echo graphs || echo eager)"
        printf 'train:\n  cuda_graphs: %s\n' "$graphs" >"$OUT/$name.yaml"
        say "ds-ops train data/smd/train/machine-1-2.txt.gz --device $DEVICE --amp $amp (shipped defaults, cuda_graphs $graphs)"
        timeout "$(t 60)" "${DSOPS[@]}" train data/smd/train/machine-1-2.txt.gz --config "$OUT/$name.yaml" --device "$DEVICE" \
            --amp "$amp" --json --name "$name" --models-dir "$OUT/models" >"$OUT/train-$name.json" 2>"$OUT/train-$name.err" \
            || { echo "ds-ops train exit status $? (124: timed out after $(t 60) s)" >>"$OUT/train-$name.err"; cat "$OUT/train-$name.err" >&2; }
    done
done

# --- 3b'. a fleet's trainings: hosts one at a time against one stack (scripts/bench_stacked.py) -------
if [[ "$DEVICE" == cpu ]]; then STACK_ARGS=(--models 4 --rows 2000); else STACK_ARGS=(--models 32 --amp bf16); fi
say "scripts/bench_stacked.py --device $DEVICE ${STACK_ARGS[*]}"
timeout "$(t 240)" "$PY" scripts/bench_stacked.py --device "$DEVICE" --json "${STACK_ARGS[@]}" >"$OUT/stacked.json" 2>"$OUT/stacked.err" \
    || { echo "bench_stacked.py exit status $? (124: timed out after $(t 240) s)" >>"$OUT/stacked.err"; cat "$OUT/stacked.err" >&2; }

# --- 3b. the training step captured in a CUDA graph against eager steps (tests/training/test_step.py) --------
say "pytest tests/training/test_step.py (CUDA graph step = eager step; its CUDA cases skip without a GPU)"
timeout "$(t 120)" "$PY" -m pytest -q -p no:cacheprovider -rs tests/training/test_step.py 2>&1 | tee "$OUT/step-tests.txt"
rc=${PIPESTATUS[0]}
summary_line="$(grep -E '(passed|failed|error)' "$OUT/step-tests.txt" | tail -n1)"
if ((rc)); then
    step "step tests" FAILED "pytest exit status $rc (124: timed out after $(t 120) s): $summary_line"
else
    step "step tests" ok "$summary_line"
fi

# --- 4. benchmark: seed loop against ds-ops's trainer ----------------------------------------------
say "scripts/bench_train.py --device $DEVICE --rows $BENCH_ROWS"
bench_args=(--device "$DEVICE" --skip-parse --rows "$BENCH_ROWS")
[[ "$DEVICE" == cpu ]] && bench_args+=(--epochs 1)
timeout "$(t 150)" "$PY" scripts/bench_train.py "${bench_args[@]}" >"$OUT/bench.txt" 2>"$OUT/bench.err"
rc=$?
if ((rc)); then
    echo "bench_train.py exit status $rc (124: timed out after $(t 150) s)" >>"$OUT/bench.err"
    cat "$OUT/bench.err" >&2
fi
cat "$OUT/bench.txt"

# --- 5. one job through the installed unit (systemd PID 1 only) -------------------------------------
say "a job through the installed ds-trainer unit"
pid1="$(cat /proc/1/comm 2>/dev/null || echo '?')"
if [[ "$pid1" != systemd ]]; then
    step "unit job" skipped "systemd is not PID 1 here (PID 1 is $pid1): no unit to run a job through"
elif ! systemctl cat ds-trainer.service >/dev/null 2>&1; then
    step "unit job" skipped "the ds-trainer unit is not installed (install ds-ops.deb to check it)"
elif ! systemctl is-active --quiet ds-trainer.service; then
    step "unit job" FAILED "ds-trainer is installed but not active: systemctl status ds-trainer"
else
    spool="$("$PY" -c 'from opt_ds_ops.config.conffile import load_config
print(load_config("/etc/ds-ops/trainer.yaml", missing_ok=True).spool.dir)')"
    drop="gpu-check-$$-$(date +%s).txt.gz"
    if ! cp data/smd/train/machine-1-2.txt.gz "$spool/incoming/$drop.part" 2>"$OUT/unit.err" \
        || ! mv "$spool/incoming/$drop.part" "$spool/incoming/$drop" 2>>"$OUT/unit.err"; then
        step "unit job" FAILED "cannot drop into $spool/incoming (run as root or a member of the spool's group): $(head -n1 "$OUT/unit.err")"
    else
        for _ in $(seq "$(t 120)"); do
            [[ -e "$spool/done/$drop.result.json" || -e "$spool/failed/$drop.error.json" ]] && break
            sleep 1
        done
        if [[ -e "$spool/done/$drop.result.json" ]]; then
            cp "$spool/done/$drop.result.json" "$OUT/unit.json"
        elif [[ -e "$spool/failed/$drop.error.json" ]]; then
            cp "$spool/failed/$drop.error.json" "$OUT/unit-error.json"
            step "unit job" FAILED "the job failed: see $OUT/unit-error.json and journalctl -u ds-trainer"
        else
            step "unit job" FAILED "no result in $spool/done/ within $(t 120) s: journalctl -u ds-trainer"
        fi
    fi
fi

# --- 5b. one job through a daemon run here (no systemd needed): forkserver, job process, its GPU ----
say "a job through ds-ops daemon on a temporary spool ($OUT/spool)"
mkdir -p "$OUT/spool" "$OUT/daemon-models"
printf '%s\n' "models_dir: $OUT/daemon-models" "device: $([[ "$DEVICE" == cpu ]] && echo cpu || echo auto)" \
    "train:" "  epochs: $EPOCHS" "spool:" "  dir: $OUT/spool" "  settle_s: 0.5" "  quiet_s: 1.0" >"$OUT/daemon.yaml"
"${DSOPS[@]}" daemon --config "$OUT/daemon.yaml" >"$OUT/daemon.log" 2>&1 &
dpid=$!
for _ in $(seq "$(t 60)"); do [[ -d "$OUT/spool/incoming" ]] && grep -q "ready" "$OUT/daemon.log" && break; sleep 1; done
cp data/smd/train/machine-1-2.txt.gz "$OUT/spool/incoming/.daemon-check.part" \
    && mv "$OUT/spool/incoming/.daemon-check.part" "$OUT/spool/incoming/daemon-check.txt.gz"
for _ in $(seq "$(t 120)"); do
    [[ -e "$OUT/spool/done/daemon-check.txt.gz.result.json" || -e "$OUT/spool/failed/daemon-check.txt.gz.error.json" ]] && break
    kill -0 "$dpid" 2>/dev/null || break
    sleep 1
done
kill -TERM "$dpid" 2>/dev/null; wait "$dpid"
if [[ -e "$OUT/spool/done/daemon-check.txt.gz.result.json" ]]; then
    cp "$OUT/spool/done/daemon-check.txt.gz.result.json" "$OUT/daemon-job.json"
else
    step "daemon job" FAILED "no result in $OUT/spool/done/ within $(t 120) s: see $OUT/daemon.log and $OUT/spool/failed/"
    tail -n 20 "$OUT/daemon.log" >&2
fi

# --- 6. one table ---------------------------------------------------------------------------------
say "summary ($OUT)"
"$PY" - "$OUT" "$DEVICE" <<'EOF'
import glob, json, os, sys

out, device = sys.argv[1], sys.argv[2]


def load(path, last_line=False):
    try:
        text = open(path).read().strip()
        return json.loads(text.splitlines()[-1] if last_line else text)
    except (OSError, ValueError, IndexError):
        return None


def gpu_figures(history):
    """Max temperature (°C), power (W) and job memory (MiB), mean utilisation (%) over the epochs."""
    gs = [h.get("gpu") for h in history or [] if isinstance(h.get("gpu"), dict)]
    if not gs:
        return "-"

    def vals(k):
        return [g[k] for g in gs if isinstance(g.get(k), (int, float))]
    t, w, m, u = vals("temperature_c"), vals("power_draw_w"), vals("process_memory_mib"), vals("utilization_gpu_pct")
    throttled = sorted({r for g in gs for r in g.get("throttle_started") or []})
    return (f"{max(t) if t else '?'} °C, {max(w) if w else '?'} W, {max(m) if m else '?'} MiB, "
            f"{sum(u) / len(u) if u else float('nan'):.0f} %" + (f", throttled {'+'.join(throttled)}" if throttled else ""))


rows = []
doc = load(f"{out}/doctor.json")
if doc:
    d = doc["decision"]
    smokes = doc.get("smoke_tests") or []
    ok = (d["action"] == "run" and str(d["device"]).startswith(device) and all(t["ok"] for t in smokes)
          and (device == "cpu" or bool(smokes)))
    gpus = ", ".join(f"{g['name']} {g['verdict']}" for g in doc["gpus"]) or "no GPU"
    smoke = "; ".join(f"smoke test {t['device']} " + ("ok" if t["ok"] else f"FAILED: {t['error']}") for t in smokes)
    rows.append(("doctor", "ok" if ok else "FAILED", str(d["device"]), str(d["amp_dtype"]), "-", "-", "-",
                 f"{smokes[-1]['seconds']:.2f}" if smokes else "-", "-",
                 f"verdict {doc['verdict']} (exit {doc['exit_code']}), tf32 {d.get('tf32')}: {gpus}"
                 + (f"; {smoke}" if smoke else "; no smoke test (no GPU planned)")))
else:
    rows.append(("doctor", "FAILED", "?", "?", "-", "-", "-", "-", "-", "no JSON (see doctor.txt)"))
for amp in ("bf16", "fp16"):
    s = load(f"{out}/smoke-{amp}.json", last_line=True)
    if s is None:
        rows.append((f"smoke {amp}", "FAILED", "?", amp, "-", "-", "-", "-", "-", "no result (timed out?)"))
        continue
    rows.append((f"smoke {amp}", "ok" if s["ok"] else "FAILED", s["device"], s["amp_dtype"], "512", "-",
                 f"{s['loss']:.5f}" if s["loss"] is not None else "-", f"{s['seconds']:.2f}", "-",
                 "one forward + backward, synchronised" if s["ok"] else s["error"]))
for path in sorted(glob.glob(f"{out}/train-*.json")):
    name = os.path.basename(path)[6:-5]
    t = load(path)
    if t is None:
        rows.append((f"train {name}", "FAILED", "?", "?", "-", "-", "-", "-", "-", "see .err"))
        continue
    md = load(os.path.join(t["model_dir"], "metadata.json")) or {}
    ok = t["device"].startswith(device) and t["amp_dtype"] in name
    if "streamed" in name:
        ok = ok and md.get("data_placement") == "streamed"
    rows.append((f"train {name}", "ok" if ok else "FAILED", t["device"], t["amp_dtype"], f"{t['rows']:,}",
                 f"{t['samples_per_s']:,.0f}", f"{t['final_train_loss']:.5f}", f"{t['duration_s']:.1f}",
                 gpu_figures(md.get("history")),
                 f"skipped_steps {t['skipped_steps']}, health {t.get('health', '?')}, placement {md.get('data_placement', '?')}, "
                 f"{md.get('step_mode', '?')}, peak RSS {(md.get('peak_rss_bytes') or 0) / 2**20:,.0f} MiB"
                 + ("" if ok else f", NOT ON {device.upper()}")))
b = load(f"{out}/bench.txt", last_line=True)
if b:
    rows.append(("bench seed loop", "ok", b["device"], "off", f"{b['rows']:,}", f"{b['seed_samples_per_s']:,}",
                 f"{b['seed_final_loss']:.5f}", "-", "-", "the seed's loop as written: DataLoader, fp32, loss.item() per batch"))
    eager = {r["amp_dtype"]: r for r in b["runs"] if not r["cuda_graphs"]}
    for r in b["runs"]:
        captured = r["cuda_graphs"] and device != "cpu"
        ok = r["step_mode"].startswith("cuda-graph") if captured else True
        note = f"ratio {r['ratio']}x the seed loop, {r['step_mode']}"
        if captured and r["amp_dtype"] in eager:
            e = eager[r["amp_dtype"]]
            note += (f", {r['samples_per_s'] / e['samples_per_s']:.2f}x eager, final loss "
                     f"{abs(r['final_loss'] - e['final_loss']) / e['final_loss']:.1e} from eager's")
        rows.append((f"bench ds-ops {'graph' if captured else 'eager'}", "ok" if ok else "FAILED", b["device"],
                     r["amp_dtype"], f"{b['rows']:,}", f"{r['samples_per_s']:,}", f"{r['final_loss']:.5f}", "-", "-", note))
else:
    rows.append(("bench", "FAILED", "?", "?", "-", "-", "-", "-", "-", "see bench.err"))
st = load(f"{out}/stacked.json", last_line=True)
if st:
    ok = not st["failed"] and st["device"].startswith(device)
    rows.append(("train fleet stacked", "ok" if ok else "FAILED", st["device"], st["amp"].replace("torch.", ""),
                 f"{st['models']} x {st['rows']:,}", "-", "-", f"{st['stacked_s']:.1f}", "-",
                 f"{st['stacked_per_h']:,.0f} models/hour stacked against {st['alone_per_h']:,.0f} one at a time "
                 f"({st['ratio']:.2f}x); shipped defaults, steps {st['steps_min']}-{st['steps_max']}; from alone: threshold "
                 f"{st['threshold_rel_diff']:.1e} relative, weight {st['weight_abs_diff']:.1e}"
                 + (f"; FAILED in the stack: {st['failed']}" if st["failed"] else "")))
else:
    rows.append(("train fleet stacked", "FAILED", "?", "?", "-", "-", "-", "-", "-", "see stacked.err"))
u = load(f"{out}/unit.json")
if u:
    ok = str(u["device"]).startswith(device)
    rows.append(("unit job", "ok" if ok else "FAILED", u["device"], u["amp_dtype"], f"{u['rows']:,}",
                 f"{u['samples_per_s']:,.0f}", f"{u['final_train_loss']:.5f}", f"{u['duration_s']:.1f}",
                 gpu_figures(u.get("history")), "through ds-trainer.service" + ("" if ok else f", NOT ON {device.upper()}")))
d = load(f"{out}/daemon-job.json")
if d:
    ok = str(d["device"]).startswith(device) and (device == "cpu" or bool(d.get("gpu_uuid")))
    gpu = f"GPU {d.get('gpu_index')} {d.get('gpu_uuid')}" if d.get("gpu_uuid") else "no GPU slot"
    rows.append(("daemon job", "ok" if ok else "FAILED", d["device"], d["amp_dtype"], f"{d['rows']:,}",
                 f"{d['samples_per_s']:,.0f}", f"{d['final_train_loss']:.5f}", f"{d['duration_s']:.1f}",
                 gpu_figures(d.get("history")), f"ds-ops daemon, its job process on {gpu}"))
for path in sorted(glob.glob(f"{out}/steps/*.tsv")):
    name, status, note = open(path).read().rstrip("\n").split("\t", 2)
    rows.append((name, status, "-", "-", "-", "-", "-", "-", "-", note))
head = ("check", "status", "device", "amp", "rows", "samples/s", "final loss", "seconds", "GPU max °C, W, MiB; mean util", "note")
widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
for r in [head] + rows:
    print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
failed = [r[0] for r in rows if r[1] == "FAILED"]
print(f"\n{len(rows) - len(failed)} of {len(rows)} checks passed or were skipped"
      + (f"; FAILED: {', '.join(failed)}" if failed else ""))
sys.exit(1 if failed else 0)
EOF
