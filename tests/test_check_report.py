"""`forge-verify check`'s report: examples counted from hypothesis itself (so a property
that runs no example never reads "holds"), skip reasons shown, and a table that reads at
100 columns."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from forge_verify.commands.check import format_table

PROPERTIES = '''
import pytest
from hypothesis import Phase, given, settings, strategies as st
from forge_verify.checks.observations import RADIUS, observe

@settings(max_examples=7, database=None)
@given(st.integers())
def test_seven(x):
    observe(0.25, RADIUS)
    assert x == x

@settings(phases=[Phase.explicit], database=None)
@given(st.integers())
def test_no_example_runs(x):
    assert False

def test_fixed_case():
    assert True

def test_skipped():
    pytest.skip("needs two CUDA GPUs")

@settings(max_examples=5, database=None, phases=[Phase.generate])
@given(st.integers(0, 10))
def test_fails(x):
    assert x < 0
'''

DRIVER = '''
import json, sys, pytest
from forge_verify.commands.check import RECORDER, _Collector, _parallel_args, verdicts
collector = _Collector()
pytest.main([sys.argv[1], "-q", "-p", "no:cacheprovider", "-p", RECORDER, *_parallel_args(int(sys.argv[2]))],
            plugins=[collector])
print("ROWS" + json.dumps(verdicts(collector)))
'''


def _verdicts(tmp_path, workers):
    (tmp_path / "test_synthetic.py").write_text(textwrap.dedent(PROPERTIES))
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_")}
    run = subprocess.run([sys.executable, "-c", DRIVER, str(tmp_path), str(workers)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    line = next(line for line in run.stdout.splitlines() if line.startswith("ROWS"))
    return {row[1]: row for row in json.loads(line[4:])}


@pytest.mark.parametrize("workers", [1, 2], ids=["one process", "two xdist workers"])
def test_report_counts_examples_and_never_calls_an_empty_run_holding(tmp_path, workers):
    """The same verdicts whether the tests run in this process or in xdist workers (whose
    counts and observations reach the table only through the reports)."""
    rows = _verdicts(tmp_path, workers)
    assert rows["seven"][3:6] == ["7", "holds", "0.25 of the proven radius"]
    # Hypothesis's own words ("... no examples ...", "... no test cases for this test"), by version.
    assert rows["no_example_runs"][4].startswith("skipped: Hypothesis has been told to run no ")
    assert rows["fixed_case"][3:5] == ["1 case", "holds"]
    assert rows["skipped"][4] == "skipped: needs two CUDA GPUs"
    assert rows["fails"][4] == "FAILED" and int(rows["fails"][3]) >= 1


def test_table_reads_at_100_columns():
    long = "properties/test_x.py::test_" + "p" * 60 + "[" + "AdamW(lr=0.001, betas=(0.9, 0.999))" * 3 + "]"
    rows = [(long, "p" * 60, "AdamW(lr=0.001, betas=(0.9, 0.999))" * 3, "20",
             "skipped: " + "a very long reason " * 5, "0.875 of the proven radius")]
    table = format_table(rows)
    assert max(len(line) for line in table.splitlines()) <= 100, table
    assert len(max(format_table(rows, short=False).splitlines(), key=len)) > 100  # the details keep it whole
