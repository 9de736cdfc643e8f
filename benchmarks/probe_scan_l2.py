"""Does the input scan warm L2 for the fused kernel? ``bench_update.py``'s captured step
with ``input_check="step"`` (scan of x and dy, then the kernel) or ``"tiles"`` (the
kernel alone), each replay after an L2 flush as ``do_bench`` does it, a few times, for
a profiler to read the fused kernel's L2 hit rate and DRAM bytes in each:

    ncu --replay-mode application --clock-control none --cache-control none --kernel-name regex:'split_kernel|pingpong_kernel|_fused_weight_update_kernel' \
        --launch-skip 2 --launch-count 1 --metrics gpu__time_duration.sum,lts__t_sector_hit_rate.pct,dram__bytes_read.sum \
        python3 benchmarks/probe_scan_l2.py bf16-rn 1024 8192x8192 tiles

(``--cache-control none``: ncu must not flush L2 itself, or it would hide what is asked;
``--replay-mode application``: kernel replay saves and restores the kernel's memory
between passes, through L2, which would leave another L2 than the flush or the scan.)
Without a profiler it prints both settings' medians through ``bench_update.timed``
(``do_bench``, which flushes L2 before each call: the figure ``bench_update.py`` reports),
alternated.

Why: on an H100 at 63fcd3d, with bf16 state rounded to nearest at 1,024 tokens on 8192 x
8192, the step without the scan read slower than the step with it, in three readings
(benchmarks/HISTORY.md, "On an H100 at 63fcd3d"), though it does strictly less work.

    python3 benchmarks/probe_scan_l2.py REGIME TOKENS OUTxIN [step|tiles] [--steps-first N]

``--steps-first N`` (timed runs only) replays each step N times before it is timed, each
on its own state, as ``bench_update.py``'s earlier methods step the state its captured
rows then read: in the same session, the benchmark's unscanned row read 5-10 % slower
than this probe's.
"""

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_update as bu  # noqa: E402  (maps this tree's kernels/ to forge_kernels)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("regime")
    parser.add_argument("tokens", type=int)
    parser.add_argument("shape", help="OUTxIN")
    parser.add_argument("settings", nargs="*", help="step, tiles or both (the default)")
    parser.add_argument("--steps-first", type=int, default=0, help="replays of each step before timing")
    args = parser.parse_args()
    if not set(args.settings) <= {"step", "tiles"}:
        parser.error(f"settings are step and tiles, got {args.settings}")
    if args.steps_first and len(args.settings) == 1:
        # The profiled run's `ncu --launch-skip 2` counts the kernel's launches from the start.
        parser.error("--steps-first times both settings; a single setting is the profiled run, whose launch "
                     "count --launch-skip relies on")
    if not torch.cuda.is_available():
        sys.exit("probe_scan_l2.py measures on a GPU; none is visible here")
    regime, tokens, settings = args.regime, args.tokens, args.settings or ["step", "tiles"]
    n, k = map(int, args.shape.split("x"))
    config = bu.tuned_config(json.loads(bu.CONFIGS_FILE.read_text()), regime, tokens)
    layer = bu.Layer(n, k, tokens, regime)
    r = bu.rule()
    steps = {s: bu.captured_step(layer, config, r, layer.fresh_state(r), input_check=s) for s in settings}
    print(f"gpu {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {bu.triton.__version__}; "
          f"{regime} {n}x{k} T={tokens} {config}; {args.steps_first} steps first", flush=True)
    for step in steps.values():
        for _ in range(args.steps_first):
            step()
    if len(settings) == 1:  # under a profiler: a few replays, each after an L2 flush as do_bench's
        flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
        for _ in range(4):
            flush.zero_()
            steps[settings[0]]()
        torch.cuda.synchronize()
        return
    for setting in itertools.islice(itertools.cycle(settings), 3 * len(settings)):
        print(f"input_check={setting:5s} {bu.timed(steps[setting])[0]:.4f} ms", flush=True)


if __name__ == "__main__":
    main()
