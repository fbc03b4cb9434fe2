# unified_amp: one virtual environment per backend, made on first use and then reused.
#   make test                  set up both environments, run the whole suite on both backends,
#                              torch's contract tests again on oneDNN's AVX2 path
#                              (ONEDNN_MAX_CPU_ISA=AVX2), and mypy (unified_amp/, backends/,
#                              the fake backend)
#   make test BACKENDS=torch   one backend only (torch needs no CPython 3.10 and no MegEngine)
#   make test-oldest           the suite on the oldest supported torch, numpy and CPython
#                              (torch 2.7.1, a CUDA build of ~5 GB installed; CPython 3.10),
#                              and its contract tests again on oneDNN's AVX2 path
#   make test-matrix           the torch suite on every torch minor of the extra's range x
#                              CPython 3.10-3.13, one uv venv at a time; writes
#                              docs/versions.json and docs/VERSIONS.md (MATRIX_TORCH="2.8 2.12"
#                              MATRIX_PYTHON=3.11: only those cells; the others are kept)
#   make fuzz PROGRAMS=N SEED=S
#                              the differential fuzz (tests/fuzz) alone, N programs per
#                              test from seed S, on both backends (BACKENDS=torch: one);
#                              make test runs its fast tier
#   make test-integrations     tests/integrations: the runners (Lightning, Fabric, ignite,
#                              Enchanter, accelerate; basecore on MegEngine) trained with
#                              their framework's scaler and with unified_amp's, in
#                              environments of their own (BACKENDS=torch: one of them);
#                              with torch, also real models (torchvision's ResNet-50, timm's
#                              ViT, transformers' GPT-2) in .venv-integrations-models
#   make demo                  fp32 vs AMP on scikit-learn's digits, on $UNIFIED_AMP_BACKEND
#                              (default torch); writes demo-output/<backend>-curves.png
#                              (DEMO_ARGS="--plant overflow" plants an overflow and prints
#                              why the step was skipped)
#   make bench NAME=overhead   a named benchmark on $UNIFIED_AMP_BACKEND (BENCH_ARGS=--quick;
#                              no NAME: the list); NAME=report writes docs/BENCHMARKS.md's
#                              tables from benchmarks/results (docs/BENCHMARKS.md)
#   make cifar                 ResNet on CIFAR-10, fp32 vs AMP, on $UNIFIED_AMP_BACKEND
#                              (docs/CIFAR.md): CIFAR_ARGS="--data DIR" reads the data set;
#                              CIFAR_ARGS="--synthetic 960 --model resnet18 --width 8" needs none
#   make typecheck             mypy on unified_amp/, backends/ and the fake backend (in .venv-torch)
#   make clean                 remove the environments and what the targets wrote
SHELL := /bin/bash

PY_TORCH ?= $(shell command -v python3.11 || command -v python3)
# MegEngine 1.13.0 has wheels for CPython 3.8-3.10 only; pyenv's 3.10 is not on PATH here.
PY_MGE ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.10.*/bin/python3.10) $(shell command -v python3.10))
# The CPython for the oldest torch (make test-oldest): the oldest that requires-python
# admits, 3.10 (pyenv's, as MegEngine's). torch 2.7.1 with these pins crashed there
# (a segfault in the compile tests' sequence) until the adapter stopped setting dynamo's
# "skip, recursively" strategy on torch 2.7-2.8 (docs/VERSIONS.md, "Failures explained").
PY_OLDEST ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.10.*/bin/python3.10) $(shell command -v python3.10))

ALL_BACKENDS := torch megengine
# Names are matched as the library matches them: case and surrounding blanks ignored.
lc = $(strip $(subst A,a,$(subst B,b,$(subst C,c,$(subst D,d,$(subst E,e,$(subst F,f,$(subst G,g,$(subst H,h,$(subst I,i,$(subst J,j,$(subst K,k,$(subst L,l,$(subst M,m,$(subst N,n,$(subst O,o,$(subst P,p,$(subst Q,q,$(subst R,r,$(subst S,s,$(subst T,t,$(subst U,u,$(subst V,v,$(subst W,w,$(subst X,x,$(subst Y,y,$(subst Z,z,$(1))))))))))))))))))))))))))))
BACKEND := $(call lc,$(or $(UNIFIED_AMP_BACKEND),torch))
BACKENDS ?= $(ALL_BACKENDS)
TEST_BACKENDS := $(call lc,$(BACKENDS))

