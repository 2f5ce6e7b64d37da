# Two commands for a new user:
#   make demo   set up a virtual environment, then run the main job on an embedded default
#   make test   set up the same environment, then run the test suite
# TORCH_SPEC picks the torch build: the default pins the CPU wheel this project is tested with.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python

.PHONY: setup test demo bench gpu-check clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,peft]"
	touch $@

test: setup
	$(PY) -m pytest -q --durations=15

# The main job: a small Llama trained on 4 CPU ranks (Ulysses 2 x ring 2, FSDP2 over all 4)
# on the Python standard library's own source; DEMO_ARGS=--steps 8 for a shorter run;
# DEMO_ARGS=--flex for flexible SP groups (sizes 1, 2, 4 chosen per micro-batch slot, FlexSP/Hydraulis).
# DEMO_ARGS="--flex --unequal-calls": ranks run different numbers of micro-batches (model unsharded per step).
DEMO_ARGS ?=
demo: setup
	$(VENV)/bin/accelerate launch --config_file accelerate_configs/cpu_4proc.yaml recipes/demo.py $(DEMO_ARGS)

bench: setup
	$(PY) benchmarks/attention.py

# Validate a GPU machine: CUDA-only tests + GPU benchmarks, one table. On CPU: collects the
# CUDA tests, runs the emulated-backend tests, reports that there is no GPU, exits 0.
gpu-check: setup
	PYTHONPATH=$(CURDIR) $(PY) benchmarks/gpu_check.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
