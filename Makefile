# pdconnect: every set-up step lives here, so `make test` and `make demo` work from a clean clone.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# The stamp names the inputs it was built from: editing either reinstalls, nothing else does.
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints-cpu.txt | sha1sum | cut -c1-12)
PYTEST_ARGS ?=
export VLLM_CACHE_ROOT ?= $(CURDIR)/build/vllm-cache
export UCX_MODULES ?= ^ib

.PHONY: install test test-fast demo bench-plan bench-transfer bench-router bench clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints-cpu.txt
	@# Mooncake's wheel links libibverbs; its recommended providers break NIXL (ENV.md).
	@dpkg -s libibverbs1 >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq --no-install-recommends libibverbs1; }
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip==25.3
	$(PY) -m pip install -q -c constraints-cpu.txt -e '.[cpu,test]'
	@# PyPI's torchvision/torchaudio/torchcodec need CUDA and break `import transformers`.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	@# nixl-cu12 ships the library; `nixl` is the import shim, installed without its CUDA deps.
	$(PY) -m pip install -q --no-deps nixl==1.5.1
	rm -f $(VENV)/.installed-* && touch $@

test: install
	$(PY) -m pytest -q $(PYTEST_ARGS)

# Everything but the real-engine tests, for a quick loop while editing.
test-fast: install
	$(PY) -m pytest -q -m "not engine" $(PYTEST_ARGS)

bench-plan: install
	$(PY) -m pdconnect.bench.plan

clean:
	rm -rf build results
