"""The fused weight update: dW = dYᵀX accumulated per tile in fp32 registers, the
optimizer rule applied to the tile in the epilogue; dW never exists as a tensor.

Three layers, as in Liger-Kernel: ``_*_kernel`` (jit, private) → ``fused_weight_update``
(checks, allocates, launches). The oracle (``oracle=True``) runs the same tile loop
(``_weight_grad_tile``) into a materialized fp32 dW, then the same epilogue
(``_rule_epilogue``, hence the same rule function) in a second kernel. The two paths
differ only in where the epilogue's gradient tile comes from.
"""

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .._backend import on_device, quiet_non_finite
from ..config import PINNED, TileConfig
from ..rules.base import NUM_SCALARS, NUM_SLOTS
from .. import q8
from .q8_codec import Q8_BLOCK, Q8_LARGEST_EXPONENT_VALUE, q8_decode, q8_encode
from .finite_check import BAD_TILES, STATUS_WORDS, is_finite, launch_finite_check
from .gradient_norm import _square_sum, check_square_sums, launch_square_sums
from .hopper_support import check_hopper_launch, check_tma_operands
from .stochastic_round import (bf16_from_high_half, check_seed, paired_words, rn_bf16_cast, rn_bf16_is_finite,
                               sr_bf16_bits, stream_seed)
from .step_scalars import StepScalars
from .update_report import UpdateReport
from ..weight_slice import WeightSlice
from .validation import check_grad_scale, check_gradient, check_update_inputs, check_weight_and_state
from .weight_gradient import _weight_grad_tile, launch_weight_gradient

# Constexpr globals: the only kind a compiled kernel may read.
_BAD_TILES = tl.constexpr(BAD_TILES)


@triton.jit
def _to_storage(v, word, TO_BF16: tl.constexpr, STOCHASTIC: tl.constexpr):
    """The value to store for fp32 ``v``: itself, or bf16 by stochastic (with the random
    ``word``) or nearest rounding. The bf16 forms may give a non-finite ``v`` another
    result than ``sr_bf16_with`` and ``rn_bf16`` (no NaN quieting; the hardware's NaN): no
    tile whose ``v`` is not finite is stored (``_storable``)."""
    out = v
    if TO_BF16:
        if STOCHASTIC:
            out = bf16_from_high_half(sr_bf16_bits(v, word))
        else:
            out = rn_bf16_cast(v)
    return out


@triton.jit
def _storable(v, stored, word, Q8: tl.constexpr, TO_BF16: tl.constexpr, STOCHASTIC: tl.constexpr):
    """Whether ``stored``, the value ``_to_storage`` made of fp32 ``v`` with ``word`` (or
    ``v`` itself for a q8 slot), may be stored: finite and, for q8, below the largest block
    exponent's range (126: a larger value would be clamped, not stored). For bf16, read
    from ``v`` (``rn_bf16_is_finite``; stochastically, ``v`` finite and its rounded
    exponent not all ones) rather than from ``stored`` widened back."""
    tl.static_assert(not (Q8 and TO_BF16), "a q8 slot is coded from fp32, not rounded to bf16")
    if TO_BF16 and not STOCHASTIC:
        ok = rn_bf16_is_finite(v)
    elif TO_BF16:
        ok = is_finite(v) & ((sr_bf16_bits(v, word) & 0x7F800000) != 0x7F800000)
    else:
        wide = stored.to(tl.float32)
        ok = is_finite(wide)
        if Q8:
            ok = ok & (tl.abs(wide) < Q8_LARGEST_EXPONENT_VALUE)
    return ok


