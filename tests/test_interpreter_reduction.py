"""The interpreter tier's bits do not depend on the CPU's BLAS.

Under TRITON_INTERPRET the interpreter evaluates ``tl.dot`` as ``numpy.matmul``, and
the BLAS behind it rounds an element's sum differently by the element's place in the
block and by CPU (seen on an AMD EPYC with numpy's OpenBLAS 0.3.31: FMA in some
lanes, not in others). The tile loop therefore sums each token block itself, in a
fixed order (proofs/interpreter_reduction.md). These tests replace numpy's matmul with
a deliberately position-dependent one, as a bad BLAS would be, and require unchanged
bits: they fail on any tile loop that hands its reduction to tl.dot when interpreted,
on every CPU, not only on the CPUs whose BLAS happens to misbehave.
"""

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

import forge_kernels as fk
from forge_verify.checks.problems import Problem, Regime, make_inputs, run_rule
from forge_verify.numerics.bits import assert_bitwise_equal

pytestmark = [pytest.mark.interpreter, pytest.mark.exactness]

_real_matmul = np.matmul


def _position_dependent_matmul(a, b, *args, **kwargs):
    """numpy's matmul, then one ulp up at every element whose (row + column) is odd."""
    out = _real_matmul(a, b, *args, **kwargs)
    rows, cols = np.indices(out.shape[-2:])
    odd = (rows + cols) % 2 == 1
    return np.where(odd, np.nextafter(out, np.inf), out)


@pytest.fixture
def bad_blas(monkeypatch):
    monkeypatch.setattr(np, "matmul", _position_dependent_matmul)


@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    a = tl.load(a_ptr + offs[:, None] * BLOCK + offs[None, :])
    b = tl.load(b_ptr + offs[:, None] * BLOCK + offs[None, :])
    tl.store(c_ptr + offs[:, None] * BLOCK + offs[None, :], tl.dot(a, b, input_precision="ieee"))


def _interpreted_dot(a, b):
    c = torch.empty_like(a)
    _dot_kernel[(1,)](a, b, c, BLOCK=a.shape[0])
    return c


def test_the_replacement_reaches_the_interpreters_dot(bad_blas):
    """The control: with the replacement in place, a kernel that does call tl.dot gets
    other bits, so the tests below would see a tile loop that uses it."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, 16, generator=gen), torch.randn(16, 16, generator=gen)
    replaced = _interpreted_dot(a, b)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(np, "matmul", _real_matmul)
        real = _interpreted_dot(a, b)
    assert not torch.equal(replaced.view(torch.int32), real.view(torch.int32))


PROBLEMS = [Problem(tokens=96, out_features=64, in_features=48, dtype=dtype, steps=2, seed=3)
            for dtype in (torch.float32, torch.bfloat16)]
CONFIGS = [fk.PINNED, fk.TileConfig(block_n=16, block_k=32, block_t=16, epilogue_split=2)]
REGIMES = [Regime(), Regime(weight=torch.bfloat16, state_format="bf16", rounding="stochastic", seed=5)]


def _run_everything(problem, config, regime):
    """The weight gradient of a column block at an offset inside a tile, the whole
    gradient, and two fused steps of AdamW."""
    inputs = make_inputs(problem, torch.device("cpu"), regime)
    x, dy = inputs.batches[0]
    grads = [fk.weight_gradient(x, dy, config=config), fk.weight_gradient(x[:, 24:], dy[:, 5:], config=config)]
    weight, state = run_rule(inputs, fk.AdamW(lr=1e-2, weight_decay=0.01), config=config, regime=regime)
    return grads + [weight] + [state[key] for key in sorted(state)]


@pytest.mark.parametrize("regime", REGIMES, ids=["fp32", "bf16-sr"])
@pytest.mark.parametrize("config", CONFIGS, ids=["pinned", "16x32x16-split2"])
@pytest.mark.parametrize("problem", PROBLEMS, ids=["fp32-act", "bf16-act"])
def test_tile_loop_bits_do_not_depend_on_numpy_matmul(problem, config, regime, monkeypatch):
    expected = _run_everything(problem, config, regime)
    monkeypatch.setattr(np, "matmul", _position_dependent_matmul)
    actual = _run_everything(problem, config, regime)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert_bitwise_equal(a, e, f"output {i} with numpy.matmul replaced by a position-dependent one")
