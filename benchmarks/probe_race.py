"""Race probe: repeats what ``probe_ab.py`` does before it times a config (a timing loop of
the kernel, then the bitwise checks) many times, and prints where any differing elements
sit: tile, column part, rows within the tile, columns within the part. A race between
warps shows up here as a rare difference confined to a few rows of one part; the unit
tests, which run each step once on a quiet GPU, may never see it. fp32 AdamW, as
``bench_update.check_fused_equals_oracle``: fused == oracle, and a captured step (device
scalars, graph replays at steps 2 and 3) == the uncaptured steps.

    python3 benchmarks/probe_race.py --configs "64,128,64,8,3,None,4,hopper" --shapes 8192x8192 --rounds 12
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_update as bu  # noqa: E402  (maps this tree's kernels/ to forge_kernels)
from checkout import parse_config  # noqa: E402


def where(config, name, a, b):
    """Where ``a`` and ``b`` differ bitwise, or None."""
    bad = (a.view(torch.int32) != b.view(torch.int32)).nonzero()
    if not len(bad):
        return None
    rows, cols = bad[:, 0].tolist(), bad[:, 1].tolist()
    height, sub = config.part_shape
    tiles = sorted({(r // config.block_n, c // config.block_k) for r, c in zip(rows, cols)})
    parts = sorted({(r % config.block_n // height) * (config.block_k // sub) + c % config.block_k // sub
                    for r, c in zip(rows, cols)})
    return (f"{name}: {len(rows)} differ in {len(tiles)} tiles {tiles[:4]} parts {parts} "
            f"rows-in-tile {sorted({r % config.block_n for r in rows})[:12]} "
            f"cols-in-part {sorted({c % sub for c in cols})[:12]}")


def differences(n, k, t, config):
    """Where the fused step differs from the oracle, and the captured from the uncaptured."""
    found = [where(config, f"oracle {name}", got, expected)
             for name, got, expected in bu.oracle_pairs(n, k, t, "fp32", config)]
    found += [where(config, f"captured {name}", got, expected)
              for name, got, expected in bu.captured_pairs(n, k, t, "fp32", config)]
    return [line for line in found if line]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", required=True, help="';'-separated configs as the sweeps print them")
    parser.add_argument("--shapes", default="8192x8192")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--timed-tokens", type=int, default=1024, help="tokens of the timing loop before each check")
    args = parser.parse_args()
    print(f"gpu {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {bu.triton.__version__}", flush=True)
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        for text in args.configs.split(";"):
            config = bu.fk.TileConfig(*parse_config(text))
            failed = 0
            for i in range(args.rounds):
                layer = bu.Layer(n, k, args.timed_tokens, "fp32")
                bu.timed(bu.capture(bu.kernel_step(layer, config))[0].replay)
                del layer
                found = differences(n, k, 512, config)
                failed += bool(found)
                for line in found:
                    print(f"  round {i}: {line}", flush=True)
            print(f"{text} {shape}: {failed} of {args.rounds} rounds differ", flush=True)


if __name__ == "__main__":
    main()
