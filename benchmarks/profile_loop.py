"""The split kernel's token loop alone (``probe_wide_loop.py``'s product variant: the
same ring, TMA warp and wgmma as the fused kernel, a stub epilogue that sums each
gradient tile) launched five times on random x and dy, for a profiler to pick one
launch, beside ``profile_case.py``'s fused kernel:

    ncu --clock-control none --kernel-name regex:wide_loop_kernel --launch-skip 3 --launch-count 1 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis python3 benchmarks/profile_loop.py 16384 4096x4096

Arguments: tokens, and the weight's shape as ``OUTxIN``.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import probe_wide_loop as pw  # noqa: E402


def main():
    tokens = int(sys.argv[1])
    out_features, in_features = map(int, sys.argv[2].split("x"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, in_features, device="cuda", generator=gen).bfloat16()
    dy = (torch.randn(tokens, out_features, device="cuda", generator=gen) * 1e-3).bfloat16()
    step, _ = pw.loop_step(x, dy, "product loop 128x128, TMA warp, 4 x 64")
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    print("token loop alone", tokens, out_features, in_features, flush=True)


if __name__ == "__main__":
    main()