VENV_torch := .venv-torch
VENV_megengine := .venv-megengine
VENV_torch-oldest := .venv-torch-oldest
VENV_integrations-torch := .venv-integrations-torch
VENV_integrations-megengine := .venv-integrations-megengine
VENV_integrations-models := .venv-integrations-models
# The runners tests/integrations trains with (exact versions: constraints/integrations-*.txt).
# They get environments of their own so that `make test`'s stay what users install:
# Enchanter goes in without its declared dependencies (it pins scikit-learn<0.25, which has
# no CPython 3.11 wheel, and numpy<2), and basecore's wheel brings a top-level `tests`.
# Each is an overlay on the backend's test environment (see `overlay` below), so torch and
# MegEngine (1.4 and 2.3 GB installed) are on disk once, not twice.
RUNNERS_torch := pytorch-lightning lightning-fabric pytorch-ignite accelerate tensorboard
RUNNERS_NODEPS_torch := enchanter
RUNNERS_megengine := basecore
# The extras each environment installs (in variables: $(call) splits its arguments at
# every literal comma).
EXTRAS_torch := torch,test,examples,bench
EXTRAS_megengine := megengine,test,examples,bench
EXTRAS_integrations-torch := torch,test
EXTRAS_integrations-megengine := megengine,test
EXTRAS_integrations-models := torch,test
PYTEST_ARGS ?=
MATRIX_TORCH ?=
MATRIX_PYTHON ?=
BENCH_ARGS ?=
DEMO_ARGS ?=
CIFAR_ARGS ?=
LOGDIR := .test-logs

# Names no environment here is made for: such a target depends on `unknown-backend`
# instead, which fails with the library's own message.
BAD_BACKEND := $(filter-out $(ALL_BACKENDS),$(BACKEND))
BAD_TEST := $(firstword $(filter-out $(ALL_BACKENDS),$(TEST_BACKENDS)))

# pip's own progress (Collecting / Downloading lines; bars on a terminal). Only stderr's
# "Location 'file:...' is ignored" warnings, one per package a local mirror lacks, go.
# $(1): the environment, $(2): pip install's arguments.
pip_install = echo '$(1)/bin/pip install $(2)'; \
	set -o pipefail; { $(1)/bin/python -m pip install --progress-bar on $(2) \
	2>&1 1>&3 | { grep --line-buffered -v "Location 'file:.*' is ignored" || true; } >&2; } 3>&1

# An overlay environment: a fresh venv whose site-packages adds the base environment's
# (site.addsitedir in a .pth file, so the base's own .pth files, its editable install
# among them, apply as well) after its own. pip counts the base's packages as installed,
# so it puts only what the overlay adds, or pins to another version, into the overlay,
# which comes first on sys.path; the base environment is never written to. The
# integrations constraints repeat the base's pins, so in practice only the runners and
# what they pull in are installed. CI once failed on a full disk with two full copies.
# $(1): the python to make the venv with, $(2): the base environment, $(3): the overlay.
overlay = $(1) -m venv $(3) && \
	base="$$($(2)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" && \
	own="$$($(3)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" && \
	echo "import site; site.addsitedir('$$base')" > "$$own/zz-unified-amp-base-environment.pth" && \
	$(3)/bin/python -c 'import sys; base = sys.argv[1]; assert base in sys.path, "the overlay does not see " + base' "$$base"

# The overlay $(1) must import $(2) from its base $(3): a second copy means the pins
# drifted apart and the disk holds the framework twice.
from_base = $(1)/bin/python -c 'import sys, $(2) as m; sys.exit(None if "/$(3)/" in m.__file__ else \
	"$(1) imports $(2) from " + m.__file__ + ", not from $(3): keep constraints/integrations-*.txt on the base pins")'

