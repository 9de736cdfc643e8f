"""Measurements that properties report alongside pass/fail, for ``forge-verify check``.

A property calls :func:`observe` once per example it checked, with what it measured in
a unit it names: ``observe()`` for a bitwise claim (0 ulp), ``observe(use, RADIUS)``
for the share of a proven radius an enclosure claim used. The check command's pytest
plugin groups them by test.
"""

import os
from collections import defaultdict

#: unit of a bitwise claim: the distance between the two results, always 0 when it holds
ULP = "ulp"
#: unit of an enclosure claim: the largest |value - centre| / radius; at most 1 when it holds
RADIUS = "of the proven radius"

_OBSERVED = defaultdict(list)


def _current_test() -> str:
    # "properties/test_x.py::test_y[adamw] (call)" -> "properties/test_x.py::test_y[adamw]"
    return os.environ.get("PYTEST_CURRENT_TEST", "<outside pytest>").rsplit(" (", 1)[0]


def observe(value: float = 0.0, unit: str = ULP) -> None:
    """Record one checked example and what it measured for the running test."""
    _OBSERVED[_current_test()].append((float(value), unit))


def observed(nodeid: str) -> list:
    """[(value, unit)] recorded for the test whose node id ends ``nodeid``'s path."""
    return list(_OBSERVED.get(nodeid, ()))


def clear() -> None:
    _OBSERVED.clear()