@triton.jit
def _load_slot(s_ptr, e_ptr, idx, eidx, mask, zeros,
               HAS: tl.constexpr, Q8: tl.constexpr, SIGNED: tl.constexpr):
    value = zeros
    if HAS:
        if Q8:
            value = q8_decode(s_ptr, e_ptr, idx, eidx, mask, SIGNED)
        else:
            value = tl.load(s_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    return value


@triton.jit
def _store_slot(s_ptr, e_ptr, v, idx, offs_n, mask_n, k0, KB, keep, mask, tile_ok, word,
                HAS: tl.constexpr, Q8: tl.constexpr, SIGNED: tl.constexpr, STOCHASTIC: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Store a slot already in its storage dtype (fp32 or bf16), or q8-encode and store it."""
    if HAS:
        if Q8:
            codes, exponents = q8_encode(tl.where(mask, v, 0.0), word, BLOCK_N, BLOCK_K,
                                         SIGNED, STOCHASTIC)
            tl.store(s_ptr + idx, codes, mask=keep)
            offs_kb = k0 // Q8_BLOCK + tl.arange(0, BLOCK_K // Q8_BLOCK)
            eidx = offs_n[:, None] * KB + offs_kb[None, :]
            tl.store(e_ptr + eidx, exponents, mask=mask_n[:, None] & (offs_kb[None, :] < KB) & ((eidx * 0 + tile_ok) != 0))
        else:
            tl.store(s_ptr + idx, v, mask=keep)


@triton.jit
def _rule_epilogue(g, w_ptr, s0_ptr, s1_ptr, s2_ptr, e0_ptr, e1_ptr, e2_ptr, flag_ptr, status_ptr, tile_id,
                   offs_n, mask_n, k0, K, KB, row0, col0, global_k, grad_scale,
                   h0, h1, h2, h3, h4, h5, h6, h7, seed,
                   RULE: tl.constexpr, VARIANT: tl.constexpr,
                   HAS_S0: tl.constexpr, HAS_S1: tl.constexpr, HAS_S2: tl.constexpr,
                   W_BF16: tl.constexpr, S_BF16: tl.constexpr, S_Q8: tl.constexpr, STOCHASTIC: tl.constexpr,
                   NONNEGATIVE: tl.constexpr, ALIGNED_PAIRS: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    """Apply RULE to one tile in fp32, convert to the storage formats, and store, unless
    anything in the tile is non-finite.

    bf16 stores and q8 codes round stochastically or to nearest. Stochastic rounding
    draws Philox4x32-10 keyed on the step's ``seed`` at the element's place in the global
    weight (row ``row0 + n``, column ``col0 + k`` of a weight with ``global_k`` columns).
    bf16 stores need 16 random bits each: one call serves a pair of neighbouring columns
    (``paired_words``), 16 bits of its word 0 rounding the weight and of word 1 + i state
    slot i, for both elements. q8 codes need 24 bits: one call per element (counter: the
    element's index in the global weight), its word 0 rounding the weight, word 1 + i
    coding slot i. On an H200 the Philox rounds, not memory, bounded the bf16 epilogue. q8
    state is decoded before the rule and re-encoded after it, block by block
    (``forge_kernels.q8``). A tile whose
    gradient, new weight or new state holds a NaN or infinity (or a value too large for
    its format) is not stored at all: weight and state keep their old values, the
    tile's count of bad elements goes to ``flag_ptr[tile_id]`` and the tile is counted
    in the status word ``status_ptr[BAD_TILES]``, so the launcher can raise. No tile
    stores anything when the input check (``finite_check``, launched before on the
    same stream) counted a non-finite input in ``status_ptr[0]`` or ``status_ptr[1]``;
    those tiles are not counted as bad (the input error is the one to report).
    ``NONNEGATIVE`` has bit i set when slot i only holds values >= 0 (its q8 map is the
    unsigned one); ``KB`` is the number of q8 blocks in a row.

    ``grad_scale`` multiplies the gradient tile once, in fp32, before the rule: the same
    multiply ``clip_grad_norm_`` applies to a materialized gradient. A scale of 1.0
    changes no bit, so unclipped steps are unaffected. With ``DEVICE_GRAD_SCALE`` the
    kernel has read it from ``grad_scale_ptr`` (``_device_grad_scale``) before this.
    """
    # The input check's verdict, read first: its latency then overlaps the loads and the rule
    # instead of following the tile's reduction.
    inputs_ok = (tl.load(status_ptr) == 0) & (tl.load(status_ptr + 1) == 0)
    g = g * grad_scale
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask = mask_n[:, None] & (offs_k < K)[None, :]
    idx = offs_n[:, None] * K + offs_k[None, :]
    eidx = offs_n[:, None] * KB + offs_k[None, :] // Q8_BLOCK
    # The element's index in the global weight: q8's Philox counter. int64: a global weight
    # may hold up to 2**32 elements (all the counters of a stream).
    counter = ((offs_n + row0).to(tl.int64)[:, None] * global_k + (offs_k + col0)[None, :]).to(tl.uint32)
    w = tl.load(w_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    zeros = tl.zeros_like(w)
    s0 = _load_slot(s0_ptr, e0_ptr, idx, eidx, mask, zeros, HAS_S0, S_Q8, (NONNEGATIVE & 1) == 0)
    s1 = _load_slot(s1_ptr, e1_ptr, idx, eidx, mask, zeros, HAS_S1, S_Q8, (NONNEGATIVE & 2) == 0)
    s2 = _load_slot(s2_ptr, e2_ptr, idx, eidx, mask, zeros, HAS_S2, S_Q8, (NONNEGATIVE & 4) == 0)
    w, s0, s1, s2 = RULE(w, g, s0, s1, s2, h0, h1, h2, h3, h4, h5, h6, h7, VARIANT)
    r0 = counter  # placeholders: nearest rounding and fp32 stores draw nothing
    r1 = counter
    r2 = counter
    r3 = counter
    if STOCHASTIC and S_Q8:
        r0, r1, r2, r3 = tl.randint4x(seed, counter)
    elif STOCHASTIC and (W_BF16 or S_BF16):
        r0, r1, r2, r3 = paired_words(seed, offs_n + row0, col0 + k0, global_k, BLOCK_N, BLOCK_K, ALIGNED_PAIRS)
    w_new = _to_storage(w, r0, W_BF16, STOCHASTIC)
    finite = is_finite(g) & _storable(w, w_new, r0, False, W_BF16, STOCHASTIC)
    s0_new = s0
    s1_new = s1
    s2_new = s2
    if not S_Q8:
        s0_new = _to_storage(s0, r1, S_BF16, STOCHASTIC)
        s1_new = _to_storage(s1, r2, S_BF16, STOCHASTIC)
        s2_new = _to_storage(s2, r3, S_BF16, STOCHASTIC)
    finite = finite & _storable(s0, s0_new, r1, S_Q8, S_BF16, STOCHASTIC)
    finite = finite & _storable(s1, s1_new, r2, S_Q8, S_BF16, STOCHASTIC)
    finite = finite & _storable(s2, s2_new, r3, S_Q8, S_BF16, STOCHASTIC)
    num_bad = tl.sum(tl.sum(tl.where(mask & ~finite, 1, 0), axis=1), axis=0)
    tile_ok = ((num_bad == 0) & inputs_ok).to(tl.int32)
    # Broadcast the tile's verdict explicitly: the interpreter rejects a scalar-bool mask term.
    keep = mask & ((idx * 0 + tile_ok) != 0)
    tl.store(w_ptr + idx, w_new, mask=keep)
    _store_slot(s0_ptr, e0_ptr, s0_new, idx, offs_n, mask_n, k0, KB, keep, mask, tile_ok, r1,
                HAS_S0, S_Q8, (NONNEGATIVE & 1) == 0, STOCHASTIC, BLOCK_N, BLOCK_K)
    _store_slot(s1_ptr, e1_ptr, s1_new, idx, offs_n, mask_n, k0, KB, keep, mask, tile_ok, r2,
                HAS_S1, S_Q8, (NONNEGATIVE & 2) == 0, STOCHASTIC, BLOCK_N, BLOCK_K)
    _store_slot(s2_ptr, e2_ptr, s2_new, idx, offs_n, mask_n, k0, KB, keep, mask, tile_ok, r3,
                HAS_S2, S_Q8, (NONNEGATIVE & 4) == 0, STOCHASTIC, BLOCK_N, BLOCK_K)
    tl.atomic_add(status_ptr + _BAD_TILES, 1, mask=(num_bad > 0) & inputs_ok)
    tl.store(flag_ptr + tile_id, num_bad)


@triton.jit
def _tile_epilogue(g, w_ptr, s0_ptr, s1_ptr, s2_ptr, e0_ptr, e1_ptr, e2_ptr, flag_ptr, status_ptr, tile_id,
                   offs_n, mask_n, k0, K, KB, row0, col0, global_k, grad_scale,
                   h0, h1, h2, h3, h4, h5, h6, h7, seed,
                   RULE: tl.constexpr, VARIANT: tl.constexpr,
                   HAS_S0: tl.constexpr, HAS_S1: tl.constexpr, HAS_S2: tl.constexpr,
                   W_BF16: tl.constexpr, S_BF16: tl.constexpr, S_Q8: tl.constexpr, STOCHASTIC: tl.constexpr,
                   NONNEGATIVE: tl.constexpr, ALIGNED_PAIRS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   SPLIT: tl.constexpr, ROWS: tl.constexpr):
    """The rule epilogue of one (BLOCK_N, BLOCK_K) gradient tile, run on SPLIT column
    slices of it in turn, or row slices with ``ROWS`` (1, 2, 4 or 8; sub-tile j, left to
    right or top to bottom, is flagged as tile ``tile_id * SPLIT + j``).

    The epilogue is element-wise, so slicing changes no bit; it bounds what is live at
    once. A 128x128 tile, which halves the GEMM's operand traffic against 64x128, needs
    more registers than a thread has when its weight, state and their addresses are all
    loaded together (fp32 AdamW compiled on an H200: 255 registers and 2.4 KB of
    spills); a quarter at a time fits (206, none)."""
    if SPLIT == 1:
        _rule_epilogue(g, w_ptr, s0_ptr, s1_ptr, s2_ptr, e0_ptr, e1_ptr, e2_ptr, flag_ptr, status_ptr, tile_id,
                       offs_n, mask_n, k0, K, KB, row0, col0, global_k, grad_scale, h0, h1, h2, h3, h4, h5, h6, h7,
                       seed, RULE, VARIANT, HAS_S0, HAS_S1, HAS_S2, W_BF16, S_BF16, S_Q8, STOCHASTIC, NONNEGATIVE,
                       ALIGNED_PAIRS, BLOCK_N, BLOCK_K)
    elif ROWS:
        # Each half of the tile is epilogued as a tile of half the split, in turn.
        HALF_N: tl.constexpr = BLOCK_N // 2
        top, bottom = _row_halves(g, BLOCK_N, BLOCK_K)
        offs_top, offs_bottom = _halves(offs_n, BLOCK_N)
        mask_top, mask_bottom = _halves(mask_n, BLOCK_N)
        for half in tl.static_range(2):
            _tile_epilogue(top if half == 0 else bottom, w_ptr, s0_ptr, s1_ptr, s2_ptr, e0_ptr, e1_ptr, e2_ptr,
                           flag_ptr, status_ptr, tile_id * 2 + half, offs_top if half == 0 else offs_bottom,
                           mask_top if half == 0 else mask_bottom, k0, K, KB, row0, col0, global_k, grad_scale,
                           h0, h1, h2, h3, h4, h5, h6, h7, seed, RULE, VARIANT, HAS_S0, HAS_S1, HAS_S2, W_BF16,
                           S_BF16, S_Q8, STOCHASTIC, NONNEGATIVE, ALIGNED_PAIRS, HALF_N, BLOCK_K, SPLIT // 2, ROWS)
    else:
        # Each half of the tile is epilogued as a tile of half the split, in turn.
        HALF: tl.constexpr = BLOCK_K // 2
        left, right = _column_halves(g, BLOCK_N, BLOCK_K)
        for half in tl.static_range(2):
            _tile_epilogue(left if half == 0 else right, w_ptr, s0_ptr, s1_ptr, s2_ptr, e0_ptr, e1_ptr, e2_ptr,
                           flag_ptr, status_ptr, tile_id * 2 + half, offs_n, mask_n, k0 + half * HALF, K, KB, row0,
                           col0, global_k, grad_scale, h0, h1, h2, h3, h4, h5, h6, h7, seed, RULE, VARIANT, HAS_S0,
                           HAS_S1, HAS_S2, W_BF16, S_BF16, S_Q8, STOCHASTIC, NONNEGATIVE, ALIGNED_PAIRS, BLOCK_N,
                           HALF, SPLIT // 2, ROWS)


@triton.jit
def _column_halves(g, BLOCK_N: tl.constexpr, WIDTH: tl.constexpr):
    """The left and right column halves of a (BLOCK_N, WIDTH) tile: in the reshape,
    (n, s, c) is column s * WIDTH / 2 + c."""
    return tl.split(tl.permute(tl.reshape(g, (BLOCK_N, 2, WIDTH // 2)), (0, 2, 1)))


@triton.jit
def _row_halves(g, HEIGHT: tl.constexpr, BLOCK_K: tl.constexpr):
    """The top and bottom row halves of a (HEIGHT, BLOCK_K) tile: in the reshape, (s, n, c)
    is row s * HEIGHT / 2 + n."""
    return tl.split(tl.permute(tl.reshape(g, (2, HEIGHT // 2, BLOCK_K)), (1, 2, 0)))


@triton.jit
def _halves(v, LENGTH: tl.constexpr):
    """The first and second halves of a vector of LENGTH (the rows of ``_row_halves``)."""
    return tl.split(tl.permute(tl.reshape(v, (2, LENGTH // 2)), (1, 0)))


@triton.jit
def _device_scalars(scalars_ptr, seed_ptr):
    """The step's rule scalars and Philox key as a ``StepScalars`` buffer holds them."""
    return (tl.load(scalars_ptr), tl.load(scalars_ptr + 1), tl.load(scalars_ptr + 2), tl.load(scalars_ptr + 3),
            tl.load(scalars_ptr + 4), tl.load(scalars_ptr + 5), tl.load(scalars_ptr + 6), tl.load(scalars_ptr + 7),
            tl.load(seed_ptr))


@triton.jit
def _device_grad_scale(grad_scale_ptr):
    """A gradient scale held in device memory, made NaN where it is negative (NaN and
    infinities stay as they are): the gradient it scales is then non-finite everywhere,
    so no part stores (the guard every non-finite gradient meets), where a host scale
    would have been refused."""
    scale = tl.load(grad_scale_ptr)
    return tl.where(scale >= 0.0, scale, float("nan"))


@triton.jit(do_not_specialize=["row0", "col0", "global_k", "seed"])
def _fused_weight_update_kernel(x_ptr, dy_ptr, w_ptr, s0_ptr, s1_ptr, s2_ptr, e0_ptr, e1_ptr, e2_ptr, flag_ptr,
                                status_ptr, T, N, K, KB, row0, col0, global_k,
                                stride_xt, stride_xk, stride_dyt, stride_dyn, grad_scale,
                                h0, h1, h2, h3, h4, h5, h6, h7, seed, scalars_ptr, seed_ptr, grad_scale_ptr,
                                sums_ptr, RULE: tl.constexpr, VARIANT: tl.constexpr,
                                HAS_S0: tl.constexpr, HAS_S1: tl.constexpr, HAS_S2: tl.constexpr,
                                W_BF16: tl.constexpr, S_BF16: tl.constexpr, S_Q8: tl.constexpr,
                                STOCHASTIC: tl.constexpr, NONNEGATIVE: tl.constexpr, ALIGNED_PAIRS: tl.constexpr,
                                DEVICE_SCALARS: tl.constexpr, DEVICE_GRAD_SCALE: tl.constexpr,
                                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
                                SPLIT: tl.constexpr, ROWS: tl.constexpr, SQUARE_SUMS: tl.constexpr,
                                x_desc=None, dy_desc=None, TMA: tl.constexpr = False):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    mask_k = offs_k < K
    g = _weight_grad_tile(x_ptr, dy_ptr, T, stride_xt, stride_xk, stride_dyt, stride_dyn,
                          offs_n, offs_k, mask_n, mask_k, BLOCK_N, BLOCK_K, BLOCK_T,
                          x_desc, dy_desc, pid_n * BLOCK_N, pid_k * BLOCK_K, TMA)
    tile_id = pid_n * tl.num_programs(1) + pid_k
    if SQUARE_SUMS:  # the tile's Σ g² of the unscaled gradient, for previous-norm clipping's norm
        tl.store(sums_ptr + tile_id, _square_sum(g, BLOCK_N, BLOCK_K))
    if DEVICE_SCALARS:
        h0, h1, h2, h3, h4, h5, h6, h7, seed = _device_scalars(scalars_ptr, seed_ptr)
    if DEVICE_GRAD_SCALE:
        grad_scale = _device_grad_scale(grad_scale_ptr)
    _tile_epilogue(g, w_ptr, s0_ptr, s1_ptr, s2_ptr, e0_ptr, e1_ptr, e2_ptr, flag_ptr, status_ptr, tile_id,
                   offs_n, mask_n, pid_k * BLOCK_K, K, KB, row0, col0, global_k, grad_scale,
                   h0, h1, h2, h3, h4, h5, h6, h7, seed,
                   RULE, VARIANT, HAS_S0, HAS_S1, HAS_S2, W_BF16, S_BF16, S_Q8, STOCHASTIC, NONNEGATIVE,
                   ALIGNED_PAIRS, BLOCK_N, BLOCK_K, SPLIT, ROWS)


@triton.jit(do_not_specialize=["row0", "col0", "global_k", "seed"])
def _apply_rule_kernel(grad_ptr, w_ptr, s0_ptr, s1_ptr, s2_ptr, e0_ptr, e1_ptr, e2_ptr, flag_ptr, status_ptr,
                       N, K, KB,
                       row0, col0, global_k, grad_scale,
                       h0, h1, h2, h3, h4, h5, h6, h7, seed, scalars_ptr, seed_ptr, grad_scale_ptr,
                       RULE: tl.constexpr, VARIANT: tl.constexpr,
                       HAS_S0: tl.constexpr, HAS_S1: tl.constexpr, HAS_S2: tl.constexpr,
                       W_BF16: tl.constexpr, S_BF16: tl.constexpr, S_Q8: tl.constexpr, STOCHASTIC: tl.constexpr,
                       NONNEGATIVE: tl.constexpr, ALIGNED_PAIRS: tl.constexpr, DEVICE_SCALARS: tl.constexpr,
                       DEVICE_GRAD_SCALE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       SPLIT: tl.constexpr, ROWS: tl.constexpr):
    """Oracle, second half: the same epilogue, its gradient tile read from memory."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    mask_k = offs_k < K
    g = tl.load(grad_ptr + offs_n[:, None] * K + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
    tile_id = pid_n * tl.num_programs(1) + pid_k
    if DEVICE_SCALARS:
        h0, h1, h2, h3, h4, h5, h6, h7, seed = _device_scalars(scalars_ptr, seed_ptr)
    if DEVICE_GRAD_SCALE:
        grad_scale = _device_grad_scale(grad_scale_ptr)
    _tile_epilogue(g, w_ptr, s0_ptr, s1_ptr, s2_ptr, e0_ptr, e1_ptr, e2_ptr, flag_ptr, status_ptr, tile_id,
                   offs_n, mask_n, pid_k * BLOCK_K, K, KB, row0, col0, global_k, grad_scale,
                   h0, h1, h2, h3, h4, h5, h6, h7, seed,
                   RULE, VARIANT, HAS_S0, HAS_S1, HAS_S2, W_BF16, S_BF16, S_Q8, STOCHASTIC, NONNEGATIVE,
                   ALIGNED_PAIRS, BLOCK_N, BLOCK_K, SPLIT, ROWS)


ROUNDINGS = ("stochastic", "nearest")
REPORTS = ("raise", "defer")
# "step": x and dy are scanned before the update, and a non-finite element skips the
# whole step. "tiles": no scan; the element makes the sums of the tiles it reaches
# non-finite, those tiles are skipped by their own verdict and the others step.
INPUT_CHECKS = ("step", "tiles")


def check_report(report) -> str:
    if report not in REPORTS:
        raise ValueError(f"report must be one of {REPORTS}, got {report!r}")
    return report


def check_input_check(input_check, config=None) -> str:
    """``input_check`` if it is one of ``INPUT_CHECKS`` and ``config`` does not scan the
    inputs inside its kernel, which "tiles" would contradict (a ``config`` that is not a
    TileConfig is left to the config's own check)."""
    if input_check not in INPUT_CHECKS:
        raise ValueError(f"input_check must be one of {INPUT_CHECKS}, got {input_check!r}")
    if input_check == "tiles" and isinstance(config, TileConfig) and config.in_kernel_check:
        raise ValueError('input_check="tiles" launches no scan of x and dy, and TileConfig(in_kernel_check=True) '
                         "is one (inside the kernel): pass one or the other")
    return input_check


def _capturing(weight) -> bool:
    return weight.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def check_capture(weight, step, report) -> bool:
    """True when the call is being captured into a CUDA graph, after refusing what a
    replay would get wrong: a step given as a number (its scalars and rounding key
    would be replayed unchanged at every later step: pass a ``StepScalars``) and
    ``report="raise"`` (it synchronizes, which capture forbids)."""
    if not _capturing(weight):
        return False
    if not isinstance(step, StepScalars):
        raise RuntimeError("a fused step captured in a CUDA graph needs its step as a forge_kernels.StepScalars "
                           "(set before each replay); with a step number every replay would repeat that step's "
                           "scalars and rounding bits")
    if report != "defer":
        raise RuntimeError('a captured fused step must use report="defer" (report="raise" synchronizes); '
                           "check the returned report after a replay")
    return True


class _Epilogue:
    """The validated, host-side arguments of the rule epilogue for one step, and the
    device status and per-tile flags its kernels write (one zeroed allocation)."""

    def __init__(self, weight, state, rule, step, config, rounding, seed, grad_scale, weight_slice):
        scale = check_grad_scale(grad_scale, weight)
        # A device scale is read by the kernels (DEVICE_GRAD_SCALE); the float argument is then unused.
        on_device_scale = isinstance(scale, torch.Tensor)
        self.grad_scale = 1.0 if on_device_scale else scale
        self.grad_scale_ptr = scale if on_device_scale else weight  # an unused pointer for a host scale
        self.config = PINNED if config is None else config
        if not isinstance(self.config, TileConfig):
            raise TypeError(f"config must be a forge_kernels.TileConfig, got {type(self.config).__name__}")
        rounding = "stochastic" if rounding is None else rounding
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
        seed = check_seed(seed)
        if isinstance(step, StepScalars):  # read on the device: the kernels' scalar arguments are unused
            step.check_for(rule, seed, weight.device)
            self.scalars, self.seed = (0.0,) * NUM_SCALARS, 0
            self.device_scalars = (step.values, step.key)
        else:
            # One Philox key per step; its words serve the weight and the state slots.
            self.scalars, self.seed = rule.scalars(step), stream_seed(seed, step)
            self.device_scalars = (weight, weight)  # unused pointers
        layout = rule.slot_layout
        assert len(layout) == NUM_SLOTS
        state_format = rule.state_format(state)
        q8_state = state_format == "q8"
        if weight_slice is None:  # the whole weight: its own place, nothing to check
            self.place = (0, 0, weight.shape[1])
        else:
            if not isinstance(weight_slice, WeightSlice):
                raise TypeError(f"weight_slice must be a forge_kernels.WeightSlice, got {type(weight_slice).__name__}")
            weight_slice.check_fits(weight.shape, q8_state)
            self.place = (weight_slice.row_start, weight_slice.col_start, weight_slice.global_shape[1])
        if q8_state and self.config.part_shape[1] < q8.BLOCK:
            raise ValueError(f"q8 state needs block_k / epilogue_split >= {q8.BLOCK} (block_k >= {q8.BLOCK} with row "
                             f"slices: a slice must hold whole q8 blocks); config has block_k={self.config.block_k}, "
                             f"epilogue_split={self.config.epilogue_split}, epilogue_axis={self.config.epilogue_axis!r}")
        # A slot the rule does not keep gets the weight's pointer; the kernel never touches it.
        self.slot_tensors = [state[name] if name is not None else weight for name in layout]
        self.exponent_tensors = [state[name + q8.EXPONENT_SUFFIX] if q8_state and name is not None else weight
                                 for name in layout]
        self.rule_args = dict(
            RULE=rule.update, VARIANT=rule.variant,
            HAS_S0=layout[0] is not None, HAS_S1=layout[1] is not None, HAS_S2=layout[2] is not None,
            W_BF16=weight.dtype == torch.bfloat16, S_BF16=state_format == "bf16", S_Q8=q8_state,
            STOCHASTIC=rounding == "stochastic",
            # Pairs of columns share a Philox call; a slice at an odd column splits them.
            ALIGNED_PAIRS=self.place[1] % 2 == 0, DEVICE_SCALARS=isinstance(step, StepScalars),
            DEVICE_GRAD_SCALE=on_device_scale,
            NONNEGATIVE=sum(1 << i for i, name in enumerate(layout) if name in rule.nonnegative))
        self.state_format = state_format
        self.shape = tuple(weight.shape)
        N, K = self.shape
        self.blocks_per_row = triton.cdiv(K, q8.BLOCK)
        self.grid = (triton.cdiv(N, self.config.block_n), triton.cdiv(K, self.config.block_k))
        tiles = self.grid[0] * self.grid[1] * self.config.epilogue_split
        # The status words, the tiles' flags, and the ticket counter at which the programs of
        # a kernel that checks its own inputs meet (``TileConfig.in_kernel_check``): not a
        # status word, which a nonzero value would flag.
        words = torch.zeros(STATUS_WORDS + tiles + 1, dtype=torch.int32, device=weight.device)
        self.status, self.flags, self.tickets = words[:STATUS_WORDS], words[STATUS_WORDS:-1], words[-1:]

    def apply(self, grad, weight):
        """The oracle's second kernel: the epilogue on a materialized fp32 gradient."""
        N, K = self.shape
        _apply_rule_kernel[self.grid](grad, weight, *self.slot_tensors, *self.exponent_tensors, self.flags,
                                      self.status, N, K, self.blocks_per_row, *self.place,
                                      self.grad_scale, *self.scalars, self.seed, *self.device_scalars,
                                      self.grad_scale_ptr, **self.rule_args, BLOCK_N=self.config.block_n,
                                      BLOCK_K=self.config.block_k, SPLIT=self.config.epilogue_split,
                                      ROWS=self.config.epilogue_axis == "rows", **self.config.launch_options())

    def check_fused(self, x, dy, weight):
        """Refuse, before anything is launched, a fused call its config's kernel cannot run."""
        if self.config.kernel == "hopper":
            check_hopper_launch(x, dy, weight, self.slot_tensors, self.state_format)
        elif self.config.operand_loads == "tma":
            check_tma_operands(x, dy)

    def fused(self, x, dy, weight, square_sums=None):
        """Launch the fused kernel (and fill ``square_sums`` with the tiles' Σ dW²);
        returns Triton's handle of the compiled kernel (its register and spill counts are
        what the benchmark's sweep records)."""
        T, K = x.shape
        N = self.shape[0]
        config = self.config
        if config.kernel == "hopper":
            from . import hopper_update  # Gluon: imported only where it runs
            return hopper_update.launch(self, x, dy, weight, square_sums)
        tma = {}
        if config.operand_loads == "tma" and T > 0:  # with no tokens the loop reads nothing
            tma = dict(x_desc=TensorDescriptor.from_tensor(x, [config.block_t, config.block_k]),
                       dy_desc=TensorDescriptor.from_tensor(dy, [config.block_t, config.block_n]), TMA=True)
        return _fused_weight_update_kernel[self.grid](
            x, dy, weight, *self.slot_tensors, *self.exponent_tensors, self.flags, self.status, T, N, K,
            self.blocks_per_row, *self.place, x.stride(0), x.stride(1), dy.stride(0), dy.stride(1),
            self.grad_scale, *self.scalars, self.seed, *self.device_scalars, self.grad_scale_ptr,
            weight if square_sums is None else square_sums,  # an unused pointer without sums
            **self.rule_args, BLOCK_N=config.block_n, BLOCK_K=config.block_k, BLOCK_T=config.block_t,
            SPLIT=config.epilogue_split, ROWS=config.epilogue_axis == "rows", SQUARE_SUMS=square_sums is not None,
            **tma, **config.launch_options())

    def report(self, report: str, input_names: tuple, captured: bool = False):
        """The call's outcome: raised now (``"raise"``, one read of the status) or
        returned as an ``UpdateReport`` (``"defer"``, no synchronization). A captured
        call's report reads the graph's status words when checked (one synchronization):
        the outcome of the latest replay."""
        outcome = UpdateReport(self.status, self.flags, input_names, self.grid, self.config, self.shape,
                               copy_async=report == "defer" and not captured)
        if report == "defer":
            return outcome
        outcome.check()
        return None


def check_fused_parts(parts, weight, state, rule, config=None):
    """Refuse what ``fused_weight_update(x, dy, weight, state, rule, ..., config=config)``
    would refuse before its launch for any ``(x, dy)`` of ``parts`` (the inputs, and what
    the config's kernel and loads need), writing nothing: for callers that launch once per
    part, so that a later part's refusal cannot follow an earlier part's write."""
    epilogue = _Epilogue(weight, state, rule, 1, config, None, 0, 1.0, None)
    for x, dy in parts:
        check_update_inputs(x, dy, weight, state, rule)
        epilogue.check_fused(x, dy, weight)


def check_epilogue_arguments(weight, state, rule, step, *, config=None, rounding=None, seed=0, weight_slice=None):
    """Refuse, writing nothing, what ``apply_rule(grad, weight, state, rule, step, ...)``
    would refuse of its other arguments (the step, seed, rounding, tile config and slice):
    for callers that apply the rule later, bucket by bucket, after a collective."""
    check_capture(weight, step, "raise")
    _Epilogue(weight, state, rule, step, config, rounding, seed, 1.0, weight_slice)


def fused_weight_update(x, dy, weight, state, rule, step, *, oracle=False, config=None,
                        rounding=None, seed=0, grad_scale=1.0, weight_slice=None, report="raise",
                        square_sums=None, input_check="step"):
    """Update ``weight`` (N, K) and ``state`` in place by one step of ``rule`` with dW = dyᵀ x.

    x: (T, K) and dy: (T, N), both float32 or both bfloat16, any strides. ``weight``
    is float32 or bfloat16 (no master copy); the state is as made by
    ``rule.init_state(weight, state_format=...)``: fp32, bf16, or q8 (uint8 codes and
    int8 block exponents). The rule always
    computes in fp32; bf16 stores and q8 codes round ``"stochastic"`` (the default) or
    ``"nearest"``; float32 stores are exact and ignore ``rounding``. Stochastic rounding
    draws Philox bits keyed on (``seed``, ``step``) at the element's place in the weight
    (16 bits per bf16 store, one call per pair of neighbouring columns; 24 bits per q8
    code, one call per element), so the same call gives the same bits and successive
    steps are independent. A shard of a
    larger weight passes its ``weight_slice`` (:class:`WeightSlice`): elements are then
    keyed on their index in the global weight, so a sharded update rounds exactly as
    the unsharded one; ``None`` means the weight is whole.

    ``step`` is the 1-based step number the rule's scalars (bias corrections,
    first-step momentum) are computed for, or a :class:`StepScalars` holding them (and
    the step's rounding key) in device memory, made for this ``rule`` and ``seed``: the
    form a CUDA-graph capture of the call needs (with ``report="defer"``; the returned
    report then reads the latest replay's outcome when checked). Either form gives the
    same bits at the same step. ``oracle=True`` materializes dW with the
    same tile loop and applies the same epilogue in a second kernel (the exactness
    reference). ``config`` is a :class:`TileConfig`; ``None`` means ``PINNED``; a config
    with ``kernel="hopper"`` runs the fused step as the Hopper kernel (sm_90 GPUs, bf16
    activations, fp32 or bf16 state; the same bits as the portable kernel at the same tile)
    and its oracle as the portable kernels.
    ``grad_scale`` (a float32 value) multiplies the gradient before the rule, as
    ``clip_grad_norm_``'s clip coefficient multiplies a materialized gradient. It may also
    be a one-element float32 tensor on the weight's device (a clip coefficient computed
    there, or a loss scaler's inverse scale), which the kernel reads itself: nothing is
    synchronized, and a captured call reads it at every replay. Its value is not checked
    on the host; a negative, infinite or NaN device scale makes every part's gradient
    non-finite, so nothing is stored and the report names every tile (a clip coefficient
    of an infinite norm is 0, a valid scale: make it NaN to store nothing).

    Non-finite values: a kernel launched just before the update (or, with
    ``TileConfig(in_kernel_check=True)``, the split Hopper kernel itself before any of
    its programs stores) counts NaN/inf in x and dy on the device; if there are any, the
    update writes nothing and the call
    raises ``NonFiniteInputError``. A tile whose gradient or result is non-finite
    (overflow) is not written; the call then raises ``NonFiniteUpdateError`` listing
    the tiles. ``input_check="tiles"`` launches no scan (it saves reading x and dy once
    more): a NaN or infinite element of x or dy makes the sum of every tile it reaches
    non-finite (NaN and infinities survive every product and sum, and 0 times an
    infinity is NaN), so exactly those tiles (for ``x[t, k]`` the tiles holding column k,
    for ``dy[t, n]`` those holding row n) are not written and the call raises
    ``NonFiniteUpdateError`` naming them; the other tiles take the step. Nothing
    non-finite is stored either way; what "tiles" gives up is skipping the whole step.
    It cannot be combined with ``TileConfig(in_kernel_check=True)``, which is a scan.
    ``report="raise"`` (default) reads the outcome once (one device-to-host
    synchronization) and raises; ``report="defer"`` does not synchronize at all and
    returns an :class:`UpdateReport`, whose ``check()`` raises the same errors later
    (the writes were already decided on the device: only the telling is deferred).
    T = 0 is allowed: dW is then the empty sum, 0, and the rule steps with a zero
    gradient (decay and momentum still act), as torch.optim does with a zero grad.

    ``square_sums`` (from ``empty_square_sums(weight.shape, config, device)``): filled
    with each tile's Σ dW² of the gradient before ``grad_scale``, as
    ``weight_gradient_square_sums`` computes them (bitwise under the interpreter; compiled,
    within ``proofs/gradient_norm.md``'s bound), so that ``norm_from_square_sums`` gives
    the gradient's norm after the step with no second pass over the tokens (previous-norm
    clipping; the step's own bits do not change). The fused kernels keep the sums in
    their epilogues (the Hopper kernels add a tile's parts' sums in part order); the
    oracle, which has no fused epilogue, launches ``weight_gradient_square_sums``' kernel
    first. Non-finite inputs give non-finite sums.
    """
    check_report(report)
    check_input_check(input_check, config)
    check_update_inputs(x, dy, weight, state, rule, square_sums=square_sums, grad_scale=grad_scale)
    captured = check_capture(weight, step, report)
    epilogue = _Epilogue(weight, state, rule, step, config, rounding, seed, grad_scale, weight_slice)
    scan = input_check == "step"
    if square_sums is not None:
        check_square_sums(square_sums, weight.shape, epilogue.config, weight.device)
    if not oracle:
        epilogue.check_fused(x, dy, weight)
    with on_device(weight.device), quiet_non_finite():
        if weight.numel():  # an empty weight takes no step: nothing to check, a clean report
            if scan and (oracle or not epilogue.config.in_kernel_check):
                launch_finite_check(epilogue.status, x, dy)
            if oracle:
                if square_sums is not None:  # the tile loop's sums, as weight_gradient_square_sums on any backend
                    launch_square_sums(*weight.shape, epilogue.config, x=x, dy=dy, out=square_sums)
                epilogue.apply(launch_weight_gradient(x, dy, epilogue.config), weight)
            else:
                epilogue.fused(x, dy, weight, square_sums)
        return epilogue.report(report, input_names=("x", "dy") if scan else (), captured=captured)


def apply_rule(grad, weight, state, rule, step, *, config=None, rounding=None, seed=0, grad_scale=1.0,
               weight_slice=None, report="raise"):
    """One step of ``rule`` on a materialized fp32 gradient ``grad`` (N, K), in place: the
    epilogue of the fused kernel (same rounding streams, same non-finite guard: a
    non-finite ``grad`` writes nothing and raises ``NonFiniteInputError``; ``report``
    and ``grad_scale``, a number or a device tensor, as in ``fused_weight_update``) as
    its own kernel. With
    ``grad = weight_gradient(x, dy, config=config)`` this is the oracle."""
    check_report(report)
    check_gradient(grad, weight)
    check_weight_and_state(weight, state, rule, read=[("grad", grad)], grad_scale=grad_scale)
    captured = check_capture(weight, step, report)
    epilogue = _Epilogue(weight, state, rule, step, config, rounding, seed, grad_scale, weight_slice)
    with on_device(weight.device), quiet_non_finite():
        if weight.numel():
            launch_finite_check(epilogue.status, grad)
            epilogue.apply(grad, weight)
        return epilogue.report(report, input_names=("grad",), captured=captured)
