"""Can the installed Triton express TMA multicast inside a thread-block cluster on Hopper?

At 1,024 tokens a byte count read the fused fp32 step on 4096 x 4096 as bound by L2-to-SM
traffic, not HBM (benchmarks/README.md, "Operand traffic through L2, and TMA multicast"):
every tile re-reads its rows of dy and columns of x over all tokens. (Measured since with
``probe_cluster.py``: x multicast in a 2-CTA cluster gained nothing on an H100, and showed
no gain on an H200.) A 2-CTA cluster whose CTAs own tiles in the same columns could read
each x block from L2 once and multicast it to both. This probe compiles (offline, no GPU
needed, for sm_90a) the smallest Gluon kernel that does that: one program is a 2-CTA cluster
(``num_ctas=2``); the x block, replicated across the cluster (``cga_layout [[0, 0]]``), is
loaded with ``multicast=True``; the dy block is split by columns; each CTA runs one wgmma
into its half of the output and stores it. It prints the PTX lines that show a cluster
launch and a multicast copy, or why the Triton installed cannot build it (3.6 stops at the
missing ``mbarrier.allocate_mbarrier``; its ``async_copy_global_to_shared`` has no multicast
argument either).

    python3 benchmarks/probe_multicast.py          # compile for sm_90a and print the PTX lines
    python3 benchmarks/probe_multicast.py gpu      # on a Hopper GPU: out == dyᵀ x
"""

import re
import sys

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

# 3.8 and later name the copies async_load / async_store; 3.7 has the multicast argument on the old names.
_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
_store = tma.async_store if hasattr(tma, "async_store") else tma.async_copy_shared_to_global

BT, BN, BK = 64, 64, 128  # one CTA's tile is BN x BK; the cluster's 2 BN x BK
PTX_LINES = r"cp\.async\.bulk|barrier\.cluster|fence\.mbarrier_init|multicast::|reqnctapercluster|explicitcluster"


@gluon.jit
def multicast_kernel(dy_desc, x_desc, out_desc):
    gl.static_assert(gl.num_ctas() == 2)
    BK: gl.constexpr = x_desc.block_type.shape[1]
    BN2: gl.constexpr = dy_desc.block_type.shape[1]
    x_smem = gl.allocate_shared_memory(x_desc.dtype, x_desc.block_type.shape, x_desc.layout)
    dy_smem = gl.allocate_shared_memory(dy_desc.dtype, dy_desc.block_type.shape, dy_desc.layout)
    bar = mbarrier.allocate_mbarrier()  # one per CTA
    mbarrier.init(bar, count=1)
    # Every byte landing in this CTA: all of x (sent by the multicast) and its half of dy.
    mbarrier.expect(bar, x_desc.nbytes_per_cta + dy_desc.nbytes_per_cta)
    off_k = gl.program_id(0) * BK  # a program is the whole cluster
    _load(x_desc, [0, off_k], bar, x_smem, multicast=True)
    _load(dy_desc, [0, 0], bar, dy_smem)
    mbarrier.wait(bar, phase=0, deps=[x_smem, dy_smem])
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                  instr_shape=[16, BK, 16], cga_layout=((1, 0),))
    acc = gl.zeros((BN2, BK), dtype=gl.float32, layout=mma)
    acc = warpgroup_mma(dy_smem.permute((1, 0)), x_smem, acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    out_smem = gl.allocate_shared_memory(gl.float32, [BN2, BK], out_desc.layout)
    out_smem.store(acc)
    fence_async_shared()
    _store(out_desc, [0, off_k], out_smem)
    tma.store_wait(0)


def descriptors(dy, x, out):
    x_layout = gl.NVMMASharedLayout.get_default_for([BT, BK], gl.bfloat16, cga_layout=[[0, 0]])
    dy_layout = gl.NVMMASharedLayout.get_default_for([BT, 2 * BN], gl.bfloat16, cga_layout=[[0, 1]])
    out_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2, cga_layout=[[1, 0]])
    return (TensorDescriptor.from_tensor(dy, [BT, 2 * BN], dy_layout),
            TensorDescriptor.from_tensor(x, [BT, BK], x_layout),
            TensorDescriptor.from_tensor(out, [2 * BN, BK], out_layout))


def compile_sm90a():
    tensors = (torch.empty(BT, 2 * BN, dtype=torch.bfloat16), torch.empty(BT, 4096, dtype=torch.bfloat16),
               torch.empty(2 * BN, 4096, dtype=torch.float32))
    signature = {name: mangle_type(d) for name, d in zip(("dy_desc", "x_desc", "out_desc"), descriptors(*tensors))}
    source = GluonASTSource(multicast_kernel, signature, constexprs={}, attrs={})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_ctas=2))


def run_on_gpu():
    n, k = 2 * BN, 1024
    dy = torch.randn(BT, n, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(BT, k, device="cuda", dtype=torch.bfloat16)
    out = torch.full((n, k), float("nan"), device="cuda", dtype=torch.float32)
    multicast_kernel[(k // BK,)](*descriptors(dy, x, out), num_warps=4, num_ctas=2)
    torch.cuda.synchronize()
    error = (out - dy.float().t() @ x.float()).abs().max().item()
    print(f"triton {triton.__version__}, {torch.cuda.get_device_name()}: max |out - dyᵀx| = {error}")
    return 0 if error < 1e-3 else 1


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["gpu"]:
        return run_on_gpu()
    print(f"triton {triton.__version__}, compiled for sm_90a, 2-CTA cluster")
    try:
        compiled = compile_sm90a()
    except Exception as error:  # 3.6: no multicast argument; report it rather than a traceback
        print(f"  cannot build it: {type(error).__name__}: {error}".splitlines()[0])
        return 1
    for line in compiled.asm["ptx"].splitlines():
        line = line.strip()
        if re.search(PTX_LINES, line) and not line.startswith((".loc", ".file")):  # not this file's own name
            print("  ", line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
