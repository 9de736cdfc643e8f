"""The fused update on Hopper (sm_90): the portable kernel's function, bit for bit, as a
persistent, warp-specialized Gluon kernel (``TileConfig(kernel="hopper")``).

The portable kernel (``fused_weight_update``) runs each tile's token loop and then its
epilogue in the same warps, so the tensor cores idle during the epilogue and HBM during
the loop, and its weight and state loads wait in registers. Here one program per
multiprocessor holds two consumer warpgroups that take alternate tiles (ping-pong: while
one runs its epilogue, the other runs its token loop on wgmma), each fed by its own TMA
warp, which copies the consumer's next dy and x blocks into a ring and the next tile's
weight and state into shared memory while the consumer still works on the previous one.
The epilogue then reads its operands from shared memory and writes the results with
plain stores. With ``epilogue_split`` > 1 the accumulator waits in shared memory and the
epilogue runs on one column part of the tile at a time (the portable kernel's split: the
same bits, the same flags), each part's weight and state staged in one of two slots.

Same function, same bits: the token loop is the same wgmma instructions over the same
``block_t``-token blocks in the same order as the portable kernel's ``tl.dot`` (bf16
operands, fp32 accumulator); the epilogue calls the same rule, rounding and verdict code
(``RULE``, ``_to_storage``, ``is_finite``) with the same Philox words (``_words`` is the
portable ``paired_words``). Measured on an H200, fused == portable for every rule, regime
and shape in ``tests/test_hopper_update.py``. Written against triton 3.6's Gluon (the GPU
runs so far), it also compiles with 3.9's, which renamed two of the operations it uses
(``tests/test_sass_count.py`` builds it for sm_90 offline in CI); this module is imported
only when a hopper config is launched on a GPU.
"""

import functools

import torch
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.errors import OutOfResources

from .finite_check import BAD_TILES, is_finite
from .fused_weight_update import _device_scalars, _to_storage

_BAD_TILES = gl.constexpr(BAD_TILES)
# Names that Gluon changed between triton 3.6 and 3.9 (the same operations): the barrier
# over one partition's warps, and the TMA copy of a global tile into shared memory.
_partition_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier
_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
# Registers per thread asked for the second consumer warpgroup (the first takes what is
# left, the TMA warps 24 each). ptxas still allocates the kernel within 168 (65,536 over
# three warpgroups): 64x32 tiles compile without spills, 64x64 fp32 AdamW spills 16 words.
CONSUMER_REGISTERS = gl.constexpr(232)


