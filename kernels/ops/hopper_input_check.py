"""The non-finite input check inside the split Hopper kernel
(``TileConfig(in_kernel_check=True)``).

A fused call otherwise launches ``finite_check``'s kernel before the update: a second read
of x and dY at the copy rate (0.072 ms of a 0.97 ms step on 4096 x 4096 at 16,384 tokens on
an H200), with the tensor cores idle. Here the split kernel's epilogue warps, which have
nothing to do until the first gradient tile is ready, count the same elements while the
matrix warpgroups run the first token loops: each program counts its share of x's and
dY's blocks, adds what it found to the same status words, and takes a ticket; no epilogue
stores before every program of the launch has taken one. So the rule is the separate
check's (any NaN or infinity in x or dY, and no tile is written) and so are the counts
(each element counted by one program, once).

Waiting for every program needs every program resident at once: the kernel is launched
as a cooperative grid (one program per multiprocessor), which the driver refuses rather
than deadlocks when they cannot all be resident."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .finite_check import is_finite

# A block of 64 rows by 256 columns: eight bf16 (16 bytes) per thread and row, and with
# eight warps eight rows per thread in flight at once. Each element is counted once,
# whatever the block.
_BLOCK_R = gl.constexpr(64)
_BLOCK_C = gl.constexpr(256)


@gluon.jit
def _count_block(ptr, block, rows, cols, stride_r, layout: gl.constexpr):
    """Non-finite elements in block number ``block`` (row-major over the block grid) of a
    (rows, cols) input with unit column stride (the TMA copies' operands)."""
    per_row = gl.cdiv(cols, _BLOCK_C)
    offs_r = (block // per_row) * _BLOCK_R + gl.arange(0, _BLOCK_R, layout=gl.SliceLayout(1, layout))
    offs_c = (block % per_row) * _BLOCK_C + gl.arange(0, _BLOCK_C, layout=gl.SliceLayout(0, layout))
    mask = (offs_r < rows)[:, None] & (offs_c < cols)[None, :]
    # int32 offsets suffice: the launchers refuse tensors whose strides reach past 2**31 - 1
    # elements (validation.MAX_ELEMENTS), as for the separate check.
    v = gl.load(ptr + offs_r[:, None] * stride_r + offs_c[None, :], mask=mask, other=0.0)
    bad = (mask & ~is_finite(v.to(gl.float32))).to(gl.int32)
    return gl.sum(gl.sum(bad, axis=1), axis=0)


@gluon.jit
def _count_share(ptr, rows, cols, stride_r, layout: gl.constexpr):
    """This program's share of an input's non-finite elements: blocks pid, pid + P, ..."""
    blocks = gl.cdiv(rows, _BLOCK_R) * gl.cdiv(cols, _BLOCK_C)
    bad = gl.program_id(0) * 0
    for block in range(gl.program_id(0), blocks, gl.num_programs(0)):
        bad += _count_block(ptr, block, rows, cols, stride_r, layout)
    return bad


@gluon.jit
def checked_inputs_ok(x_ptr, dy_ptr, status_ptr, tickets_ptr, T, N, K, stride_xt, stride_dt):
    """Count this program's share of x's (T, K) and dY's (T, N) non-finite elements into
    ``status[0]`` and ``status[1]``, take a ticket, wait until every program of this launch
    has, and return whether both counts are zero (the verdict ``finite_check`` gives)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [gl.num_warps(), 1], [1, 0])
    bad_x = _count_share(x_ptr, T, K, stride_xt, layout)
    bad_dy = _count_share(dy_ptr, T, N, stride_dt, layout)
    gl.atomic_add(status_ptr, bad_x, mask=bad_x > 0)
    gl.atomic_add(status_ptr + 1, bad_dy, mask=bad_dy > 0)
    # Release: this program's counts are visible to whoever acquires the ticket counter
    # after it. The counter is zeroed before each call; waiting for the end of this
    # launch's round of tickets (not for a count of P) keeps the wait a barrier where a
    # benchmark relaunches the kernel without zeroing it.
    ticket = gl.atomic_add(tickets_ptr, 1, sem="release")
    everyone = (ticket // gl.num_programs(0) + 1) * gl.num_programs(0)
    taken = gl.atomic_add(tickets_ptr, 0, sem="acquire")
    while taken < everyone:
        taken = gl.atomic_add(tickets_ptr, 0, sem="acquire")
    return ((gl.atomic_add(status_ptr, 0, sem="relaxed") == 0)
            & (gl.atomic_add(status_ptr + 1, 0, sem="relaxed") == 0))