# MegEngine's CUDA stub prints a banner and "failed to load cuda func" lines from C,
# whatever MegEngine's log level (MEGENGINE_LOGGING_LEVEL quiets only its Python
# logger), when there is no CUDA driver; on a CPU machine they only say it runs on CPU.
CUDA_STUB_NOISE := ^(info: \+|debug: failed to load cuda func: )

# The cross-backend fuzz (tests/fuzz/test_portable_fuzz.py) runs in torch's run and
# starts MegEngine's interpreter, named here when both backends are selected; the test
# fails if it is named and missing, and says why it cannot run where it is not named.
CROSS_ENV := $(if $(and $(filter torch,$(TEST_BACKENDS)),$(filter megengine,$(TEST_BACKENDS))),UNIFIED_AMP_MEGENGINE_PYTHON=$(VENV_megengine)/bin/python)

.PHONY: fuzz test test-oldest test-matrix test-integrations demo bench cifar typecheck env-torch env-megengine unknown-backend clean

$(VENV_torch)/.ready: pyproject.toml constraints/torch.txt
	@echo ">>> setting up $(VENV_torch) with $(PY_TORCH) (torch and the test tools; about 1.5 min the first time)"
	@test -n "$(PY_TORCH)" || { echo "no python3 found: set PY_TORCH=/path/to/python3.11"; exit 1; }
	$(PY_TORCH) -m venv $(VENV_torch)
	@$(call pip_install,$(VENV_torch),-c constraints/torch.txt -e ".[$(EXTRAS_torch)]")
	@touch $@

$(VENV_megengine)/.ready: pyproject.toml constraints/megengine.txt
	@echo ">>> setting up $(VENV_megengine) with $(PY_MGE) (MegEngine is a 0.9 GB wheel; about 3 min the first time)"
	@test -n "$(PY_MGE)" || { echo "CPython 3.10 not found (MegEngine needs 3.8-3.10, unified_amp >= 3.10): set PY_MGE=/path/to/python3.10, or run only torch: make test BACKENDS=torch"; exit 1; }
	$(PY_MGE) -m venv $(VENV_megengine)
	@$(call pip_install,$(VENV_megengine),-c constraints/megengine.txt -e ".[$(EXTRAS_megengine)]")
	@touch $@

$(VENV_torch-oldest)/.ready: pyproject.toml constraints/torch-oldest.txt
	@echo ">>> setting up $(VENV_torch-oldest) with $(PY_OLDEST) (the oldest supported torch: a CUDA build, ~5 GB installed with its nvidia wheels; it runs on CPU too)"
	@test -n "$(PY_OLDEST)" || { echo "CPython 3.10 not found: set PY_OLDEST=/path/to/python3.10"; exit 1; }
	rm -rf $(VENV_torch-oldest)
	$(PY_OLDEST) -m venv $(VENV_torch-oldest)
	@$(call pip_install,$(VENV_torch-oldest),-c constraints/torch-oldest.txt -e ".[$(EXTRAS_torch)]")
	@touch $@

$(VENV_integrations-torch)/.ready: $(VENV_torch)/.ready pyproject.toml constraints/integrations-torch.txt
	@echo ">>> setting up $(VENV_integrations-torch) over $(VENV_torch) (the torch runners; about 1 min the first time)"
	rm -rf $(VENV_integrations-torch)
	$(call overlay,$(PY_TORCH),$(VENV_torch),$(VENV_integrations-torch))
	@$(call pip_install,$(VENV_integrations-torch),-c constraints/integrations-torch.txt -e ".[$(EXTRAS_integrations-torch)]" $(RUNNERS_torch))
	@$(call pip_install,$(VENV_integrations-torch),--no-deps -c constraints/integrations-torch.txt $(RUNNERS_NODEPS_torch))
	@$(call from_base,$(VENV_integrations-torch),torch,$(VENV_torch))
	@touch $@

$(VENV_integrations-megengine)/.ready: $(VENV_megengine)/.ready pyproject.toml constraints/integrations-megengine.txt
	@echo ">>> setting up $(VENV_integrations-megengine) over $(VENV_megengine) (basecore; under a minute the first time)"
	rm -rf $(VENV_integrations-megengine)
	$(call overlay,$(PY_MGE),$(VENV_megengine),$(VENV_integrations-megengine))
	@$(call pip_install,$(VENV_integrations-megengine),-c constraints/integrations-megengine.txt -e ".[$(EXTRAS_integrations-megengine)]" $(RUNNERS_megengine))
	@$(call from_base,$(VENV_integrations-megengine),megengine,$(VENV_megengine))
	@touch $@

