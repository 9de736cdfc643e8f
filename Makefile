# Two commands set everything up on a fresh machine:
#   make check   create .venv, install the pinned set, run `forge-verify check`
#   make test    same set-up, run the default test tier (pytest; slow tier excluded)
#   make gate    same set-up, run the kernel-change gate against the committed baseline
#   make report  same set-up, execute the reports/ notebooks (fast setting) into build/reports/
# Without CUDA the pinned set takes the CPU build of torch (requirements/cpu.txt).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
REQUIREMENTS := $(if $(shell command -v nvidia-smi 2>/dev/null),requirements/cuda.txt,requirements/cpu.txt)
STAMP := $(VENV)/.installed-$(notdir $(REQUIREMENTS))

.PHONY: check test gate report setup clean

$(STAMP): $(REQUIREMENTS) pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --requirement $(REQUIREMENTS)
	$(PY) -m pip install --quiet --no-deps --editable .
	touch $@

setup: $(STAMP)

check: $(STAMP)
	$(VENV)/bin/forge-verify check

# PYTEST_ARGS narrows the run (.ci/run passes "tests": `make check` has just run the properties).
test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

gate: $(STAMP)
	$(VENV)/bin/forge-verify gate

report: $(STAMP)
	$(VENV)/bin/forge-verify report --mode fast

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build
