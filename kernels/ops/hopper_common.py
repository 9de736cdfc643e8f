"""What both Hopper kernel structures (``hopper_pingpong``, ``hopper_split``) share: a
tile's token loop on wgmma, the TMA copy of one block of it into the ring, and the
epilogue's arithmetic on one part of a tile (a column part, or in the split kernel a row
part: the portable kernel's rule, rounding, verdict and Philox words, bit for bit), read
from staging slots a TMA warp fills; the ring, staging slots and gradient layout both
allocate in shared memory; and the few Gluon names that changed between triton 3.6 and
3.9."""

import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

from .finite_check import BAD_TILES, is_finite
from .fused_weight_update import _storable, _to_storage

_BAD_TILES = gl.constexpr(BAD_TILES)
# Names that Gluon changed between triton 3.6 and 3.9 (the same operations): the barrier
# over one partition's warps, and the TMA copy of a global tile into shared memory.
_partition_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier
_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared


@gluon.jit
def _token_loop(dy_bufs, x_bufs, ready, free, acc, counter, num_t, IN_FLIGHT: gl.constexpr = False):
    """A tile's dW block over all its tokens: ``acc += dyᵀ x`` on wgmma, one ring stage at
    a time in token order (the portable kernel's ``tl.dot`` over the same blocks), each
    stage released once its wgmma is done. ``counter`` counts the stages taken so far
    (the ring's position and barrier phase); returns the accumulator and the new count.
    With ``IN_FLIGHT`` a block's wgmma is left running while the next block is waited for
    and issued, and its stage released after that: the same wgmma on the same accumulator
    in the same order (no bit moves), the tensor cores not drained between blocks."""
    STAGES: gl.constexpr = dy_bufs.shape[0]
    for i in range(num_t):
        stage = counter % STAGES
        mbarrier.wait(ready.index(stage), (counter // STAGES) & 1)
        dy_t = dy_bufs.index(stage).permute((1, 0))
        acc = warpgroup_mma(dy_t, x_bufs.index(stage), acc, is_async=True)
        if IN_FLIGHT:
            # Every wgmma but this block's has retired: the previous block's stage is free.
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            if i > 0:
                mbarrier.arrive(free.index((counter + STAGES - 1) % STAGES))
        else:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(free.index(stage))
        counter += 1
    if IN_FLIGHT:
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        if num_t > 0:
            mbarrier.arrive(free.index((counter + STAGES - 1) % STAGES))
    return acc, counter


@gluon.jit
def _fill_stage(dy_desc, x_desc, dy_bufs, x_bufs, ready, free, counter, i, off_n, off_k):
    """Copy token block ``i`` of the tile at (off_n, off_k), its dy and x, into the ring's
    next stage once the matrix warps have released it."""
    BLOCK_T: gl.constexpr = dy_desc.block_type.shape[0]
    STAGES: gl.constexpr = dy_bufs.shape[0]
    BLOCK_BYTES: gl.constexpr = dy_desc.block_type.nbytes + x_desc.block_type.nbytes
    stage = counter % STAGES
    # A fresh barrier counts as released once: waiting on the other parity passes.
    mbarrier.wait(free.index(stage), ((counter // STAGES) & 1) ^ 1)
    mbarrier.expect(ready.index(stage), BLOCK_BYTES)
    _tma_load(dy_desc, [i * BLOCK_T, off_n], ready.index(stage), dy_bufs.index(stage))
    _tma_load(x_desc, [i * BLOCK_T, off_k], ready.index(stage), x_bufs.index(stage))


@gluon.jit
def _fill_slot(w_desc, s0_desc, s1_desc, s2_desc, w_smem, s0_smem, s1_smem, s2_smem, epi_ready, epi_free, slot,
               uses, off_n, col, HAS_S0: gl.constexpr, HAS_S1: gl.constexpr, HAS_S2: gl.constexpr):
    """Copy the weight's and each state slot's part at (off_n, col) into staging
    slot ``slot`` once the epilogue has read what its ``uses`` earlier fills put there."""
    EPI_BYTES: gl.constexpr = (w_desc.block_type.nbytes + HAS_S0 * s0_desc.block_type.nbytes
                               + HAS_S1 * s1_desc.block_type.nbytes + HAS_S2 * s2_desc.block_type.nbytes)
    # A fresh barrier counts as released once: waiting on the other parity passes.
    mbarrier.wait(epi_free.index(slot), (uses & 1) ^ 1)
    mbarrier.expect(epi_ready.index(slot), EPI_BYTES)
    _tma_load(w_desc, [off_n, col], epi_ready.index(slot), w_smem.index(slot))
    if HAS_S0:
        _tma_load(s0_desc, [off_n, col], epi_ready.index(slot), s0_smem.index(slot))
    if HAS_S1:
        _tma_load(s1_desc, [off_n, col], epi_ready.index(slot), s1_smem.index(slot))
    if HAS_S2:
        _tma_load(s2_desc, [off_n, col], epi_ready.index(slot), s2_smem.index(slot))


@gluon.constexpr_function
def _epilogue_layout(block_k, num_warps):
    """Row-major, four consecutive columns per thread, over the epilogue's warps."""
    across = min(16, block_k // 4)
    return gl.BlockedLayout([1, 4], [32 // across, across], [num_warps, 1], [1, 0])


@gluon.constexpr_function
def _pair_layout(block_k, num_warps):
    """``_epilogue_layout`` over column pairs: a pair joined with itself is ``_epilogue_layout``."""
    across = min(16, block_k // 4)
    return gl.BlockedLayout([1, 2], [32 // across, across], [num_warps, 1], [1, 0])


@gluon.jit
def _words(seed, row0, col0, global_k, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, ALIGNED: gl.constexpr,
           NUM_WARPS: gl.constexpr):
    """The portable ``paired_words`` for the tile whose first element sits at global
    (row0, col0): one Philox call per pair of neighbouring columns, the even column taking
    each word's low 16 bits and the odd one the high 16; an odd ``col0`` draws per element."""
    epi: gl.constexpr = _epilogue_layout(BLOCK_K, NUM_WARPS)
    pairs_per_row = (global_k + 1) // 2
    if ALIGNED:
        pair: gl.constexpr = _pair_layout(BLOCK_K, NUM_WARPS)
        rows = row0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, pair))
        pairs = col0 // 2 + gl.arange(0, BLOCK_K // 2, layout=gl.SliceLayout(0, pair))
        counter = (rows.to(gl.int64)[:, None] * pairs_per_row + pairs[None, :]).to(gl.uint32)
        r0, r1, r2, r3 = tl.randint4x(seed, counter)
        w0 = gl.convert_layout(gl.reshape(gl.join(r0, r0 >> 16), [BLOCK_N, BLOCK_K]), epi)
        w1 = gl.convert_layout(gl.reshape(gl.join(r1, r1 >> 16), [BLOCK_N, BLOCK_K]), epi)
        w2 = gl.convert_layout(gl.reshape(gl.join(r2, r2 >> 16), [BLOCK_N, BLOCK_K]), epi)
        w3 = gl.convert_layout(gl.reshape(gl.join(r3, r3 >> 16), [BLOCK_N, BLOCK_K]), epi)
    else:
        rows = row0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, epi))
        cols = col0 + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, epi))
        counter = (rows.to(gl.int64)[:, None] * pairs_per_row + (cols // 2)[None, :]).to(gl.uint32)
        r0, r1, r2, r3 = tl.randint4x(seed, counter)
        shift = ((cols % 2) * 16).to(gl.uint32)[None, :]
        w0 = r0 >> shift
        w1 = r1 >> shift
        w2 = r2 >> shift
        w3 = r3 >> shift
    return w0, w1, w2, w3


@gluon.jit
def _slot(smem, zeros, HAS: gl.constexpr, layout: gl.constexpr):
    """A slot's part in fp32, or zeros for a slot the rule lacks (as the portable kernel)."""
    value = zeros
    if HAS:
        value = smem.load(layout).to(gl.float32)
    return value


@gluon.jit
def _square_sum(g):
    """Σ g² over a part of a gradient tile, each square rounded to fp32 (contraction is
    off at every launch), added in the tree Triton's reduction makes of the part's layout:
    previous-norm clipping's tile sums (``fused_weight_update(..., square_sums=)``)."""
    return gl.sum(gl.sum(g * g, axis=1), axis=0)


@gluon.jit
def _release_slots(epi_free, grad_free, RELEASE_GRAD: gl.constexpr):
    """Hand the staging slot (and with ``RELEASE_GRAD`` the gradient slot) back once every
    warp of the partition has read it."""
    # The slot's next TMA copy is issued once every warp has passed the barrier below, but a
    # warp's loads may still be in flight there, and the copy's writes (the async proxy) are
    # not ordered behind them: this proxy fence is what keeps the copy from overwriting
    # values not yet read (without it, eight epilogue warps read part of a weight row of
    # the next part on an H200: results/tuning/h200-slot-war-race.log).
    fence_async_shared()
    _partition_barrier()
    mbarrier.arrive(epi_free)
    if RELEASE_GRAD:
        mbarrier.arrive(grad_free)


@gluon.constexpr_function
def _counts_layout(rows, num_warps):
    """A part's row counts, all of them in every warp (each lane a share, the warps
    alike), so that their sum needs no shared memory or barrier of its own."""
    return gl.BlockedLayout([max(1, rows // 32)], [32], [num_warps], [0])


@gluon.constexpr_function
def _counts_buffers_layout():
    """A part's row counts in shared memory, unswizzled (the layout of each of the two)."""
    return gl.SwizzledSharedLayout(1, 1, 1, order=[0])


@gluon.jit
def _epilogue_part(g, w_ptr, s0_ptr, s1_ptr, s2_ptr, flag_ptr, status_ptr, w_smem, s0_smem, s1_smem, s2_smem,
                   epi_ready, epi_free, phase, grad_free, RELEASE_GRAD: gl.constexpr, inputs_ok, flag, off_n, off_k,
                   N, K, row0, col0, global_k, grad_scale, h0, h1, h2, h3, h4, h5, h6, h7, seed,
                   RULE: gl.constexpr, VARIANT: gl.constexpr, HAS_S0: gl.constexpr, HAS_S1: gl.constexpr,
                   HAS_S2: gl.constexpr, W_BF16: gl.constexpr, S_BF16: gl.constexpr, STOCHASTIC: gl.constexpr,
                   ALIGNED: gl.constexpr, counts_smem, ONE_BARRIER: gl.constexpr):
    """The portable epilogue's arithmetic on one part (BLOCK_N x SUB: the staging slot's
    shape, a column or a row part) of a tile whose first element is at (off_n, off_k), on
    the calling partition's warps: its gradient ``g`` in the epilogue layout, its weight and state in one
    staging slot, the portable kernel's ``_rule_epilogue`` on its ``epilogue_split`` slice
    ``flag``. With ``RELEASE_GRAD`` (the last part of a tile whose gradient waits in a slot
    of its own) that slot is handed back (``grad_free``) with the staging slot.

    The part's non-finite count (its verdict) is a sum over every warp's elements, and no
    element is stored before it. With ``ONE_BARRIER`` the warps write their rows' counts to
    ``counts_smem`` (the caller alternates two, so that no warp still reading one part's
    counts sees the next part's written) and the barrier that hands the staging slot back also
    publishes them, where a cross-warp ``gl.sum`` waits at a barrier of its own after the
    slot's barrier: the same count (an integer sum), one barrier a part instead of
    two, the slot handed back after the rule's arithmetic instead of before it."""
    BLOCK_N: gl.constexpr = w_smem.shape[0]
    SUB: gl.constexpr = w_smem.shape[1]
    WARPS: gl.constexpr = gl.num_warps()  # a ping-pong consumer's 4, the split kernel's epilogue's 8 or 16
    epi: gl.constexpr = _epilogue_layout(SUB, WARPS)
    g = g * grad_scale
    mbarrier.wait(epi_ready, phase)
    w = w_smem.load(epi).to(gl.float32)
    zeros = gl.zeros_like(w)
    s0 = _slot(s0_smem, zeros, HAS_S0, epi)
    s1 = _slot(s1_smem, zeros, HAS_S1, epi)
    s2 = _slot(s2_smem, zeros, HAS_S2, epi)
    if not ONE_BARRIER:
        _release_slots(epi_free, grad_free, RELEASE_GRAD)
    w, s0, s1, s2 = RULE(w, g, s0, s1, s2, h0, h1, h2, h3, h4, h5, h6, h7, VARIANT)
    r0 = zeros.to(gl.uint32, bitcast=True)  # placeholders: nearest rounding and fp32 stores draw nothing
    r1 = r0
    r2 = r0
    r3 = r0
    if STOCHASTIC and (W_BF16 or S_BF16):
        r0, r1, r2, r3 = _words(seed, off_n + row0, off_k + col0, global_k, BLOCK_N, SUB, ALIGNED, WARPS)
    # The portable verdict, slots the rule lacks included (it returns them as given).
    w_new = _to_storage(w, r0, W_BF16, STOCHASTIC)
    s0_new = _to_storage(s0, r1, S_BF16, STOCHASTIC)
    s1_new = _to_storage(s1, r2, S_BF16, STOCHASTIC)
    s2_new = _to_storage(s2, r3, S_BF16, STOCHASTIC)
    finite = (is_finite(g) & _storable(w, w_new, r0, False, W_BF16, STOCHASTIC)
              & _storable(s0, s0_new, r1, False, S_BF16, STOCHASTIC) & _storable(s1, s1_new, r2, False, S_BF16, STOCHASTIC)
              & _storable(s2, s2_new, r3, False, S_BF16, STOCHASTIC))
    rows = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, epi))
    cols = off_k + gl.arange(0, SUB, layout=gl.SliceLayout(0, epi))
    inside = (rows < N)[:, None] & (cols < K)[None, :]
    row_bad = gl.sum(gl.where(inside & ~finite, 1, 0), axis=1)
    if ONE_BARRIER:
        counts_smem.store(row_bad)
        _release_slots(epi_free, grad_free, RELEASE_GRAD)  # also: every warp's row counts are in shared memory
        num_bad = gl.sum(counts_smem.load(_counts_layout(BLOCK_N, WARPS)), axis=0)
    else:
        num_bad = gl.sum(row_bad, axis=0)
    idx = rows[:, None] * K + cols[None, :]
    keep = inside & ((idx * 0 + ((num_bad == 0) & inputs_ok).to(gl.int32)) != 0)
    gl.store(w_ptr + idx, w_new, mask=keep)
    if HAS_S0:
        gl.store(s0_ptr + idx, s0_new, mask=keep)
    if HAS_S1:
        gl.store(s1_ptr + idx, s1_new, mask=keep)
    if HAS_S2:
        gl.store(s2_ptr + idx, s2_new, mask=keep)
    gl.atomic_add(status_ptr + _BAD_TILES, 1, mask=(num_bad > 0) & inputs_ok)
    gl.store(flag_ptr + flag, num_bad)


# The fp32 gradient tile waiting in shared memory for the epilogue: four-word units
# swizzled by row, so that the wgmma layout's stores of column pairs and the epilogue's
# loads of four columns both spread over the banks.
_GRADIENT_LAYOUT = gl.constexpr(gl.SwizzledSharedLayout(4, 1, 8, order=[1, 0]))


@gluon.jit
def _ring(dy_desc, x_desc, NUM_STAGES: gl.constexpr):
    """The token loop's ring: ``NUM_STAGES`` dy and x blocks, and their barriers (filled:
    ``ready``; read: ``free``)."""
    dy_bufs = gl.allocate_shared_memory(dy_desc.dtype, [NUM_STAGES] + dy_desc.block_type.shape, dy_desc.layout)
    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [NUM_STAGES] + x_desc.block_type.shape, x_desc.layout)
    ready = _barriers(NUM_STAGES)
    free = _barriers(NUM_STAGES)
    return dy_bufs, x_bufs, ready, free


@gluon.jit
def _staging_slots(w_desc, s0_desc, s1_desc, s2_desc, HAS_S0: gl.constexpr, HAS_S1: gl.constexpr,
                   HAS_S2: gl.constexpr, SLOTS: gl.constexpr):
    """``SLOTS`` staging slots of a part's weight and state, and their barriers
    (filled: ``epi_ready``; read: ``epi_free``)."""
    w_smem = gl.allocate_shared_memory(w_desc.dtype, [SLOTS] + w_desc.block_type.shape, w_desc.layout)
    s0_smem = _staging_buffer(s0_desc, w_smem, HAS_S0, SLOTS)
    s1_smem = _staging_buffer(s1_desc, w_smem, HAS_S1, SLOTS)
    s2_smem = _staging_buffer(s2_desc, w_smem, HAS_S2, SLOTS)
    epi_ready = _barriers(SLOTS)
    epi_free = _barriers(SLOTS)
    return w_smem, s0_smem, s1_smem, s2_smem, epi_ready, epi_free


@gluon.jit
def _staging_buffer(desc, weight_smem, HAS: gl.constexpr, SLOTS: gl.constexpr):
    """A slot's staging buffers, or the weight's (never touched) for a slot the rule lacks."""
    if HAS:
        buffer = gl.allocate_shared_memory(desc.dtype, [SLOTS] + desc.block_type.shape, desc.layout)
    else:
        buffer = weight_smem
    return buffer


@gluon.jit
def _barriers(count: gl.constexpr):
    """``count`` mbarriers, each completing a phase at one arrival (plus any expected bytes)."""
    bars = gl.allocate_shared_memory(gl.int64, [count, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(count):
        mbarrier.init(bars.index(i), count=1)
    return bars
