# Two entry points for a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8

.PHONY: demo test venv test-env clean system-deps

$(VENV)/.base: pyproject.toml setup.py src/nnx_save/io/_gather.c
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.test: $(VENV)/.base
	$(PY) -m pip install -q -e ".[test]"
	touch $@

venv: $(VENV)/.base
test-env: $(VENV)/.test

demo: $(VENV)/.base
	$(PY) examples/demo.py

# nginx serves checkpoints to the remote-source tests and docs/remote.md; tmux is the terminal of
# tests/test_progress.py (Debian packages; needs root). Without them those tests would not run.
system-deps:
	@missing="$$(command -v nginx >/dev/null 2>&1 || test -x /usr/sbin/nginx || echo nginx) \
	  $$(command -v tmux >/dev/null 2>&1 || echo tmux)"; \
	if [ -n "$$(echo $$missing)" ]; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; fi

# What CI runs: lint, format, types, dead code (vulture; used names it cannot see are in
# vulture_allowlist.py), every module's doctests, then the whole suite on every
# core (pytest-xdist). Each test file is one unit of work and the multi-process tests are one,
# run first and one at a time (tests/conftest.py); `.venv/bin/python -m pytest` runs it serially.
test: $(VENV)/.test system-deps
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	$(PY) -m vulture src/nnx_save vulture_allowlist.py --min-confidence 60
	$(PY) -m pytest -q -p no:cacheprovider --doctest-modules src/nnx_save
	$(PY) -m pytest -q -n auto --dist loadgroup --no-loadscope-reorder

clean:
	rm -rf $(VENV) build dist src/*.egg-info
