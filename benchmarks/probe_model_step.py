"""Where a model's training step spends its GPU time: ``bench_model``'s step (same model,
variants and methods) run a few times under ``torch.profiler``, every GPU activity
grouped by kind (the fused FORGE step, matrix products, attention, torch's optimizer,
norms, element-wise, copies and fills), with the step's wall time, the GPU's busy time
and its idle gaps inside the steps, so the captured FORGE step and torch's can be
compared part by part in one run. The profiler slows the host, so where host work sits
between a step's GPU activities the idle it shows exceeds the unprofiled step's: take
idle as ``bench_model``'s wall time minus the busy time here.

    python3 benchmarks/probe_model_step.py [--layers 2] [--tokens 512,4096] [--variants bf16] \
        [--methods "torch captured,forge captured"] [--max-norm 1.0 --norm tiles] [--input-check tiles] [--back-to-back 10]
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

# FORGE's kernels, by their exact names (Triton names a kernel after its function).
FORGE_KERNELS = {
    "_fused_weight_update_kernel": "forge fused step", "pingpong_kernel": "forge fused step",
    "split_kernel": "forge fused step", "_square_sums_kernel": "forge tile norms", "_norm_kernel": "forge tile norms",
    "_weight_grad_kernel": "forge gradient", "_apply_rule_kernel": "forge rule", "_finite_check_kernel": "forge checks",
}
# Everything else, first match wins: a name (lower case) containing the key goes to that kind.
# torch's fused optimizers run in multi_tensor_apply_kernel<...FusedOptimizerTensorListMetadata...>;
# its other foreach kernels (clip_grad_norm_'s norms and scaling) are "foreach".
KINDS = (
    ("flash", "attention"), ("fmha", "attention"), ("sdpa", "attention"),
    ("fusedoptimizer", "torch optimizer"), ("multi_tensor", "foreach"),
    ("layer_norm", "rms/layer norms"), ("rms_norm", "rms/layer norms"),
    ("reduce_kernel", "reductions"), ("lpnorm", "reductions"),
    ("gemm", "matrix products"), ("nvjet", "matrix products"), ("cutlass", "matrix products"),
    ("xmma", "matrix products"),
    ("memcpy", "copies, casts and fills"), ("memset", "copies, casts and fills"), ("copy", "copies, casts and fills"),
    ("fill", "copies, casts and fills"),
    ("elementwise", "element-wise"),
)


def kind(name: str) -> str:
    if name in FORGE_KERNELS:
        return FORGE_KERNELS[name]
    lowered = name.lower()
    return next((k for key, k in KINDS if key in lowered), "other")


def busy_and_gaps(intervals):
    """(busy time, gaps) of (start, end, name) intervals sorted by start: busy is the length
    of their union, each gap (length, name before, name after) is measured from the
    latest end so far, so an activity inside a longer one opens no gap."""
    gaps, busy, latest, before = [], 0.0, None, None
    for begin, finish, name in intervals:
        if latest is None:
            busy, latest, before = finish - begin, finish, name
            continue
        if begin > latest:
            gaps.append((begin - latest, before, name))
        if finish > latest:
            busy += finish - max(begin, latest)
            latest, before = finish, name
    return busy, gaps


def breakdown(step, steps, back_to_back=1):
    """Per call of ``steps`` profiled runs of ``back_to_back`` calls: the median wall time
    (``bench_model.measure``: events around each run, synchronized after it), the GPU's
    busy time (the union of its activities' intervals) and its idle time, the mean GPU
    time per kind and kernel, and the idle gaps inside the profiled runs: each gap is
    measured from the latest end so far, and the ``steps - 1`` gaps between runs, where
    the host waits for the synchronization and runs the next call, are dropped, taken to
    be the largest (they were 0.1-0.9 ms on the H200, the gaps inside a step at most
    0.13 ms; the wall time holds only the part of them after the next step's start event)."""
    calls = steps * back_to_back
    for _ in range(4):
        step()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        wall = bm.measure(step, warmup=0, steps=steps, back_to_back=back_to_back)[0]
    per_kind, per_name = collections.Counter(), collections.Counter()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    for event in events:
        us = event.time_range.elapsed_us() / calls
        per_kind[kind(event.name)] += us
        per_name[event.name] += us
    busy, gaps = busy_and_gaps([(e.time_range.start, e.time_range.end, e.name) for e in events])
    gaps = sorted(gaps, reverse=True)[steps - 1:]
    return wall, busy / calls, sum(g for g, _, _ in gaps) / calls, per_kind, per_name, gaps


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", default="512,4096")
    parser.add_argument("--variants", default="bf16")
    parser.add_argument("--methods", default="torch captured,forge captured")
    parser.add_argument("--max-norm", type=float, default=None)
    parser.add_argument("--norm", choices=("gradient", "tiles"), default="gradient")
    parser.add_argument("--input-check", choices=("step", "tiles"), default="step",
                        help="the fused layers' input_check, as bench_model's flag")
    parser.add_argument("--top", type=int, default=8, help="also list this many kernels by time")
    parser.add_argument("--steps", type=int, default=3, help="profiled runs per row")
    parser.add_argument("--back-to-back", type=int, default=1,
                        help="calls per run with no wait between them, as a training loop calls steps")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("probe_model_step.py measures on a GPU; none is visible here")
    configs = json.loads(CONFIGS_FILE.read_text()) if CONFIGS_FILE.exists() else {}
    print(f"gpu {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"per step of {args.steps} profiled runs of {args.back_to_back} call(s) (wall: median; GPU times: mean)")
    for tokens in (int(t) for t in args.tokens.split(",")):
        for name in args.variants.split(","):
            for method in args.methods.split(","):
                model, step = bm.variant(name, method, args.layers, tokens, configs,
                                         max_norm=args.max_norm, norm=args.norm,
                                         input_check=args.input_check)
                wall_ms, busy_us, idle_us, per_kind, per_name, gaps = breakdown(step, args.steps,
                                                                                args.back_to_back)
                print(f"T={tokens:5d} {name:11s} {method:21s} wall {wall_ms:6.2f} ms, "
                      f"GPU busy {busy_us / 1e3:6.2f} ms, "
                      f"idle inside the steps {idle_us / 1e3:5.3f} ms; largest gaps (us, all steps): "
                      f"{', '.join(f'{g:.0f}' for g, _, _ in gaps[:6])}")
                for g, before, after in gaps[:3]:
                    print(f"      gap {g:7.1f} us after {before[:50]} before {after[:50]}")
                for k, us in per_kind.most_common():
                    print(f"    {k:22s} {us / 1e3:7.3f} ms")
                for n, us in per_name.most_common(args.top):
                    print(f"      {us / 1e3:7.3f} ms  {n[:110]}")
                del model, step
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