# Real models nobody here wrote, for tests/integrations/test_torch_models.py: torchvision,
# timm and transformers. Not an overlay: the registry's torchvision wheels are CUDA builds
# that load only into the CUDA build of the same torch, so this venv holds torch 2.14.1's
# CUDA 13 build with its nvidia wheels (it runs on CPU) beside .venv-torch's 2.13.0 CPU
# build. Measured on the 2-core machine (local mirror, no pip cache): 6.1 GB on disk,
# about 1.5 min to install.
MODELS := torch torchvision timm transformers
$(VENV_integrations-models)/.ready: pyproject.toml constraints/integrations-models.txt
	@echo ">>> setting up $(VENV_integrations-models) with $(PY_TORCH) (torch 2.14.1's CUDA build for torchvision, timm, transformers: 6 GB, about 1.5 min the first time)"
	rm -rf $(VENV_integrations-models)
	$(PY_TORCH) -m venv $(VENV_integrations-models)
	@$(call pip_install,$(VENV_integrations-models),-c constraints/integrations-models.txt -e ".[$(EXTRAS_integrations-models)]" $(MODELS))
	@touch $@

env-torch: $(VENV_torch)/.ready
env-megengine: $(VENV_megengine)/.ready

# The library's own error for a backend name it does not know (it lists the valid ones),
# from the framework-free core, so before any environment is made.
demo bench cifar: BAD_NAME = $(UNIFIED_AMP_BACKEND)
demo bench cifar: BAD_SOURCE = the UNIFIED_AMP_BACKEND environment variable
test fuzz test-integrations: BAD_NAME = $(BAD_TEST)
test: BAD_SOURCE = make test BACKENDS=...
fuzz: BAD_SOURCE = make fuzz BACKENDS=...
test-integrations: BAD_SOURCE = make test-integrations BACKENDS=...
unknown-backend:
	@$(PY_TORCH) -c 'import sys; from unified_amp import _registry as r; \
	sys.excepthook = lambda t, e, tb: print(f"make: *** {e}", file=sys.stderr); \
	r._validate(sys.argv[1], sys.argv[2]); \
	sys.exit(f"make: *** {sys.argv[1]!r} has no environment in this Makefile; it has: $(ALL_BACKENDS).")' \
	  '$(BAD_NAME)' '$(BAD_SOURCE)'

# The tests that touch low-precision CPU kernels, eager and compiled, run a second time on
# torch under oneDNN's AVX2 path (ONEDNN_MAX_CPU_ISA=AVX2 caps oneDNN's instruction set on
# any x86 CPU): there it has no bfloat16/float16 RNN primitive, and CI's CPU, with
# AVX-512 BF16, would not see what breaks on users' AVX2-only CPUs.
ISA_TESTS := tests/contract tests/native/test_torch_compiled_dtype_table.py tests/native/test_torch_recurrent_compiled.py
run_avx2 = echo; echo "================ backend: torch, oneDNN's AVX2 path (ONEDNN_MAX_CPU_ISA=AVX2) ================"; \
	  ONEDNN_MAX_CPU_ISA=AVX2 UNIFIED_AMP_BACKEND=torch $(1)/bin/python -m pytest $(ISA_TESTS) -q -p no:cacheprovider $(PYTEST_ARGS) 2>&1 \
	    | tee $(LOGDIR)/$(2).log; \
	  [ $${PIPESTATUS[0]} -eq 0 ] || status=1;
AVX2_RUN := $(if $(filter torch,$(TEST_BACKENDS)),torch-avx2)

