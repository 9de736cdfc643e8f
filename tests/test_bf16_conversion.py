"""Nearest rounding to bf16 in the fused epilogue: ``rn_bf16_cast`` (the hardware's
conversion where compiled, ``rn_bf16``'s integer arithmetic in the interpreter) gives
``rn_bf16``'s bits for every fp32 input but NaN, and ``rn_bf16_is_finite`` says exactly
whether the result is finite (proofs/bf16_rounding.md). On a GPU, every one of the 2**32
fp32 bit patterns; on every backend, the inputs that decide the claims (the overflow
threshold and its neighbours, ties, subnormals, the specials: ``bf16_rounding_edges``),
on which properties/test_stochastic_rounding.py also holds both forms to torch's rounding."""

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

import forge_kernels as fk
from forge_kernels.ops.stochastic_round import BF16_RN_OVERFLOW, rn_bf16, rn_bf16_cast, rn_bf16_is_finite
from forge_verify.numerics.bits import bf16_rounding_edges, fp32_from_bits

# Counters of _compare_kernel: results whose bits differ (non-NaN input), NaN inputs whose
# cast result is not a NaN, and inputs whose finiteness verdict is wrong.
# Constexpr globals: the only kind a compiled kernel may read.
BITS, NAN, VERDICT = (tl.constexpr(i) for i in range(3))


@triton.jit
def _compare_kernel(x_ptr, counts_ptr, first, total, FROM_PATTERNS: tl.constexpr, BLOCK: tl.constexpr):
    """Rounds fp32 inputs both ways and counts disagreements into ``counts_ptr`` (BITS,
    NAN, VERDICT). The inputs are the bit patterns first .. first + total - 1 with
    ``FROM_PATTERNS``, otherwise ``x_ptr[first ..]``."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < total
    if FROM_PATTERNS:
        x = (first + offs).to(tl.uint32).to(tl.float32, bitcast=True)
    else:
        x = tl.load(x_ptr + first + offs, mask=inside, other=0.0)
    cast = rn_bf16_cast(x).to(tl.uint16, bitcast=True).to(tl.uint32)
    trick = rn_bf16(x).to(tl.uint16, bitcast=True).to(tl.uint32)
    nan = x != x
    cast_nan = (cast & 0x7FFF) > 0x7F80
    trick_finite = (trick & 0x7F80) != 0x7F80
    bits_differ = inside & ~nan & (cast != trick)
    nan_lost = inside & nan & ~cast_nan
    verdict_wrong = inside & (rn_bf16_is_finite(x) != trick_finite)
    tl.atomic_add(counts_ptr + BITS, tl.sum(bits_differ.to(tl.int32), axis=0))
    tl.atomic_add(counts_ptr + NAN, tl.sum(nan_lost.to(tl.int32), axis=0))
    tl.atomic_add(counts_ptr + VERDICT, tl.sum(verdict_wrong.to(tl.int32), axis=0))


def _deciding_inputs() -> torch.Tensor:
    """The patterns around every boundary of rounding to bf16 (``bf16_rounding_edges``) and
    4,096 drawn ones, each with both signs."""
    drawn = np.random.default_rng(20261204).integers(0, 2**31, size=4096).astype(np.uint32)
    return fp32_from_bits(np.concatenate([bf16_rounding_edges(), drawn, drawn | np.uint32(0x80000000)]))


@pytest.mark.exactness
def test_threshold_is_the_midpoint_above_the_largest_bf16():
    assert np.float32(BF16_RN_OVERFLOW.value).view(np.uint32) == 0x7F7F8000
    largest = fp32_from_bits([0x7F7F7FFF])
    assert torch.isfinite(largest.to(torch.bfloat16)).all()  # just below: rounds down to 0x7F7F
    assert torch.isinf(torch.tensor([BF16_RN_OVERFLOW.value], dtype=torch.float32).to(torch.bfloat16)).all()


@pytest.mark.exactness
def test_deciding_inputs_round_alike():
    """The cast against ``rn_bf16`` (bits, NaN kept a NaN, and the verdict against
    ``rn_bf16``'s result) on the inputs that decide the claims; compiled on a GPU the cast
    is the hardware's, in the interpreter it is ``rn_bf16`` itself. Both forms against
    torch's rounding on the same edges: ``test_nearest_rounding_matches_torch``."""
    x = _deciding_inputs().to(fk.kernel_device())
    counts = torch.zeros(3, dtype=torch.int32, device=x.device)
    _compare_kernel[(triton.cdiv(x.numel(), 1024),)](x, counts, 0, x.numel(), FROM_PATTERNS=False, BLOCK=1024)
    assert counts.tolist() == [0, 0, 0], f"bits differ, NaN lost, verdict wrong: {counts.tolist()}"


@pytest.mark.gpu
@pytest.mark.exactness
@pytest.mark.skipif(fk.interpreting(), reason="the hardware conversion exists only compiled; the interpreter runs "
                                               "rn_bf16 itself (and 2**32 inputs would take it hours)")
def test_every_fp32_pattern_rounds_alike_compiled():
    chunk, block = 2**30, 1024
    for first in range(0, 2**32, chunk):
        # Checked per chunk: an int32 counter over all 2**32 inputs could wrap to 0.
        counts = torch.zeros(3, dtype=torch.int32, device="cuda")
        _compare_kernel[(chunk // block,)](counts, counts, first, chunk, FROM_PATTERNS=True, BLOCK=block)
        assert counts.tolist() == [0, 0, 0], (f"of inputs {first:#x} + 2**30: bits differ, NaN lost, verdict wrong: "
                                              f"{counts.tolist()}")
