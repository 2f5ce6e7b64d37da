# Two commands for a new user:
#   make demo   set up a virtual environment, then run the main job on an embedded default
#   make test   set up the same environment, then run the test suite
# TORCH_SPEC picks the torch build: the default pins the CPU wheel this project is tested with.
# It reaches pip unquoted, so it may carry pip options (quote a spec with < or > inside it:
# TORCH_SPEC='"torch>=2.11"'):
#   make gpu-check TORCH_SPEC="torch==2.11.0 --index-url https://download.pytorch.org/whl/cu128"
# (PIP_INDEX_URL / PIP_EXTRA_INDEX_URL work too). The venv stamp names a hash of TORCH_SPEC:
# changing it reinstalls.
# PYTHON_ENV=system: no venv, no network -- use $(PYTHON) with its own (CUDA) torch and
# transformers, installing only what is missing from the wheel folder $(WHEELS) (README, GPU).
# LOCK: the exact releases the suite last passed with (pip constraints, tools/lock.py); torch comes
# from TORCH_SPEC. `make test-latest` tries the newest releases and reports what differs and what
# broke; `make lock` then rewrites the lock from them, on purpose. LOCK= installs unconstrained.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
LOCK ?= constraints/main.txt
PIN = $(if $(LOCK),-c $(LOCK))
PYTHON_ENV ?= venv
WHEELS ?= wheels
TORCH_STAMP := $(VENV)/.installed-$(shell printf '%s' '$(TORCH_SPEC)' | cksum | cut -d' ' -f1)
SYSTEM_NEEDS := "torch>=2.11" "transformers>=5.17,<6" "accelerate>=1.15,<2" numpy tqdm "pytest>=8" "hypothesis>=6" pytest-timeout

ifeq ($(PYTHON_ENV),system)
PY := $(PYTHON)
SETUP := setup-system
else ifeq ($(PYTHON_ENV),venv)
PY := $(VENV)/bin/python
SETUP := $(TORCH_STAMP)
else
$(error PYTHON_ENV must be venv (default) or system, got "$(PYTHON_ENV)")
endif

.PHONY: setup setup-system test test-latest lock test-floor test-transformers-5.17 test-bf16-isa test-memory-isa demo bench gpu-check docs clean

setup: $(SETUP)

$(TORCH_STAMP): pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	rm -f $(VENV)/.installed-*
	$(PY) -m pip install -q $(PIN) $(TORCH_SPEC)
	$(PY) -m pip install -q $(PIN) -e ".[test,peft]"
	touch $@

# What is already installed satisfies pip without any source; the rest comes from the wheel
# folder, and from a package index when one is configured (PIP_INDEX_URL / PIP_EXTRA_INDEX_URL,
# or index-url in pip's config: a mirror); with none, pip stays offline (--no-index).
PIP_INDEX_SET = $(strip $(PIP_INDEX_URL)$(PIP_EXTRA_INDEX_URL)$(shell $(PY) -m pip config list 2>/dev/null | grep -i 'index-url'))
setup-system:
	$(PY) -m pip install -q $(if $(PIP_INDEX_SET),,--no-index) $(if $(wildcard $(WHEELS)),--find-links $(WHEELS)) $(SYSTEM_NEEDS)

test: setup
	$(PY) -m pytest -q --durations=15

