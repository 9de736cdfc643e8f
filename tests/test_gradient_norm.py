"""``weight_gradient_norm``: the norm of dW without dW (proofs/gradient_norm.md).

Under the interpreter its tiles' sums of squares are bitwise those of the materialized
gradient summed by the same code (so the norm is of the elements the fused step uses),
its total is the float64 sum in index order, and no bit depends on the CPU's BLAS; on
every backend its value is within the proof's bound of the float64 norm of that
gradient (compiled, a tile's sum is a tree whose shape follows the register layout, so
only the bound is claimed there).
"""

import math

import numpy as np
import pytest
import torch

import forge_kernels as fk
from forge_kernels.ops.gradient_norm import launch_norm, square_sums, weight_gradient_square_sums
from forge_verify.numerics.bits import assert_bitwise_equal
from forge_verify.numerics.tolerances import gradient_norm_bound
from tests.test_interpreter_reduction import _position_dependent_matmul

SMALL = fk.TileConfig(32, 32, 16, 4, 2)  # several tiles, partial ones at the edges of the shapes below
SHAPES = [(70, 90, 50), (33, 64, 64), (5, 17, 300)]  # (tokens, rows, columns)


def _inputs(t, n, k, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=gen).to(device, dtype)
    dy = (torch.randn(t, n, generator=gen) * 0.5).to(device, dtype)
    return x, dy


