"""Measurements that properties report alongside pass/fail, for ``forge-verify check``.

A property calls :func:`observe` once per example it checked, with the deviation it
measured (0 for bitwise claims); the check command's pytest plugin groups them by test.
"""

import os
from collections import defaultdict

_OBSERVED = defaultdict(list)


def _current_test() -> str:
    # "properties/test_x.py::test_y[adamw] (call)" -> "properties/test_x.py::test_y[adamw]"
    return os.environ.get("PYTEST_CURRENT_TEST", "<outside pytest>").rsplit(" (", 1)[0]


def observe(deviation_ulps: float = 0.0) -> None:
    """Record one checked example and its deviation in ulps for the running test."""
    _OBSERVED[_current_test()].append(float(deviation_ulps))


def observed(nodeid: str) -> list:
    return list(_OBSERVED.get(nodeid, ()))


def clear() -> None:
    _OBSERVED.clear()
