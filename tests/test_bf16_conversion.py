"""Nearest rounding to bf16 in the fused epilogue: ``rn_bf16_cast`` (the hardware's
conversion where compiled, ``rn_bf16``'s integer arithmetic in the interpreter) gives
``rn_bf16``'s bits for every fp32 input but NaN, and ``rn_bf16_is_finite`` says exactly
whether the result is finite (proofs/bf16_rounding.md). On a GPU, every one of the 2**32
fp32 bit patterns; on the CPU, the inputs that decide the claims (the overflow threshold
and its neighbours, ties, subnormals, the specials) against torch's own rounding."""

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

import forge_kernels as fk
from forge_kernels.ops.stochastic_round import BF16_RN_OVERFLOW, rn_bf16, rn_bf16_cast, rn_bf16_is_finite

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


def _deciding_inputs() -> np.ndarray:
    """fp32 bit patterns around every boundary the claims turn on, both signs: the overflow
    threshold 0x7F7F8000 and the largest bf16, infinity and NaNs, ties (low half 0x8000)
    with even and odd bf16 neighbours, the subnormal range and its top, zero."""
    centres = [0x7F7F8000, 0x7F7F0000, 0x7F800000, 0x7F800001, 0x7FC00000, 0x7FFFFFFF,
               0x3F808000, 0x3F818000, 0x00008000, 0x00018000, 0x007F8000, 0x007FFFFF, 0x00800000, 0x0]
    around = np.arange(-3, 4, dtype=np.int64)
    patterns = {(c + d) & 0x7FFFFFFF for c in centres for d in around}
    rng = np.random.default_rng(20261204)
    patterns |= set(int(p) for p in rng.integers(0, 2**31, size=4096))
    positive = np.array(sorted(patterns), dtype=np.uint32)
    return np.concatenate([positive, positive | np.uint32(0x80000000)]).view(np.float32)


@pytest.mark.exactness
def test_threshold_is_the_midpoint_above_the_largest_bf16():
    assert np.float32(BF16_RN_OVERFLOW.value).view(np.uint32) == 0x7F7F8000
    largest = torch.tensor(np.array([0x7F7F7FFF], dtype=np.uint32).view(np.float32))
    assert torch.isfinite(largest.to(torch.bfloat16)).all()  # just below: rounds down to 0x7F7F
    assert torch.isinf(torch.tensor([BF16_RN_OVERFLOW.value], dtype=torch.float32).to(torch.bfloat16)).all()


@pytest.mark.exactness
def test_deciding_inputs_round_as_torch_rounds():
    """The cast against ``rn_bf16`` (bits, NaN kept a NaN, and the verdict against
    ``rn_bf16``'s result) and ``rn_bf16`` against torch's CPU rounding, on the inputs that
    decide the claims; compiled on a GPU the cast is the hardware's, in the interpreter it
    is ``rn_bf16`` itself."""
    x = torch.from_numpy(_deciding_inputs()).to(fk.kernel_device())
    counts = torch.zeros(3, dtype=torch.int32, device=x.device)
    _compare_kernel[(triton.cdiv(x.numel(), 1024),)](x, counts, 0, x.numel(), FROM_PATTERNS=False, BLOCK=1024)
    assert counts.tolist() == [0, 0, 0], f"bits differ, NaN lost, verdict wrong: {counts.tolist()}"
    expected = x.cpu().to(torch.bfloat16)
    trick = _rn_bf16_on(x).cpu()
    not_nan = ~torch.isnan(x.cpu())
    assert torch.equal(trick[not_nan].view(torch.int16), expected[not_nan].view(torch.int16))
    assert torch.isnan(trick[~not_nan]).all()


@triton.jit
def _rn_bf16_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, rn_bf16(tl.load(x_ptr + offs, mask=offs < n)), mask=offs < n)


def _rn_bf16_on(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    _rn_bf16_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    return out


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
