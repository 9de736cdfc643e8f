"""``forge-verify check``: run the properties (exactness and closeness; not the slow tier)
and print a verdict table.

The properties run in-process through pytest; a small plugin collects each test's
outcome and the examples and deviations the properties reported through
``forge_verify.checks.observations``.
"""

import importlib.util
import re
import sys
from pathlib import Path

import pytest

import forge_kernels as fk

from ..checks import observations
from ..checks.tables import render_table
from ..checks.torch_optim import measure



def properties_dir() -> Path:
    """Where the properties are: the installed ``forge_verify.properties`` package (the
    checkout's ``properties/``, mapped there by pyproject.toml), or, where the harness is
    put on PYTHONPATH without being installed, the checkout's folder beside it."""
    spec = importlib.util.find_spec("forge_verify.properties")
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    return Path(__file__).resolve().parents[2] / "properties"


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
    properties = properties_dir()
    if not properties.is_dir():
        print(f"forge-verify check: no properties at {properties}: the installation is incomplete",
              file=sys.stderr)
        return 2
    print(f"forge-verify check: the properties in {properties}, on "
          f"{'the Triton interpreter (CPU)' if fk.interpreting() else 'the GPU'}")
    observations.clear()
    collector = _Collector()
    # -v with the count style names each property as it starts ("[12/140] ...::test_x
    # [adamw]"), so a long one is seen running; the plugin brings markers and fixtures
    # where no conftest is (an installed package).
    args = [str(properties), "-m", marker, "-p", "forge_verify.pytest_plugin", "-p", "no:cacheprovider",
            "--strict-markers", "-o", "xfail_strict=true", "-v", "-o", "console_output_style=count",
            f"--rootdir={properties.parent}", *extra_args]
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
