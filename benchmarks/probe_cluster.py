"""The split Hopper kernel's fp32 AdamW step with its x blocks shared by TMA multicast
across a 2-CTA cluster (Triton >= 3.8's Gluon only), checked bit for bit against the
product's split kernel and timed beside it and torch's captured step in one process.

A measurement for benchmarks/README.md, "Operand traffic through L2, and TMA multicast":
the byte count there reads the 1,024-token rows as bound by the dy and x blocks every
tile re-reads from L2; two CTAs owning tiles in the same columns can read each x block
once and receive it both. This probe asks whether they are faster, before the product
grows a cluster kernel. It runs only where Gluon can express multicast (the GPU image's
Triton 3.6 cannot: ``probe_multicast.py``), with a Triton 3.8+ on ``PYTHONPATH``.

What it builds, in Gluon's CGA model: a cluster of ``CTAS`` (1 or 2) CTAs owns a cluster
tile of CTAS * 128 rows x 128 columns; CTA c its tile row CTAS * cluster_row + c, the same
128 x 128 tiles and 64-token blocks as the tuned fp32 entries (``TILES``), so each tile's
wgmma sequence is the product's and its bits must be too. With CTAS = 2 the lead CTA
copies each x block into both CTAs' rings by one multicast TMA load once both have released the stage (a two-CTA barrier: both arrive at
the lead's, only the lead waits); each CTA copies its own dy block. The epilogue is the
product's on 16-row parts with a leading CTA dimension: the rule (``AdamW.update``), the
verdict and the stores per CTA (the bad-tile count added relaxed: at the default ordering
Gluon syncs the cluster at each part), fp32 weight and state only (no rounding, no draw). CTAS
= 1 is the same code with no multicast, which separates the multicast's effect from most
of the kernel's other differences (the tile order is in bands of 4 cluster rows: 8 tile rows
with two CTAs, as the product's, 4 with one). The product kernel is timed with the tuned
1,024-token entry's tile at every token count, or with ``--tile 16384`` the 16,384-token
entry's (four ring stages, one staging slot, a wgmma in flight: the cluster kernel then
takes the same ring, slot and wait, so its 1-CTA form is the product's kernel in bands of 4).

    PYTHONPATH=/tmp/site:... python3 benchmarks/probe_cluster.py --shapes 4096x4096,4096x14336 --tokens 512,1024
    PYTHONPATH=/tmp/site:... python3 benchmarks/probe_cluster.py --tile 16384 --tokens 16384,4096

``--compile-only`` compiles the cluster kernel for sm_90a without a GPU and prints its
shared memory, registers and spill stores (``sass_count.ptxas_usage``: the wheel's
ptxas), and its multicast loads and ``wgmma.wait_group 1`` waits (the wgmma in flight),
one line per CTA count.
"""

import argparse
import os
import sys
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.jit import mangle_type

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_update as bu  # noqa: E402  (maps this tree's kernels/ to forge_kernels)
from probe_operand_loads import same_bits  # noqa: E402
from sass_count import ptxas_usage  # noqa: E402

import forge_kernels as fk  # noqa: E402
from forge_kernels.ops.finite_check import BAD_TILES, STATUS_WORDS, is_finite  # noqa: E402
from forge_kernels.ops.fused_weight_update import _Epilogue, _storable  # noqa: E402

# The tile, token block and row part of the tuned fp32 entries.
BLOCK_T, BLOCK_N, BLOCK_K, PART_ROWS = 64, 128, 128, 16
BT, BN, BK, PART_N = (gl.constexpr(v) for v in (BLOCK_T, BLOCK_N, BLOCK_K, PART_ROWS))
# --tile: the tuned fp32 entry whose ring stages, staging slots and wgmma-in-flight the
# cluster kernel takes, and that entry as the product kernel it is checked and timed against.
TILES = {
    "1024": (3, 2, False, fk.TileConfig(128, 128, 64, 8, 3, None, 8, "hopper", "rows")),
    "16384": (4, 1, True, fk.TileConfig(128, 128, 64, 8, 4, None, 8, "hopper", "rows", 1, "pointers", True)),
}
# Set from --tile in main(), before the first compile (the kernels read them as constants).
STAGES, SLOTS, IN_FLIGHT = (gl.constexpr(v) for v in TILES["1024"][:3])
PRODUCT = TILES["1024"][3]
_BAD = gl.constexpr(BAD_TILES)
_BAND = gl.constexpr(4)  # cluster rows per band: 8 tile rows, the product's band


