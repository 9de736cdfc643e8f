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
from . import check_recorder
from ..checks.tables import render_table
from ..checks.torch_optim import measure
from ..distributed.workers import default_workers



def properties_dir() -> Path:
    """Where the properties are: the installed ``forge_verify.properties`` package (the
    checkout's ``properties/``, mapped there by pyproject.toml), or, where the harness is
    put on PYTHONPATH without being installed, the checkout's folder beside it."""
    spec = importlib.util.find_spec("forge_verify.properties")
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    return Path(__file__).resolve().parents[2] / "properties"


#: the table's widths: it must read at 100 columns (the full ids go to the details file)
_WIDTH = {"property": 28, "case": 14, "verdict": 16}
#: the plugin that records examples and observations where each test runs
RECORDER = "forge_verify.commands.check_recorder"


class _Collector:
    """Each test's outcome, skip reason, and (from the reports ``check_recorder``
    annotated) how many examples a hypothesis property ran and what it observed."""

    def __init__(self):
        self.rows, self.reasons, self.examples, self.observed = {}, {}, {}, {}

    def pytest_runtest_logreport(self, report):
        for key, value in report.user_properties:
            if key == check_recorder.EXAMPLES:
                self.examples[report.nodeid] = value
            elif key == check_recorder.OBSERVED:
                self.observed[report.nodeid] = [tuple(seen) for seen in value]
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            self.rows[report.nodeid] = "skipped" if report.skipped else report.outcome
            if report.skipped and isinstance(report.longrepr, tuple):
                self.reasons[report.nodeid] = report.longrepr[2].removeprefix("Skipped: ")


def _split(nodeid: str):
    """'properties/test_a.py::test_b[adamw]' -> ('b', 'adamw')."""
    name = nodeid.split("::")[-1]
    match = re.fullmatch(r"(?P<prop>[^\[]+)(\[(?P<param>.*)\])?", name)
    return match["prop"].removeprefix("test_"), match["param"] or "-"


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


def _worst(seen) -> str:
    if not seen:
        return "-"
    value, unit = max(seen)
    if unit == observations.ULP and value == 0:
        return "bitwise"
    return f"{value:.3g} {unit}"


def verdicts(collector) -> list:
    """(node id, property, case, examples, verdict, worst) per test run. Examples are
    hypothesis's own count; a property told to run none is skipped by hypothesis, with
    its reason, so nothing that ran no example reads "holds"."""
    out = []
    for nodeid, outcome in collector.rows.items():
        prop, case = _split(nodeid)
        examples = collector.examples.get(nodeid)
        if outcome == "passed":
            verdict = "holds"
        elif outcome == "skipped":
            verdict = f"skipped: {collector.reasons.get(nodeid, 'no reason given')}"
        else:
            verdict = outcome.upper()
        count = "1 case" if examples is None else str(examples)
        out.append((nodeid, prop, case, count, verdict, _worst(collector.observed.get(nodeid, ()))))
    return out


def format_table(rows, short=True) -> str:
    """The verdict table; ``short`` cuts names and verdicts to read at 100 columns."""
    def cut(text, column):
        return _short(text, _WIDTH[column]) if short else text
    lines = [(cut(prop, "property"), cut(case, "case"), count, cut(verdict, "verdict"), worst)
             for _, prop, case, count, verdict, worst in rows]
    return render_table(("property", "case", "examples", "verdict", "worst"), lines)


def format_details(rows) -> str:
    return "\n".join(f"{nodeid}\n    examples: {count}; verdict: {verdict}; worst: {worst}"
                      for nodeid, _, _, count, verdict, worst in rows)


def format_torch_optim_table(rows) -> str:
    lines = [(name, dtype, f"{median:g}", str(worst), f"{scaled:.2f}") for name, dtype, median, worst, scaled in rows]
    return render_table(("rule", "activations", "median ulp", "max ulp", "max |diff| / (eps max|w|)"), lines)


DETAILS = "build/forge-verify-check.txt"


def _parallel_args(workers: int) -> list:
    """pytest-xdist's arguments for ``workers`` processes, or none (one process)."""
    if workers <= 1:
        return []
    if importlib.util.find_spec("xdist") is None:
        print(f"forge-verify check: pytest-xdist is not installed, so one process runs what {workers} would")
        return []
    # pytest-benchmark (where installed) refuses to run beside xdist, as an error under
    # this project's warning filters: the properties time nothing, so it stays out.
    # worksteal: the longest properties (tile invariance, 20 interpreted steps per example)
    # would otherwise leave one worker busy alone at the end.
    return ["-n", str(workers), "--dist", "worksteal", "-p", "no:benchmark"]


def run_check(marker: str = "not slow", extra_args=(), details_path=DETAILS, workers=None) -> int:
    properties = properties_dir()
    if not properties.is_dir():
        print(f"forge-verify check: no properties at {properties}: the installation is incomplete",
              file=sys.stderr)
        return 2
    workers = default_workers() if workers is None else workers
    parallel = _parallel_args(workers)
    print(f"forge-verify check: the properties in {properties}, on "
          f"{'the Triton interpreter (CPU)' if fk.interpreting() else 'the GPU'}, "
          f"{workers if parallel else 1} process(es)")
    collector = _Collector()
    # -v with the count style names each property as it starts ("[12/140] ...::test_x
    # [adamw]"), so a long one is seen running; with several processes, each as it ends
    # ("[gw1] [ 12%] PASSED ..."). The plugin brings markers and fixtures where no conftest
    # is (an installed package). hypothesis is already imported here (the catalog's
    # strategies), so pytest cannot rewrite its asserts, and says so: not ours to fix.
    args = [str(properties), "-m", marker, "-p", "forge_verify.pytest_plugin", "-p", RECORDER,
            "-p", "no:cacheprovider",
            "-W", "ignore:Module already imported so cannot be rewritten:pytest.PytestAssertRewriteWarning",
            "--strict-markers", "-o", "xfail_strict=true", "-v", "-o", "console_output_style=count",
            f"--rootdir={properties.parent}", *parallel, *extra_args]
    code = pytest.main(args, plugins=[collector])
    rows = verdicts(collector)
    print()
    print(format_table(rows))
    print("worst: over the examples, what each property measured: 'bitwise' for exact claims, the share of the")
    print("proven radius used for enclosure claims (at most 1 when the claim holds).")
    details = Path(details_path)
    details.parent.mkdir(parents=True, exist_ok=True)
    details.write_text(format_details(rows) + "\n")
    print(f"every test's full id and case: {details}")
    print()
    print("Distance to torch.optim given the same gradient (3 steps, 4 seeds; measured, no bound asserted):")
    print(format_torch_optim_table(measure(fk.kernel_device())))
    counts = {kind: sum(1 for row in rows if row[4].startswith(kind)) for kind in ("holds", "skipped")}
    print()
    print(f"forge-verify check: {counts['holds']} of {len(rows)} hold, {len(rows) - sum(counts.values())} failed, "
          f"{counts['skipped']} skipped (pytest exit {int(code)})")
    return int(code)
