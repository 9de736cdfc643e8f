"""Where one launch of the fused kernel spends its host time: ``cProfile`` over 300 eager
launches of the kernel alone (``bench_update.kernel_step``), for the Hopper kernel and the
portable one, 4096 x 4096, 256 tokens, fp32 state; with the host time per launch
(``bench_update.host_us``) before each profile. ``--call`` profiles the whole call a
training step makes instead: ``fused_weight_update(..., report="defer")`` checking the
previous call's report first (``bench_update``'s ``forge deferred``), its argument
checks, the input check's launch and the report included, sorted by cumulative time.

    python3 benchmarks/probe_launch_host.py [--call]
"""

import cProfile
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_update as bu  # noqa: E402  (maps this tree's kernels/ to forge_kernels)

CONFIGS = [(64, 32, 128, 4, 2, None, 1, "hopper"), (16, 128, 64, 4, 3, None, 2)]


def main():
    whole_call = "--call" in sys.argv[1:]
    layer = bu.Layer(4096, 4096, 256, "fp32")
    for config in CONFIGS:
        tile = bu.fk.TileConfig(*config)
        step = bu.methods(layer, "fp32", tile)["forge deferred"] if whole_call else bu.kernel_step(layer, tile)
        step()
        torch.cuda.synchronize()
        print(config, "host us per launch", bu.host_us(step), bu.host_us(step, 200))
        profile = cProfile.Profile()
        torch.cuda.synchronize()
        profile.enable()
        for _ in range(300):
            step()
        profile.disable()
        torch.cuda.synchronize()
        pstats.Stats(profile).sort_stats("cumulative" if whole_call else "tottime").print_stats(30)


if __name__ == "__main__":
    main()