@gluon.constexpr_function
def _cga(ctas, rank, dim):
    """The CGA bases that split dimension ``dim`` of a rank-``rank`` tensor over the CTAs."""
    return [] if ctas == 1 else [[1 if d == dim else 0 for d in range(rank)]]


@gluon.constexpr_function
def _shared_cga(ctas, rank):
    """The CGA bases of a block every CTA holds whole (the multicast x block)."""
    return [] if ctas == 1 else [[0] * rank]


@gluon.jit
def _cluster_tile(tile, N, K):
    """The ``tile``-th cluster tile in bands of ``_BAND`` cluster rows: its cluster row
    and its first column."""
    CTAS: gl.constexpr = gl.num_ctas()
    rows_c = gl.cdiv(N, CTAS * BN)
    tiles_k = gl.cdiv(K, BK)
    band = tile // (_BAND * tiles_k)
    first = band * _BAND
    rows = gl.minimum(rows_c - first, _BAND)
    within = tile - band * _BAND * tiles_k
    return first + within % rows, (within // rows) * BK


@gluon.jit
def _ring_loader(dy_desc, x_desc, dy_bufs, x_bufs, ready, free, free_pair, T, N, K):
    CTAS: gl.constexpr = gl.num_ctas()
    num_tiles = gl.cdiv(N, CTAS * BN) * gl.cdiv(K, BK)
    num_t = gl.cdiv(T, BT)
    counter = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        crow, off_k = _cluster_tile(tile, N, K)
        for i in range(num_t):
            s = counter % STAGES
            phase = ((counter // STAGES) & 1) ^ 1
            mbarrier.wait(free.index(s), phase)  # this CTA's matrix warps are done with the stage
            if CTAS > 1:
                mbarrier.wait(free_pair.index(s), phase)  # both CTAs' (the lead waits; the other skips)
            mbarrier.expect(ready.index(s), x_desc.nbytes_per_cta + dy_desc.nbytes_per_cta)
            tma.async_load(x_desc, [i * BT, off_k], ready.index(s), x_bufs.index(s), multicast=CTAS > 1)
            tma.async_load(dy_desc, [i * BT, crow * CTAS * BN], ready.index(s), dy_bufs.index(s))
            counter += 1


@gluon.jit
def _release(free, free_pair, s):
    """Ring stage ``s`` handed back: to this CTA's loader, and with two CTAs to the lead's."""
    mbarrier.arrive(free.index(s))
    if gl.num_ctas() > 1:
        mbarrier.arrive(free_pair.index(s))


@gluon.jit
def _matrix(dy_bufs, x_bufs, ready, free, free_pair, grad_smem, grad_ready, grad_free, T, N, K):
    CTAS: gl.constexpr = gl.num_ctas()
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                  instr_shape=[16, BK, 16], cga_layout=_cga(CTAS, 2, 0))
    num_tiles = gl.cdiv(N, CTAS * BN) * gl.cdiv(K, BK)
    num_t = gl.cdiv(T, BT)
    counter = 0
    visit = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        acc = gl.zeros((CTAS * BN, BK), dtype=gl.float32, layout=mma)
        for i in range(num_t):
            s = counter % STAGES
            mbarrier.wait(ready.index(s), (counter // STAGES) & 1)
            acc = warpgroup_mma(dy_bufs.index(s).permute((1, 0)), x_bufs.index(s), acc, is_async=True)
            if IN_FLIGHT:  # the product's _token_loop: the previous block's stage is freed once its wgmma retired
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                if i > 0:
                    _release(free, free_pair, (counter + STAGES - 1) % STAGES)
            else:
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                _release(free, free_pair, s)
            counter += 1
        if IN_FLIGHT:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            if num_t > 0:
                _release(free, free_pair, (counter + STAGES - 1) % STAGES)
        mbarrier.wait(grad_free.index(0), (visit & 1) ^ 1)
        grad_smem.index(0).store(acc)
        gl.barrier()  # every warp's rows are in shared memory before the slot is handed over
        mbarrier.arrive(grad_ready.index(0))
        visit += 1


@gluon.jit
def _stage_loader(w_desc, m_desc, v_desc, w_smem, m_smem, v_smem, epi_ready, epi_free, N, K):
    CTAS: gl.constexpr = gl.num_ctas()
    num_tiles = gl.cdiv(N, CTAS * BN) * gl.cdiv(K, BK)
    part = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        crow, off_k = _cluster_tile(tile, N, K)
        for j in gl.static_range(BN // PART_N):
            slot = part % SLOTS
            mbarrier.wait(epi_free.index(slot), ((part // SLOTS) & 1) ^ 1)
            mbarrier.expect(epi_ready.index(slot), 3 * w_desc.nbytes_per_cta)
            coord = [crow * CTAS, j * PART_N, off_k]  # the weight viewed as (N / BN, BN, K)
            tma.async_load(w_desc, coord, epi_ready.index(slot), w_smem.index(slot))
            tma.async_load(m_desc, coord, epi_ready.index(slot), m_smem.index(slot))
            tma.async_load(v_desc, coord, epi_ready.index(slot), v_smem.index(slot))
            part += 1


@gluon.jit
def _epilogue(w_ptr, m_ptr, v_ptr, flag_ptr, status_ptr, grad_smem, grad_ready, grad_free, w_smem, m_smem, v_smem,
              epi_ready, epi_free, N, K, h0, h1, h2, h3, h4, h5, h6, h7, RULE: gl.constexpr, VARIANT: gl.constexpr):
    CTAS: gl.constexpr = gl.num_ctas()
    SPLIT: gl.constexpr = BN // PART_N
    epi: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 1, 32], [1, gl.num_warps(), 1], [2, 1, 0],
                                         cga_layout=_cga(CTAS, 3, 0))
    tiles_k = gl.cdiv(K, BK)
    num_tiles = gl.cdiv(N, CTAS * BN) * tiles_k
    cta = gl.arange(0, CTAS, layout=gl.SliceLayout(1, gl.SliceLayout(2, epi)))
    r = gl.arange(0, PART_N, layout=gl.SliceLayout(0, gl.SliceLayout(2, epi)))
    c = gl.arange(0, BK, layout=gl.SliceLayout(0, gl.SliceLayout(1, epi)))
    inputs_ok = (gl.load(status_ptr) == 0) & (gl.load(status_ptr + 1) == 0)
    visit = 0
    part = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        crow, off_k = _cluster_tile(tile, N, K)
        tile_row = crow * CTAS + cta  # [CTAS]: each CTA's own tile row
        mbarrier.wait(grad_ready.index(0), visit & 1)
        grad = grad_smem.index(0).reshape([CTAS, BN, BK])
        for j in gl.static_range(SPLIT):
            slot = part % SLOTS
            g = grad.slice(j * PART_N, PART_N, dim=1).load(epi)
            mbarrier.wait(epi_ready.index(slot), (part // SLOTS) & 1)
            w = w_smem.index(slot).load(epi)
            m = m_smem.index(slot).load(epi)
            v = v_smem.index(slot).load(epi)
            fence_async_shared()
            gl.barrier()  # every warp has read the slot (and g) before either is reused
            mbarrier.arrive(epi_free.index(slot))
            if j == SPLIT - 1:
                mbarrier.arrive(grad_free.index(0))
            w, m, v, unused = RULE(w, g, m, v, w, h0, h1, h2, h3, h4, h5, h6, h7, VARIANT)
            finite = (is_finite(g) & _storable(w, w, 0, False, False, False)
                      & _storable(m, m, 0, False, False, False) & _storable(v, v, 0, False, False, False))
            rows = tile_row[:, None, None] * BN + j * PART_N + r[None, :, None]
            cols = off_k + c[None, None, :]
            inside = (rows < N) & (cols < K)
            num_bad = gl.sum(gl.sum(gl.where(inside & ~finite, 1, 0), axis=2), axis=1)  # [CTAS], per CTA
            idx = rows * K + cols
            keep = inside & (((num_bad == 0) & inputs_ok)[:, None, None])
            gl.store(w_ptr + idx, w, mask=keep)
            gl.store(m_ptr + idx, m, mask=keep)
            gl.store(v_ptr + idx, v, mask=keep)
            gl.atomic_add(status_ptr + _BAD + cta * 0, 1, mask=(num_bad > 0) & inputs_ok, sem="relaxed")
            gl.store(flag_ptr + (tile_row * tiles_k + off_k // BK) * SPLIT + j, num_bad)
            part += 1
        visit += 1


@gluon.jit
def cluster_kernel(dy_desc, x_desc, w_desc, m_desc, v_desc, w_ptr, m_ptr, v_ptr, flag_ptr, status_ptr, T, N, K,
                   h0, h1, h2, h3, h4, h5, h6, h7, RULE: gl.constexpr, VARIANT: gl.constexpr):
    CTAS: gl.constexpr = gl.num_ctas()
    dy_bufs = gl.allocate_shared_memory(dy_desc.dtype, [STAGES] + dy_desc.block_type.shape, dy_desc.layout)
    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    grad_layout: gl.constexpr = gl.SwizzledSharedLayout(4, 1, 8, order=[1, 0], cga_layout=_cga(CTAS, 2, 0))
    grad_smem = gl.allocate_shared_memory(gl.float32, [1, CTAS * BN, BK], grad_layout)
    w_smem = gl.allocate_shared_memory(w_desc.dtype, [SLOTS] + w_desc.block_type.shape, w_desc.layout)
    m_smem = gl.allocate_shared_memory(m_desc.dtype, [SLOTS] + m_desc.block_type.shape, m_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [SLOTS] + v_desc.block_type.shape, v_desc.layout)
    ready = mbarrier.allocate_mbarrier(batch=STAGES)
    free = mbarrier.allocate_mbarrier(batch=STAGES)
    free_pair = mbarrier.allocate_mbarrier(batch=STAGES, two_ctas=CTAS > 1)
    grad_ready = mbarrier.allocate_mbarrier(batch=1)
    grad_free = mbarrier.allocate_mbarrier(batch=1)
    epi_ready = mbarrier.allocate_mbarrier(batch=SLOTS)
    epi_free = mbarrier.allocate_mbarrier(batch=SLOTS)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(free.index(i), count=1)
        mbarrier.init(free_pair.index(i), count=1)  # a two-CTA barrier counts one arrival per CTA
    mbarrier.init(grad_ready.index(0), count=1)
    mbarrier.init(grad_free.index(0), count=1)
    for i in gl.static_range(SLOTS):
        mbarrier.init(epi_ready.index(i), count=1)
        mbarrier.init(epi_free.index(i), count=1)
    gl.warp_specialize([
        (_epilogue, (w_ptr, m_ptr, v_ptr, flag_ptr, status_ptr, grad_smem, grad_ready, grad_free, w_smem, m_smem,
                     v_smem, epi_ready, epi_free, N, K, h0, h1, h2, h3, h4, h5, h6, h7, RULE, VARIANT)),
        (_matrix, (dy_bufs, x_bufs, ready, free, free_pair, grad_smem, grad_ready, grad_free, T, N, K)),
        (_ring_loader, (dy_desc, x_desc, dy_bufs, x_bufs, ready, free, free_pair, T, N, K)),
        (_stage_loader, (w_desc, m_desc, v_desc, w_smem, m_smem, v_smem, epi_ready, epi_free, N, K)),
    ], [BN // 16, 1, 1], [96, 24, 24])


def descriptors(ctas, x, dy, w, m, v):
    """TMA descriptors: dy blocks of CTAS * BLOCK_N columns (each CTA its own BLOCK_N), x blocks
    every CTA holds whole, and 16-row parts of the weight and state viewed as (N / BLOCK_N, BLOCK_N, K)."""
    N, K = w.shape
    base = [] if ctas == 1 else [[0, 1]]
    dy_l = gl.NVMMASharedLayout.get_default_for([BLOCK_T, ctas * BLOCK_N], gl.bfloat16, cga_layout=base)
    x_l = gl.NVMMASharedLayout.get_default_for([BLOCK_T, BLOCK_K], gl.bfloat16, cga_layout=[] if ctas == 1 else [[0, 0]])
    part_l = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3,
                                  cga_layout=[] if ctas == 1 else [[1, 0, 0]])
    parts = [TensorDescriptor.from_tensor(t.view(N // BLOCK_N, BLOCK_N, K), [ctas, PART_ROWS, BLOCK_K], part_l) for t in (w, m, v)]
    return [TensorDescriptor.from_tensor(dy, [BLOCK_T, ctas * BLOCK_N], dy_l), TensorDescriptor.from_tensor(x, [BLOCK_T, BLOCK_K], x_l)] + parts


class ClusterStep:
    """One launch of ``cluster_kernel`` on a benchmark layer's fp32 weight and AdamW state."""

    def __init__(self, layer, state, rule, ctas, step=1):
        N, K = layer.w.shape
        if N % (ctas * BLOCK_N) or K % BLOCK_K:
            raise ValueError(f"{N}x{K}: rows must be whole cluster tiles of {ctas * BLOCK_N}, columns of {BLOCK_K}")
        self.layer, self.state, self.ctas = layer, state, ctas
        self.scalars = rule.scalars(step)
        self.update, self.variant = rule.update, rule.variant
        tiles = (N // BLOCK_N) * (K // BLOCK_K) * (BLOCK_N // PART_ROWS)
        self.words = torch.zeros(STATUS_WORDS + tiles, dtype=torch.int32, device="cuda")
        self.desc = descriptors(ctas, layer.x, layer.dy, layer.w, state["exp_avg"], state["exp_avg_sq"])
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.grid = (min(sms // ctas, (N // (ctas * BLOCK_N)) * (K // BLOCK_K)),)

    def __call__(self):
        layer, s = self.layer, self.state
        N, K = layer.w.shape
        cluster_kernel[self.grid](*self.desc, layer.w, s["exp_avg"], s["exp_avg_sq"], self.words[STATUS_WORDS:],
                                  self.words, layer.x.shape[0], N, K, *self.scalars, RULE=self.update,
                                  VARIANT=self.variant, num_warps=8, num_ctas=self.ctas, enable_fp_fusion=False)

    def flags(self):
        return self.words[STATUS_WORDS:]


def stepped(n, k, t, make):
    """Weight, state and flags after one step of ``make(layer, state, rule)`` on a fixed layer."""
    layer = bu.Layer(n, k, t, "fp32", seed=3)
    r = bu.rule()
    torch.manual_seed(5)  # fresh_state draws from the global generator
    state = layer.fresh_state(r)
    flags = make(layer, state, r)
    torch.cuda.synchronize()
    return [layer.w, state["exp_avg"], state["exp_avg_sq"]], flags


def product_step(layer, state, r):
    epilogue = _Epilogue(layer.w, state, r, 1, PRODUCT, None, 0, 1.0, None)
    epilogue.fused(layer.x, layer.dy, layer.w)
    return epilogue.flags


def cluster_step(ctas):
    def make(layer, state, r):
        step = ClusterStep(layer, state, r, ctas)
        step()
        return step.flags()
    return make


def compile_only(ctas):
    """The cluster kernel compiled for sm_90a (no GPU needed): one line of what it holds."""
    T, N, K = 1024, 4096, 4096
    x, dy = torch.empty(T, K, dtype=torch.bfloat16), torch.empty(T, N, dtype=torch.bfloat16)
    w, m, v = (torch.empty(N, K) for _ in range(3))
    names = cluster_kernel.arg_names
    r = bu.rule()
    signature = dict(zip(["dy_desc", "x_desc", "w_desc", "m_desc", "v_desc"],
                         (mangle_type(d) for d in descriptors(ctas, x, dy, w, m, v))))
    signature.update(w_ptr="*fp32", m_ptr="*fp32", v_ptr="*fp32", flag_ptr="*i32", status_ptr="*i32", T="i32",
                     N="i32", K="i32", RULE="constexpr", VARIANT="constexpr",
                     **{f"h{i}": "fp32" for i in range(8)})  # Python floats, as the launch passes them
    source = GluonASTSource(cluster_kernel, signature,
                            constexprs={(names.index("RULE"),): r.update, (names.index("VARIANT"),): r.variant},
                            attrs={(names.index(n),): [["tt.divisibility", 16]]
                                   for n in ("w_ptr", "m_ptr", "v_ptr", "flag_ptr", "T", "N", "K")})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=8, num_ctas=ctas, enable_fp_fusion=False))
    ptx = compiled.asm["ptx"]
    registers, spills = ptxas_usage(ptx, None)
    print(f"{ctas} CTA(s), {PRODUCT}: shared {compiled.metadata.shared} bytes, registers {registers}, "
          f"spill stores {spills} bytes, multicast loads {ptx.count('multicast::cluster')}, "
          f"wgmma.wait_group 1 {ptx.count('wgmma.wait_group.sync.aligned 1')}", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="4096x4096,4096x14336")
    parser.add_argument("--tokens", default="512,1024")
    parser.add_argument("--ctas", default="2,1")
    parser.add_argument("--tile", default="1024", choices=sorted(TILES),
                        help="the tuned fp32 entry (token count) whose ring, staging slots and wgmma in flight to take")
    parser.add_argument("--compile-only", action="store_true", help="compile for sm_90a and say what the kernel holds")
    args = parser.parse_args(argv)
    global STAGES, SLOTS, IN_FLIGHT, PRODUCT
    STAGES, SLOTS, IN_FLIGHT = (gl.constexpr(v) for v in TILES[args.tile][:3])
    PRODUCT = TILES[args.tile][3]
    if tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 8):
        sys.exit(f"probe_cluster.py needs Triton 3.8 or later (multicast TMA loads, two-CTA barriers); "
                 f"this is {triton.__version__}")
    if args.compile_only:
        print(f"# triton {triton.__version__}, sm_90a, offline", flush=True)
        for ctas in (int(v) for v in args.ctas.split(",")):
            compile_only(ctas)
        return
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"FORGE_COMMIT={os.environ.get('FORGE_COMMIT', '?')}; product kernel and cluster stages as {PRODUCT}",
          flush=True)
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        for t in (int(v) for v in args.tokens.split(",")):
            ref, ref_flags = stepped(n, k, t, product_step)
            row = {}
            for ctas in (int(v) for v in args.ctas.split(",")):
                got, flags = stepped(n, k, t, cluster_step(ctas))
                row[ctas] = same_bits(ref + [ref_flags], got + [flags])
            layer = bu.Layer(n, k, t, "fp32")
            r = bu.rule()
            found = bu.methods(layer, "fp32", PRODUCT)
            times = {"torch captured": bu.timed(found["torch captured"])[0]}
            product = _Epilogue(layer.w, layer.fresh_state(r), r, 1, PRODUCT, None, 0, 1.0, None)
            times["product kernel replayed"] = bu.timed(bu.capture(lambda: product.fused(layer.x, layer.dy,
                                                                                         layer.w))[0].replay)[0]
            for ctas in row:
                step = ClusterStep(layer, layer.fresh_state(r), r, ctas)
                times[f"cluster {ctas} replayed"] = bu.timed(bu.capture(step)[0].replay)[0]
            times["product kernel again"] = bu.timed(bu.capture(lambda: product.fused(layer.x, layer.dy,
                                                                                      layer.w))[0].replay)[0]
            base = times["torch captured"]
            print(f"{shape} T={t} same bits as the product kernel: "
                  + ", ".join(f"{c} CTA{'s' if c > 1 else ''} {'yes' if ok else 'NO'}" for c, ok in row.items()), flush=True)
            for name, ms in times.items():
                print(f"  {name:26s} {ms:.4f} ms  ({base / ms:.3f}x torch captured)", flush=True)


if __name__ == "__main__":
    main()