# Each backend runs in its own interpreter; all run even if one fails, and the target
# fails if any did.
test: $(if $(BAD_TEST),unknown-backend,$(foreach b,$(TEST_BACKENDS),$(VENV_$(b))/.ready))
	@mkdir -p $(LOGDIR); status=0; \
	for b in $(TEST_BACKENDS); do \
	  echo; echo "================ backend: $$b ================"; \
	  UNIFIED_AMP_BACKEND=$$b $(CROSS_ENV) MEGENGINE_LOGGING_LEVEL=ERROR .venv-$$b/bin/python -m pytest tests -q -p no:cacheprovider $(PYTEST_ARGS) 2>&1 \
	    | { grep --line-buffered -v -E '$(CUDA_STUB_NOISE)' || true; } | tee $(LOGDIR)/$$b.log; \
	  [ $${PIPESTATUS[0]} -eq 0 ] || status=1; \
	done; \
	$(if $(AVX2_RUN),$(call run_avx2,$(VENV_torch),torch-avx2)) \
	typed="skipped (no torch environment in BACKENDS)"; \
	if [ -x $(VENV_torch)/bin/python ] && [[ " $(TEST_BACKENDS) " == *" torch "* ]]; then \
	  echo; echo "================ mypy: unified_amp/, backends/, the fake backend ================"; \
	  $(VENV_torch)/bin/python -m mypy 2>&1 | tee $(LOGDIR)/mypy.log; \
	  [ $${PIPESTATUS[0]} -eq 0 ] || status=1; typed="$$(tail -1 $(LOGDIR)/mypy.log)"; \
	fi; \
	echo; echo "================ summary ================"; \
	for b in $(TEST_BACKENDS) $(AVX2_RUN); do printf '%-10s %s\n' "$$b:" "$$(grep -E '^=*.*(passed|failed|error).* in [0-9.]+s' $(LOGDIR)/$$b.log | tail -1 | tr -d '=')"; done; \
	printf '%-10s %s\n' "mypy:" "$$typed"; \
	exit $$status

# The long fuzz: the same tests as make test's fast tier, with N programs each.
PROGRAMS ?= 200
SEED ?= 0
fuzz: $(if $(BAD_TEST),unknown-backend,$(foreach b,$(TEST_BACKENDS),$(VENV_$(b))/.ready))
	@status=0; for b in $(TEST_BACKENDS); do \
	  echo; echo "================ fuzz: $$b, $(PROGRAMS) programs per test from seed $(SEED) ================"; \
	  UNIFIED_AMP_BACKEND=$$b $(CROSS_ENV) UNIFIED_AMP_FUZZ_PROGRAMS=$(PROGRAMS) UNIFIED_AMP_FUZZ_SEED=$(SEED) MEGENGINE_LOGGING_LEVEL=ERROR \
	    .venv-$$b/bin/python -m pytest tests/fuzz -q -p no:cacheprovider $(PYTEST_ARGS) 2>&1 \
	    | { grep --line-buffered -v -E '$(CUDA_STUB_NOISE)' || true; }; \
	  [ $${PIPESTATUS[0]} -eq 0 ] || status=1; \
	done; exit $$status

# With torch, the real models too, in their environment (a package missing there is an
# error as well: UNIFIED_AMP_REQUIRE_MODELS); HF_HUB_OFFLINE: nothing is downloaded.
MODELS_SUITE := $(if $(filter torch,$(TEST_BACKENDS)),models)
run_models = echo; echo "================ integrations: real models (torch) ================"; \
	  UNIFIED_AMP_BACKEND=torch UNIFIED_AMP_REQUIRE_MODELS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
	    $(VENV_integrations-models)/bin/python -m pytest tests/integrations/test_torch_models.py \
	    tests/test_bench_smoke.py::test_real_models_benchmark_times_each_variant_beside_a_control \
	    -q -p no:cacheprovider $(PYTEST_ARGS) 2>&1 \
	    | tee $(LOGDIR)/integrations-models.log; \
	  [ $${PIPESTATUS[0]} -eq 0 ] || status=1;

