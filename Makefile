# unified_amp: one virtual environment per backend, made on first use and then reused.
#   make test   - set up both environments and run the whole suite on both backends
#   make demo   - train the example CNN, fp32 vs AMP, on $UNIFIED_AMP_BACKEND (default torch)
#                 (DEMO_ARGS="--plant overflow" plants an overflow and prints why it skipped)
#   make bench  - the benchmark CLI on $UNIFIED_AMP_BACKEND (BENCH_ARGS=--quick for a smoke run)
SHELL := /bin/bash

PY_TORCH ?= $(shell command -v python3.11 || command -v python3)
# MegEngine 1.13.0 has wheels for CPython 3.8-3.10 only; pyenv's 3.10 is not on PATH here.
PY_MGE ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.10.*/bin/python3.10) $(shell command -v python3.10))

VENV_torch := .venv-torch
VENV_megengine := .venv-megengine
BACKEND := $(or $(UNIFIED_AMP_BACKEND),torch)
PYTEST_ARGS ?=
BENCH_ARGS ?=
DEMO_ARGS ?=
LOGDIR := .test-logs

# pip's local mirrors print a warning for every package they don't carry; keep the noise out.
PIP_FILTER := grep -v "Location 'file:.*' is ignored" || true

.PHONY: test demo bench env-torch env-megengine clean

$(VENV_torch)/.ready: pyproject.toml
	@echo ">>> setting up $(VENV_torch) with $(PY_TORCH)"
	@test -n "$(PY_TORCH)" || { echo "no python3 found"; exit 1; }
	$(PY_TORCH) -m venv $(VENV_torch)
	set -o pipefail; $(VENV_torch)/bin/pip install -q -e ".[torch,test,bench]" 2>&1 | { $(PIP_FILTER); }
	@touch $@

$(VENV_megengine)/.ready: pyproject.toml
	@echo ">>> setting up $(VENV_megengine) with $(PY_MGE)"
	@test -n "$(PY_MGE)" || { echo "CPython 3.10 not found (MegEngine needs 3.8-3.10): set PY_MGE=/path/to/python3.10"; exit 1; }
	$(PY_MGE) -m venv $(VENV_megengine)
	set -o pipefail; $(VENV_megengine)/bin/pip install -q -e ".[megengine,test,bench]" 2>&1 | { $(PIP_FILTER); }
	@touch $@

env-torch: $(VENV_torch)/.ready
env-megengine: $(VENV_megengine)/.ready

# Each backend runs in its own interpreter; both run even if the first fails, and the
# target fails if either did.
test: $(VENV_torch)/.ready $(VENV_megengine)/.ready
	@mkdir -p $(LOGDIR); status=0; \
	for b in torch megengine; do \
	  echo; echo "================ backend: $$b ================"; \
	  UNIFIED_AMP_BACKEND=$$b .venv-$$b/bin/python -m pytest tests -q -p no:cacheprovider $(PYTEST_ARGS) 2>&1 \
	    | tee $(LOGDIR)/$$b.log; \
	  [ $${PIPESTATUS[0]} -eq 0 ] || status=1; \
	done; \
	echo; echo "================ summary ================"; \
	for b in torch megengine; do printf '%-10s %s\n' "$$b:" "$$(grep -E '^=*.*(passed|failed|error).* in [0-9.]+s' $(LOGDIR)/$$b.log | tail -1 | tr -d '=')"; done; \
	exit $$status

demo: $(VENV_$(BACKEND))/.ready
	UNIFIED_AMP_BACKEND=$(BACKEND) $(VENV_$(BACKEND))/bin/python -m examples.cnn_classifier --demo $(DEMO_ARGS)

bench: $(VENV_$(BACKEND))/.ready
	UNIFIED_AMP_BACKEND=$(BACKEND) $(VENV_$(BACKEND))/bin/python -m benchmarks.bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV_torch) $(VENV_megengine) $(LOGDIR) *.egg-info
