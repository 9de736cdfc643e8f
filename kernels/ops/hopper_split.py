"""The split Hopper kernel (``TileConfig(kernel="hopper", num_warps=8)`` or 16): one program
per multiprocessor, in which a matrix warpgroup per 64 rows of the tile (one or two) runs
every tile's token loop on wgmma into fp32 gradient slots in shared memory (the gradient
still never reaches global memory), ``num_warps`` epilogue warps (the default partition)
apply the rule to each slot part by part, and two TMA warps feed the ring of dy and x blocks and
the staging slots of the weight and state parts. Measured on an H200 its 64 x 128 tile
was 1.09-1.20x faster than the ping-pong kernel's tuned tile at 512-2,048 tokens on four
shapes, where the ping-pong consumers' epilogues leave the tensor cores waiting
(results/tuning/h200-split-kernel.log); its 128 x 128 tile, whose two warpgroups read
each x block once for both, is 1.01-1.23x faster again at 1,024-2,048 tokens
(results/tuning/h200-split-128-rows.log). The epilogue's parts are column slices or
(``epilogue_axis="rows"``) row slices of the tile; row slices, whose weight and state
rows are copied and stored in runs of the tile's full width, measured 1.00-1.09x faster
than column slices of the same configs at 512-2,048 tokens (the 128 x 128 tile in
16-row parts: 1.06-1.08x at 1,024; results/tuning/h200-row-parts.log). Sixteen epilogue
warps are for the bf16 epilogues, which Nsight Compute found latency-bound even with 16
warps per multiprocessor (the portable fused tile and the streaming epilogue;
benchmarks/README.md, "bf16 rounded to nearest by the hardware's conversion"), where eight
leave half as many warps to hide that latency; they leave each thread 72-80 registers, so
only tiles of at most 64 columns compile (results/tuning/ptxas-split-16-warps-3.9.txt).
On an H100 they pass tests/test_hopper_update.py's cases and are bf16-SR's tile at
256-1,023 tokens (results/h100-hopper-tests-16-warps-16116a5.log; benchmarks/HISTORY.md,
"On an H100 again"), and fp32's there too: on an H100 its 128 x 64 tile in four row parts
stepped fp32 state 1.01-1.08x faster than the entries it replaced
(results/h100-fp32-16-warps-0b82584.log)."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from .fused_weight_update import _device_grad_scale, _device_scalars
from .hopper_common import (_GRADIENT_LAYOUT, _barriers, _counts_buffers_layout, _epilogue_layout, _epilogue_part,
                            _fill_slot, _fill_stage, _partition_barrier, _ring, _square_sum, _staging_slots,
                            _token_loop)
from .hopper_input_check import checked_inputs_ok

# Registers per thread asked for the matrix warpgroups (accumulator and addresses); the
# epilogue warps take what is left, the TMA warps 24 each.
MATRIX_REGISTERS = gl.constexpr(96)


@gluon.constexpr_function
def _gradient_slots(block_n, block_k):
    """Two gradient slots where they take at most 64 KB (a 64-row tile), else one: a
    128 x 128 fp32 slot is 64 KB, and the matrix warpgroups then hold the next tile's
    accumulator in their registers while the epilogue drains the slot."""
    return 2 if 2 * block_n * block_k * 4 <= 64 * 1024 else 1


@gluon.constexpr_function
def _parts(block_n, block_k, part_n, part_k):
    """How many parts of ``part_n x part_k`` make a tile: its column or its row slices."""
    return (block_n // part_n) * (block_k // part_k)


@gluon.constexpr_function
def _part_row(j, block_k, part_n, part_k):
    """Part ``j``'s first row in its tile: column slices run left to right, row slices top
    to bottom (one of the two counts is 1), the portable kernel's flag order."""
    return (j // (block_k // part_k)) * part_n


@gluon.constexpr_function
def _part_col(j, block_k, part_k):
    """Part ``j``'s first column in its tile (see ``_part_row``)."""
    return (j % (block_k // part_k)) * part_k


@gluon.jit
def _part(grad, row: gl.constexpr, col: gl.constexpr, PART_N: gl.constexpr, PART_K: gl.constexpr):
    """A part of the gradient slot ``grad`` (a column or a row slice of it, or all of it)."""
    BLOCK_N: gl.constexpr = grad.shape[0]
    if PART_N < BLOCK_N:
        part = grad.slice(row, PART_N, dim=0)
    else:
        part = grad.slice(col, PART_K, dim=1)
    return part


@gluon.constexpr_function
def _one_barrier(parts, num_warps):
    """Whether the epilogue publishes each part's verdict with the barrier that hands its
    staging slot back (``_epilogue_part``'s ONE_BARRIER): with sixteen epilogue warps, whose
    barriers cost most, and an even part count (a part's counts buffer is then its
    parity's). Measured on an H100, kernel alone (results/tuning/h100-one-barrier-fc21096.log):
    1.011-1.024x faster with sixteen warps (bf16-SR's tile at 256 and 512 tokens, four
    shapes; an unchanged control read 1.013), 0.98x with eight on bf16-rn's 128 x 128 tile
    at 256 and 512 tokens (0.99-1.01x on the other tiles), where the later hand-back of the
    staging slot costs more than the barrier saved."""
    return parts % 2 == 0 and num_warps == 16


# The programs take tiles down bands of this many tile rows before across (a band's first
# column of tiles, then its next): the 132 tiles in flight at once then read the dy blocks
# of eight tile rows and the x blocks of some seventeen tile columns, which stay in L2,
# where row-major order had every tile column's x block in flight, evicted by the
# streaming weight and state and read from DRAM again at each tile row (Nsight Compute on
# 4096 x 14336 at 1,024 tokens: 1.45x the bytes the step needs). Measured 1.05-1.18x
# faster there at 512-2,048 tokens, 1.06-1.10x on 8192 x 8192 at 1,024-2,048, 0.99-1.03x
# on 4096 x 4096 and 14336 x 4096 below 2,048 (bands of 4 and 16 within 3 % of 8;
# results/tuning/h200-tile-bands.log). The ping-pong kernel keeps row-major
# order: the bands were 2-5 % slower for its 256-token tile. No bit moves with the order:
# each tile's sum and epilogue are its own.
_TILE_BAND: gl.constexpr = gl.constexpr(8)


@gluon.jit
def _tile_at(tile, N, K, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):
    """The ``tile``-th tile of the band order: its first row and column, and its row-major
    index (which names its verdict flags, as the portable kernel's tile index does)."""
    tiles_n = gl.cdiv(N, BLOCK_N)
    tiles_k = gl.cdiv(K, BLOCK_K)
    band = tile // (_TILE_BAND * tiles_k)
    first = band * _TILE_BAND
    rows = gl.minimum(tiles_n - first, _TILE_BAND)
    within = tile - band * _TILE_BAND * tiles_k
    row = first + within % rows
    col = within // rows
    return row * BLOCK_N, col * BLOCK_K, row * tiles_k + col


@gluon.jit
def _ring_loader(dy_desc, x_desc, dy_bufs, x_bufs, ready, free, T, N, K):
    """The token loop's TMA warp: each tile's dy and x blocks into the ring, a stage once
    the matrix warpgroups have read what it held."""
    BLOCK_T: gl.constexpr = dy_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = dy_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    tiles_k = gl.cdiv(K, BLOCK_K)
    num_tiles = gl.cdiv(N, BLOCK_N) * tiles_k
    num_t = gl.cdiv(T, BLOCK_T)
    counter = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        off_n, off_k, _ = _tile_at(tile, N, K, BLOCK_N, BLOCK_K)
        for i in range(num_t):
            _fill_stage(dy_desc, x_desc, dy_bufs, x_bufs, ready, free, counter, i, off_n, off_k)
            counter += 1


@gluon.jit
def _stage_loader(w_desc, s0_desc, s1_desc, s2_desc, w_smem, s0_smem, s1_smem, s2_smem, epi_ready, epi_free,
                  N, K, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, HAS_S0: gl.constexpr, HAS_S1: gl.constexpr,
                  HAS_S2: gl.constexpr):
    """The epilogue's TMA warp: each tile's weight and state, one part at a time, into the
    staging slots (part p of this program in slot p % slots), each once the epilogue has
    read the slot's previous part."""
    PART_N: gl.constexpr = w_desc.block_type.shape[0]
    PART_K: gl.constexpr = w_desc.block_type.shape[1]
    SLOTS: gl.constexpr = w_smem.shape[0]
    tiles_k = gl.cdiv(K, BLOCK_K)
    num_tiles = gl.cdiv(N, BLOCK_N) * tiles_k
    part = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        off_n, off_k, _ = _tile_at(tile, N, K, BLOCK_N, BLOCK_K)
        for j in gl.static_range(_parts(BLOCK_N, BLOCK_K, PART_N, PART_K)):
            _fill_slot(w_desc, s0_desc, s1_desc, s2_desc, w_smem, s0_smem, s1_smem, s2_smem, epi_ready, epi_free,
                       part % SLOTS, part // SLOTS, off_n + _part_row(j, BLOCK_K, PART_N, PART_K),
                       off_k + _part_col(j, BLOCK_K, PART_K), HAS_S0, HAS_S1, HAS_S2)
            part += 1


@gluon.jit
def _matrix(dy_bufs, x_bufs, ready, free, grad_smem, grad_ready, grad_free, T, N, K, IN_FLIGHT: gl.constexpr):
    """The matrix warpgroups: each tile's token loop on wgmma (the portable kernel's
    ``tl.dot`` over the same blocks in the same order), then its fp32 gradient tile into a
    gradient slot in shared memory for the epilogue warps, and on to the next tile while
    they work on this one. A ring stage is released once both warpgroups of a 128-row
    tile are done with it: Triton puts a barrier over the partition's warps before the
    arrival, which one thread makes. With ``IN_FLIGHT`` (``TileConfig.wgmma_in_flight``)
    each block's wgmma is left running while the next is waited for and issued: with a
    three-stage ring slower (0.93x on 4096 x 4096 at 4,096 tokens,
    results/tuning/h100-wgmma-in-flight-f74a1ed.log), with four faster at 4,096 tokens
    (h100-wgmma-in-flight-four-stages-3db4b79.log). Running the two warpgroups as two
    partitions, each releasing stages by itself, measured 0.96-1.06x (the probe's old/new,
    same log): not taken."""
    BLOCK_T: gl.constexpr = x_bufs.shape[1]
    BLOCK_N: gl.constexpr = dy_bufs.shape[2]
    BLOCK_K: gl.constexpr = x_bufs.shape[2]
    GSLOTS: gl.constexpr = grad_smem.shape[0]
    # One warpgroup per 64 rows of the tile: with 128 rows, two, each reading the same x stage.
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                  instr_shape=[16, BLOCK_K, 16])
    tiles_k = gl.cdiv(K, BLOCK_K)
    num_tiles = gl.cdiv(N, BLOCK_N) * tiles_k
    num_t = gl.cdiv(T, BLOCK_T)
    counter = 0
    visit = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        acc = gl.zeros((BLOCK_N, BLOCK_K), dtype=gl.float32, layout=mma)
        acc, counter = _token_loop(dy_bufs, x_bufs, ready, free, acc, counter, num_t, IN_FLIGHT)
        slot = visit % GSLOTS
        # A fresh barrier counts as released once: waiting on the other parity passes.
        mbarrier.wait(grad_free.index(slot), ((visit // GSLOTS) & 1) ^ 1)
        grad_smem.index(slot).store(acc)
        _partition_barrier()  # every warp's part of the tile is in shared memory before it is handed over
        mbarrier.arrive(grad_ready.index(slot))
        visit += 1


@gluon.jit
def _epilogue(w_ptr, s0_ptr, s1_ptr, s2_ptr, flag_ptr, status_ptr, grad_smem, grad_ready, grad_free,
              w_smem, s0_smem, s1_smem, s2_smem, epi_ready, epi_free, counts_even, counts_odd, N, K, row0, col0,
              global_k, grad_scale, h0, h1, h2, h3, h4, h5, h6, h7, seed, scalars_ptr, seed_ptr, grad_scale_ptr,
              sums_ptr, x_ptr, dy_ptr, T, stride_xt, stride_dt, tickets_ptr, RULE: gl.constexpr,
              VARIANT: gl.constexpr, HAS_S0: gl.constexpr, HAS_S1: gl.constexpr,
              HAS_S2: gl.constexpr, W_BF16: gl.constexpr, S_BF16: gl.constexpr, STOCHASTIC: gl.constexpr,
              ALIGNED: gl.constexpr, DEVICE_SCALARS: gl.constexpr, DEVICE_GRAD_SCALE: gl.constexpr,
              SQUARE_SUMS: gl.constexpr, IN_KERNEL_CHECK: gl.constexpr):
    """The epilogue warps (the default partition): each tile's gradient from its slot, part
    by part, with the part's weight and state from its staging slot, through the rule,
    the rounding and the verdict, while the matrix warpgroups compute the next tiles.
    With ``SQUARE_SUMS`` the tile's Σ g² (the parts' sums added in part order) is stored
    at its row-major index. With ``IN_KERNEL_CHECK`` they first count the non-finite
    elements of this program's share of x and dy (``hopper_input_check``) while the
    matrix warpgroups run the first token loops."""
    BLOCK_N: gl.constexpr = grad_smem.shape[1]
    BLOCK_K: gl.constexpr = grad_smem.shape[2]
    PART_N: gl.constexpr = w_smem.shape[1]
    PART_K: gl.constexpr = w_smem.shape[2]
    SPLIT: gl.constexpr = _parts(BLOCK_N, BLOCK_K, PART_N, PART_K)
    SLOTS: gl.constexpr = w_smem.shape[0]
    GSLOTS: gl.constexpr = grad_smem.shape[0]
    epi: gl.constexpr = _epilogue_layout(PART_K, gl.num_warps())
    tiles_k = gl.cdiv(K, BLOCK_K)
    num_tiles = gl.cdiv(N, BLOCK_N) * tiles_k
    if DEVICE_SCALARS:
        h0, h1, h2, h3, h4, h5, h6, h7, seed = _device_scalars(scalars_ptr, seed_ptr)
    if DEVICE_GRAD_SCALE:
        grad_scale = _device_grad_scale(grad_scale_ptr)
    if IN_KERNEL_CHECK:
        # Counted here, with every program's count in before any tile is stored.
        inputs_ok = checked_inputs_ok(x_ptr, dy_ptr, status_ptr, tickets_ptr, T, N, K, stride_xt, stride_dt)
    else:
        # The input check's verdict (launched before, on the same stream): no tile stores when it counted anything.
        inputs_ok = (gl.load(status_ptr) == 0) & (gl.load(status_ptr + 1) == 0)
    visit = 0
    part = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        off_n, off_k, tile_id = _tile_at(tile, N, K, BLOCK_N, BLOCK_K)
        gslot = visit % GSLOTS
        mbarrier.wait(grad_ready.index(gslot), (visit // GSLOTS) & 1)
        grad = grad_smem.index(gslot)
        squares = 0.0
        for j in gl.static_range(SPLIT):
            slot = part % SLOTS
            counts = counts_even
            if j % 2 == 1:  # SPLIT is even where it matters: a part's parity is j's
                counts = counts_odd
            g = _part(grad, _part_row(j, BLOCK_K, PART_N, PART_K), _part_col(j, BLOCK_K, PART_K), PART_N, PART_K)
            g = g.load(epi)
            if SQUARE_SUMS:
                squares += _square_sum(g)
            _epilogue_part(g, w_ptr, s0_ptr, s1_ptr, s2_ptr, flag_ptr, status_ptr, w_smem.index(slot),
                           s0_smem.index(slot), s1_smem.index(slot), s2_smem.index(slot), epi_ready.index(slot),
                           epi_free.index(slot), (part // SLOTS) & 1, grad_free.index(gslot), j == SPLIT - 1,
                           inputs_ok, tile_id * SPLIT + j, off_n + _part_row(j, BLOCK_K, PART_N, PART_K),
                           off_k + _part_col(j, BLOCK_K, PART_K), N, K, row0, col0, global_k, grad_scale,
                           h0, h1, h2, h3, h4, h5, h6, h7, seed, RULE, VARIANT, HAS_S0, HAS_S1, HAS_S2, W_BF16, S_BF16,
                           STOCHASTIC, ALIGNED, counts, _one_barrier(SPLIT, gl.num_warps()))
            part += 1
        if SQUARE_SUMS:
            gl.store(sums_ptr + tile_id, squares)
        visit += 1


@gluon.jit(do_not_specialize=["row0", "col0", "global_k", "seed"])
def split_kernel(dy_desc, x_desc, w_desc, s0_desc, s1_desc, s2_desc, w_ptr, s0_ptr, s1_ptr, s2_ptr,
                 flag_ptr, status_ptr, T, N, K, row0, col0, global_k, grad_scale,
                 h0, h1, h2, h3, h4, h5, h6, h7, seed, scalars_ptr, seed_ptr, grad_scale_ptr, sums_ptr,
                 x_ptr, dy_ptr, stride_xt, stride_dt, tickets_ptr,
                 RULE: gl.constexpr, VARIANT: gl.constexpr, HAS_S0: gl.constexpr, HAS_S1: gl.constexpr,
                 HAS_S2: gl.constexpr, W_BF16: gl.constexpr, S_BF16: gl.constexpr,
                 STOCHASTIC: gl.constexpr, ALIGNED: gl.constexpr, DEVICE_SCALARS: gl.constexpr,
                 DEVICE_GRAD_SCALE: gl.constexpr, NUM_STAGES: gl.constexpr, EPILOGUE_STAGES: gl.constexpr,
                 SQUARE_SUMS: gl.constexpr, IN_FLIGHT: gl.constexpr, IN_KERNEL_CHECK: gl.constexpr):
    """Persistent, one program per multiprocessor: the matrix warpgroups compute this
    program's gradient tiles one after another into the gradient slots in shared memory,
    the epilogue warps (the default partition) apply the rule to them, and two TMA warps
    feed the one with dy and x blocks (``NUM_STAGES`` ring stages) and the other with
    weight and state parts (``EPILOGUE_STAGES`` staging slots). With ``IN_KERNEL_CHECK``
    the epilogue warps also check x and dy (read through ``x_ptr`` and ``dy_ptr``, rows
    ``stride_xt`` and ``stride_dt`` elements apart) and meet at ``tickets_ptr``'s
    counter; otherwise those arguments are unused."""
    BLOCK_N: gl.constexpr = dy_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    dy_bufs, x_bufs, ready, free = _ring(dy_desc, x_desc, NUM_STAGES)
    GRAD_SLOTS: gl.constexpr = _gradient_slots(BLOCK_N, BLOCK_K)
    grad_smem = gl.allocate_shared_memory(gl.float32, [GRAD_SLOTS, BLOCK_N, BLOCK_K], _GRADIENT_LAYOUT)
    grad_ready = _barriers(GRAD_SLOTS)
    grad_free = _barriers(GRAD_SLOTS)
    w_smem, s0_smem, s1_smem, s2_smem, epi_ready, epi_free = _staging_slots(w_desc, s0_desc, s1_desc, s2_desc, HAS_S0,
                                                                           HAS_S1, HAS_S2, EPILOGUE_STAGES)
    # The epilogue's row counts of its even and of its odd parts (_epilogue_part's ONE_BARRIER; with
    # an even part count a part's parity is its index's, so each part's buffer is chosen when compiling).
    counts_even = gl.allocate_shared_memory(gl.int32, [w_desc.block_type.shape[0]], _counts_buffers_layout())
    counts_odd = gl.allocate_shared_memory(gl.int32, [w_desc.block_type.shape[0]], _counts_buffers_layout())
    gl.warp_specialize([
        (_epilogue, (w_ptr, s0_ptr, s1_ptr, s2_ptr, flag_ptr, status_ptr, grad_smem, grad_ready, grad_free,
                     w_smem, s0_smem, s1_smem, s2_smem, epi_ready, epi_free, counts_even, counts_odd, N, K, row0,
                     col0, global_k, grad_scale, h0, h1, h2, h3, h4, h5, h6, h7, seed, scalars_ptr, seed_ptr,
                     grad_scale_ptr, sums_ptr, x_ptr, dy_ptr, T, stride_xt, stride_dt, tickets_ptr, RULE, VARIANT,
                     HAS_S0, HAS_S1, HAS_S2, W_BF16, S_BF16, STOCHASTIC, ALIGNED, DEVICE_SCALARS, DEVICE_GRAD_SCALE,
                     SQUARE_SUMS, IN_KERNEL_CHECK)),
        (_matrix, (dy_bufs, x_bufs, ready, free, grad_smem, grad_ready, grad_free, T, N, K, IN_FLIGHT)),
        (_ring_loader, (dy_desc, x_desc, dy_bufs, x_bufs, ready, free, T, N, K)),
        (_stage_loader, (w_desc, s0_desc, s1_desc, s2_desc, w_smem, s0_smem, s1_smem, s2_smem, epi_ready, epi_free,
                         N, K, BLOCK_N, BLOCK_K, HAS_S0, HAS_S1, HAS_S2)),
    ], [BLOCK_N // 16, 1, 1], [MATRIX_REGISTERS, 24, 24])
