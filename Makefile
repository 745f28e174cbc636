# ds-ops developer entry points. Quick start: `make demo`, then `make test`.
# PYTHON is Debian's interpreter, the one the package runs on (/usr/bin/python3, 3.11).
PYTHON ?= /usr/bin/python3
VENV   ?= .venv
BIN    := $(VENV)/bin
MODELS ?= $(CURDIR)/build/models
SMD    := data/smd
DEMO   ?= machine-1-2

.PHONY: venv demo test bench eval clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip setuptools
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

demo: venv
	$(BIN)/ds-ops train $(SMD)/train/$(DEMO).txt.gz --models-dir $(MODELS)
	$(BIN)/ds-ops score $(MODELS)/$(DEMO)/current $(SMD)/test/$(DEMO).txt.gz \
	    --labels $(SMD)/test_label/$(DEMO).txt.gz --output $(CURDIR)/build/$(DEMO).scores.csv

test: venv
	$(BIN)/python -m pytest -q -m 'not e2e'

bench: venv
	$(BIN)/python scripts/bench_train.py

eval: venv
	$(BIN)/python scripts/eval_smd.py

clean:
	rm -rf build $(VENV) *.egg-info
