"""The part of ``forge-verify check``'s bookkeeping that runs where a test runs: a pytest
plugin (loaded with ``-p``) that attaches to each test's report how many examples
hypothesis ran and what the property observed (``forge_verify.checks.observations``).

Reports carry ``user_properties`` from the process that ran the test to the one that
prints the table, also when pytest-xdist runs the properties in worker processes (which
load ``-p`` plugins but not the objects handed to ``pytest.main``); so the table reads the
same with one process or several.
"""

import pytest

from ..checks import observations

#: the user_properties keys this plugin writes
EXAMPLES, OBSERVED = "forge_verify.examples", "forge_verify.observed"
#: hypothesis's phases whose examples count as checked (shrinking only re-runs them)
_COUNTED_PHASES = ("explicit", "reuse", "generate")


def examples_run(statistics: dict) -> int:
    """Examples hypothesis ran to completion (passing or failing), from the statistics it
    hands its collector (``hypothesis.statistics``; tests/test_check_report.py notices if
    that format changes)."""
    return sum(1 for phase in _COUNTED_PHASES for case in statistics.get(f"{phase}-phase", {}).get("test-cases", ())
               if case["status"] in ("valid", "interesting"))


def pytest_configure(config):
    observations.clear()  # a second run in one process starts from nothing


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_call(item):
    from hypothesis.statistics import collector
    outer = collector.value

    def note(statistics):
        item.user_properties.append((EXAMPLES, examples_run(statistics)))
        if outer is not None:
            outer(statistics)

    with collector.with_value(note):
        yield
    item.user_properties.append((OBSERVED, observations.observed(item.nodeid)))
