"""Hypothesis profiles, chosen by the FORGE_HYPOTHESIS_PROFILE environment variable.

* ``dev`` (default): few random examples, for quick local runs;
* ``ci``: derandomized (the same examples every run), no deadline (JIT compiles);
* ``nightly``: many random examples;
* ``first-failure``: ``ci`` without shrinking, for showing that a planted mistake is
  caught (the first failing example is enough; shrinking it would cost minutes).

``max_examples`` is per property and per rule: the exactness tier in CI checks
``ci`` examples of each rule family.
"""

import os

from hypothesis import HealthCheck, Phase, settings

from .check import PROFILE_VARIABLE

_COMMON = dict(deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

settings.register_profile("dev", max_examples=8, **_COMMON)
settings.register_profile("ci", max_examples=20, derandomize=True, **_COMMON)
settings.register_profile("nightly", max_examples=300, **_COMMON)
settings.register_profile("first-failure", max_examples=20, derandomize=True,
                          phases=(Phase.explicit, Phase.generate), **_COMMON)


def load_profile() -> str:
    name = os.environ.get(PROFILE_VARIABLE, "dev")
    settings.load_profile(name)
    return name
