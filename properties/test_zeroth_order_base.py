"""The base U (and MeZO's z) is standard normal and its neighbouring entries uncorrelated.

* distribution: sup |F_n - Φ| ≤ the DKW radius for a false alarm of 1e-6 (Massart's
  constant), over 2**17 draws of one stream, Φ from scipy;
* neighbours and successive calls: with V = Φ(U) - ½ (uniform on [-½, ½] under the claim),
  |mean V V'| (V' from call 1) ≤ sqrt(ln(2/α)/(8n)) and |mean V_j V_{j+1}| ≤
  sqrt(ln(4/α)/(4n)) (Hoeffding: under independence the products have mean 0 and lie in
  [-¼, ¼]; neighbours split into two families of disjoint pairs, proofs/zeroth_order.md),
  α = 1e-6. This detects a rank correlation above about 0.05 (E[V V'] = ρ_s / 12).
"""

import math

import numpy as np
import pytest
import torch
from scipy.stats import norm

from forge_kernels.zeroth_order.draws import BASE, standard_normal, stream_key
from forge_verify.checks.observations import RADIUS, observe
from forge_verify.numerics.stats import dkw_radius

SAMPLES = 2**17
FALSE_ALARM = 1e-6


def _base(call, dtype=torch.float64):
    return standard_normal(stream_key(5, call, "blocks.0.fc.weight", BASE), torch.arange(SAMPLES), dtype)


@pytest.mark.stats
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_base_is_standard_normal(dtype):
    u = np.sort(_base(0, dtype).to(torch.float64).numpy())
    cdf = norm.cdf(u)
    upper = np.arange(1, SAMPLES + 1) / SAMPLES
    distance = max(float(np.max(upper - cdf)), float(np.max(cdf - (upper - 1 / SAMPLES))))
    radius = dkw_radius(SAMPLES, FALSE_ALARM)
    assert distance <= radius
    observe(distance / radius, RADIUS)


@pytest.mark.stats
def test_neighbouring_entries_and_successive_calls_are_uncorrelated():
    v, later = (torch.from_numpy(norm.cdf(_base(call).numpy())) - 0.5 for call in (0, 1))
    n = SAMPLES - 2  # twice the smaller family: (SAMPLES - 2)/2 = 65,535 products
    for what, products, radius in (
            ("neighbours", v[1:] * v[:-1], math.sqrt(math.log(4 / FALSE_ALARM) / (4 * n))),
            ("calls", v * later, math.sqrt(math.log(2 / FALSE_ALARM) / (8 * SAMPLES)))):
        mean = float(products.mean())
        assert abs(mean) <= radius, f"{what}: {mean}"
        observe(abs(mean) / radius, RADIUS)