# The newest releases of every dependency (torch still from TORCH_SPEC), in a venv of their own built
# afresh: what differs from $(LOCK), then the suite; a green run leaves a stamp that `make lock` needs.
LATEST_VENV ?= .venv-latest
test-latest:
	rm -rf $(LATEST_VENV)
	$(PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/python -m pip install -q $(TORCH_SPEC)
	$(LATEST_VENV)/bin/python -m pip install -q --upgrade --upgrade-strategy eager -e ".[test,peft,docs]"
	$(LATEST_VENV)/bin/python tools/lock.py diff --python $(LATEST_VENV)/bin/python --lock $(LOCK) | tee $(LATEST_VENV)/report.txt
	$(LATEST_VENV)/bin/python -m pytest -q -p no:cacheprovider -rfE > $(LATEST_VENV)/pytest.txt 2>&1; rc=$$?; \
	  grep -E "^(FAILED|ERROR) |^[0-9]+ (passed|failed)|(passed|failed|error).* in [0-9.]+s" $(LATEST_VENV)/pytest.txt >> $(LATEST_VENV)/report.txt; \
	  cat $(LATEST_VENV)/report.txt; echo "whole log: $(LATEST_VENV)/pytest.txt"; \
	  if [ $$rc -eq 0 ]; then touch $(LATEST_VENV)/.passed; fi; exit $$rc

# Rewrite $(LOCK) from the newest releases the suite just passed with (after `make test-latest`).
lock:
	@[ -f $(LATEST_VENV)/.passed ] || { echo "make lock: no green $(LATEST_VENV) (run make test-latest first; it must pass)"; exit 1; }
	$(LATEST_VENV)/bin/python tools/lock.py write --python $(LATEST_VENV)/bin/python --out $(LOCK) \
	  --note "make test-latest passed with these"

# The version floor (pyproject.toml): torch 2.11.0 from PyPI (its CUDA build, with its nvidia
# wheels, ~4.6 GB; it runs on CPU) and the oldest supported transformers/accelerate/datasets/
# peft/TRL, in a venv of its own.
FLOOR_VENV ?= .venv-floor
FLOOR_SPEC ?= torch==2.11.0 transformers==5.19.0 accelerate==1.15.0 datasets==5.2.0 peft==0.21.2 trl==1.16.0
FLOOR_TESTS ?= tests/unit tests/integration tests/distributed

FLOOR_LOCK ?= constraints/floor.txt
$(FLOOR_VENV)/.installed-floor: pyproject.toml $(FLOOR_LOCK)
	$(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python -m pip install -q $(if $(FLOOR_LOCK),-c $(FLOOR_LOCK)) $(FLOOR_SPEC)
	$(FLOOR_VENV)/bin/python -m pip install -q $(if $(FLOOR_LOCK),-c $(FLOOR_LOCK)) -e ".[test,peft]" $(FLOOR_SPEC)
	touch $@

test-floor: $(FLOOR_VENV)/.installed-floor
	$(FLOOR_VENV)/bin/python -m pytest -q --durations=15 $(FLOOR_TESTS)

# transformers 5.17, what the GPU image carries: patch(), the patched models, the FSDP plan,
# torch.compile and gpu-check's CPU path on it (the multi-rank Trainer needs 5.19): the floor
# venv with transformers 5.17 and its own dependencies laid over it on PYTHONPATH.
T517_DIR ?= .floor-transformers-5.17
T517_TESTS ?= tests/integration/test_patch.py tests/distributed/test_models.py tests/distributed/test_fsdp.py \
	tests/distributed/test_compile.py tests/unit/test_gpu_check.py
T517_LOCK ?= constraints/transformers-5.17.txt
$(T517_DIR)/.installed: $(FLOOR_VENV)/.installed-floor $(T517_LOCK)
	$(FLOOR_VENV)/bin/python -m pip install -q $(if $(T517_LOCK),-c $(T517_LOCK)) --target $(T517_DIR) transformers==5.17.0
	touch $@

test-transformers-5.17: $(T517_DIR)/.installed
	PYTHONPATH=$(CURDIR)/$(T517_DIR) $(FLOOR_VENV)/bin/python -m pytest -q $(T517_TESTS)

# Tests under each CPU kernel set: ATEN_CPU_CAPABILITY picks torch's vectorised kernels (default =
# scalar, avx2, avx512), ONEDNN_MAX_CPU_ISA caps oneDNN's matmuls (AVX2, AVX512_CORE, AVX512_CORE_BF16,
# AVX512_CORE_AMX, DEFAULT); a setting above what the CPU has runs its best. Each setting's line says
# what torch used; every one must pass. $(1): label, $(2): settings, $(3): pytest selection.
define isa_runs
fail=0; for s in $(2); do \
  export ATEN_CPU_CAPABILITY=$${s%%:*} ONEDNN_MAX_CPU_ISA=$${s##*:}; \
  used=$$($(PY) -c "import torch; print(torch.backends.cpu.get_cpu_capability(), 'oneDNN bf16:', torch.ops.mkldnn._is_mkldnn_bf16_supported())"); \
  $(PY) -m pytest -q -p no:cacheprovider $(3) > .$(1)-isa-$$s.log 2>&1; rc=$$?; \
  echo "ATEN_CPU_CAPABILITY=$$ATEN_CPU_CAPABILITY ONEDNN_MAX_CPU_ISA=$$ONEDNN_MAX_CPU_ISA (torch used: $$used): $$(tail -1 .$(1)-isa-$$s.log)"; \
  [ $$rc -eq 0 ] || fail=1; done; exit $$fail
endef

# The bf16 tests (-k "bf16 or bfloat16") under each CPU kernel set. BF16_ISAS="avx2:AVX2" for one.
BF16_ISAS ?= default:AVX2 avx2:AVX2 avx2:DEFAULT avx512:AVX512_CORE avx512:AVX512_CORE_BF16 avx512:AVX512_CORE_AMX
BF16_TESTS ?= tests/unit tests/distributed
test-bf16-isa: setup
	@$(call isa_runs,bf16,$(BF16_ISAS),-k "bf16 or bfloat16" $(BF16_TESTS))

# The memory tests (the planner against the census of real steps) under each CPU kernel set: what a
# step allocates must not depend on which kernels the CPU runs. MEMORY_ISAS="avx2:AVX2" for one.
MEMORY_ISAS ?= $(BF16_ISAS)
MEMORY_TESTS ?= tests/unit/test_memory_budget.py tests/unit/test_memory_budget_tasks.py tests/unit/test_memory_model.py \
	tests/unit/test_packed_memory.py
test-memory-isa: setup
	@$(call isa_runs,memory,$(MEMORY_ISAS),$(MEMORY_TESTS))

# The main job: a small Llama trained on 4 CPU ranks (Ulysses 2 x ring 2, FSDP2 over all 4)
# on the Python standard library's own source; DEMO_ARGS=--steps 8 for a shorter run;
# DEMO_ARGS=--flex for flexible SP groups (sizes 1, 2, 4 chosen per micro-batch slot, FlexSP/Hydraulis).
# DEMO_ARGS="--flex --unequal-calls": ranks run different numbers of micro-batches (model unsharded per step).
DEMO_ARGS ?=
demo: setup
	$(VENV)/bin/accelerate launch --config_file accelerate_configs/cpu_4proc.yaml recipes/demo.py $(DEMO_ARGS)

bench: setup
	$(PY) benchmarks/attention.py

# Validate a GPU machine: CUDA-only tests, patched steps under CUDA's sync debug mode "error",
# GPU benchmarks, one table (~5 min on one H100; every subprocess bounded, a hang ends in a
# "TIMED OUT after N s" row). On CPU: collects the CUDA tests, runs the emulated-backend tests
# and the hot-path counts, reports that there is no GPU, exits 0.
# GPU_CHECK_ARGS=--max-tokens 262144 raises the longest-context bound (default 32K).
GPU_CHECK_ARGS ?=
gpu-check: setup
	PYTHONPATH=$(CURDIR) $(PY) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

# The documentation site: the `docs` extra (MkDocs, mkdocstrings, pinned in pyproject.toml) in the
# same environment, then `mkdocs build --strict` into site/ (~15 s on an idle 2-core machine): a
# broken link or anchor, a page outside the navigation, a public name without a docstring or
# without its place in the API reference (docs/hooks/api_check.py) fails it. The figures are drawn
# by the project's own code during the build (docs/hooks/figures.py).
DOCS_STAMP := $(if $(filter system,$(PYTHON_ENV)),.docs-installed,$(VENV)/.installed-docs)
$(DOCS_STAMP): pyproject.toml $(SETUP)
	$(PY) -m pip install -q $(if $(filter system,$(PYTHON_ENV)),,$(PIN)) -e ".[docs]"
	touch $@

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 PYTHONPATH=$(CURDIR) $(PY) -m mkdocs build --strict

clean:
	rm -rf $(VENV) $(FLOOR_VENV) $(LATEST_VENV) $(T517_DIR) .pytest_cache .hypothesis site .docs-installed
