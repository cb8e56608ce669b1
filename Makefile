# kvfork: `make serve` and `make test` do all the set-up they need.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# MLX's Linux wheel bundles a reference BLAS; preload OpenBLAS when the machine has it.
BLAS_ENV = LD_PRELOAD="$$($(BIN)/python -m kvfork.backends.mlx.blas)"
ARGS ?=

.PHONY: install model serve test test-long test-distributed test-all test-numeric smoke soak bench peers cluster clients clean

install: $(STAMP)

$(STAMP): pyproject.toml setup.py
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || { \
	  echo "kvfork needs Python 3.11 or newer, and $(PYTHON) is $$($(PYTHON) --version 2>/dev/null || echo missing):" \
	    "install Python 3.11+ (macOS: brew install python@3.12; Ubuntu 22.04: sudo apt install python3.11 python3.11-venv)" \
	    "and run make again with PYTHON=python3.12 (or python3.11)." >&2; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[dev,cluster,kv-router]'
	$(BIN)/python -m kvfork.backends.mlx.blas --install
	touch $(STAMP)

model: install
	$(BIN)/kvfork fetch-model

serve: install
	$(BIN)/kvfork serve $(ARGS)

# The tiers (tests/README.md): `make test` is the fast tier, run before every push; the `long` and
# `distributed` markers put a test in a tier of its own; `make test-all` runs every tier at once.
# TEST_WORKERS pytest-xdist processes run them, each with one OpenMP thread (two workers on two cores,
# none spinning on the other); a file stays in one worker, so its shared daemon or backend is made once,
# except in the long tier, whose few tests are each worth a worker.
FAST_TIER    := not long and not distributed
TEST_WORKERS ?= 2
PYTEST = OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS)

test: install
	$(BLAS_ENV) $(PYTEST) --dist loadfile -m "$(FAST_TIER)" $(ARGS)

test-long: install
	$(BLAS_ENV) $(PYTEST) --dist load -m long $(ARGS)

# Each test starts two ranks of its own: one file at a time.
test-distributed: install
	$(BLAS_ENV) $(BIN)/python -m pytest -q -m distributed $(ARGS)

test-all: install
	$(BLAS_ENV) $(PYTEST) --dist loadfile $(ARGS)

# The numeric tests (marked `numeric`) without the OpenBLAS preload: MLX's bundled BLAS and torch's own
# (as `kvfork serve --backend torch` runs) sum in other orders, so a tolerance fitted to one BLAS fails here.
test-numeric: install
	LD_PRELOAD= $(PYTEST) --dist loadfile -m numeric $(ARGS)

# Replicas of one model behind smg on this machine: ARGS="--replicas 3 --port 9000" (README: Several replicas).
cluster: install
	$(BIN)/kvfork cluster $(ARGS)

smoke: install
	$(BIN)/kvfork smoke $(ARGS)

# 2,000 requests on the default model with faults, hang-ups and fuzzed bodies; prints the table of checks.
soak: install
	$(BIN)/kvfork soak $(ARGS)

# A small paired replay (reuse off, then on) on the default model; prints the table.
bench: install
	$(BIN)/kvfork bench paired $(ARGS)

# Opt-in: also mlx_lm.server and llama.cpp's server (built once, about 20 min on 2 cores).
peers: install
	$(BIN)/kvfork bench peers $(ARGS)

# Opt-in: Codex CLI, Claude Code and opencode from npm (into $KVFORK_HOME/clients), each in a scripted
# 3-turn session with a tool call against a tiny 64k-context model; prints the table.
clients: install
	$(BIN)/kvfork clients --install $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