@gluon.constexpr_function
def _epilogue_layout(block_k, num_warps=4):
    """Row-major, four consecutive columns per thread (a consumer is one warpgroup)."""
    across = min(16, block_k // 4)
    return gl.BlockedLayout([1, 4], [32 // across, across], [num_warps, 1], [1, 0])


@gluon.constexpr_function
def _pair_layout(block_k, num_warps=4):
    """``_epilogue_layout`` over column pairs: a pair joined with itself is ``_epilogue_layout``."""
    across = min(16, block_k // 4)
    return gl.BlockedLayout([1, 2], [32 // across, across], [num_warps, 1], [1, 0])


@gluon.jit
def _words(seed, row0, col0, global_k, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, ALIGNED: gl.constexpr,
           NUM_WARPS: gl.constexpr = 4):
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
    """A slot's tile in fp32, or zeros for a slot the rule lacks (as the portable kernel)."""
    value = zeros
    if HAS:
        value = smem.load(layout).to(gl.float32)
    return value


@gluon.jit
def _stage_parts(w_desc, s0_desc, s1_desc, s2_desc, w_smem, s0_smem, s1_smem, s2_smem, epi_ready, epi_free,
                 off_n, off_k, visit, FIRST: gl.constexpr, LAST: gl.constexpr,
                 HAS_S0: gl.constexpr, HAS_S1: gl.constexpr, HAS_S2: gl.constexpr, SPLIT: gl.constexpr):
    """Copy column parts FIRST..LAST-1 of the tile's weight and state into their staging
    slots (part j in slot j % slots), each once the consumer has read the slot's last part."""
    SUB: gl.constexpr = w_desc.block_type.shape[1]
    SLOTS: gl.constexpr = w_smem.shape[0]
    EPI_BYTES: gl.constexpr = (w_desc.block_type.nbytes + HAS_S0 * s0_desc.block_type.nbytes
                               + HAS_S1 * s1_desc.block_type.nbytes + HAS_S2 * s2_desc.block_type.nbytes)
    for j in gl.static_range(FIRST, LAST):
        slot = j % SLOTS
        uses = visit * (SPLIT // SLOTS) + j // SLOTS  # earlier fills of this slot
        # A fresh barrier counts as released once: waiting on the other parity passes.
        mbarrier.wait(epi_free.index(slot), (uses & 1) ^ 1)
        mbarrier.expect(epi_ready.index(slot), EPI_BYTES)
        _tma_load(w_desc, [off_n, off_k + j * SUB], epi_ready.index(slot), w_smem.index(slot))
        if HAS_S0:
            _tma_load(s0_desc, [off_n, off_k + j * SUB], epi_ready.index(slot), s0_smem.index(slot))
        if HAS_S1:
            _tma_load(s1_desc, [off_n, off_k + j * SUB], epi_ready.index(slot), s1_smem.index(slot))
        if HAS_S2:
            _tma_load(s2_desc, [off_n, off_k + j * SUB], epi_ready.index(slot), s2_smem.index(slot))


@gluon.jit
def _loader(dy_desc, x_desc, w_desc, s0_desc, s1_desc, s2_desc, dy_bufs, x_bufs, ready, free,
            w_smem, s0_smem, s1_smem, s2_smem, epi_ready, epi_free, T, N, K,
            HAS_S0: gl.constexpr, HAS_S1: gl.constexpr, HAS_S2: gl.constexpr, C: gl.constexpr):
    """Consumer C's TMA warp: for each of its tiles, the dy and x blocks into its ring and
    the weight and state, part by part, into its staging slots, in the order measured
    faster on an H200 (``results/tuning/h200-hopper-split-ab.log``). A tile of one part
    copies its part first (its slot is free early in the previous tile's epilogue), then
    the ring: copying the ring's first blocks before the part was 8-11 % slower. A tile
    of several parts copies the ring's first blocks first (their stages are free once the
    previous token loop is done), then the parts whose slots the previous epilogue frees,
    the rest of the ring, and the parts that wait for this tile's own epilogue: copying
    the first part first was 2-4 % slower."""
    BLOCK_T: gl.constexpr = dy_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = dy_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    SPLIT: gl.constexpr = BLOCK_K // w_desc.block_type.shape[1]
    SLOTS: gl.constexpr = w_smem.shape[0]
    STAGES: gl.constexpr = dy_bufs.shape[0]
    BLOCK_BYTES: gl.constexpr = dy_desc.block_type.nbytes + x_desc.block_type.nbytes
    tiles_k = gl.cdiv(K, BLOCK_K)
    num_tiles = gl.cdiv(N, BLOCK_N) * tiles_k
    num_t = gl.cdiv(T, BLOCK_T)
    # Ring blocks copied before the tile's first parts: none for a tile of one part.
    early = gl.minimum(num_t, STAGES) if SPLIT > 1 else 0
    programs = gl.num_programs(0)
    counter = 0
    visit = 0
    for tile in range(gl.program_id(0) + C * programs, num_tiles, 2 * programs):
        off_n = (tile // tiles_k) * BLOCK_N
        off_k = (tile % tiles_k) * BLOCK_K
        if early == 0:
            _stage_parts(w_desc, s0_desc, s1_desc, s2_desc, w_smem, s0_smem, s1_smem, s2_smem, epi_ready, epi_free,
                         off_n, off_k, visit, 0, SLOTS, HAS_S0, HAS_S1, HAS_S2, SPLIT)
        for i in range(num_t):
            stage = counter % STAGES
            mbarrier.wait(free.index(stage), ((counter // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(stage), BLOCK_BYTES)
            _tma_load(dy_desc, [i * BLOCK_T, off_n], ready.index(stage), dy_bufs.index(stage))
            _tma_load(x_desc, [i * BLOCK_T, off_k], ready.index(stage), x_bufs.index(stage))
            counter += 1
            if i + 1 == early:
                _stage_parts(w_desc, s0_desc, s1_desc, s2_desc, w_smem, s0_smem, s1_smem, s2_smem, epi_ready,
                             epi_free, off_n, off_k, visit, 0, SLOTS, HAS_S0, HAS_S1, HAS_S2, SPLIT)
        _stage_parts(w_desc, s0_desc, s1_desc, s2_desc, w_smem, s0_smem, s1_smem, s2_smem, epi_ready, epi_free,
                     off_n, off_k, visit, SLOTS, SPLIT, HAS_S0, HAS_S1, HAS_S2, SPLIT)
        visit += 1


@gluon.jit
def _epilogue_part(g, w_ptr, s0_ptr, s1_ptr, s2_ptr, flag_ptr, status_ptr, w_smem, s0_smem, s1_smem, s2_smem,
                   epi_ready, epi_free, phase, inputs_ok, flag, off_n, off_k, N, K, row0, col0, global_k, grad_scale,
                   h0, h1, h2, h3, h4, h5, h6, h7, seed,
                   RULE: gl.constexpr, VARIANT: gl.constexpr, HAS_S0: gl.constexpr, HAS_S1: gl.constexpr,
                   HAS_S2: gl.constexpr, W_BF16: gl.constexpr, S_BF16: gl.constexpr, STOCHASTIC: gl.constexpr,
                   ALIGNED: gl.constexpr):
    """The portable epilogue's arithmetic on one column part (BLOCK_N x SUB) of a tile, its
    gradient ``g`` in the epilogue layout, its weight and state in one staging slot: the
    portable kernel's ``_rule_epilogue`` on its ``epilogue_split`` slice ``flag``."""
    BLOCK_N: gl.constexpr = w_smem.shape[0]
    SUB: gl.constexpr = w_smem.shape[1]
    epi: gl.constexpr = _epilogue_layout(SUB)
    g = g * grad_scale
    mbarrier.wait(epi_ready, phase)
    w = w_smem.load(epi).to(gl.float32)
    zeros = gl.zeros_like(w)
    s0 = _slot(s0_smem, zeros, HAS_S0, epi)
    s1 = _slot(s1_smem, zeros, HAS_S1, epi)
    s2 = _slot(s2_smem, zeros, HAS_S2, epi)
    _partition_barrier()  # every warp of the group has read the slot (and g) before it is reused
    mbarrier.arrive(epi_free)
    w, s0, s1, s2 = RULE(w, g, s0, s1, s2, h0, h1, h2, h3, h4, h5, h6, h7, VARIANT)
    r0 = zeros.to(gl.uint32, bitcast=True)  # placeholders: nearest rounding and fp32 stores draw nothing
    r1 = r0
    r2 = r0
    r3 = r0
    if STOCHASTIC and (W_BF16 or S_BF16):
        r0, r1, r2, r3 = _words(seed, off_n + row0, off_k + col0, global_k, BLOCK_N, SUB, ALIGNED)
    # The portable verdict, slots the rule lacks included (it returns them as given).
    w = _to_storage(w, r0, W_BF16, STOCHASTIC)
    s0 = _to_storage(s0, r1, S_BF16, STOCHASTIC)
    s1 = _to_storage(s1, r2, S_BF16, STOCHASTIC)
    s2 = _to_storage(s2, r3, S_BF16, STOCHASTIC)
    finite = (is_finite(g) & is_finite(w.to(gl.float32)) & is_finite(s0.to(gl.float32))
              & is_finite(s1.to(gl.float32)) & is_finite(s2.to(gl.float32)))
    rows = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, epi))
    cols = off_k + gl.arange(0, SUB, layout=gl.SliceLayout(0, epi))
    inside = (rows < N)[:, None] & (cols < K)[None, :]
    num_bad = gl.sum(gl.sum(gl.where(inside & ~finite, 1, 0), axis=1), axis=0)
    idx = rows[:, None] * K + cols[None, :]
    keep = inside & ((idx * 0 + ((num_bad == 0) & inputs_ok).to(gl.int32)) != 0)
    gl.store(w_ptr + idx, w, mask=keep)
    if HAS_S0:
        gl.store(s0_ptr + idx, s0, mask=keep)
    if HAS_S1:
        gl.store(s1_ptr + idx, s1, mask=keep)
    if HAS_S2:
        gl.store(s2_ptr + idx, s2, mask=keep)
    gl.atomic_add(status_ptr + _BAD_TILES, 1, mask=(num_bad > 0) & inputs_ok)
    gl.store(flag_ptr + flag, num_bad)


@gluon.jit
def _consumer(w_ptr, s0_ptr, s1_ptr, s2_ptr, flag_ptr, status_ptr, dy_bufs, x_bufs, ready, free,
              w_smem, s0_smem, s1_smem, s2_smem, epi_ready, epi_free, acc_smem, T, N, K, row0, col0, global_k,
              grad_scale, h0, h1, h2, h3, h4, h5, h6, h7, seed, scalars_ptr, seed_ptr,
              RULE: gl.constexpr, VARIANT: gl.constexpr, HAS_S0: gl.constexpr, HAS_S1: gl.constexpr,
              HAS_S2: gl.constexpr, W_BF16: gl.constexpr, S_BF16: gl.constexpr, STOCHASTIC: gl.constexpr,
              ALIGNED: gl.constexpr, DEVICE_SCALARS: gl.constexpr, C: gl.constexpr):
    """One warpgroup: every other tile of this program, its token loop on wgmma, then the
    portable epilogue's arithmetic on it, part by part, while the other warpgroup runs its
    own tile. A tile of one part converts its accumulator to the epilogue layout in
    registers; a wider tile leaves it in shared memory (``acc_smem``) and reads one part
    at a time, so that only a part's weight and state are live at once."""
    BLOCK_T: gl.constexpr = x_bufs.shape[1]
    BLOCK_N: gl.constexpr = dy_bufs.shape[2]
    BLOCK_K: gl.constexpr = x_bufs.shape[2]
    SUB: gl.constexpr = w_smem.shape[2]
    SPLIT: gl.constexpr = BLOCK_K // SUB
    SLOTS: gl.constexpr = w_smem.shape[0]
    STAGES: gl.constexpr = dy_bufs.shape[0]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_K, 16])
    epi: gl.constexpr = _epilogue_layout(SUB)
    tiles_k = gl.cdiv(K, BLOCK_K)
    num_tiles = gl.cdiv(N, BLOCK_N) * tiles_k
    num_t = gl.cdiv(T, BLOCK_T)
    programs = gl.num_programs(0)
    if DEVICE_SCALARS:
        h0, h1, h2, h3, h4, h5, h6, h7, seed = _device_scalars(scalars_ptr, seed_ptr)
    # The input check's verdict (launched before, on the same stream): no tile stores when it counted anything.
    inputs_ok = (gl.load(status_ptr) == 0) & (gl.load(status_ptr + 1) == 0)
    counter = 0
    visit = 0
    for tile in range(gl.program_id(0) + C * programs, num_tiles, 2 * programs):
        off_n = (tile // tiles_k) * BLOCK_N
        off_k = (tile % tiles_k) * BLOCK_K
        acc = gl.zeros((BLOCK_N, BLOCK_K), dtype=gl.float32, layout=mma)
        for i in range(num_t):
            stage = counter % STAGES
            mbarrier.wait(ready.index(stage), (counter // STAGES) & 1)
            dy_t = dy_bufs.index(stage).permute((1, 0))
            acc = warpgroup_mma(dy_t, x_bufs.index(stage), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(free.index(stage))
            counter += 1
        if SPLIT == 1:
            _epilogue_part(gl.convert_layout(acc, epi), w_ptr, s0_ptr, s1_ptr, s2_ptr, flag_ptr, status_ptr,
                           w_smem.index(0), s0_smem.index(0), s1_smem.index(0), s2_smem.index(0),
                           epi_ready.index(0), epi_free.index(0), visit & 1, inputs_ok, tile, off_n, off_k, N, K,
                           row0, col0, global_k, grad_scale, h0, h1, h2, h3, h4, h5, h6, h7, seed, RULE, VARIANT,
                           HAS_S0, HAS_S1, HAS_S2, W_BF16, S_BF16, STOCHASTIC, ALIGNED)
        else:
            acc_smem.store(acc)
            _partition_barrier()  # the whole accumulator is in shared memory before any part is read
            for j in gl.static_range(SPLIT):
                slot = j % SLOTS
                uses = visit * (SPLIT // SLOTS) + j // SLOTS
                _epilogue_part(acc_smem.slice(j * SUB, SUB, dim=1).load(epi), w_ptr, s0_ptr, s1_ptr, s2_ptr,
                               flag_ptr, status_ptr, w_smem.index(slot), s0_smem.index(slot), s1_smem.index(slot),
                               s2_smem.index(slot), epi_ready.index(slot), epi_free.index(slot), uses & 1, inputs_ok,
                               tile * SPLIT + j, off_n, off_k + j * SUB, N, K, row0, col0, global_k, grad_scale,
                               h0, h1, h2, h3, h4, h5, h6, h7, seed, RULE, VARIANT, HAS_S0, HAS_S1, HAS_S2, W_BF16,
                               S_BF16, STOCHASTIC, ALIGNED)
        visit += 1


@gluon.jit
def _epilogue_buffer(desc, weight_smem, HAS: gl.constexpr, SLOTS: gl.constexpr):
    """A slot's staging buffers, or the weight's (never touched) for a slot the rule lacks."""
    if HAS:
        buffer = gl.allocate_shared_memory(desc.dtype, [SLOTS] + desc.block_type.shape, desc.layout)
    else:
        buffer = weight_smem
    return buffer


@gluon.jit
def _consumer_buffers(dy_desc, x_desc, w_desc, s0_desc, s1_desc, s2_desc, HAS_S0: gl.constexpr,
                      HAS_S1: gl.constexpr, HAS_S2: gl.constexpr, NUM_STAGES: gl.constexpr):
    """One consumer's shared memory: its ring of dy and x blocks with their barriers; the
    staging slots of its weight and state parts with theirs (filled: ``epi_ready``; read:
    ``epi_free``): one part's slot for a tile of one part, two (one filling while the
    other is read) for a wider tile, which also keeps its accumulator here."""
    BLOCK_N: gl.constexpr = dy_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    SPLIT: gl.constexpr = BLOCK_K // w_desc.block_type.shape[1]
    SLOTS: gl.constexpr = 1 if SPLIT == 1 else 2
    dy_bufs = gl.allocate_shared_memory(dy_desc.dtype, [NUM_STAGES] + dy_desc.block_type.shape, dy_desc.layout)
    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [NUM_STAGES] + x_desc.block_type.shape, x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(free.index(i), count=1)
    w_smem = gl.allocate_shared_memory(w_desc.dtype, [SLOTS] + w_desc.block_type.shape, w_desc.layout)
    s0_smem = _epilogue_buffer(s0_desc, w_smem, HAS_S0, SLOTS)
    s1_smem = _epilogue_buffer(s1_desc, w_smem, HAS_S1, SLOTS)
    s2_smem = _epilogue_buffer(s2_desc, w_smem, HAS_S2, SLOTS)
    epi_ready = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    epi_free = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(SLOTS):
        mbarrier.init(epi_ready.index(i), count=1)
        mbarrier.init(epi_free.index(i), count=1)
    if SPLIT == 1:
        acc_smem = w_smem  # unused: the accumulator is converted in registers
    else:
        # Four-word units swizzled by row: the wgmma layout's stores of column pairs and the
        # epilogue's loads of four columns both spread over the banks.
        acc_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_N, BLOCK_K],
                                             gl.SwizzledSharedLayout(4, 1, 8, order=[1, 0]))
    return dy_bufs, x_bufs, ready, free, w_smem, s0_smem, s1_smem, s2_smem, epi_ready, epi_free, acc_smem


@gluon.jit(do_not_specialize=["row0", "col0", "global_k", "seed"])
def _hopper_update_kernel(dy_desc, x_desc, w_desc, s0_desc, s1_desc, s2_desc, w_ptr, s0_ptr, s1_ptr, s2_ptr,
                          flag_ptr, status_ptr, T, N, K, row0, col0, global_k, grad_scale,
                          h0, h1, h2, h3, h4, h5, h6, h7, seed, scalars_ptr, seed_ptr,
                          RULE: gl.constexpr, VARIANT: gl.constexpr, HAS_S0: gl.constexpr, HAS_S1: gl.constexpr,
                          HAS_S2: gl.constexpr, W_BF16: gl.constexpr, S_BF16: gl.constexpr,
                          STOCHASTIC: gl.constexpr, ALIGNED: gl.constexpr, DEVICE_SCALARS: gl.constexpr,
                          NUM_STAGES: gl.constexpr):
    """Persistent: two consumer warpgroups (the default partition is consumer 0) take
    alternate tiles of this program's share, each fed by its own TMA warp. The weight and
    state descriptors' blocks are one column part of a tile (``epilogue_split``)."""
    ring0 = _consumer_buffers(dy_desc, x_desc, w_desc, s0_desc, s1_desc, s2_desc, HAS_S0, HAS_S1, HAS_S2, NUM_STAGES)
    ring1 = _consumer_buffers(dy_desc, x_desc, w_desc, s0_desc, s1_desc, s2_desc, HAS_S0, HAS_S1, HAS_S2, NUM_STAGES)
    dy_bufs0, x_bufs0, ready0, free0, w_smem0, s0_smem0, s1_smem0, s2_smem0, epi_ready0, epi_free0, acc_smem0 = ring0
    dy_bufs1, x_bufs1, ready1, free1, w_smem1, s0_smem1, s1_smem1, s2_smem1, epi_ready1, epi_free1, acc_smem1 = ring1
    gl.warp_specialize([
        (_consumer, (w_ptr, s0_ptr, s1_ptr, s2_ptr, flag_ptr, status_ptr, dy_bufs0, x_bufs0, ready0, free0,
                     w_smem0, s0_smem0, s1_smem0, s2_smem0, epi_ready0, epi_free0, acc_smem0, T, N, K, row0, col0,
                     global_k, grad_scale, h0, h1, h2, h3, h4, h5, h6, h7, seed, scalars_ptr, seed_ptr, RULE,
                     VARIANT, HAS_S0, HAS_S1, HAS_S2, W_BF16, S_BF16, STOCHASTIC, ALIGNED, DEVICE_SCALARS, 0)),
        (_consumer, (w_ptr, s0_ptr, s1_ptr, s2_ptr, flag_ptr, status_ptr, dy_bufs1, x_bufs1, ready1, free1,
                     w_smem1, s0_smem1, s1_smem1, s2_smem1, epi_ready1, epi_free1, acc_smem1, T, N, K, row0, col0,
                     global_k, grad_scale, h0, h1, h2, h3, h4, h5, h6, h7, seed, scalars_ptr, seed_ptr, RULE,
                     VARIANT, HAS_S0, HAS_S1, HAS_S2, W_BF16, S_BF16, STOCHASTIC, ALIGNED, DEVICE_SCALARS, 1)),
        (_loader, (dy_desc, x_desc, w_desc, s0_desc, s1_desc, s2_desc, dy_bufs0, x_bufs0, ready0, free0,
                   w_smem0, s0_smem0, s1_smem0, s2_smem0, epi_ready0, epi_free0, T, N, K, HAS_S0, HAS_S1, HAS_S2, 0)),
        (_loader, (dy_desc, x_desc, w_desc, s0_desc, s1_desc, s2_desc, dy_bufs1, x_bufs1, ready1, free1,
                   w_smem1, s0_smem1, s1_smem1, s2_smem1, epi_ready1, epi_free1, T, N, K, HAS_S0, HAS_S1, HAS_S2, 1)),
    ], [4, 1, 1], [CONSUMER_REGISTERS, 24, 24])


@functools.lru_cache(maxsize=None)
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# The shared-memory layouts are immutable and depend on the block and element type only:
# made once, not on every launch (their construction took about a sixth of the launch's
# host time under cProfile: results/tuning/h200-hopper-host-profile.log).
@functools.lru_cache(maxsize=None)
def _operand_layout(block: tuple, bf16: bool):
    return gl.NVMMASharedLayout.get_default_for(list(block), gl.bfloat16 if bf16 else gl.float32)


@functools.lru_cache(maxsize=None)
def _tile_layout(element_bits: int):
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=element_bits, rank=2)


def _operand_descriptor(t, block):
    """dy and x blocks: the swizzled layout wgmma reads."""
    return TensorDescriptor.from_tensor(t, block, _operand_layout(tuple(block), t.dtype == torch.bfloat16))


def _tile_descriptor(t, block):
    """Weight and state tiles: unswizzled, read row by row by the epilogue."""
    return TensorDescriptor.from_tensor(t, block, _tile_layout(t.element_size() * 8))


def descriptors(config, x, dy, weight, slot_tensors):
    """The kernel's six TMA descriptors for ``config``: dy and x blocks of ``block_t``
    tokens, and one column part (``block_k / epilogue_split`` wide) of the weight's and each
    slot's tile."""
    part = [config.block_n, config.block_k // config.epilogue_split]
    return ([_operand_descriptor(dy, [config.block_t, config.block_n]),
             _operand_descriptor(x, [config.block_t, config.block_k])]
            + [_tile_descriptor(t, part) for t in [weight] + slot_tensors])


def launch(epilogue, x, dy, weight):
    """Launch the Hopper kernel for an ``_Epilogue`` (arguments checked by
    ``hopper_support.check_hopper_launch``); returns the compiled kernel's handle."""
    config = epilogue.config
    T, K = x.shape
    N = weight.shape[0]
    if T == 0:  # a TMA descriptor needs a nonempty tensor; the token loop reads none of it
        x = x.new_zeros((1, K))
        dy = dy.new_zeros((1, N))
    tiles = epilogue.grid[0] * epilogue.grid[1]
    grid = (min(tiles, _multiprocessors(weight.device.index if weight.device.index is not None
                                        else torch.cuda.current_device())),)
    args = epilogue.rule_args
    try:
        return _hopper_update_kernel[grid](
            *descriptors(config, x, dy, weight, epilogue.slot_tensors), weight, *epilogue.slot_tensors,
            epilogue.flags, epilogue.status, T, N, K, *epilogue.place,
            epilogue.grad_scale, *epilogue.scalars, epilogue.seed, *epilogue.device_scalars,
            RULE=args["RULE"], VARIANT=args["VARIANT"], HAS_S0=args["HAS_S0"], HAS_S1=args["HAS_S1"],
            HAS_S2=args["HAS_S2"], W_BF16=args["W_BF16"], S_BF16=args["S_BF16"], STOCHASTIC=args["STOCHASTIC"],
            ALIGNED=args["ALIGNED_PAIRS"], DEVICE_SCALARS=args["DEVICE_SCALARS"], NUM_STAGES=config.num_stages,
            num_warps=4, enable_fp_fusion=False)
    except OutOfResources as error:  # raised when compiling, before the kernel runs: nothing was written
        raise ValueError(f"{config} stages each consumer's token blocks, weight and state parts (and, for a tile "
                         f"of several parts, its accumulator) in shared memory, and with "
                         f"{len([t for t in epilogue.slot_tensors if t is not weight])} state slots of "
                         f"{epilogue.state_format} beside a {weight.dtype} weight they do not fit ({error}); use "
                         "a narrower tile or part, shorter token blocks or fewer stages") from error
