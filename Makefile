# Two commands set everything up on a fresh machine:
#   make check   create .venv, install the pinned set, run `forge-verify check`
#   make test    same set-up, run the default test tier (pytest; slow tier excluded)
#   make gate    same set-up, run the kernel-change gate against the committed baseline
#   make report  same set-up, execute the reports/ notebooks (fast setting) into build/reports/
# Without CUDA the pinned set takes the CPU build of torch (requirements/cpu.txt).

PYTHON ?= python3
# `make test` runs pytest in one process per usable core (pytest-xdist's `-n auto`, whose
# count forge_verify/distributed/workers.py sets as for `forge-verify check`: at most 8 on a GPU
# machine; work stealing, since a few long tests would otherwise leave one worker busy
# alone at the end); TEST_WORKERS=1 runs it in one process.
TEST_WORKERS ?= auto
VENV := .venv
PY := $(VENV)/bin/python
REQUIREMENTS := $(if $(shell command -v nvidia-smi 2>/dev/null),requirements/cuda.txt,requirements/cpu.txt)
STAMP := $(VENV)/.installed-$(notdir $(REQUIREMENTS))

.PHONY: check test gate report setup clean

# --no-compile: pip would byte-compile every file of every package (torch and transformers
# hold tens of thousands) on one core; Python compiles the modules a run imports, once.
$(STAMP): $(REQUIREMENTS) pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --no-compile --requirement $(REQUIREMENTS)
	$(PY) -m pip install --quiet --no-compile --no-deps --editable .
	touch $@

setup: $(STAMP)

check: $(STAMP)
	$(VENV)/bin/forge-verify check

# PYTEST_ARGS narrows the run (.ci/run passes "tests": `make check` has just run the properties).
# pytest-benchmark, where installed, refuses to run beside xdist: nothing here times itself.
test: $(STAMP)
	$(PY) -m pytest $(if $(filter-out 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist worksteal -p no:benchmark) $(PYTEST_ARGS)

gate: $(STAMP)
	$(VENV)/bin/forge-verify gate

report: $(STAMP)
	$(VENV)/bin/forge-verify report --mode fast

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build
