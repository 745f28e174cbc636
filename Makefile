# ds-ops developer entry points. Quick start: `make demo`, then `make test`.
# PYTHON is Debian's interpreter, the one the package runs on (/usr/bin/python3, 3.11).
PYTHON ?= /usr/bin/python3
VENV   ?= .venv
BIN    := $(VENV)/bin
MODELS ?= $(CURDIR)/build/models
SMD    := data/smd
DEMO   ?= machine-1-2

.PHONY: venv demo test test-durations test-slow gpu-check-dry fuzz bench bench-fleet soak fuzz-soak replay eval clean deb deb-deps lintian e2e

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	scripts/install-build-deps.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip setuptools
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

demo: venv
	$(BIN)/ds-ops train $(SMD)/train/$(DEMO).txt.gz --models-dir $(MODELS)
	$(BIN)/ds-ops score $(MODELS)/$(DEMO)/current $(SMD)/test/$(DEMO).txt.gz \
	    --labels $(SMD)/test_label/$(DEMO).txt.gz --output $(CURDIR)/build/$(DEMO).scores.csv \
	    || test $$? -eq 3  # 3: rows flagged (the test period holds anomalies)

# The unit and integration tests, in TEST_WORKERS processes (pytest-xdist; most tests wait on real
# daemons and job processes, so more workers than cores pays; docs/development.md). Other targets
# run the rest: the long runs and the crash-recovery tests (make test-slow),
# e2e (make e2e), the soaks (make soak, make fuzz-soak), the GPU check's dry run (make gpu-check-dry);
# CI runs each once.
# TEST_ARGS: more pytest arguments, e.g. TEST_ARGS='--durations=25'.
TEST_WORKERS ?= 4
TEST_ARGS ?=
test: venv
	$(BIN)/python -m pytest -q -m 'not e2e and not slow and not recovery and not soak and not gpu_check' \
	    -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(TEST_ARGS)

# tests/durations.json, the order make test hands tests out in (the longest first), measured anew:
# every test in one process on an otherwise idle machine (about 30 minutes on 2 cores).
test-durations: venv
	$(BIN)/python -m pytest -q -m 'not e2e' --store-durations

# The long runs (marker slow: every shared SMD machine trained and scored, a 2 GiB dataset streamed
# under a 1 GiB limit, the small month replay, 20 datasets at once...), and the crash-recovery tests (marker
# recovery: a daemon, job or command ended by a signal mid-work, or a daemon restarted, then what
# the restart or the next run finds). Run it too when a change touches the spool, the store, the
# daemon's jobs, checkpoints or restarts (about 6 minutes on 2 cores).
test-slow: venv
	$(BIN)/python -m pytest -q -m 'slow or recovery' -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(TEST_ARGS)

# scripts/gpu-check.sh's dry run on the CPU (GPU_CHECK_DEVICE=cpu), twice: every step passing, then
# a failing one named (tests/test_gpu_check.py, about 2-4 minutes on 2 cores).
gpu-check-dry: venv
	$(BIN)/python -m pytest -q -m gpu_check tests/test_gpu_check.py

# Coverage-guided fuzzing (atheris) of every reader: the datasets per format, sidecars, the conffile;
# FUZZ_SECONDS per target (9 targets), findings kept in tests/fuzz/regressions (docs/development-fuzz.md).
# FUZZ_SEED fixes libFuzzer's seed (CI does: the same inputs every run); unset, each run explores anew.
FUZZ_SECONDS ?= 60
FUZZ_SEED ?=
fuzz: venv
	$(BIN)/python scripts/fuzz.py --seconds $(FUZZ_SECONDS) $(if $(FUZZ_SEED),--seed $(FUZZ_SEED))

# Training loop against the seed script's loop; parsing of CSV (numeric, ISO time) and Parquet
# against numpy's loadtxt. Each prints ratios against its baseline, run in the same process.
bench: venv
	$(BIN)/python scripts/bench_train.py --skip-parse
	$(BIN)/python scripts/bench_parse.py

# A fleet on one server: N models scored every 5 minutes through a real daemon, then with the day's
# retrainings queued beside (scripts/bench_fleet.py; docs/performance.md, "A fleet on one server").
bench-fleet: venv
	$(BIN)/python scripts/bench_fleet.py --models 100 1000 --train-queue 40 --retrain-daily --stacked 16 $(BENCH_FLEET_ARGS)

