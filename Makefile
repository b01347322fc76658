# kvwire: the two commands a fresh machine needs are `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The CPU build of torch: on these machines it installs from local disk, never a CUDA download.
TORCH  ?= torch==2.13.0

.PHONY: demo test lint unit e2e bench asan other-pythons clean venv engine-wheels

$(STAMP): pyproject.toml kvwire/wire/_pack.c kvwire/prefix_index/_core.c
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[engine,test,metrics,demo]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) -m kvwire.demo

lint: $(STAMP)
	$(VENV)/bin/ruff check kvwire tests benchmarks examples
	$(VENV)/bin/mypy

# vLLM's and SGLang's wheels for tests/integrations: pip download --no-deps into
# ~/.cache/kvwire/wheels (reused); a failed download stops here with pip's reason.
engine-wheels: $(STAMP)
	$(PY) -m tests.integrations.engines

# The native tests under the sanitizers first (about 3 min), on the other CPython
# versions this machine has (about 1 min, side by side), then the whole suite.
# Two pytest workers: the suite waits on sockets and timers about 40% of the time,
# so a second worker uses the idle core. A file's tests share a worker, so the
# containerised tests build their image once.
JOBS ?= 2
PYTEST := $(PY) -m pytest -q -ra -n $(JOBS) --dist loadfile

test: $(STAMP) lint engine-wheels asan other-pythons
	$(PYTEST)

unit: $(STAMP) engine-wheels
	$(PYTEST) -m "not e2e"

e2e: $(STAMP)
	$(PYTEST) -m e2e

# The C extensions rebuilt with AddressSanitizer and UBSan, under their tests
# and the short fuzz run; part of `make test`, so CI (.ci/run) runs it.
asan: $(STAMP)
	scripts/asan-native.sh $(PY)

# The native int reads follow CPython's int layout, which changed in 3.12: their
# tests on every CPython 3.12+ found (pyenv's, or KVWIRE_PYTHONS); none found: a note.
other-pythons:
	scripts/other-pythons.sh

# Dynamo's RadixTree, the index benchmark's baseline, in a venv of its own.
.venv-dynamo/.installed:
	$(PYTHON) -m venv .venv-dynamo
	.venv-dynamo/bin/pip install -q ai-dynamo-runtime==1.6.1 numpy msgspec
	touch $@

# One BLAS thread: idle OpenBLAS workers spinning in every numpy process add noise.
bench: $(STAMP) .venv-dynamo/.installed
	OPENBLAS_NUM_THREADS=1 $(PY) benchmarks/publisher_bench.py
	OPENBLAS_NUM_THREADS=1 $(PY) benchmarks/subscriber_bench.py
	OPENBLAS_NUM_THREADS=1 $(PY) benchmarks/index_bench.py

clean:
	rm -rf $(VENV) .venv-py3.* build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
