"""Stochastic rounding fp32 -> bf16, counter-based.

The random bits for element ``i`` are Philox4x32-10 (Triton's ``tl.randint``) keyed on
``seed`` with counter ``offset + i``: a pure function of (seed, global index, value),
so results do not depend on tiles, launch order, autotuning or sharding. Sixteen
random bits are added below the bf16 cut and the low half truncated, so an fp32 value
whose low 16 bits are ``f`` rounds away from zero with probability exactly
``f / 2**16``: unbiased in distribution (proofs/stochastic_rounding.md).

Special values: NaN stays NaN (sign kept, quiet, canonical payload: adding noise to a
NaN whose payload sits in the low bits could otherwise produce an infinity); ±inf
stays ±inf; ±0 stays ±0. A finite value beyond the largest bf16 (above 0x7F7F0000 in
magnitude) rounds to ±inf with probability equal to its fraction of the way there, as
if infinity were the next representable value; round-to-nearest does the same for
values past the midpoint.
"""

import numpy as np
import torch
import triton
import triton.language as tl

from .._backend import INTERPRETED, kernel_device, on_device

# Counters are 32-bit: Philox is called with one 32-bit counter word, which Triton
# versions treat alike (wider offsets are split differently across versions).
MAX_COUNTER = 2**32
# A constexpr global (the only kind a compiled kernel may read): the least fp32 magnitude whose nearest bf16 is infinite: 0x7F7F8000, halfway between the
# largest bf16 (0x7F7F0000) and 2**128, a tie that goes to the even neighbour 0x7F80 (inf).
BF16_RN_OVERFLOW = tl.constexpr(float.fromhex("0x1.ffp+127"))


@triton.jit
def sr_bf16(x, seed, counter):
    """fp32 tile -> bf16 tile, rounded stochastically with Philox bits at ``counter`` (uint32)."""
    return sr_bf16_with(x, tl.randint(seed, counter))


@triton.jit
def sr_bf16_with(x, word):
    """fp32 tile -> bf16 tile, rounded stochastically with the low 16 bits of the random
    uint32 ``word`` drawn for each element."""
    quiet_nan = (x.to(tl.uint32, bitcast=True) & 0x80000000) | 0x7FC00000
    return bf16_from_high_half(tl.where(x != x, quiet_nan, sr_bf16_bits(x, word)))


@triton.jit
def sr_bf16_bits(x, word):
    """``sr_bf16_with(x, word)``'s bf16 in the high half of a uint32 (low half zero), for
    ``x`` not NaN; a NaN's result may be any pattern (it is not quieted: a caller that
    stores no tile holding a non-finite input needs no quieting)."""
    return (x.to(tl.uint32, bitcast=True) + (word & 0xFFFF)) & 0xFFFF0000


