# A record, not the project's code: the prototype behind benchmarks/README.md, "Operand traffic through L2, and TMA multicast" (2026-12-05).
# Compiled offline for sm_90a with Triton 3.9.0 (split-cluster-prototype-3.9.txt); never run on a GPU; it has no rule, rounding or draw.
"""Prototype (not the project's kernel): the split kernel's structure with a 2 x 1 cluster
(num_ctas=2) and x multicast, in Gluon's CGA model (triton >= 3.8; 3.9 API names).
Cluster tile = 2*BN rows x BK cols: CTA c owns tile row 2*cluster_row + c.
- dy block [BT, 2*BN], cga [[0, 1]]: each CTA loads its own BN dy columns (plain TMA).
- x block [BT, BK], cga [[0, 0]]: multicast (lowered: CTA 0 issues, mask 0b11).
- ring: ready (per CTA), free_local (per CTA), free_pair (one per pair, on the lead CTA).
- gradient slot [2, BN, BK] cga [[1, 0, 0]]; epilogue parts [2, PART_N, BK] with per-CTA
  reductions (axes 2 then 1: never across CTAs, which warp_specialize forbids).
- W viewed as 3D [N/BN, BN, K]: a part [2, PART_N, BK] cga [[1,0,0]], CTA c's from its own tile."""
import os, re, sys
os.environ["TRITON_INTERPRET"] = "0"
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
                                                              fence_async_shared)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type

_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
_partition_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier


