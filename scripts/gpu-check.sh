#!/bin/bash
# GPU check for ds-ops, for a machine with an NVIDIA GPU: about 2-3 minutes expected; every step has
# a timeout and together they stay under 8 minutes (30+30 s doctor, 4 x 60 s train, 150 s bench).
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
# Steps: ds-ops doctor (text and --json); ds-ops train --device cuda with bf16 and with
# fp16+GradScaler on the bundled SMD machine and on a 1,000,000 x 32 synthetic file;
# scripts/bench_train.py --device cuda (seed loop against ds-ops's trainer); then one table.
# Everything is kept in $GPU_CHECK_OUT (default: a new folder under /tmp), printed at the end.
# Exit status: 0 all steps passed; 1 a step failed; 3 no usable CUDA GPU or missing packages.
# GPU_CHECK_DEVICE=cpu runs the same steps on the CPU (a dry run of this script on a machine
# without a GPU; slow, bf16/fp16 autocast on the CPU).
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

# --- 1. doctor ----------------------------------------------------------------------------------
say "ds-ops doctor"
timeout 30 "${DSOPS[@]}" doctor | tee "$OUT/doctor.txt"
timeout 30 "${DSOPS[@]}" doctor --json >"$OUT/doctor.json"
echo "$?" >"$OUT/doctor.rc"

[[ "$DEVICE" == cpu ]] || "$PY" - <<'EOF' || die "torch sees no CUDA GPU; see the doctor output above (driver, torch build) - stopping"
import sys, torch
ok = torch.cuda.is_available()
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, available={ok}, GPUs={torch.cuda.device_count()}")
sys.exit(0 if ok else 1)
EOF

# --- 2. training on $DEVICE with bf16 and fp16 + GradScaler ---------------------------------------
say "making a 1,000,000 x 32 synthetic dataset"
"$PY" - "$OUT/synthetic-1m.npy" <<'EOF' || die "cannot write the synthetic dataset" 1
import sys, numpy as np
rng = np.random.default_rng(0)
base = rng.standard_normal((1_000_000, 8), dtype=np.float32)
mix = rng.standard_normal((8, 32), dtype=np.float32)
x = base @ mix + 0.1 * rng.standard_normal((1_000_000, 32), dtype=np.float32)  # low-rank telemetry-like
np.save(sys.argv[1], x.astype(np.float32))
EOF

failed=0
for amp in bf16 fp16; do
    for data in data/smd/train/machine-1-2.txt.gz "$OUT/synthetic-1m.npy"; do
        base="$(basename "$data")"
        name="${base%%.*}-$amp"
        say "ds-ops train $data --device $DEVICE --amp $amp"
        timeout 60 "${DSOPS[@]}" train "$data" --device "$DEVICE" --amp "$amp" --epochs 5 --json \
            --name "$name" --models-dir "$OUT/models" >"$OUT/train-$name.json" 2>"$OUT/train-$name.err"
        rc=$?
        if ((rc)); then
            failed=1
            echo "ds-ops train exit status $rc (124: timed out after 60 s)" >>"$OUT/train-$name.err"
            cat "$OUT/train-$name.err" >&2
        fi
    done
done

# --- 3. benchmark: seed loop against ds-ops's trainer on CUDA ---------------------------------
say "scripts/bench_train.py --device $DEVICE"
timeout 150 "$PY" scripts/bench_train.py --device "$DEVICE" --skip-parse >"$OUT/bench.txt" 2>"$OUT/bench.err"
rc=$?
if ((rc)); then
    failed=1
    echo "bench_train.py exit status $rc (124: timed out after 150 s)" >>"$OUT/bench.err"
    cat "$OUT/bench.err" >&2
fi
cat "$OUT/bench.txt"

# --- 4. one table -------------------------------------------------------------------------------
say "summary ($OUT)"
"$PY" - "$OUT" "$DEVICE" <<'EOF' || failed=1
import glob, json, os, sys

out, device = sys.argv[1], sys.argv[2]


def load(path, last_line=False):
    try:
        text = open(path).read().strip()
        return json.loads(text.splitlines()[-1] if last_line else text)
    except (OSError, ValueError, IndexError):
        return None


rows = []
doc = load(f"{out}/doctor.json")
if doc:
    d = doc["decision"]
    gpus = ", ".join(f"{g['name']} {g['verdict']}" for g in doc["gpus"]) or "no GPU"
    rows.append(("doctor", str(d["device"]), str(d["amp_dtype"]), "-", "-", "-",
                 f"verdict {doc['verdict']} (exit {doc['exit_code']}): {gpus}"))
else:
    rows.append(("doctor", "?", "?", "-", "-", "-", "no JSON (see doctor.txt)"))
for path in sorted(glob.glob(f"{out}/train-*.json")):
    name = os.path.basename(path)[6:-5]
    t = load(path)
    if t is None:
        rows.append((f"train {name}", "?", "?", "-", "-", "-", "FAILED (see .err)"))
        continue
    ok = t["device"].startswith(device) and t["amp_dtype"] in name
    rows.append((f"train {name}", t["device"], t["amp_dtype"], f"{t['rows']:,}", f"{t['samples_per_s']:,.0f}",
                 f"{t['final_train_loss']:.5f}",
                 f"skipped_steps {t['skipped_steps']}, health {t.get('health', '?')}" + ("" if ok else f" NOT ON {device.upper()}")))
b = load(f"{out}/bench.txt", last_line=True)
if b:
    rows.append(("bench seed loop", b["device"], b["amp_dtype"], f"{b['rows']:,}", f"{b['seed_samples_per_s']:,}",
                 f"{b['seed_final_loss']:.5f}", "DataLoader + loss.item() per batch"))
    rows.append(("bench ds-ops", b["device"], b["amp_dtype"], f"{b['rows']:,}", f"{b['ds_ops_samples_per_s']:,}",
                 f"{b['ds_ops_final_loss']:.5f}", f"ratio {b['ratio']}x, loss diff {b['loss_rel_diff']:.1%}"))
else:
    rows.append(("bench", "?", "?", "-", "-", "-", "FAILED (see bench.err)"))
head = ("check", "device", "amp", "rows", "samples/s", "final loss", "note")
widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
for r in [head] + rows:
    print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
sys.exit(0 if all("FAILED" not in r[-1] and " NOT ON " not in r[-1] for r in rows) else 1)
EOF
exit "$failed"
