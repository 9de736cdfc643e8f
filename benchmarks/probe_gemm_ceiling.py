"""How fast can a Triton kernel on this GPU compute the weight gradient alone? The fused
step at long token counts is its token loop (dW = dyᵀ x, 2 T N K FLOPs) plus an epilogue,
so the fastest Triton GEMM of the same operands with no optimizer epilogue at all, among
the configs tried here, says how near a fused step written in Triton could come (a
measurement over these configs, not a bound over all kernels).

Timed side by side in one process, on each shape and token count:

* ``cublas dW``: torch's GEMM of the gradient (``bench_update.torch_grad``: fp32 output
  for fp32 weights);
* ``torch captured``: that GEMM and ``AdamW(fused=True, capturable=True)``, replayed
  from a CUDA graph (bench_update's row of the same name);
* ``forge``: the fused step with the tuned config, replayed (bench_update's ``forge
  kernel replayed``);
* ``triton gemm``: a plain Triton kernel, the same dy and x blocks through TMA tensor
  descriptors, ``tl.dot`` into an fp32 accumulator, the fp32 tile stored (a GEMM's
  output; the fused step stores its weight and state instead), over the tile shapes
  Triton's Hopper matmul tutorials tune (128 x 128 with 64- or 128-token blocks and 4 or
  8 warps, 128 x 256 with 64-token blocks and 8 warps; 3-4 stages), one program per tile
  or persistent (one per SM); the fastest is reported with its config.

``budget`` is torch captured / 0.95, the most a step may take to be 0.95x torch's (issue
13's long-token target): where even the fastest Triton GEMM alone takes longer, no fused
step written in Triton among these reaches the target on this machine.

    python3 benchmarks/probe_gemm_ceiling.py [--shapes 4096x4096,8192x8192] [--tokens 4096,16384]
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_update as bu  # noqa: E402  (maps this tree's kernels/ to forge_kernels)

# (BLOCK_N, BLOCK_K, BLOCK_T, num_warps, num_stages, persistent)
CONFIGS = [(bn, bk, bt, w, s, p)
           for bn, bk in ((128, 128), (128, 256))
           for bt in (64, 128)
           for w in (4, 8)
           for s in (3, 4)
           for p in (False, True)
           if not (bk == 256 and w == 4)  # a 128 x 256 fp32 accumulator over 4 warps spills
           and not (bk == 256 and bt == 128)]  # (128 + 256) x 128 bf16 = 96 KB a stage: 2 fit, not 3


@triton.jit
def _tile(tile, tiles_n, tiles_k, BAND: tl.constexpr):
    """Tiles down bands of BAND tile rows, then across (the tutorials' grouped order)."""
    band = tile // (BAND * tiles_k)
    first = band * BAND
    rows = tl.minimum(tiles_n - first, BAND)
    within = tile - band * BAND * tiles_k
    return first + within % rows, within // rows


@triton.jit
def _gemm_kernel(dy_desc, x_desc, out_ptr, T, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_T: tl.constexpr, STAGES: tl.constexpr, PERSISTENT: tl.constexpr):
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_k = tl.cdiv(K, BLOCK_K)
    step = tl.num_programs(0) if PERSISTENT else tiles_n * tiles_k
    for tile in range(tl.program_id(0), tiles_n * tiles_k, step):
        tn, tk = _tile(tile, tiles_n, tiles_k, 8)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for i in tl.range(0, tl.cdiv(T, BLOCK_T), num_stages=STAGES):
            a = dy_desc.load([i * BLOCK_T, tn * BLOCK_N])
            b = x_desc.load([i * BLOCK_T, tk * BLOCK_K])
            acc = tl.dot(a.T, b, acc)
        rows = tn * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tk * BLOCK_K + tl.arange(0, BLOCK_K)
        tl.store(out_ptr + rows[:, None] * K + cols[None, :], acc,
                 mask=(rows < N)[:, None] & (cols < K)[None, :])


def triton_gemm(dy, x, config):
    """dW = dyᵀ x in fp32 by ``_gemm_kernel`` under ``config``: a zero-argument callable."""
    bn, bk, bt, warps, stages, persistent = config
    t, n = dy.shape
    k = x.shape[1]
    out = torch.empty(n, k, device=dy.device, dtype=torch.float32)
    dy_desc = TensorDescriptor.from_tensor(dy, [bt, bn])
    x_desc = TensorDescriptor.from_tensor(x, [bt, bk])
    tiles = triton.cdiv(n, bn) * triton.cdiv(k, bk)
    grid = (min(tiles, torch.cuda.get_device_properties(dy.device).multi_processor_count) if persistent else tiles,)

    def run():
        _gemm_kernel[grid](dy_desc, x_desc, out, t, n, k, BLOCK_N=bn, BLOCK_K=bk, BLOCK_T=bt, STAGES=stages,
                           PERSISTENT=persistent, num_warps=warps, num_stages=stages)
    return run, out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="4096x4096,8192x8192")
    parser.add_argument("--tokens", default="4096,16384")
    parser.add_argument("--regimes", default="fp32,bf16-sr")
    args = parser.parse_args(argv)
    configs = json.loads(bu.CONFIGS_FILE.read_text())
    print(f"gpu {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        for t in (int(v) for v in args.tokens.split(",")):
            layer = bu.Layer(n, k, t, "fp32")
            reference = bu.torch_grad(layer)
            best = None
            for config in CONFIGS:
                try:
                    run, out = triton_gemm(layer.dy, layer.x, config)
                    run()
                    torch.cuda.synchronize()
                except Exception as error:  # a config that does not compile is named, not hidden
                    print(f"  {n}x{k} T={t:5d} triton gemm {config}: {type(error).__name__}: {str(error)[:120]}")
                    continue
                # The same sums as cuBLAS's up to order: a wrong kernel would be far off.
                err = ((out - reference).abs().max() / reference.abs().max()).item()
                ms = bu.timed(bu.capture(run)[0].replay)[0]
                print(f"  {n}x{k} T={t:5d} triton gemm {config}: {ms:.4f} ms (max rel. diff from cuBLAS {err:.1e})")
                if err < 1e-3 and (best is None or ms < best[0]):
                    best = (ms, config)
            cublas = bu.timed(bu.capture(lambda: bu.torch_grad(layer))[0].replay)[0]
            flops = 2.0 * t * n * k
            for regime in args.regimes.split(","):
                torch_ms, _, forge_ms = bu.torch_and_tuned(bu.Layer(n, k, t, regime), regime, t, configs)
                budget = torch_ms / 0.95
                line = (f"{n}x{k} T={t:5d} {regime:7s} torch captured {torch_ms:.4f} ms, budget for 0.95x {budget:.4f}; "
                        f"forge {forge_ms:.4f} ({torch_ms / forge_ms:.3f}x); cublas dW {cublas:.4f} "
                        f"({flops / cublas * 1e-9:.0f} TFLOP/s)")
                if best is not None:
                    line += (f"; best triton gemm {best[0]:.4f} ({flops / best[0] * 1e-9:.0f} TFLOP/s, {best[1]}), "
                             f"{'over' if best[0] > budget else 'within'} the budget")
                print(line, flush=True)


if __name__ == "__main__":
    main()
