"""The non-finite input check inside the split kernel (``TileConfig(in_kernel_check=True)``)
against the separate check kernel before it: the captured step (``bench_update``'s
``forge captured``: ``StepScalars.set`` and one replay of the fused call) with each, and
the kernel alone, timed alternately in one process beside torch's captured step; first
one step with each from the same weight and state, compared bit for bit, and one with a
NaN in dy, which must write nothing with either.

The tuned config of each regime and token count (or ``--config``, for a regime whose
tuned entry is not the split kernel) is the separate-check side; the same config with
``in_kernel_check=True`` the other (split Hopper configs only).

    PYTHONPATH=. python3 benchmarks/probe_in_kernel_check.py [--shapes 4096x4096] [--tokens 4096,16384] [--regimes fp32]
        [--config "128,128,64,8,4,None,8,hopper,rows,None,pointers,True"]
"""

import argparse
import dataclasses
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_update as bu  # noqa: E402  (maps this tree's kernels/ to forge_kernels)
from checkout import parse_config  # noqa: E402
from probe_operand_loads import same_bits  # noqa: E402

fk = bu.fk


def one_step(layer, config, nan=False):
    """Weight and state after one fused step from the layer's fresh state (seeded), or None
    where the call refused non-finite inputs."""
    r = bu.rule()
    torch.manual_seed(0)
    state = layer.fresh_state(r)
    w = layer.w.clone()
    dy = layer.dy.clone()
    if nan:
        dy[dy.shape[0] // 2, dy.shape[1] - 1] = float("nan")
    try:
        fk.fused_weight_update(layer.x, dy, w, state, r, 1, config=config, rounding=layer.rounding)
    except fk.NonFiniteInputError:
        assert torch.equal(w.view(torch.uint8), layer.w.view(torch.uint8)), "a refused step wrote the weight"
        return None
    return [w] + list(state.values())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="4096x4096")
    parser.add_argument("--tokens", default="4096,16384")
    parser.add_argument("--regimes", default="fp32")
    parser.add_argument("--config", help="the separate-check side's tile config (default: the tuned one)")
    args = parser.parse_args()
    configs = bu.json.loads(bu.CONFIGS_FILE.read_text())
    print(f"gpu {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {bu.triton.__version__}")
    for shape, t, regime in itertools.product(args.shapes.split(","), map(int, args.tokens.split(",")),
                                              args.regimes.split(",")):
        n, k = map(int, shape.split("x"))
        separate = (fk.TileConfig(*parse_config(args.config)) if args.config
                    else bu.tuned_config(configs, regime, t))
        if not (separate.kernel == "hopper" and separate.num_warps in (8, 16)):
            print(f"{n}x{k} T={t} {regime}: tuned {separate} is not the split kernel; skipped", flush=True)
            continue
        folded = dataclasses.replace(separate, in_kernel_check=True)
        layer = bu.Layer(n, k, t, regime)
        bits = same_bits(one_step(layer, separate), one_step(layer, folded))
        refused = one_step(layer, separate, nan=True) is None and one_step(layer, folded, nan=True) is None
        r = bu.rule()
        steps = {"separate check": bu.captured_step(layer, separate, r, layer.fresh_state(r)),
                 "in-kernel check": bu.captured_step(layer, folded, r, layer.fresh_state(r)),
                 "kernel alone, separate": bu.capture(bu.kernel_step(layer, separate))[0].replay,
                 "kernel alone, in-kernel check": bu.capture(bu.kernel_step(layer, folded))[0].replay,
                 "torch captured": bu.methods(layer, regime, separate)["torch captured"]}
        times = {name: [] for name in steps}
        for _ in range(2):  # alternated, so that drift falls on every side alike
            for name, step in steps.items():
                times[name].append(bu.timed(step)[0])
        torch_ms = min(times["torch captured"])
        print(f"{n}x{k} T={t} {regime} {separate}: bits equal {bits}, NaN in dy refused by both {refused}",
              flush=True)
        for name, ms in times.items():
            print(f"  {name:30s} {ms[0]:.4f} / {ms[1]:.4f} ms  torch captured / this {torch_ms / min(ms):.3f}",
                  flush=True)
        gain = min(times["separate check"]) / min(times["in-kernel check"])
        print(f"  captured step: in-kernel check {gain:.3f}x the separate check", flush=True)
        del layer, steps


if __name__ == "__main__":
    main()
