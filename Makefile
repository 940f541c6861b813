# Two commands matter (README, Quick start): `make demo` and `make test`.
# Each creates .venv on first use and installs ubep into it (editable; pip builds the C core).
# torch is pinned to the CPU wheel 2.13.0 and installed before anything that could ask for
# another torch, so pip never resolves a CUDA build.
VENV       ?= .venv
PY         := $(VENV)/bin/python
PIP        := $(PY) -m pip install -q --disable-pip-version-check
BASE_STAMP := $(VENV)/.stamp-base
TEST_STAMP := $(VENV)/.stamp-test
TORCH_PIN  := torch==2.13.0

.PHONY: demo test lint smoke venv clean

$(BASE_STAMP): pyproject.toml setup.py
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) -e '.[plot]'
	touch $@

# One editable install with every extra: pip builds the C core once (installing '.[plot]' first
# and then the rest would build it twice). The same install is what `make demo` needs.
$(TEST_STAMP): pyproject.toml setup.py
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) '$(TORCH_PIN)'
	$(PIP) '$(TORCH_PIN)' -e '.[plot,dev,torch,mpi,triton]'
	touch $(BASE_STAMP) $@

# .venv with every extra: torch (the CPU wheel) and torchrun, mpi4py + mpiexec, the dev tools
venv: $(TEST_STAMP)

demo: $(BASE_STAMP)
	$(VENV)/bin/ubep demo

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/mypy

# the smoke suite on every other CPython the package claims (tests/smoke/run_pythons.sh; one
# the machine lacks is skipped with its reason), then the full suite on this interpreter
test: lint
	tests/smoke/run_pythons.sh
	$(PY) -m pytest -q

smoke:
	tests/smoke/run_pythons.sh

clean:
	rm -rf $(VENV) .venv-smoke build src/*.egg-info
