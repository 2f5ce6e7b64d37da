# Two commands for a new user:
#   make demo   set up a virtual environment, then run the main job on an embedded default
#   make test   set up the same environment, then run the test suite
# TORCH_SPEC picks the torch build: the default pins the CPU wheel this project is tested with.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python

.PHONY: setup test demo bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,peft]"
	touch $@

test: setup
	$(PY) -m pytest -q --durations=15

demo: setup
	$(PY) -m torch.distributed.run --nproc-per-node 4 recipes/attention_demo.py

bench: setup
	$(PY) benchmarks/attention.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
