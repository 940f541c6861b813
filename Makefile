# Two commands matter (README, Quick start): `make demo` and `make test`.
# Both create .venv on first use and install ubep into it (editable, native core built by pip).
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
EXTRAS ?= dev

.PHONY: demo test lint venv clean

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[$(EXTRAS)]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/ubep demo

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/mypy

test: lint
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) build src/*.egg-info
