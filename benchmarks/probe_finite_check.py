"""How fast is the non-finite input check, and does its tile shape matter? The check
kernel (``ops.finite_check._finite_check_kernel``) that every fused call launches before
the update, timed on x and dY (bf16, T x K and T x N) over its committed tile (32 x 128
elements, 4 warps) and wider ones, each replayed from a CUDA graph (a captured step
launches it that way), beside the time the bytes take at the copy bandwidth measured in
the same run. The counts are the same for every tile shape (each element is read once);
the shape only sets how many programs run and how many elements each loads.

    python3 benchmarks/probe_finite_check.py [--shape 4096x4096] [--tokens 256,1024,16384]
"""

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_update as bu  # noqa: E402  (maps this tree's kernels/ to forge_kernels)

from forge_kernels.ops.finite_check import CHECK_BLOCK_C, CHECK_BLOCK_R, STATUS_WORDS, _finite_check_kernel  # noqa: E402

# (block_r, block_c, num_warps); the first is the committed tile.
TILES = [(CHECK_BLOCK_R, CHECK_BLOCK_C, 4), (32, 256, 4), (64, 128, 4), (64, 256, 8), (128, 256, 8), (64, 512, 8)]


def check_step(status, a, b, block_r, block_c, warps):
    tiles_a = triton.cdiv(a.shape[0], block_r) * triton.cdiv(a.shape[1], block_c)
    tiles_b = triton.cdiv(b.shape[0], block_r) * triton.cdiv(b.shape[1], block_c)

    def step():
        _finite_check_kernel[(tiles_a + tiles_b,)](
            a, b, status, a.shape[0], a.shape[1], a.stride(0), a.stride(1), tiles_a,
            b.shape[0], b.shape[1], b.stride(0), b.stride(1), BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
    return step


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="4096x4096")
    parser.add_argument("--tokens", default="256,1024,16384")
    args = parser.parse_args()
    n, k = (int(v) for v in args.shape.split("x"))
    bandwidth, _ = bu.measure_ceilings()
    print(f"gpu {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; dY {n} columns, x {k} columns, bf16")
    status = torch.zeros(STATUS_WORDS, dtype=torch.int32, device="cuda")
    for t in (int(v) for v in args.tokens.split(",")):
        x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
        at_copy_rate = (x.numel() + dy.numel()) * 2 / bandwidth * 1e3
        for block_r, block_c, warps in TILES:
            step = check_step(status, x, dy, block_r, block_c, warps)
            ms = bu.timed(bu.capture(step)[0].replay)[0]
            assert int(status[0]) == 0 and int(status[1]) == 0, "random normal inputs are finite"
            print(f"T={t:6d} tile ({block_r:3d}, {block_c:3d}, {warps} warps) replayed {ms * 1e3:8.2f} us  "
                  f"{ms / at_copy_rate:5.2f}x the bytes at the copy rate ({at_copy_rate * 1e3:.2f} us)", flush=True)


if __name__ == "__main__":
    main()