@triton.jit
def bf16_from_high_half(bits):
    """The bf16 in the high half of each uint32 of ``bits``."""
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def paired_words(seed, rows, c0, global_k, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ALIGNED: tl.constexpr):
    """Four random words per element of a (BLOCK_N, BLOCK_K) tile whose rows are the global
    rows ``rows`` (BLOCK_N,) and whose columns are the global columns ``c0 .. c0 + BLOCK_K - 1``
    of a weight with ``global_k`` columns; only each word's low 16 bits are meant to be used.

    One Philox4x32-10 call serves a *pair* of neighbouring elements: columns 2j and 2j + 1 of
    a row share the counter ``row * ceil(global_k / 2) + j``; the even column takes the low
    16 bits of each of the call's four words, the odd column the high 16 bits. So the bits
    are a pure function of (seed, global row, global column), whatever the tile, split or
    shard. ``ALIGNED`` (``c0`` even) draws once per pair and interleaves the halves; an odd
    ``c0`` (a shard starting at an odd column) splits pairs across tiles, so each element
    draws its pair's call itself and shifts: the same bits, at twice the Philox cost."""
    row_base = rows.to(tl.int64) * ((global_k + 1) // 2)
    if ALIGNED:
        pairs = c0 // 2 + tl.arange(0, BLOCK_K // 2)
        counter = (row_base[:, None] + pairs[None, :]).to(tl.uint32)
        r0, r1, r2, r3 = tl.randint4x(seed, counter)
        w0 = tl.interleave(r0, r0 >> 16)
        w1 = tl.interleave(r1, r1 >> 16)
        w2 = tl.interleave(r2, r2 >> 16)
        w3 = tl.interleave(r3, r3 >> 16)
    else:
        cols = c0 + tl.arange(0, BLOCK_K)
        counter = (row_base[:, None] + (cols // 2)[None, :]).to(tl.uint32)
        r0, r1, r2, r3 = tl.randint4x(seed, counter)
        shift = ((cols % 2) * 16).to(tl.uint32)[None, :]
        w0 = r0 >> shift
        w1 = r1 >> shift
        w2 = r2 >> shift
        w3 = r3 >> shift
    return w0, w1, w2, w3


@triton.jit
def rn_bf16(x):
    """fp32 tile -> bf16 tile, rounded to nearest, ties to even, by integer arithmetic.

    Not ``x.to(tl.bfloat16)``: the Triton interpreter (3.9) truncates in that cast
    (1 + 2**-8 + 2**-12 becomes 1.0). The same bits on every backend, NaN payloads
    included; ``rn_bf16_cast`` is the faster form where a NaN is never stored.
    """
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    quiet_nan = (bits & 0x80000000) | 0x7FC00000
    return bf16_from_high_half(tl.where(x != x, quiet_nan, rounded))


@triton.jit
def rn_bf16_cast(x):
    """fp32 tile -> bf16 tile rounded to nearest, ties to even, for a caller that stores no
    tile holding a NaN result.

    Compiled, the hardware's conversion (``cvt.rn.bf16x2.f32``: one instruction per two
    elements, where ``rn_bf16``'s integer arithmetic takes about six per element); in the
    interpreter, whose cast truncates, ``rn_bf16``. The two give the same bits for every
    fp32 input but NaN, whose result is a NaN either way with a payload that may differ
    (tests/test_bf16_conversion.py compares all 2**32 inputs compiled: proofs/bf16_rounding.md
    says whether that has run)."""
    tl.static_assert(x.dtype == tl.float32, "rn_bf16_cast rounds fp32")
    if INTERPRETED:
        rounded = rn_bf16(x)
    else:
        rounded = x.to(tl.bfloat16)
    return rounded


@triton.jit
def rn_bf16_is_finite(x):
    """Whether fp32 ``x`` rounds to nearest to a finite bf16: |x| < ``BF16_RN_OVERFLOW``
    (NaN compares false). One comparison on the fp32 value, where widening the bf16 back
    to test it takes three instructions (proofs/bf16_rounding.md)."""
    tl.static_assert(x.dtype == tl.float32, "the threshold is an fp32 one")
    return tl.abs(x) < BF16_RN_OVERFLOW


@triton.jit(do_not_specialize=["seed", "offset"])
def _stochastic_round_kernel(x_ptr, out_ptr, n, seed, offset, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    x = tl.load(x_ptr + i, mask=mask, other=0.0)
    counter = (i + offset).to(tl.uint32)
    tl.store(out_ptr + i, sr_bf16(x, seed, counter), mask=mask)


_MASK64 = 2**64 - 1


_GAMMA, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _splitmix64(z: int) -> int:
    z = (z + _GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def _splitmix64_array(z: np.ndarray) -> np.ndarray:
    """``_splitmix64`` on a uint64 array (numpy's uint64 arithmetic wraps, as the mask does)."""
    with np.errstate(over="ignore"):
        z = z + np.uint64(_GAMMA)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX2)
    return z ^ (z >> np.uint64(31))


def stream_seed(seed: int, step: int, output: int = 0) -> int:
    """A Philox key: the user's seed, the step and ``output`` mixed by SplitMix64, kept
    below 2**63. The fused update keys each step with ``output=0``; with bf16 stores it
    takes 16 bits of word 0 for the weight and of word 1 + i for state slot i, one call
    per pair of neighbouring elements (``paired_words``); with q8 state, whose codes
    need 24 bits, the four whole words of one call per element (``_rule_epilogue``).
    ``fuse`` derives its layers' seeds with it too."""
    return _splitmix64(_splitmix64(seed) ^ (step * 4 + output)) >> 1


def stream_seeds(seeds, step: int, output: int = 0) -> np.ndarray:
    """``stream_seed(seed, step, output)`` for every seed in ``seeds`` at once (uint64 array)."""
    mixed = _splitmix64_array(np.asarray(seeds, dtype=np.uint64))
    return _splitmix64_array(mixed ^ np.uint64((step * 4 + output) & _MASK64)) >> np.uint64(1)


def check_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"seed must be an integer in [0, 2**63), got {seed!r}")
    return seed


def stochastic_round(x: torch.Tensor, seed: int, offset: int = 0) -> torch.Tensor:
    """Round fp32 ``x`` to bf16 stochastically; element ``i`` (flat, row-major) uses the
    random bits at counter ``offset + i`` of the stream ``seed``.

    Two calls with the same (seed, offset) and the same values give the same bits; a
    sharded call passing each shard's global offset gives the bits of the whole.
    """
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
        raise TypeError(f"stochastic_round rounds float32 tensors, got "
                        f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.device.type != kernel_device().type:
        raise ValueError(f"x is on {x.device}; kernels run on {kernel_device().type}")
    seed = check_seed(seed)
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"offset must be a non-negative integer, got {offset!r}")
    if offset + x.numel() > MAX_COUNTER:
        raise ValueError(f"offset + numel = {offset + x.numel()} exceeds the 2**32 counters of one stream")
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    if x.numel():
        block = 1024
        with on_device(x.device):
            _stochastic_round_kernel[(triton.cdiv(x.numel(), block),)](x, out, x.numel(), seed, offset, BLOCK=block)
    return out
