"""Is a CUDA-graph replay slower than the eager launch of the same work at long token
counts? ``bench_update.py``'s own callables (``forge kernel`` and ``forge kernel
replayed``, ``forge captured unscanned``, ``torch`` and ``torch captured``) timed two ways,
in rounds that alternate the methods, with the SM clock and board power sampled by
``nvidia-smi`` every 50 ms:

* ``do_bench``: ``bench_update.timed``, Triton's ``do_bench`` with its L2 flush before
  each call, the figure ``bench_update.py`` reports;
* ``back to back``: ``probe_clocks.replay_for``, calls with no flush and no wait, for
  two seconds.

Why: on an H100 at 16,384 tokens (benchmarks/HISTORY.md, "On an H100 at 63fcd3d") torch's captured
step read slower than its eager one (4.12 against 3.68 ms on 8192 x 8192, fp32) and
FORGE's kernel replayed slower than launched eagerly (4.47 against 3.69 ms), while
FORGE's captured step was not; the ratios against torch captured there rest on it.
If the back-to-back times agree where ``do_bench``'s do not, the gap is in the timing,
not in the graphs.

    PYTHONPATH=. python3 benchmarks/probe_replay.py [--cases 8192x8192:16384,4096x4096:16384] \
        [--regimes fp32] [--rounds 2]
"""

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_update as bu  # noqa: E402  (maps this tree's kernels/ to forge_kernels)
from probe_clocks import clock_samples, clock_summary, parse_cases, replay_for  # noqa: E402

METHODS = ("forge kernel", "forge kernel replayed", "forge captured unscanned", "torch", "torch captured")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="8192x8192:16384,4096x4096:16384", help="OUTxIN:tokens, comma-separated")
    parser.add_argument("--regimes", default="fp32")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("probe_replay.py measures on a GPU; none is visible here")
    configs = json.loads(bu.CONFIGS_FILE.read_text())
    print(f"gpu {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {bu.triton.__version__}", flush=True)
    phases = []
    print(f"{'case':58s} do_bench  back to back (ms)", flush=True)
    with clock_samples() as rows:
        for n, k, t in parse_cases(args.cases):
            for regime in args.regimes.split(","):
                layer = bu.Layer(n, k, t, regime)
                found = bu.methods(layer, regime, bu.tuned_config(configs, regime, t))
                # Reversed every other round: a method's reading after another's two seconds at
                # the power cap must not always follow the same method.
                for reading, name in bu.in_rounds(METHODS, args.rounds):
                    flushed_start = time.time()
                    flushed = bu.timed(found[name])[0]
                    start, end, ms = replay_for(found[name])
                    label = f"{n}x{k} T={t} {regime} {name} #{reading}"
                    # Printed as measured: a timeout later loses no reading.
                    print(f"{label:58s} {flushed:8.4f}  {ms:8.4f}", flush=True)
                    phases.append((label, flushed_start, start, end))
                del layer, found
                gc.collect()
                torch.cuda.empty_cache()
    print("clocks: during do_bench (all samples) | back to back (after its first 0.3 s)")
    for label, flushed_start, start, end in phases:
        print(f"{label:58s} {clock_summary(rows, flushed_start, start, settle=0.0)} | "
              f"{clock_summary(rows, start, end)}", flush=True)


if __name__ == "__main__":
    main()
