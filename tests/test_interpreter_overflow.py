"""The interpreter's integer-overflow check is off by default (``kernels/_backend.py``
says why: by Triton's defaults it is computed and then dropped, at 30 to 40 % of the CPU
tier's time). Here it is on, asserting, for the paths that take large indices: each must
run without an overflow and give the bits it gives with the check off. A control shows
that the switch reaches the interpreter and that an overflow then raises."""

import pytest
import torch
import triton
import triton.language as tl

import forge_kernels as fk
from forge_kernels._backend import overflow_sanitizer
from forge_verify.numerics.bits import assert_bitwise_equal

pytestmark = pytest.mark.skipif(not fk.interpreting(), reason="the sanitizer is the Triton interpreter's")


@triton.jit
def _square(x_ptr, out_ptr):
    x = tl.load(x_ptr + tl.arange(0, 2))
    tl.store(out_ptr + tl.arange(0, 2), x * x)


def test_the_switch_reaches_the_interpreter():
    x, out = torch.tensor([65536, 3], dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    with overflow_sanitizer(True), pytest.raises(Exception, match="int32 overflow"):
        _square[(1,)](x, out)
    with overflow_sanitizer(False):
        _square[(1,)](x, out)  # wraps, as a compiled kernel does
    assert out.tolist() == [0, 9]


def _both_ways(call):
    """``call()`` with the sanitizer on and off: no overflow, and the same bits."""
    with overflow_sanitizer(True):
        sanitized = call()
    with overflow_sanitizer(False):
        plain = call()
    for name, (a, b) in enumerate(zip(sanitized, plain)):
        assert_bitwise_equal(a, b, f"output {name}, sanitizer on vs off")


def test_stochastic_rounding_at_counters_near_2_to_the_31():
    x = torch.randn(40, generator=torch.Generator().manual_seed(0))
    _both_ways(lambda: [fk.stochastic_round(x, 2**63 - 1, 2**31 - 16)])


@pytest.mark.parametrize("weight_dtype, state_format", [(torch.bfloat16, "bf16"), (torch.bfloat16, "q8"),
                                                         (torch.float32, "fp32")], ids=["bf16", "q8", "fp32"])
def test_a_slice_at_the_end_of_a_weight_of_2_to_the_32_counters(weight_dtype, state_format):
    """The last rows and columns of a 65,536 x 65,536 weight: global counters up to
    2**32 - 1 (every counter of a stream), row offsets times the global width past 2**31."""
    gen = torch.Generator().manual_seed(1)
    x, dy = torch.randn(9, 64, generator=gen).to(weight_dtype), torch.randn(9, 24, generator=gen).to(weight_dtype)
    w0 = (torch.randn(24, 64, generator=gen) * 0.1).to(weight_dtype)
    rule = fk.AdamW(lr=1e-2)
    place = fk.WeightSlice(2**16 - 24, 2**16 - 64, (2**16, 2**16))

    def step():
        w = w0.clone()
        state = rule.init_state(w, state_format)
        fk.fused_weight_update(x, dy, w, state, rule, 3, seed=2**62 + 5, weight_slice=place,
                               config=fk.TileConfig(block_n=16, block_k=32, block_t=16))
        return [w, *state.values()]
    _both_ways(step)
