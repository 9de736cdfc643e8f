"""The ping-pong Hopper kernel (``TileConfig(kernel="hopper", num_warps=4)``): one program
per multiprocessor holds two consumer warpgroups that take alternate tiles, so that while
one runs its epilogue the other runs its token loop on wgmma, each fed by its own TMA warp,
which copies the consumer's next dy and x blocks into a ring and the next tile's weight
and state into staging slots while the consumer still works on the previous one. With
``epilogue_split`` > 1 the accumulator waits in shared memory and the epilogue runs on one
column part of the tile at a time, each part's weight and state in one of two slots."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .fused_weight_update import _device_grad_scale, _device_scalars
from .hopper_common import (_GRADIENT_LAYOUT, _epilogue_layout, _epilogue_part, _fill_slot, _fill_stage,
                            _partition_barrier, _ring, _square_sum, _staging_slots, _token_loop)

# Registers per thread asked for the second consumer warpgroup (the first takes what is
# left, the TMA warps 24 each). ptxas still allocates the kernel within 168 (65,536 over
# three warpgroups): 64x32 tiles compile without spills, 64x64 fp32 AdamW spills 16 words.
CONSUMER_REGISTERS = gl.constexpr(232)


@gluon.jit
def _stage_parts(w_desc, s0_desc, s1_desc, s2_desc, w_smem, s0_smem, s1_smem, s2_smem, epi_ready, epi_free,
                 off_n, off_k, visit, FIRST: gl.constexpr, LAST: gl.constexpr,
                 HAS_S0: gl.constexpr, HAS_S1: gl.constexpr, HAS_S2: gl.constexpr, SPLIT: gl.constexpr):
    """Copy column parts FIRST..LAST-1 of the tile's weight and state into their staging
    slots (part j in slot j % slots), each once the consumer has read the slot's last part."""
    SUB: gl.constexpr = w_desc.block_type.shape[1]
    SLOTS: gl.constexpr = w_smem.shape[0]
    for j in gl.static_range(FIRST, LAST):
        uses = visit * (SPLIT // SLOTS) + j // SLOTS  # earlier fills of this slot
        _fill_slot(w_desc, s0_desc, s1_desc, s2_desc, w_smem, s0_smem, s1_smem, s2_smem, epi_ready, epi_free,
                   j % SLOTS, uses, off_n, off_k + j * SUB, HAS_S0, HAS_S1, HAS_S2)


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
            _fill_stage(dy_desc, x_desc, dy_bufs, x_bufs, ready, free, counter, i, off_n, off_k)
            counter += 1
            if i + 1 == early:
                _stage_parts(w_desc, s0_desc, s1_desc, s2_desc, w_smem, s0_smem, s1_smem, s2_smem, epi_ready,
                             epi_free, off_n, off_k, visit, 0, SLOTS, HAS_S0, HAS_S1, HAS_S2, SPLIT)
        _stage_parts(w_desc, s0_desc, s1_desc, s2_desc, w_smem, s0_smem, s1_smem, s2_smem, epi_ready, epi_free,
                     off_n, off_k, visit, SLOTS, SPLIT, HAS_S0, HAS_S1, HAS_S2, SPLIT)
        visit += 1


@gluon.jit
def _consumer(w_ptr, s0_ptr, s1_ptr, s2_ptr, flag_ptr, status_ptr, dy_bufs, x_bufs, ready, free,
              w_smem, s0_smem, s1_smem, s2_smem, epi_ready, epi_free, acc_smem, T, N, K, row0, col0, global_k,
              grad_scale, h0, h1, h2, h3, h4, h5, h6, h7, seed, scalars_ptr, seed_ptr, grad_scale_ptr, sums_ptr,
              RULE: gl.constexpr, VARIANT: gl.constexpr, HAS_S0: gl.constexpr, HAS_S1: gl.constexpr,
              HAS_S2: gl.constexpr, W_BF16: gl.constexpr, S_BF16: gl.constexpr, STOCHASTIC: gl.constexpr,
              ALIGNED: gl.constexpr, DEVICE_SCALARS: gl.constexpr, DEVICE_GRAD_SCALE: gl.constexpr,
              SQUARE_SUMS: gl.constexpr, C: gl.constexpr):
    """One warpgroup: every other tile of this program, its token loop on wgmma, then the
    portable epilogue's arithmetic on it, part by part, while the other warpgroup runs its
    own tile. A tile of one part converts its accumulator to the epilogue layout in
    registers; a wider tile leaves it in shared memory (``acc_smem``) and reads one part
    at a time, so that only a part's weight and state are live at once. With
    ``SQUARE_SUMS`` each tile's Σ g² (its parts' sums added in part order) is stored at
    its row-major index."""
    BLOCK_T: gl.constexpr = x_bufs.shape[1]
    BLOCK_N: gl.constexpr = dy_bufs.shape[2]
    BLOCK_K: gl.constexpr = x_bufs.shape[2]
    SUB: gl.constexpr = w_smem.shape[2]
    SPLIT: gl.constexpr = BLOCK_K // SUB
    SLOTS: gl.constexpr = w_smem.shape[0]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_K, 16])
    epi: gl.constexpr = _epilogue_layout(SUB, gl.num_warps())
    tiles_k = gl.cdiv(K, BLOCK_K)
    num_tiles = gl.cdiv(N, BLOCK_N) * tiles_k
    num_t = gl.cdiv(T, BLOCK_T)
    programs = gl.num_programs(0)
    if DEVICE_SCALARS:
        h0, h1, h2, h3, h4, h5, h6, h7, seed = _device_scalars(scalars_ptr, seed_ptr)
    if DEVICE_GRAD_SCALE:
        grad_scale = _device_grad_scale(grad_scale_ptr)
    # The input check's verdict (launched before, on the same stream): no tile stores when it counted anything.
    inputs_ok = (gl.load(status_ptr) == 0) & (gl.load(status_ptr + 1) == 0)
    counter = 0
    visit = 0
    for tile in range(gl.program_id(0) + C * programs, num_tiles, 2 * programs):
        off_n = (tile // tiles_k) * BLOCK_N
        off_k = (tile % tiles_k) * BLOCK_K
        acc = gl.zeros((BLOCK_N, BLOCK_K), dtype=gl.float32, layout=mma)
        acc, counter = _token_loop(dy_bufs, x_bufs, ready, free, acc, counter, num_t)
        if SPLIT == 1:
            g = gl.convert_layout(acc, epi)
            if SQUARE_SUMS:
                gl.store(sums_ptr + tile, _square_sum(g))
            _epilogue_part(g, w_ptr, s0_ptr, s1_ptr, s2_ptr, flag_ptr, status_ptr,
                           w_smem.index(0), s0_smem.index(0), s1_smem.index(0), s2_smem.index(0),
                           epi_ready.index(0), epi_free.index(0), visit & 1, epi_free.index(0), False, inputs_ok,
                           tile, off_n, off_k, N, K, row0, col0, global_k, grad_scale, h0, h1, h2, h3, h4, h5, h6, h7,
                           seed, RULE, VARIANT, HAS_S0, HAS_S1, HAS_S2, W_BF16, S_BF16, STOCHASTIC, ALIGNED,
                           w_smem, False)  # no ONE_BARRIER here: its counts buffer (the slot) is never touched
        else:
            acc_smem.store(acc)
            _partition_barrier()  # the whole accumulator is in shared memory before any part is read
            squares = 0.0
            for j in gl.static_range(SPLIT):
                slot = j % SLOTS
                uses = visit * (SPLIT // SLOTS) + j // SLOTS
                g = acc_smem.slice(j * SUB, SUB, dim=1).load(epi)
                if SQUARE_SUMS:
                    squares += _square_sum(g)
                _epilogue_part(g, w_ptr, s0_ptr, s1_ptr, s2_ptr,
                               flag_ptr, status_ptr, w_smem.index(slot), s0_smem.index(slot), s1_smem.index(slot),
                               s2_smem.index(slot), epi_ready.index(slot), epi_free.index(slot), uses & 1,
                               epi_free.index(slot), False, inputs_ok, tile * SPLIT + j, off_n, off_k + j * SUB, N, K,
                               row0, col0, global_k, grad_scale, h0, h1, h2, h3, h4, h5, h6, h7, seed, RULE, VARIANT,
                               HAS_S0, HAS_S1, HAS_S2, W_BF16, S_BF16, STOCHASTIC, ALIGNED, w_smem, False)  # as above
            if SQUARE_SUMS:
                gl.store(sums_ptr + tile, squares)
        visit += 1


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
    dy_bufs, x_bufs, ready, free = _ring(dy_desc, x_desc, NUM_STAGES)
    w_smem, s0_smem, s1_smem, s2_smem, epi_ready, epi_free = _staging_slots(w_desc, s0_desc, s1_desc, s2_desc, HAS_S0,
                                                                           HAS_S1, HAS_S2, SLOTS)
    if SPLIT == 1:
        acc_smem = w_smem  # unused: the accumulator is converted in registers
    else:
        acc_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_N, BLOCK_K], _GRADIENT_LAYOUT)
    return dy_bufs, x_bufs, ready, free, w_smem, s0_smem, s1_smem, s2_smem, epi_ready, epi_free, acc_smem


