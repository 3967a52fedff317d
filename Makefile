# Two commands on a fresh machine: `make train` and `make test`.
# Both create .venv with the standard library's venv, pin torch (the CPU build on this
# machine's disk), install the project, then run.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_PIN := torch==2.13.0
NPROC ?= 4

.PHONY: train test install install-dev clean test-unit test-distributed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_PIN)"
	$(PY) -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PY) -m pip install --quiet -e ".[dev]" "$(TORCH_PIN)"
	touch $@

install: $(VENV)/.installed

install-dev: $(VENV)/.installed-dev

train: $(VENV)/.installed
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --nproc-per-node $(NPROC) --local-ranks-filter 0 examples/train_llama.py

test: $(VENV)/.installed-dev
	$(PY) -m pytest tests/unit -q -p no:cacheprovider
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --nproc-per-node 4 --local-ranks-filter 0 \
		-m pytest tests/distributed -q -p no:cacheprovider

clean:
	rm -rf $(VENV) build *.egg-info