@gluon.jit
def _loader(dy_desc, x_desc, dy_bufs, x_bufs, ready, free_local, free_pair, T, N, K):
    BT: gl.constexpr = dy_desc.block_type.shape[0]
    BN2: gl.constexpr = dy_desc.block_type.shape[1]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    S: gl.constexpr = dy_bufs.shape[0]
    tiles_k = gl.cdiv(K, BK)
    num_tiles = gl.cdiv(N, BN2) * tiles_k          # cluster tiles
    num_t = gl.cdiv(T, BT)
    counter = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        off_n = (tile // tiles_k) * BN2
        off_k = (tile % tiles_k) * BK
        for i in range(num_t):
            s = counter % S
            ph = ((counter // S) & 1) ^ 1
            mbarrier.wait(free_local.index(s), ph)   # my dy stage is free
            mbarrier.wait(free_pair.index(s), ph)    # both CTAs' x stage is free (the lead waits)
            mbarrier.expect(ready.index(s), x_desc.nbytes_per_cta + dy_desc.nbytes_per_cta)
            _tma_load(x_desc, [i * BT, off_k], ready.index(s), x_bufs.index(s), multicast=True)
            _tma_load(dy_desc, [i * BT, off_n], ready.index(s), dy_bufs.index(s))
            counter += 1


@gluon.jit
def _matrix(dy_bufs, x_bufs, ready, free_local, free_pair, grad_smem, grad_ready, grad_free, T, N, K):
    BT: gl.constexpr = x_bufs.shape[1]
    BN2: gl.constexpr = dy_bufs.shape[2]
    BK: gl.constexpr = x_bufs.shape[2]
    S: gl.constexpr = dy_bufs.shape[0]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                  instr_shape=[16, BK, 16], cga_layout=((1, 0),))
    tiles_k = gl.cdiv(K, BK)
    num_tiles = gl.cdiv(N, BN2) * tiles_k
    num_t = gl.cdiv(T, BT)
    counter = 0
    visit = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        acc = gl.zeros((BN2, BK), dtype=gl.float32, layout=mma)
        for i in range(num_t):
            s = counter % S
            mbarrier.wait(ready.index(s), (counter // S) & 1)
            acc = warpgroup_mma(dy_bufs.index(s).permute((1, 0)), x_bufs.index(s), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(free_local.index(s))
            mbarrier.arrive(free_pair.index(s))
            counter += 1
        mbarrier.wait(grad_free.index(0), (visit & 1) ^ 1)
        grad_smem.index(0).store(gl.reshape(acc, [2, BN2 // 2, BK]))
        _partition_barrier()
        mbarrier.arrive(grad_ready.index(0))
        visit += 1


@gluon.jit
def _stage_loader(w_desc, w_smem, epi_ready, epi_free, N, K, BN2: gl.constexpr, BK: gl.constexpr):
    PART_N: gl.constexpr = w_desc.block_type.shape[1]
    SLOTS: gl.constexpr = w_smem.shape[0]
    tiles_k = gl.cdiv(K, BK)
    num_tiles = gl.cdiv(N, BN2) * tiles_k
    part = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        row2 = (tile // tiles_k) * 2          # first tile row of the cluster tile (3D view's dim 0)
        off_k = (tile % tiles_k) * BK
        for j in gl.static_range((BN2 // 2) // PART_N):
            slot = part % SLOTS
            mbarrier.wait(epi_free.index(slot), ((part // SLOTS) & 1) ^ 1)
            mbarrier.expect(epi_ready.index(slot), w_desc.nbytes_per_cta)
            _tma_load(w_desc, [row2, j * PART_N, off_k], epi_ready.index(slot), w_smem.index(slot))
            part += 1


@gluon.jit
def _epilogue(w_ptr, flag_ptr, grad_smem, grad_ready, grad_free, w_smem, epi_ready, epi_free, N, K):
    BN: gl.constexpr = grad_smem.shape[2]
    BK: gl.constexpr = grad_smem.shape[3]
    PART_N: gl.constexpr = w_smem.shape[2]
    SLOTS: gl.constexpr = w_smem.shape[0]
    SPLIT: gl.constexpr = BN // PART_N
    epi: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 1, 32], [1, gl.num_warps(), 1], [2, 1, 0],
                                         cga_layout=((1, 0, 0),))
    tiles_k = gl.cdiv(K, BK)
    num_tiles = gl.cdiv(N, 2 * BN) * tiles_k
    cta = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, epi)))          # [2]: CTA c holds c
    r = gl.arange(0, PART_N, layout=gl.SliceLayout(0, gl.SliceLayout(2, epi)))
    cc = gl.arange(0, BK, layout=gl.SliceLayout(0, gl.SliceLayout(1, epi)))
    visit = 0
    part = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        tile_row = (tile // tiles_k) * 2 + cta        # [2]: each CTA's own tile row
        off_k = (tile % tiles_k) * BK
        mbarrier.wait(grad_ready.index(0), visit & 1)
        for j in gl.static_range(SPLIT):
            slot = part % SLOTS
            g = grad_smem.index(0).slice(j * PART_N, PART_N, dim=1).load(epi)
            mbarrier.wait(epi_ready.index(slot), (part // SLOTS) & 1)
            w = w_smem.index(slot).load(epi)
            fence_async_shared()
            _partition_barrier()
            mbarrier.arrive(epi_free.index(slot))
            if j == SPLIT - 1:
                mbarrier.arrive(grad_free.index(0))
            w_new = w - 0.01 * g
            rows = tile_row[:, None, None] * BN + j * PART_N + r[None, :, None]
            cols = off_k + cc[None, None, :]
            inside = (rows < N) & (cols < K)
            bad = gl.sum(gl.sum(gl.where(inside & (w_new != w_new), 1, 0), axis=2), axis=1)   # [2], per CTA
            keep = inside & (bad == 0)[:, None, None]
            gl.store(w_ptr + rows * K + cols, w_new, mask=keep)
            gl.store(flag_ptr + (tile_row * tiles_k + off_k // BK) * SPLIT + j, bad, mask=tile_row * BN < N)
            part += 1
        visit += 1


@gluon.jit
def split_mc_kernel(dy_desc, x_desc, w_desc, w_ptr, flag_ptr, T, N, K, NUM_STAGES: gl.constexpr,
                    EPILOGUE_STAGES: gl.constexpr):
    gl.static_assert(gl.num_ctas() == 2)
    BN2: gl.constexpr = dy_desc.block_type.shape[1]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    dy_bufs = gl.allocate_shared_memory(dy_desc.dtype, [NUM_STAGES] + dy_desc.block_type.shape, dy_desc.layout)
    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [NUM_STAGES] + x_desc.block_type.shape, x_desc.layout)
    grad_layout: gl.constexpr = gl.SwizzledSharedLayout(4, 1, 8, order=[2, 1, 0], cga_layout=((1, 0, 0),))
    grad_smem = gl.allocate_shared_memory(gl.float32, [1, 2, BN2 // 2, BK], grad_layout)
    w_smem = gl.allocate_shared_memory(w_desc.dtype, [EPILOGUE_STAGES] + w_desc.block_type.shape, w_desc.layout)
    ready = mbarrier.allocate_mbarrier(batch=NUM_STAGES)
    free_local = mbarrier.allocate_mbarrier(batch=NUM_STAGES)
    free_pair = mbarrier.allocate_mbarrier(batch=NUM_STAGES, two_ctas=True)
    grad_ready = mbarrier.allocate_mbarrier(batch=1)
    grad_free = mbarrier.allocate_mbarrier(batch=1)
    epi_ready = mbarrier.allocate_mbarrier(batch=EPILOGUE_STAGES)
    epi_free = mbarrier.allocate_mbarrier(batch=EPILOGUE_STAGES)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(free_local.index(i), count=1)
        mbarrier.init(free_pair.index(i), count=1)   # x2 arrivals: Gluon multiplies by the CTAs sharing it
    mbarrier.init(grad_ready.index(0), count=1)
    mbarrier.init(grad_free.index(0), count=1)
    for i in gl.static_range(EPILOGUE_STAGES):
        mbarrier.init(epi_ready.index(i), count=1)
        mbarrier.init(epi_free.index(i), count=1)
    gl.warp_specialize([
        (_epilogue, (w_ptr, flag_ptr, grad_smem, grad_ready, grad_free, w_smem, epi_ready, epi_free, N, K)),
        (_matrix, (dy_bufs, x_bufs, ready, free_local, free_pair, grad_smem, grad_ready, grad_free, T, N, K)),
        (_loader, (dy_desc, x_desc, dy_bufs, x_bufs, ready, free_local, free_pair, T, N, K)),
        (_stage_loader, (w_desc, w_smem, epi_ready, epi_free, N, K, BN2, BK)),
    ], [8, 1, 1], [96, 24, 24])


BT, BN, BK, PART_N = 64, 128, 128, 16


def descriptors(dy, x, w):
    N, K = w.shape
    dy_l = gl.NVMMASharedLayout.get_default_for([BT, 2 * BN], gl.bfloat16, cga_layout=[[0, 1]])
    x_l = gl.NVMMASharedLayout.get_default_for([BT, BK], gl.bfloat16, cga_layout=[[0, 0]])
    w_l = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3, cga_layout=[[1, 0, 0]])
    w3 = w.view(N // BN, BN, K)
    return (TensorDescriptor.from_tensor(dy, [BT, 2 * BN], dy_l), TensorDescriptor.from_tensor(x, [BT, BK], x_l),
            TensorDescriptor.from_tensor(w3, [2, PART_N, BK], w_l))


def compile_sm90a(T=1024, N=4096, K=4096):
    dy = torch.empty(T, N, dtype=torch.bfloat16); x = torch.empty(T, K, dtype=torch.bfloat16)
    w = torch.empty(N, K, dtype=torch.float32)
    d = descriptors(dy, x, w)
    sig = {"dy_desc": mangle_type(d[0]), "x_desc": mangle_type(d[1]), "w_desc": mangle_type(d[2]), "w_ptr": "*fp32",
           "flag_ptr": "*i32", "T": "i32", "N": "i32", "K": "i32", "NUM_STAGES": "constexpr", "EPILOGUE_STAGES": "constexpr"}
    names = split_mc_kernel.arg_names
    src = GluonASTSource(split_mc_kernel, sig, constexprs={(names.index("NUM_STAGES"),): 3, (names.index("EPILOGUE_STAGES"),): 2},
                         attrs={(names.index(n),): [["tt.divisibility", 16]] for n in ("w_ptr", "flag_ptr", "T", "N", "K")})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8, num_ctas=2))


if __name__ == "__main__":
    print("triton", triton.__version__)
    c = compile_sm90a()
    ptx = c.asm["ptx"]
    seen = {}
    for l in ptx.splitlines():
        key = re.sub(r"\[.*", "", re.sub(r"^@%p\d+\s+", "", l.strip()))
        if re.search(r"cp\.async\.bulk\.tensor|mbarrier\.(arrive|init|try_wait)|barrier\.cluster|fence\.mbarrier|mapa|cluster_ctarank|reqnctapercluster|shared::cluster", l):
            seen[key] = seen.get(key, 0) + 1
    for kk, v in seen.items():
        print(f"  {v:3d} x {kk}")
    print("shared bytes", c.metadata.shared, "num_ctas", c.metadata.num_ctas)
