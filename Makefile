# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: demo test test-all bench clean venv

venv: $(STAMP)

# torch is installed first and pinned: `pip install torch==2.13.0` takes the CPU build where one is
# provided (find-links / a CPU index in pip.conf); never let a later resolve pick an unpinned torch.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/prime-node demo --summary demo-summary.json

# Everything not marked gpu. Exit code 5 ("no tests collected") is not a failure of the suite.
test: $(STAMP)
	$(BIN)/python -m pytest -m "not gpu" -q $(PYTEST_ARGS) || [ $$? -eq 5 ]

test-all: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

bench: $(STAMP)
	for b in bench/*.py; do $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