@gluon.jit(do_not_specialize=["row0", "col0", "global_k", "seed"])
def pingpong_kernel(dy_desc, x_desc, w_desc, s0_desc, s1_desc, s2_desc, w_ptr, s0_ptr, s1_ptr, s2_ptr,
                    flag_ptr, status_ptr, T, N, K, row0, col0, global_k, grad_scale,
                    h0, h1, h2, h3, h4, h5, h6, h7, seed, scalars_ptr, seed_ptr, grad_scale_ptr, sums_ptr,
                    RULE: gl.constexpr, VARIANT: gl.constexpr, HAS_S0: gl.constexpr, HAS_S1: gl.constexpr,
                    HAS_S2: gl.constexpr, W_BF16: gl.constexpr, S_BF16: gl.constexpr,
                    STOCHASTIC: gl.constexpr, ALIGNED: gl.constexpr, DEVICE_SCALARS: gl.constexpr,
                    DEVICE_GRAD_SCALE: gl.constexpr, NUM_STAGES: gl.constexpr, SQUARE_SUMS: gl.constexpr):
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
                     global_k, grad_scale, h0, h1, h2, h3, h4, h5, h6, h7, seed, scalars_ptr, seed_ptr,
                     grad_scale_ptr, sums_ptr, RULE, VARIANT, HAS_S0, HAS_S1, HAS_S2, W_BF16, S_BF16, STOCHASTIC,
                     ALIGNED, DEVICE_SCALARS, DEVICE_GRAD_SCALE, SQUARE_SUMS, 0)),
        (_consumer, (w_ptr, s0_ptr, s1_ptr, s2_ptr, flag_ptr, status_ptr, dy_bufs1, x_bufs1, ready1, free1,
                     w_smem1, s0_smem1, s1_smem1, s2_smem1, epi_ready1, epi_free1, acc_smem1, T, N, K, row0, col0,
                     global_k, grad_scale, h0, h1, h2, h3, h4, h5, h6, h7, seed, scalars_ptr, seed_ptr,
                     grad_scale_ptr, sums_ptr, RULE, VARIANT, HAS_S0, HAS_S1, HAS_S2, W_BF16, S_BF16, STOCHASTIC,
                     ALIGNED, DEVICE_SCALARS, DEVICE_GRAD_SCALE, SQUARE_SUMS, 1)),
        (_loader, (dy_desc, x_desc, w_desc, s0_desc, s1_desc, s2_desc, dy_bufs0, x_bufs0, ready0, free0,
                   w_smem0, s0_smem0, s1_smem0, s2_smem0, epi_ready0, epi_free0, T, N, K, HAS_S0, HAS_S1, HAS_S2, 0)),
        (_loader, (dy_desc, x_desc, w_desc, s0_desc, s1_desc, s2_desc, dy_bufs1, x_bufs1, ready1, free1,
                   w_smem1, s0_smem1, s1_smem1, s2_smem1, epi_ready1, epi_free1, T, N, K, HAS_S0, HAS_S1, HAS_S2, 1)),
    ], [4, 1, 1], [CONSUMER_REGISTERS, 24, 24])