# Each backend's runners in their own environment; a runner missing there is an error
# (UNIFIED_AMP_REQUIRE_RUNNERS), not a file quietly left uncollected.
test-integrations: $(if $(BAD_TEST),unknown-backend,$(foreach b,$(TEST_BACKENDS),$(VENV_integrations-$(b))/.ready) $(if $(MODELS_SUITE),$(VENV_integrations-models)/.ready))
	@mkdir -p $(LOGDIR); status=0; \
	for b in $(TEST_BACKENDS); do \
	  echo; echo "================ integrations: $$b ================"; \
	  UNIFIED_AMP_BACKEND=$$b UNIFIED_AMP_REQUIRE_RUNNERS=1 MEGENGINE_LOGGING_LEVEL=ERROR \
	    .venv-integrations-$$b/bin/python -m pytest tests/integrations -q -p no:cacheprovider $(PYTEST_ARGS) 2>&1 \
	    | { grep --line-buffered -v -E '$(CUDA_STUB_NOISE)' || true; } | tee $(LOGDIR)/integrations-$$b.log; \
	  [ $${PIPESTATUS[0]} -eq 0 ] || status=1; \
	done; \
	$(if $(MODELS_SUITE),$(run_models)) \
	echo; echo "================ integrations summary ================"; \
	for b in $(TEST_BACKENDS) $(MODELS_SUITE); do printf '%-10s %s\n' "$$b:" "$$(grep -E '^=*.*(passed|failed|error).* in [0-9.]+s' $(LOGDIR)/integrations-$$b.log | tail -1 | tr -d '=')"; done; \
	exit $$status

# Not part of `make test` (it downloads a CUDA build of torch), but CI runs it after
# make test and removes its environment (.ci/run).
test-oldest: $(VENV_torch-oldest)/.ready
	UNIFIED_AMP_BACKEND=torch $(VENV_torch-oldest)/bin/python -c 'import sys, torch, numpy; print(f"torch {torch.__version__}, numpy {numpy.__version__}, CPython {sys.version.split()[0]}")'
	@mkdir -p $(LOGDIR); status=0; \
	UNIFIED_AMP_BACKEND=torch $(VENV_torch-oldest)/bin/python -m pytest tests -q -p no:cacheprovider $(PYTEST_ARGS) 2>&1 \
	  | tee $(LOGDIR)/torch-oldest.log; \
	[ $${PIPESTATUS[0]} -eq 0 ] || status=1; \
	$(call run_avx2,$(VENV_torch-oldest),torch-oldest-avx2) \
	exit $$status

# Every torch of the range x every CPython torch has wheels for; not in CI (hours, and
# 5-6 GB of disk at a time). tools/version_matrix.py says how; docs/VERSIONS.md has
# the last run's table and what a full run costs.
test-matrix:
	$(PY_TORCH) tools/version_matrix.py --torch "$(MATRIX_TORCH)" --python "$(MATRIX_PYTHON)" --pytest-args "$(PYTEST_ARGS)"

demo: $(if $(BAD_BACKEND),unknown-backend,$(VENV_$(BACKEND))/.ready)
	UNIFIED_AMP_BACKEND=$(BACKEND) MEGENGINE_LOGGING_LEVEL=ERROR $(VENV_$(BACKEND))/bin/python -m examples.cnn_classifier --demo --plot demo-output/$(BACKEND)-curves.png $(DEMO_ARGS)

bench: $(if $(BAD_BACKEND),unknown-backend,$(VENV_$(BACKEND))/.ready)
	UNIFIED_AMP_BACKEND=$(BACKEND) MEGENGINE_LOGGING_LEVEL=ERROR $(VENV_$(BACKEND))/bin/python -m benchmarks $(NAME) $(BENCH_ARGS)

# No data set is downloaded: without --data or --synthetic it reads data/cifar-10-batches-py
# and says where to get it if that is missing.
cifar: $(if $(BAD_BACKEND),unknown-backend,$(VENV_$(BACKEND))/.ready)
	UNIFIED_AMP_BACKEND=$(BACKEND) MEGENGINE_LOGGING_LEVEL=ERROR $(VENV_$(BACKEND))/bin/python -m examples.cifar $(CIFAR_ARGS)

typecheck: $(VENV_torch)/.ready
	$(VENV_torch)/bin/python -m mypy

clean:
	rm -rf $(VENV_torch) $(VENV_megengine) $(VENV_torch-oldest) $(VENV_integrations-torch) \
	  $(VENV_integrations-megengine) $(VENV_integrations-models) $(LOGDIR) demo-output \
	  cifar-output .mypy_cache *.egg-info .matrix
