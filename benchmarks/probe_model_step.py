"""Where a model's training step spends its GPU time: ``bench_model``'s step (same model,
variants and methods) run a few times under ``torch.profiler``, every GPU activity
grouped by kind (the fused FORGE step, matrix products, attention, torch's optimizer,
norms, element-wise, copies and fills), with the step's busy and wall time, so the
captured FORGE step and torch's can be compared part by part in one run.

    python3 benchmarks/probe_model_step.py [--layers 2] [--tokens 512,4096] [--variants bf16] \
        [--methods "torch captured,forge captured"] [--max-norm 1.0 --norm tiles]
"""

import argparse
import collections
import json
import sys
from pathlib import Path

import torch
import triton
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_model as bm  # noqa: E402  (also maps kernels/ to forge_kernels)
from bench_update import CONFIGS_FILE  # noqa: E402

# First match wins: a kernel's name (lower case) containing the key goes to that kind.
KINDS = (
    ("_fused_weight_update_kernel", "forge fused step"), ("pingpong_kernel", "forge fused step"),
    ("split_kernel", "forge fused step"), ("_square_sums_kernel", "forge tile norms"), ("_total_kernel", "forge tile norms"),
    ("_weight_grad_kernel", "forge gradient"), ("_apply_rule_kernel", "forge rule"), ("_finite_check", "forge checks"),
    ("flash", "attention"), ("fmha", "attention"), ("attention", "attention"),
    ("adam", "torch optimizer"), ("multi_tensor", "torch optimizer"), ("norm", "norms"),
    ("gemm", "matrix products"), ("nvjet", "matrix products"), ("cutlass", "matrix products"), ("sm90", "matrix products"),
    ("memcpy", "copies and fills"), ("memset", "copies and fills"), ("fill", "copies and fills"),
    ("elementwise", "element-wise"), ("vectorized", "element-wise"), ("reduce", "reductions"),
)


def kind(name: str) -> str:
    lowered = name.lower()
    return next((k for key, k in KINDS if key in lowered), "other")


def breakdown(step, steps=3):
    """Per step: wall time (events around each step, synchronized after it as
    ``bench_model`` times it), GPU time per kind and per kernel, and the idle gaps between
    consecutive GPU activities (the largest, with the activities on either side)."""
    for _ in range(4):
        step()
    torch.cuda.synchronize()
    walls = []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            walls.append(start.elapsed_time(end))
    per_kind, per_name = collections.Counter(), collections.Counter()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    gaps = []
    for before, after in zip(events, events[1:]):
        gap = after.time_range.start - before.time_range.end
        if gap > 0:
            gaps.append((gap, before.name, after.name))
    for event in events:
        us = event.time_range.elapsed_us() / steps
        per_kind[kind(event.name)] += us
        per_name[event.name] += us
    return sum(walls) / steps, per_kind, per_name, sorted(gaps, reverse=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", default="512,4096")
    parser.add_argument("--variants", default="bf16")
    parser.add_argument("--methods", default="torch captured,forge captured")
    parser.add_argument("--max-norm", type=float, default=None)
    parser.add_argument("--norm", choices=("gradient", "tiles"), default="gradient")
    parser.add_argument("--top", type=int, default=8, help="also list this many kernels by time")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("probe_model_step.py measures on a GPU; none is visible here")
    configs = json.loads(CONFIGS_FILE.read_text()) if CONFIGS_FILE.exists() else {}
    print(f"gpu {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"per step, mean of 3 profiled steps")
    for tokens in (int(t) for t in args.tokens.split(",")):
        for name in args.variants.split(","):
            for method in args.methods.split(","):
                model, step = bm.variant(name, method, args.layers, tokens, configs,
                                         max_norm=args.max_norm, norm=args.norm)
                wall_ms, per_kind, per_name, gaps = breakdown(step)
                busy = sum(per_kind.values()) / 1e3
                # Gaps include the two between the profiled steps (host work before a step's
                # first activity shows there); the largest are listed with their neighbours.
                print(f"T={tokens:5d} {name:11s} {method:15s} wall {wall_ms:6.2f} ms, GPU busy {busy:6.2f} ms, "
                      f"{len(gaps)} gaps, largest {', '.join(f'{g:.0f}' for g, _, _ in gaps[:8])} us, "
                      f"sum of gaps under 50 us {sum(g for g, _, _ in gaps if g < 50) / 3e3:.3f} ms per step")
                for g, before, after in gaps[:4]:
                    print(f"      gap {g:7.1f} us after {before[:50]} before {after[:50]}")
                for k, us in per_kind.most_common():
                    print(f"    {k:22s} {us / 1e3:7.3f} ms")
                for n, us in per_name.most_common(args.top):
                    print(f"      {us / 1e3:7.3f} ms  {n[:110]}")
                del model, step
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
