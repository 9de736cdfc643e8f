"""Against arbitrary precision: the exact trajectory (exact gradient sums, the rule in
mpmath at 113 bits) lies inside the enclosure in every regime, so the enclosure the
kernel is checked against bounds the real-number step. And, in the slow tier: along a
real AdamW trajectory with bf16 weights, stochastic rounding keeps no bias."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import forge_kernels as fk
from forge_verify.checks import claims
from forge_verify.checks import strategies as fst
from forge_verify.checks.deviation import deviation_table
from forge_verify.checks.problems import Problem, Regime
from forge_verify.numerics.stats import azuma_radius

pytestmark = pytest.mark.mpmath


@pytest.mark.parametrize("family", sorted(fst.RULES))
@settings(max_examples=5)
@given(data=st.data())
def test_exact_trajectory_inside_enclosure(family, data, backend):
    problem = data.draw(fst.problems(max_tokens=12, max_features=5, max_steps=3), label="problem")
    rule = data.draw(fst.RULES[family], label="rule")
    regime = data.draw(fst.regimes(), label="regime")
    claims.exact_inside_enclosure(problem, rule, backend, regime=regime)


@pytest.mark.slow
def test_stochastic_rounding_keeps_no_bias_along_an_adamw_trajectory(device):
    """bf16 weights, 16x16, 100 AdamW steps: the mean error along the exact trajectory's
    direction (in bf16 ulps) stays within Azuma's radius. Each element's error is a sum of
    100 rounding errors of zero mean, each under 2 ulps at the exact value (the ulp can
    double across a binade), so the mean over 256 elements has sum c_i^2 = 4 * 100 / 256;
    false alarm 1e-9: radius 8.2 ulps. Its power is low: round to nearest (bias about
    -2 ulps here) would pass too, so it guards against gross bias only; what ties the
    kernel's stores to the unbiased rounding is the bit-exact test in
    tests/test_low_precision_stores.py."""
    rule = fk.AdamW(lr=1e-3, weight_decay=0.01)
    regimes = {"stochastic": Regime(weight=torch.bfloat16, rounding="stochastic", seed=3)}
    rows = deviation_table(rule, Problem(16, 16, 16, torch.bfloat16, 100, seed=4), checkpoints=(100,),
                           regimes=regimes, device=device)
    forge = next(r for r in rows if r.method == "forge")
    radius = azuma_radius(4 * 100 / 256, 1e-9)
    assert abs(forge.bias_ulp) <= radius, (forge, radius)
    assert np.isfinite(forge.spread_ulp)
