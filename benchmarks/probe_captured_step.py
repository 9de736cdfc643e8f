"""Where a captured fused step's GPU time goes beyond the kernel's: the parts of
``bench_update``'s ``forge captured`` row (``StepScalars.set``, then one replay of the
graph of ``fused_weight_update(..., report="defer")``) timed one by one, each replayed
from its own CUDA graph with ``do_bench`` (L2 flushed before each call), beside the
kernel alone (``forge kernel replayed``) and torch's captured step, in the same run; then
a ``torch.profiler`` trace of a few captured steps listing every GPU activity (kernels,
copies, memsets) with its duration and the idle gap before it. ``--input-check tiles``
times the step without its input scan (``bench_update``'s ``forge captured unscanned``
row), whose graph holds no check.

    python3 benchmarks/probe_captured_step.py [--shapes 4096x4096] [--tokens 256,512,1024] [--regimes fp32] \
        [--input-check step|tiles]
"""

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_update as bu  # noqa: E402  (maps this tree's kernels/ to forge_kernels)

from forge_kernels.ops.finite_check import STATUS_WORDS, launch_finite_check  # noqa: E402

fk = bu.fk


def parts(layer, config, input_check="step"):
    """name -> zero-argument callable: the captured step and its parts (the input check's
    only with ``input_check="step"``)."""
    r = bu.rule()
    state = layer.fresh_state(r)
    scalars = fk.StepScalars(r, seed=1, device="cuda").set(1)
    kernel = bu.kernel_step(layer, config, r, state)
    found = {"kernel": bu.capture(kernel)[0].replay}
    # The words a call zeroes, as many as its _Epilogue allocates: the status, one flag per
    # tile part and the ticket counter.
    words = sum(t.numel() for t in (kernel.epilogue.status, kernel.epilogue.flags, kernel.epilogue.tickets))

    if input_check == "step":
        status = torch.zeros(STATUS_WORDS, dtype=torch.int32, device="cuda")

        def check_and_kernel():
            launch_finite_check(status, layer.x, layer.dy)
            kernel()
        found["check + kernel"] = bu.capture(check_and_kernel)[0].replay
        found["check"] = bu.capture(lambda: launch_finite_check(status, layer.x, layer.dy))[0].replay
    found["status zeros"] = bu.capture(lambda: torch.zeros(words, dtype=torch.int32, device="cuda"))[0].replay
    call, _ = bu.capture(lambda: fk.fused_weight_update(layer.x, layer.dy, layer.w, state, r, scalars, seed=1,
                                                        config=config, rounding=layer.rounding, report="defer",
                                                        input_check=input_check))
    found["call replay"] = call.replay
    steps = itertools.count(2)
    found["scalars set"] = lambda: scalars.set(next(steps))

    def captured():
        scalars.set(next(steps))
        call.replay()
    found["set + call replay (forge captured)"] = captured
    found["torch captured"] = bu.methods(layer, "fp32" if layer.w.dtype == torch.float32 else "bf16-sr",
                                         config)["torch captured"]
    return found, captured


def trace(step, steps=5):
    """GPU activities of ``steps`` calls, each after an L2 flush, with the gap before each."""
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            flush.zero_()
            step()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    end = None
    for e in events:
        gap = "" if end is None else f"gap {e.time_range.start - end:7.1f} us"
        print(f"  {e.time_range.elapsed_us():8.1f} us  {gap:16s} {e.name[:90]}")
        end = e.time_range.end


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="4096x4096")
    parser.add_argument("--tokens", default="256,512,1024")
    parser.add_argument("--regimes", default="fp32")
    parser.add_argument("--input-check", choices=("step", "tiles"), default="step",
                        help="the captured call's input_check (default step: the input scan)")
    args = parser.parse_args()
    configs = json.loads(bu.CONFIGS_FILE.read_text())
    print(f"gpu {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {bu.triton.__version__}")
    for shape, t, regime in itertools.product(args.shapes.split(","), map(int, args.tokens.split(",")),
                                              args.regimes.split(",")):
        n, k = map(int, shape.split("x"))
        config = bu.tuned_config(configs, regime, t)
        layer = bu.Layer(n, k, t, regime)
        found, captured = parts(layer, config, args.input_check)
        print(f"{n}x{k} T={t} {regime} input_check={args.input_check} {config}")
        for name, fn in found.items():
            median, low, high = bu.timed(fn)
            print(f"  {name:38s} {median:.4f} ms  (min {low:.4f}, max {high:.4f})")
        trace(captured)


if __name__ == "__main__":
    main()