# Soak: 200 datasets dropped by 4 writers while the daemon is SIGKILLed 100 times (scripts/soak.py);
# then 50 scored chunks that each open an incident, a SIGKILL in each: every incident entry said once (scripts/alert_soak.py);
# then 200 pulls of hosts from a real Prometheus, ds-ops pull SIGKILLed in half of them, a member planting
# names and taking model names: every row scored once, the anomaly paged once (scripts/pull_soak.py).
# SOAK_ARGS, ALERT_SOAK_ARGS and PULL_SOAK_ARGS size them (CI runs a smaller soak: .ci/run). They run as
# the tests tests/test_soak.py::test_soak, ::test_alert_soak and ::test_pull_soak (marker soak), their output shown.
SOAK_ARGS ?=
ALERT_SOAK_ARGS ?=
PULL_SOAK_ARGS ?=
soak: export DS_OPS_SOAK_ARGS = $(SOAK_ARGS)
soak: export DS_OPS_ALERT_SOAK_ARGS = $(ALERT_SOAK_ARGS)
soak: export DS_OPS_PULL_SOAK_ARGS = $(PULL_SOAK_ARGS)
soak: venv
	$(BIN)/python -m pytest -s -q -p no:cacheprovider tests/test_soak.py::test_soak tests/test_soak.py::test_alert_soak \
	    tests/test_soak.py::test_pull_soak

# Daemon fuzz soak: 500 hostile items (corrupt files of every format, random sidecars, FIFOs,
# links, foreign 0600 files, stalled writers, ...) and 30 good datasets while the daemon is SIGKILLed
# 50 times (scripts/fuzz_soak.py, docs/development-soak.md). FUZZ_SOAK_ARGS: e.g. --seed 7. It runs as
# the test tests/test_soak.py::test_fuzz_soak (marker soak), its output shown.
fuzz-soak: export DS_OPS_FUZZ_SOAK_ARGS = $(FUZZ_SOAK_ARGS)
fuzz-soak: venv
	$(BIN)/python -m pytest -s -q -p no:cacheprovider tests/test_soak.py::test_fuzz_soak

# Detection quality: train and score every labelled machine, with both baselines (ds-ops evaluate).
EVAL_SMD ?= $(if $(wildcard ../shared/data/smd/train),../shared/data/smd,$(SMD))
eval: venv
	$(BIN)/python -m opt_ds_ops.cli evaluate $(EVAL_SMD)

# A month of one SMD machine replayed through the real daemon with retrain.every on: what status,
# models and the journal say, and the retraining's invariants (scripts/replay_month.py,
# docs/retraining.md "A month, replayed"). REPLAY_ARGS: e.g. --machine machine-2-3 --keep.
replay: venv
	$(BIN)/python scripts/replay_month.py --smd $(EVAL_SMD) $(REPLAY_ARGS)

clean:
	rm -rf build $(VENV) *.egg-info

# Debian package (debian/): built from a copy of the tree's tracked and unignored files in
# build/deb/src, so local build products never leak in. TORCH=cuda builds the CUDA variant (build
# profile pkg.ds-ops.cuda, torch from pip's configured index) into build/deb-cuda/.
TORCH   ?= cpu
DEBDIR   = build/deb$(if $(filter cuda,$(TORCH)),-cuda)
DEB      = $(DEBDIR)/ds-ops_$(shell dpkg-parsechangelog -S Version)_$(shell dpkg --print-architecture).deb

# deb-deps first, as its own target: $(DEB) runs dpkg-parsechangelog (dpkg-dev) when the deb
# recipe is expanded, which must come after the install. As root it installs debian/control's
# Build-Depends (apt-get build-dep ./); as another user it prints the command and stops.
deb-deps:
	scripts/install-build-deps.sh --deb

deb: deb-deps
	rm -rf $(DEBDIR) && mkdir -p $(DEBDIR)/src
	git ls-files -z --cached --others --exclude-standard \
	    | tar --null -T - --ignore-failed-read -cf - | tar -xf - -C $(DEBDIR)/src
	cd $(DEBDIR)/src && dpkg-buildpackage -b -us -uc $(if $(filter cuda,$(TORCH)),-Ppkg.ds-ops.cuda)
	@ls -l $(DEB)

lintian:
	lintian --fail-on error,warning --info $(DEB)

# End-to-end: boots Debian 12 with systemd in systemd-nspawn and runs the install section of
# docs/INSTALL.md against the built package (root; root file system cached in /var/cache/ds-ops-e2e);
# and, in a container of its own, Debian's prometheus scrapes ds-ops through prometheus-node-exporter
# and the shipped alert fires for a scored anomaly (tests/e2e/test_alerts_e2e.py, prints its wall time).
e2e: venv
	test -f $(DEB) || $(MAKE) deb
	DS_OPS_DEB=$(CURDIR)/$(DEB) $(BIN)/python -m pytest -v -m e2e tests/e2e
