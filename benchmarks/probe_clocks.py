"""The SM clock and board power while the split kernel's token loop alone
(``probe_wide_loop.py``'s product variant), the tuned fused fp32 kernel and cuBLAS's dW
each replay back to back for two seconds, twice, sampled by ``nvidia-smi`` every 50 ms.

Why: at 16,384 tokens the fused kernel runs about 12 % longer than its token loop alone,
and an H100 runs such work at its 700 W cap; if the epilogue's extra memory traffic cost
power, the clock would drop while the fused kernel runs. ms/iter is from CUDA events over
the replays (no L2 flush between them, unlike ``do_bench``; the host waits for the GPU
every 20 replays, in the time measured); the clock and power are the samples after each
phase's first 0.3 s.

    PYTHONPATH=. python3 benchmarks/probe_clocks.py [--cases 4096x4096:16384,4096x14336:16384]
"""

import argparse
import contextlib
import datetime
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_update as bu  # noqa: E402  (maps this tree's kernels/ to forge_kernels)
import probe_wide_loop as pw  # noqa: E402

FIELDS = "timestamp,clocks.sm,power.draw,clocks_event_reasons.active"


def replay_for(fn, seconds=2.0):
    """(start, end, ms per call) of ``fn`` called back to back for ``seconds``."""
    torch.cuda.synchronize()
    start = time.time()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    calls = 0
    while time.time() - start < seconds:
        for _ in range(20):
            fn()
        calls += 20
        torch.cuda.synchronize()
    end.record()
    torch.cuda.synchronize()
    return start, time.time(), begin.elapsed_time(end) / calls


def samples(path):
    """(time, SM MHz, watts, throttle reasons) per nvidia-smi line (its clock is this machine's)."""
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            stamp, mhz, watts, reasons = (v.strip() for v in line.split(","))
            rows.append((datetime.datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f").timestamp(), float(mhz),
                         float(watts), reasons))
        except ValueError:  # "[N/A]", or the last line cut off when the sampler stopped: not a sample
            continue
    return rows


def parse_cases(text):
    """"OUTxIN:tokens,..." -> [(out, in, tokens), ...]."""
    cases = []
    for case in text.split(","):
        shape, t = case.split(":")
        n, k = map(int, shape.split("x"))
        cases.append((n, k, int(t)))
    return cases


@contextlib.contextmanager
def clock_samples():
    """Sample the SM clock and board power every 50 ms while the block runs; the list it
    yields holds ``samples``' rows once the block is over."""
    rows = []
    with tempfile.NamedTemporaryFile("w", suffix=".csv") as log:
        smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits", "-lms", "50"],
                               stdout=log)
        try:
            yield rows
        finally:
            time.sleep(0.2)
            smi.terminate()
            smi.wait()
            log.flush()
            rows.extend(samples(log.name))


def clock_summary(rows, start, end, settle=0.3):
    """The samples of one phase, past its first ``settle`` seconds (the clock settling), in
    one line."""
    inside = [r for r in rows if start + settle <= r[0] <= end]
    if not inside:
        return "no clock samples"
    return (f"SM clock median {statistics.median(r[1] for r in inside):.0f} MHz "
            f"min {min(r[1] for r in inside):.0f}  power median {statistics.median(r[2] for r in inside):.0f} W  "
            f"reasons {sorted(set(r[3] for r in inside))}  ({len(inside)} samples)")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="4096x4096:16384,4096x14336:16384", help="OUTxIN:tokens, comma-separated")
    args = parser.parse_args()
    configs = bu.json.loads(bu.CONFIGS_FILE.read_text())
    print(f"gpu {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {bu.triton.__version__}", flush=True)
    phases = []
    with clock_samples() as rows:
        for n, k, t in parse_cases(args.cases):
            layer = bu.Layer(n, k, t, "fp32")
            loop, _ = pw.loop_step(layer.x, layer.dy, "product loop 128x128, TMA warp, 4 x 64")
            cases = {"loop alone": bu.capture(loop)[0].replay,
                     "fused kernel": bu.capture(bu.kernel_step(layer, bu.tuned_config(configs, "fp32", t)))[0].replay,
                     "cuBLAS dW": bu.capture(lambda: bu.torch_grad(layer))[0].replay}
            for reading in range(2):
                for name, fn in cases.items():
                    phases.append((f"{n}x{k} T={t} {name} #{reading}", *replay_for(fn)))
            del layer, cases
    for name, start, end, ms in phases:
        print(f"{name:45s} {ms:.4f} ms/iter  {clock_summary(rows, start, end)}", flush=True)


if __name__ == "__main__":
    main()
