"""The gradient's norm without the gradient (``weight_gradient_norm``, proofs/gradient_norm.md):
over drawn shapes, tiles, activation dtypes and scales, ragged edges and T = 0 included,
its tile sums are bitwise the materialized gradient's summed by the same code (under the
interpreter: compiled, the reduction tree follows the register layout), and the norm is
within the proof's bound of the float64 norm of that gradient (everywhere)."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import forge_kernels as fk
from forge_kernels.ops.gradient_norm import square_sums, weight_gradient_square_sums
from forge_verify.checks import strategies as fst
from forge_verify.checks.observations import RADIUS, observe
from forge_verify.checks.problems import make_inputs
from forge_verify.numerics.bits import assert_bitwise_equal
from forge_verify.numerics.tolerances import gradient_norm_bound


@pytest.mark.interpreter
@pytest.mark.exactness
@given(data=st.data())
def test_tile_sums_are_the_materialized_gradients(data, device):
    problem = data.draw(fst.problems(max_steps=1), label="problem")
    config = data.draw(fst.tile_configs(), label="config")
    x, dy = make_inputs(problem, device).batches[0]
    grad = fk.weight_gradient(x, dy, config=config)
    assert_bitwise_equal(weight_gradient_square_sums(x, dy, config=config), square_sums(grad, config=config),
                         f"tile sums, {problem.describe()}")
    observe(0)


@given(data=st.data())
def test_norm_is_within_its_bound(data, device):
    problem = data.draw(fst.problems(max_steps=1), label="problem")
    config = data.draw(fst.tile_configs(), label="config")
    x, dy = make_inputs(problem, device).batches[0]
    exact = float(np.linalg.norm(fk.weight_gradient(x, dy, config=config).double().cpu().numpy()))
    found = float(fk.weight_gradient_norm(x, dy, config=config))
    bound = gradient_norm_bound(exact, problem.out_features, problem.in_features, config.block_n, config.block_k)
    observe(abs(found - exact) / bound, RADIUS)
    assert abs(found - exact) <= bound, (problem.describe(), found, exact, bound)
