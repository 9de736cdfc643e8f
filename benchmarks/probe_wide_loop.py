"""Can the split kernel's token loop run at cuBLAS's rate with a 128 x 256 tile? The token
loop alone (no rule: a stub epilogue reads each gradient tile from its shared-memory slot
and stores its sum), in the split kernel's structure, timed beside cuBLAS's dW and the
product's fused fp32 kernel in one process.

Why: at 16,384 tokens the fused fp32 kernel (the split 128 x 128 tile with a wgmma in
flight) runs at about 0.94-1.00x torch's whole step, cuBLAS's dW plus fused AdamW, so its
token loop runs well below cuBLAS's matrix rate; a 128 x 256 tile reads a quarter fewer
operand bytes per flop, and a plain Triton GEMM with that tile reached cuBLAS's rate
(``probe_gemm_ceiling.py``). The product's split kernel cannot hold it: its epilogue
warps, matrix warpgroups and two TMA warps (padded to a warpgroup) make sixteen warps, so
every instruction is compiled within 128 registers a thread, and the m64n256 wgmma needs
154 (``results/tuning/ptxas-128x256-four-epilogue-warps-3.9.txt``). Here the matrix
warpgroups issue their own TMA copies (each block's copy issued once the block it replaces
has been read by both warpgroups), so the kernel has twelve warps: four epilogue warps
and eight matrix warps, 168 registers a thread. The shared memory is what the fused
kernel would have: the 128 KB gradient slot and a ring of 32-token blocks (three stages
leave room for fp32 staging slots; four, or two of 64 tokens, do not).

Variants (``VARIANTS``): the product's loop (128 x 128, a TMA warp feeding a four-stage
ring of 64-token blocks, a wgmma in flight), the same tile with the copies issued by the
matrix warpgroups, and the 128 x 256 tile so with three or four stages of 32 tokens or
two of 64. ``--check`` first compares every variant's gradient tiles with the product
loop's, bit for bit, and with cuBLAS's within fp32 rounding, on a ragged token count.

    python3 benchmarks/probe_wide_loop.py [--shapes 4096x4096,14336x4096] [--tokens 4096,16384] [--check]
"""

import argparse
import sys
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_update as bu  # noqa: E402  (maps this tree's kernels/ to forge_kernels)

from forge_kernels.ops.hopper_common import (_GRADIENT_LAYOUT, _barriers, _epilogue_layout,  # noqa: E402
                                             _partition_barrier, _ring, _tma_load)
from forge_kernels.ops.hopper_split import _matrix, _ring_loader, _tile_at  # noqa: E402

# name: (block_k, block_t, ring stages, copies issued by the matrix warpgroups)
VARIANTS = {
    "product loop 128x128, TMA warp, 4 x 64": (128, 64, 4, False),
    "128x128, inline copies, 4 x 64": (128, 64, 4, True),
    "128x256, inline copies, 3 x 32": (256, 32, 3, True),
    "128x256, inline copies, 4 x 32": (256, 32, 4, True),
    "128x256, inline copies, 2 x 64": (256, 64, 2, True),
}
BLOCK_N = 128
PART_ROWS = gl.constexpr(16)
# Registers a thread asked for the matrix warpgroups with inline copies (a 64 x 256 fp32
# accumulator is 128 of them); the four epilogue warps take what is left.
INLINE_MATRIX_REGISTERS = gl.constexpr(192)


@gluon.jit
def _stub_epilogue(grad_smem, grad_ready, grad_free, out_ptr, N, K, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                   FULL: gl.constexpr):
    """Each tile's gradient read from its slot in 16-row parts, as the fused epilogue reads
    it; ``FULL`` stores the whole tile at its place in ``out`` (the check), else its sum at
    the tile's row-major index (so the reads are not dead code)."""
    epi: gl.constexpr = _epilogue_layout(BLOCK_K, gl.num_warps())
    num_tiles = gl.cdiv(N, BLOCK_N) * gl.cdiv(K, BLOCK_K)
    visit = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        off_n, off_k, tile_id = _tile_at(tile, N, K, BLOCK_N, BLOCK_K)
        mbarrier.wait(grad_ready.index(0), visit & 1)
        total = 0.0
        for j in gl.static_range(BLOCK_N // PART_ROWS):
            g = grad_smem.index(0).slice(j * PART_ROWS, PART_ROWS, dim=0).load(epi)
            if FULL:
                rows = off_n + j * PART_ROWS + gl.arange(0, PART_ROWS, layout=gl.SliceLayout(1, epi))
                cols = off_k + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, epi))
                inside = (rows < N)[:, None] & (cols < K)[None, :]
                gl.store(out_ptr + rows[:, None] * K + cols[None, :], g, mask=inside)
            else:
                total += gl.sum(gl.sum(g, axis=1), axis=0)
        _partition_barrier()  # every warp has read the slot before it is handed back
        mbarrier.arrive(grad_free.index(0))
        if not FULL:
            gl.store(out_ptr + tile_id, total)
        visit += 1


