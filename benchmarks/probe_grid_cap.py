"""Is the persistent fused kernel bound per program or by HBM? Its grid is one program per
multiprocessor, each taking tiles round after round; here the grid is capped below the
multiprocessor count (``hopper_update._multiprocessors`` patched for the launch) and the
kernel alone replayed from a CUDA graph captured with each cap, the caps timed in rounds
alternating their order (``bench_update.timed_in_rounds``). If time follows the number of
rounds (``ceil(tiles / programs)``), the case is bound per program and a last round that is
only partly full costs a whole one; if it stays flat, HBM bounds it. ``balanced`` is the
fewest programs that keep the uncapped round count (tile counts that differ by at most one
between programs, and by none where the programs divide the tiles).

Every cap starts from the same weight and seeded state and its first step's weight and
state are compared bitwise with the uncapped launch's: tiles never depend on which
program takes them, so a difference is a bug.

    python3 benchmarks/probe_grid_cap.py [--cases 4096x4096:256:fp32,...] [--below 4,12,20] [--rounds 6]
"""

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_update as bu  # noqa: E402  (maps this tree's kernels/ to forge_kernels)

import forge_kernels.ops.hopper_update as hopper_update  # noqa: E402

DEFAULT_CASES = "4096x4096:256:fp32,4096x4096:512:fp32,4096x4096:1024:fp32,4096x4096:256:bf16-rn"


def capped_steps(layer, config, caps):
    """cap -> (the kernel's graph replay, its first step's weight and state)."""
    real = hopper_update._multiprocessors
    r, w_init = bu.rule(), layer.w.clone()
    found = {}
    try:
        for cap in caps:
            hopper_update._multiprocessors = lambda index, c=cap: c
            torch.manual_seed(0)
            state = layer.fresh_state(r)
            layer.w.copy_(w_init)
            step = bu.kernel_step(layer, config, r, state)
            step()
            torch.cuda.synchronize()
            first = [layer.w.clone(), *(v.clone() for v in state.values())]
            found[cap] = (bu.capture(step)[0].replay, first)
    finally:
        hopper_update._multiprocessors = real
    return found


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default=DEFAULT_CASES, help="NxK:tokens:regime, comma-separated")
    parser.add_argument("--below", default="4,12,20", help="caps this many programs below the SM count")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    configs = json.loads(bu.CONFIGS_FILE.read_text())
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"gpu {torch.cuda.get_device_name()} ({sms} SMs), torch {torch.__version__}, triton {bu.triton.__version__}")
    for case in args.cases.split(","):
        shape, t, regime = case.split(":")
        n, k = map(int, shape.split("x"))
        layer = bu.Layer(n, k, int(t), regime)
        config = bu.tuned_config(configs, regime, int(t))
        if config.kernel != "hopper":
            print(f"{case}: its entry is the portable kernel, one program per tile: no grid to cap")
            continue
        tiles = math.ceil(n / config.block_n) * math.ceil(k / config.block_k)
        balanced = math.ceil(tiles / math.ceil(tiles / sms))
        uncapped = min(sms, tiles)  # the launch's own grid: a program per tile where tiles are fewer
        caps = sorted({uncapped, balanced, *(sms - int(b) for b in args.below.split(","))} & set(range(1, tiles + 1)),
                      reverse=True)
        found = capped_steps(layer, config, caps)
        same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # bytes: every dtype, NaN included
                   for cap in caps for a, b in zip(found[cap][1], found[uncapped][1]))
        names = {f"cap {cap:3d} ({math.ceil(tiles / cap)} rounds)": cap for cap in caps}
        times = bu.timed_in_rounds({name: found[cap][0] for name, cap in names.items()}, args.rounds)
        base = times[next(iter(names))][0]
        print(f"{regime} {n}x{k} T={t} {config} tiles {tiles} bits-equal-across-caps {same}", flush=True)
        for name, (median, low, high) in times.items():
            print(f"   {name:24s} {median:.4f} ms  [{low:.4f} {high:.4f}]  {base / median:.3f}x", flush=True)
        del found, layer
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
