# One-command workflows. `make train` and `make test` are the README quickstart; both install first.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export VERL_CACHE_DIR ?= $(CURDIR)/.cache

.PHONY: install train test test-slow test-vllm test-all lint bench clean loadtest

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU torch first: with torch already satisfied, nothing below pulls a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

train: install
	$(BIN)/verl train

test: install
	$(BIN)/python -m pytest -q --durations=15

test-slow: install
	$(BIN)/python -m pytest -q -m slow --durations=15

test-vllm: install
	bash scripts/vllm_env.sh
	$(VENV)-vllm/bin/python -m pytest -q -m vllm

test-all: test test-slow test-vllm

lint: install
	$(BIN)/ruff check .

# Service on 127.0.0.1 -> stepped Locust run (1, 2, 4, 8 users x 20 s) -> capacity report in outputs/loadtest.
loadtest: install
	$(BIN)/verl loadtest --out outputs/loadtest

clean:
	rm -rf $(VENV) $(VENV)-vllm .cache outputs
