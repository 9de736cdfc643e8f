"""Hypothesis profiles, chosen by the FORGE_HYPOTHESIS_PROFILE environment variable.

* ``dev`` (default): few random examples, for quick local runs;
* ``ci``: derandomized (the same examples every run), no deadline (JIT compiles), and
  no shrinking: a failing property reports its first failing example as drawn, within
  the time of one example, instead of spending minutes shrinking it (a failing
  interpreted example once took over five; reproduce and shrink locally with ``dev``);
* ``nightly``: many random examples.

``max_examples`` is per property and per rule: the exactness tier in CI checks
``ci`` examples of each rule family.
"""

import os

from hypothesis import HealthCheck, Phase, settings


#: environment variable naming the hypothesis profile
PROFILE_VARIABLE = "FORGE_HYPOTHESIS_PROFILE"

_COMMON = dict(deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

settings.register_profile("dev", max_examples=8, **_COMMON)
settings.register_profile("ci", max_examples=20, derandomize=True,
                          phases=(Phase.explicit, Phase.reuse, Phase.generate), **_COMMON)
settings.register_profile("nightly", max_examples=300, **_COMMON)


def load_profile() -> str:
    name = os.environ.get(PROFILE_VARIABLE, "dev")
    settings.load_profile(name)
    return name
