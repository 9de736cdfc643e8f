"""Hypothesis profiles, chosen by the FORGE_HYPOTHESIS_PROFILE environment variable.

* ``dev`` (default): few random examples, for quick local runs;
* ``ci``: derandomized (the same examples every run), no deadline (JIT compiles);
* ``nightly``: many random examples.

``max_examples`` is per property and per rule: the exactness tier in CI checks
``ci`` examples of each rule family.
"""

import os

from hypothesis import HealthCheck, settings

from .check import PROFILE_VARIABLE

_COMMON = dict(deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

settings.register_profile("dev", max_examples=8, **_COMMON)
settings.register_profile("ci", max_examples=20, derandomize=True, **_COMMON)
settings.register_profile("nightly", max_examples=300, **_COMMON)


def load_profile() -> str:
    name = os.environ.get(PROFILE_VARIABLE, "dev")
    settings.load_profile(name)
    return name
