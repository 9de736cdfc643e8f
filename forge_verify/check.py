"""``forge-verify check``: run the properties (exactness and closeness; not the slow tier)
and print a verdict table.

The properties run in-process through pytest; a small plugin collects each test's
outcome and the examples and deviations the properties reported through
``forge_verify.observations``.
"""

import re
import sys
from pathlib import Path

import pytest

import forge_kernels as fk

from . import observations
from .tables import render_table
from .torch_optim import measure

#: environment variable naming the hypothesis profile (forge_verify.hypothesis_profiles)
PROFILE_VARIABLE = "FORGE_HYPOTHESIS_PROFILE"

PROPERTIES_DIR = Path(__file__).resolve().parent.parent / "properties"


class _Collector:
    def __init__(self):
        self.rows = {}

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            self.rows[report.nodeid] = "skipped" if report.skipped else report.outcome


def _split(nodeid: str):
    """'properties/test_a.py::test_b[adamw]' -> ('test_b', 'adamw')."""
    name = nodeid.split("::")[-1]
    match = re.fullmatch(r"(?P<prop>[^\[]+)(\[(?P<param>.*)\])?", name)
    return match["prop"].removeprefix("test_"), match["param"] or "-"


def format_table(rows) -> str:
    lines = []
    for nodeid, verdict in rows.items():
        prop, param = _split(nodeid)
        seen = observations.observed(nodeid)
        worst = f"{max(seen):g} ulp" if seen else "-"
        lines.append((prop, param, str(len(seen)), "holds" if verdict == "passed" else verdict.upper(), worst))
    return render_table(("property", "rule/case", "examples", "verdict", "worst deviation"), lines)


def format_torch_optim_table(rows) -> str:
    lines = [(name, dtype, f"{median:g}", str(worst), f"{scaled:.2f}") for name, dtype, median, worst, scaled in rows]
    return render_table(("rule", "activations", "median ulp", "max ulp", "max |diff| / (eps max|w|)"), lines)


def run_check(marker: str = "not slow", extra_args=()) -> int:
    if not PROPERTIES_DIR.is_dir():
        print(f"forge-verify check: no properties at {PROPERTIES_DIR}; run from a source checkout",
              file=sys.stderr)
        return 2
    observations.clear()
    collector = _Collector()
    args = [str(PROPERTIES_DIR), "-m", marker, "-p", "no:cacheprovider", "-q",
            f"--rootdir={PROPERTIES_DIR.parent}", *extra_args]
    code = pytest.main(args, plugins=[collector])
    print()
    print(format_table(collector.rows))
    print()
    print("Distance to torch.optim given the same gradient (3 steps, 4 seeds; measured, no bound asserted):")
    print(format_torch_optim_table(measure(fk.kernel_device())))
    failed = [n for n, v in collector.rows.items() if v == "failed"]
    print()
    if code == 0:
        print(f"forge-verify check: all {len(collector.rows)} properties hold")
    else:
        print(f"forge-verify check: {len(failed)} of {len(collector.rows)} properties FAILED (pytest exit {int(code)})")
    return int(code)