@pytest.mark.interpreter
@pytest.mark.exactness
@pytest.mark.parametrize("config", [fk.PINNED, SMALL], ids=["pinned", "small"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_tile_sums_are_those_of_the_materialized_gradient(shape, dtype, config, device):
    x, dy = _inputs(*shape, dtype, device)
    found = weight_gradient_square_sums(x, dy, config=config)
    assert found.shape == (math.ceil(shape[1] / config.block_n), math.ceil(shape[2] / config.block_k))
    assert_bitwise_equal(found, square_sums(fk.weight_gradient(x, dy, config=config), config=config), "tile sums")


@pytest.mark.parametrize("config", [fk.PINNED, SMALL], ids=["pinned", "small"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_norm_is_within_its_bound_of_the_exact_norm_of_the_gradient(shape, dtype, config, device):
    """The bound's N is the gradient's norm in float64 (the fp32 elements are exact
    inputs); the computed norm must also be no worse than the bound for every scale of
    the gradient: the inputs are scaled by powers of two (exact) down to where every
    square underflows and up to tile sums above 2^110 (fp32 overflows at 2^128)."""
    x, dy = _inputs(*shape, dtype, device, seed=1)
    for scale in (2.0**-70, 1.0, 2.0**52):
        xs = x * scale
        grad = fk.weight_gradient(xs, dy, config=config)
        if scale > 1:
            assert float(square_sums(grad, config=config).max()) > 2.0**110
        exact = float(np.linalg.norm(grad.double().cpu().numpy()))
        found = fk.weight_gradient_norm(xs, dy, config=config)
        assert found.dtype == torch.float32 and found.shape == () and found.device == x.device
        bound = gradient_norm_bound(exact, shape[1], shape[2], config.block_n, config.block_k)
        assert abs(float(found) - exact) <= bound, (scale, float(found), exact, bound)


def test_the_bound_is_not_vacuous():
    """For a 64 x 64 tile the bound is about γ_4095 / 2 relative, 1.2e-4: a norm that
    dropped one of a thousand equal tiles would be outside it."""
    assert gradient_norm_bound(1.0, 4096, 4096, 64, 64) < 1.3e-4
    assert 1 - math.sqrt(999 / 1000) > gradient_norm_bound(1.0, 4096, 4096, 64, 64)


def _tile_sums_fp32_would_lose(count, device):
    """``count`` tile sums, 1 then 2^-30 each (positive, as sums of squares are): an fp32
    total stays 1, the float64 total is 1 + (count - 1) 2^-30."""
    sums = torch.full((count,), 2.0**-30)
    sums[0] = 1.0
    return sums.to(device)


@pytest.mark.interpreter
@pytest.mark.exactness
@pytest.mark.parametrize("count", [7, 1024, 3001])
def test_total_is_the_in_order_float64_sum_of_the_tiles(count, device):
    """Interpreted, the total is the float64 sum in index order, bit for bit, also over
    more than one block of 1,024 tiles; an fp32 total (or one that kept only the last
    block) would differ."""
    sums = _tile_sums_fp32_would_lose(count, device)
    total = 0.0
    for value in sums.double().tolist():
        total += value
    assert_bitwise_equal(launch_norm(sums), torch.tensor(math.sqrt(total), dtype=torch.float64).float(), "norm")


@pytest.mark.parametrize("count", [7, 3001])
def test_total_keeps_what_fp32_would_lose(count, device):
    """On every backend the total is a float64 sum: within the float64 bound of the exact
    one (math.fsum), where fp32 would drop every term after the first."""
    sums = _tile_sums_fp32_would_lose(count, device)
    exact = math.sqrt(math.fsum(sums.double().tolist()))
    assert exact > 1 + (count - 1) * 2.0**-32
    # The root's fp32 rounding (2^-24 relative) and the float64 sum's γ_3000 (3e-13) stay
    # under 2^-23; an fp32 total misses 3,001 tiles' sum by 1.4e-6 relative.
    assert abs(float(launch_norm(sums)) - exact) <= exact * 2.0**-23


@pytest.mark.exactness
@pytest.mark.parametrize("total_hex", ["0x1.fe928f4ca1f87p+1", "0x1.04425567ebb8fp+0"])
def test_root_is_correctly_rounded(total_hex, device):
    """The float64 root is correctly rounded on every backend, so the fp32 norm is
    fp32(rn64(√S)), the two roundings proofs/gradient_norm.md step 6 counts (not always
    the correctly rounded fp32 √S: for 0x1.04425567ebb8fp+0 the two differ by an fp32
    ulp): each total here (split into three fp32 tile sums whose float64 sum is exact in
    any order) has a root within a float64 ulp of an fp32 rounding boundary, where torch
    2.13.0+cpu's float64 ``sqrt`` (one ulp off for these) gives the neighbouring fp32
    value."""
    total = float.fromhex(total_hex)
    high = float(np.float32(total))
    middle = float(np.float32(total - high))
    low = total - high - middle
    assert float(np.float32(low)) == low and high + middle + low == total
    sums = torch.tensor([high, middle, low], dtype=torch.float32, device=device)
    assert_bitwise_equal(launch_norm(sums), torch.tensor(math.sqrt(total), dtype=torch.float32), "norm")


def test_norm_of_no_tokens_is_zero_and_of_a_non_finite_input_is_not_finite(device):
    x, dy = _inputs(0, 40, 24, torch.bfloat16, device)
    assert float(fk.weight_gradient_norm(x, dy)) == 0.0
    x, dy = _inputs(9, 40, 24, torch.bfloat16, device)
    x[4, 3] = float("nan")
    assert math.isnan(float(fk.weight_gradient_norm(x, dy)))
    x[4, 3] = float("inf")
    assert not math.isfinite(float(fk.weight_gradient_norm(x, dy)))


@pytest.mark.parametrize("call, error", [
    (lambda x, dy: fk.weight_gradient_norm(x, dy[:, :3].T), ValueError),
    (lambda x, dy: fk.weight_gradient_norm(x, dy.double()), TypeError),
    (lambda x, dy: fk.weight_gradient_norm(x, dy, config=(16, 16)), TypeError),
    (lambda x, dy: square_sums(x.double()), TypeError),
])
def test_bad_input_is_refused(call, error, device):
    x, dy = _inputs(6, 8, 4, torch.float32, device)
    with pytest.raises(error):
        call(x, dy)


@pytest.mark.interpreter
@pytest.mark.exactness
def test_interpreted_norm_does_not_use_blas(monkeypatch, device):
    """numpy's matmul made position-dependent (as a bad BLAS would be) changes no bit of
    the tile sums or the norm (tests/test_interpreter_reduction.py's check, here)."""
    x, dy = _inputs(70, 90, 50, torch.bfloat16, device, seed=3)
    before = (weight_gradient_square_sums(x, dy, config=SMALL), fk.weight_gradient_norm(x, dy, config=SMALL))
    monkeypatch.setattr(np, "matmul", _position_dependent_matmul)
    assert_bitwise_equal(weight_gradient_square_sums(x, dy, config=SMALL), before[0], "tile sums")
    assert_bitwise_equal(fk.weight_gradient_norm(x, dy, config=SMALL), before[1], "norm")