@gluon.jit
def _issue_block(dy_desc, x_desc, dy_bufs, x_bufs, ready, block, num_t, N, K):
    """Copy this program's ``block``-th token block (its tiles' blocks in order) into ring
    stage ``block % STAGES``."""
    BLOCK_T: gl.constexpr = dy_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = dy_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    STAGES: gl.constexpr = dy_bufs.shape[0]
    BLOCK_BYTES: gl.constexpr = dy_desc.block_type.nbytes + x_desc.block_type.nbytes
    tile = gl.program_id(0) + (block // num_t) * gl.num_programs(0)
    i = block % num_t
    off_n, off_k, _ = _tile_at(tile, N, K, BLOCK_N, BLOCK_K)
    stage = block % STAGES
    mbarrier.expect(ready.index(stage), BLOCK_BYTES)
    _tma_load(dy_desc, [i * BLOCK_T, off_n], ready.index(stage), dy_bufs.index(stage))
    _tma_load(x_desc, [i * BLOCK_T, off_k], ready.index(stage), x_bufs.index(stage))


@gluon.jit
def _matrix_inline(dy_desc, x_desc, dy_bufs, x_bufs, ready, grad_smem, grad_ready, grad_free, T, N, K):
    """The matrix warpgroups, issuing their own copies: block c's wgmma is left in flight,
    and once block c - 1's has retired in both warpgroups (its wait, then a barrier over the
    partition) block c + STAGES - 1 is copied into the stage block c - 1 held."""
    BLOCK_T: gl.constexpr = x_bufs.shape[1]
    BLOCK_N: gl.constexpr = dy_bufs.shape[2]
    BLOCK_K: gl.constexpr = x_bufs.shape[2]
    STAGES: gl.constexpr = dy_bufs.shape[0]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                  instr_shape=[16, BLOCK_K, 16])
    num_tiles = gl.cdiv(N, BLOCK_N) * gl.cdiv(K, BLOCK_K)
    num_t = gl.cdiv(T, BLOCK_T)
    mine = gl.cdiv(num_tiles - gl.program_id(0), gl.num_programs(0))
    blocks = mine * num_t
    for block in range(0, gl.minimum(STAGES - 1, blocks)):
        _issue_block(dy_desc, x_desc, dy_bufs, x_bufs, ready, block, num_t, N, K)
    counter = 0
    visit = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        acc = gl.zeros((BLOCK_N, BLOCK_K), dtype=gl.float32, layout=mma)
        for i in range(num_t):
            stage = counter % STAGES
            mbarrier.wait(ready.index(stage), (counter // STAGES) & 1)
            acc = warpgroup_mma(dy_bufs.index(stage).permute((1, 0)), x_bufs.index(stage), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            _partition_barrier()  # block counter - 1's wgmma has retired in both warpgroups
            if counter + STAGES - 1 < blocks:
                _issue_block(dy_desc, x_desc, dy_bufs, x_bufs, ready, counter + STAGES - 1, num_t, N, K)
            counter += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.wait(grad_free.index(0), (visit & 1) ^ 1)
        grad_smem.index(0).store(acc)
        _partition_barrier()  # the whole tile is in the slot before it is handed over
        mbarrier.arrive(grad_ready.index(0))
        visit += 1


@gluon.jit
def wide_loop_kernel(dy_desc, x_desc, out_ptr, T, N, K, NUM_STAGES: gl.constexpr, INLINE: gl.constexpr,
                     FULL: gl.constexpr):
    BLOCK_N: gl.constexpr = dy_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    dy_bufs, x_bufs, ready, free = _ring(dy_desc, x_desc, NUM_STAGES)
    grad_smem = gl.allocate_shared_memory(gl.float32, [1, BLOCK_N, BLOCK_K], _GRADIENT_LAYOUT)
    grad_ready = _barriers(1)
    grad_free = _barriers(1)
    if INLINE:
        gl.warp_specialize([
            (_stub_epilogue, (grad_smem, grad_ready, grad_free, out_ptr, N, K, BLOCK_N, BLOCK_K, FULL)),
            (_matrix_inline, (dy_desc, x_desc, dy_bufs, x_bufs, ready, grad_smem, grad_ready, grad_free, T, N, K)),
        ], [BLOCK_N // 16], [INLINE_MATRIX_REGISTERS])
    else:
        gl.warp_specialize([
            (_stub_epilogue, (grad_smem, grad_ready, grad_free, out_ptr, N, K, BLOCK_N, BLOCK_K, FULL)),
            (_matrix, (dy_bufs, x_bufs, ready, free, grad_smem, grad_ready, grad_free, T, N, K, True)),
            (_ring_loader, (dy_desc, x_desc, dy_bufs, x_bufs, ready, free, T, N, K)),
        ], [BLOCK_N // 16, 1], [96, 24])


def loop_step(x, dy, variant, full=False):
    """A launch of ``variant``'s loop on (x, dy); returns (step, out)."""
    block_k, block_t, stages, inline = VARIANTS[variant]
    T, K = x.shape
    N = dy.shape[1]

    def descriptor(t, block):
        return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16))

    dy_desc = descriptor(dy, [block_t, BLOCK_N])
    x_desc = descriptor(x, [block_t, block_k])
    tiles = triton.cdiv(N, BLOCK_N) * triton.cdiv(K, block_k)
    out = torch.zeros((N, K) if full else (tiles,), dtype=torch.float32, device=x.device)
    grid = (min(tiles, torch.cuda.get_device_properties(x.device).multi_processor_count),)

    def step():
        wide_loop_kernel[grid](dy_desc, x_desc, out, T, N, K, NUM_STAGES=stages, INLINE=inline, FULL=full,
                               num_warps=4)
    return step, out


def check(n, k, t):
    """Each variant's gradient against the product loop's (bitwise) and cuBLAS's (close)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(t, k, device="cuda", generator=gen).bfloat16()
    dy = torch.randn(t, n, device="cuda", generator=gen).bfloat16()
    cublas = torch.mm(dy.t().float(), x.float())
    reference = None
    for variant in VARIANTS:
        step, out = loop_step(x, dy, variant, full=True)
        step()
        torch.cuda.synchronize()
        if reference is None:
            reference = out.clone()
        same = torch.equal(out.view(torch.int32), reference.view(torch.int32))
        error = ((out - cublas).abs().max() / cublas.abs().max()).item()
        print(f"check {n}x{k} T={t} {variant:40s} == product loop {same}  max |out - cuBLAS| / max |cuBLAS| "
              f"{error:.2e}", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="4096x4096,14336x4096,4096x14336")
    parser.add_argument("--tokens", default="16384,4096")
    parser.add_argument("--variants", default=";".join(VARIANTS), help="';'-separated")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    print(f"gpu {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    if args.check:
        check(384, 768, 1000)
    configs = bu.json.loads(bu.CONFIGS_FILE.read_text())
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        for t in (int(v) for v in args.tokens.split(",")):
            layer = bu.Layer(n, k, t, "fp32")
            torch_ms, config, product_ms = bu.torch_and_tuned(layer, "fp32", t, configs)
            mm_ms = bu.timed(bu.capture(lambda: bu.torch_grad(layer))[0].replay)[0]
            flops = 2.0 * n * k * t
            print(f"{n}x{k} T={t}: torch captured {torch_ms:.4f} ms, cuBLAS dW {mm_ms:.4f} ms "
                  f"({flops / mm_ms / 1e9:.0f} TFLOP/s), product fused kernel {product_ms:.4f} ms "
                  f"({torch_ms / product_ms:.3f}x torch) {config}", flush=True)
            for variant in args.variants.split(";"):
                try:
                    step, _ = loop_step(layer.x, layer.dy, variant)
                    ms = [bu.timed(bu.capture(step)[0].replay)[0] for _ in range(2)]
                except Exception as error:  # e.g. out of shared memory: said, and swept past
                    print(f"  {variant:40s} {type(error).__name__}: {str(error)[:200]}", flush=True)
                    continue
                print(f"  {variant:40s} {ms[0]:.4f} / {ms[1]:.4f} ms  {flops / min(ms) / 1e9:4.0f} TFLOP/s  "
                      f"{mm_ms / min(ms):.3f}x cuBLAS dW", flush=True)
            del layer


if __name__ == "__main__":
    main()
