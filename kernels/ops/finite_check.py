"""The non-finite input check, on the device: one kernel scans the update's inputs (x
and dY, or a materialized gradient) and counts their NaN and infinite elements into a
device status word that the update kernel's epilogue reads before it stores anything.

It replaces a host-side check (``aminmax`` then ``bool(...)``) whose device-to-host
synchronization stalled the CPU on every step until the GPU queue drained. Launched on
the same stream just before the update, it needs no synchronization: the update
kernel starts after it has finished, sees the count, and writes nothing when it is
nonzero. The host reads the counts later, once (``UpdateReport``). The split Hopper
kernel can count them itself instead (``TileConfig(in_kernel_check=True)``,
``hopper_input_check``), into the same words.

Status layout (int32, ``STATUS_WORDS`` of them, zeroed before the check):
``status[i]`` for i < ``MAX_INPUTS``: non-finite elements of input i;
``status[BAD_TILES]``: tiles the epilogue skipped for their own non-finite values.
"""

import triton
import triton.language as tl

MAX_INPUTS = 2
BAD_TILES = MAX_INPUTS
STATUS_WORDS = MAX_INPUTS + 1
# A tile of a scanned input: 2-D so that no per-element division finds an element's
# row and column (any strides are allowed), 4096 elements per program.
CHECK_BLOCK_R = 32
CHECK_BLOCK_C = 128

# A constexpr global: the only kind a compiled kernel may read.
FP32_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def is_finite(v):
    """fp32 ``v`` is neither NaN nor infinite: |v| <= FP32_MAX is false for NaN and for
    both infinities."""
    return tl.abs(v) <= FP32_MAX


@triton.jit
def _count_non_finite_tile(ptr, tile, rows, cols, stride_r, stride_c,
                           BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Non-finite elements in tile number ``tile`` (row-major over the tile grid)."""
    tiles_per_row = tl.cdiv(cols, BLOCK_C)
    offs_r = (tile // tiles_per_row) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_c = (tile % tiles_per_row) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (offs_r < rows)[:, None] & (offs_c < cols)[None, :]
    # bf16 upcasts exactly, NaN and infinities included.
    # int32 offsets suffice: the launchers refuse tensors whose strides reach past 2**31 - 1
    # elements (validation.MAX_ELEMENTS), as the update kernels index the same way.
    v = tl.load(ptr + offs_r[:, None] * stride_r + offs_c[None, :] * stride_c, mask=mask, other=0.0)
    finite = is_finite(v.to(tl.float32))
    return tl.sum(tl.sum(tl.where(mask & ~finite, 1, 0), axis=1), axis=0)


@triton.jit
def _finite_check_kernel(a_ptr, b_ptr, status_ptr, rows_a, cols_a, stride_ar, stride_ac, tiles_a,
                         rows_b, cols_b, stride_br, stride_bc,
                         BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Programs 0 .. tiles_a-1 scan input a, the rest input b; a program that finds
    non-finite elements adds their count to its input's status word (one atomic, and
    only then: a clean input costs no atomics)."""
    pid = tl.program_id(0)
    if pid < tiles_a:
        bad = _count_non_finite_tile(a_ptr, pid, rows_a, cols_a, stride_ar, stride_ac, BLOCK_R, BLOCK_C)
        tl.atomic_add(status_ptr, bad, mask=bad > 0)
    else:
        bad = _count_non_finite_tile(b_ptr, pid - tiles_a, rows_b, cols_b, stride_br, stride_bc, BLOCK_R, BLOCK_C)
        tl.atomic_add(status_ptr + 1, bad, mask=bad > 0)


def _tiles(t) -> int:
    rows, cols = t.shape
    return triton.cdiv(rows, CHECK_BLOCK_R) * triton.cdiv(cols, CHECK_BLOCK_C) if t.numel() else 0


def launch_finite_check(status, *inputs):
    """Count the non-finite elements of each 2-D input (one or two, any strides, float32
    or bfloat16) into ``status[0]``, ``status[1]``: one launch, no synchronization.
    ``status`` must be zeroed; inputs are validated by the caller."""
    assert 1 <= len(inputs) <= MAX_INPUTS
    a = inputs[0]
    b = inputs[1] if len(inputs) > 1 else a
    tiles_a = _tiles(a)
    tiles_b = _tiles(b) if len(inputs) > 1 else 0
    if tiles_a + tiles_b == 0:
        return
    _finite_check_kernel[(tiles_a + tiles_b,)](
        a, b, status, a.shape[0], a.shape[1], a.stride(0), a.stride(1), tiles_a,
        b.shape[0], b.shape[1], b.stride(0), b.stride(1),
        BLOCK_R=CHECK_BLOCK_R, BLOCK_C=CHECK_BLOCK_C)
