"""The portable kernel's dy and x blocks read by masked pointer loads against TMA tensor
descriptors (``TileConfig.operand_loads``), per config, beside torch's captured step and
the tuned config in the same process: each config's fused kernel replayed from a CUDA
graph with each kind of load, its registers and spills, and whether the two give the same
weight and state bits after one step (they must: the same blocks, the same ``tl.dot``).

    python3 benchmarks/probe_operand_loads.py --tokens 16384 --regimes fp32,bf16-sr \\
        --shapes 4096x4096,8192x8192,4096x14336,14336x4096 \\
        --configs "128,256,64,16,3,None,4;128,256,64,16,3,None,8,portable,rows"
"""

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_update as bu  # noqa: E402  (maps this tree's kernels/ to forge_kernels)
from checkout import parse_config  # noqa: E402

import forge_kernels as fk  # noqa: E402
from forge_verify.numerics.bits import int_view  # noqa: E402


def stepped_bits(n, k, t, regime, config):
    """Weight and state after one fused step of ``config`` on a fixed layer and state."""
    layer = bu.Layer(n, k, t, regime, seed=3)
    r = bu.rule()
    torch.manual_seed(5)  # fresh_state draws from the global generator
    state = layer.fresh_state(r)
    bu.kernel_step(layer, config, r, state)()
    torch.cuda.synchronize()
    return [layer.w] + list(state.values())


def same_bits(a, b):
    assert len(a) == len(b)
    return all(torch.equal(int_view(x), int_view(y)) if x.is_floating_point() else torch.equal(x, y)
               for x, y in zip(a, b))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="4096x4096,8192x8192")
    parser.add_argument("--tokens", default="4096,16384")
    parser.add_argument("--regimes", default="fp32,bf16-sr")
    parser.add_argument("--configs", required=True, help="TileConfig fields, configs separated by ';'")
    args = parser.parse_args(argv)
    configs = [fk.TileConfig(*parse_config(c)) for c in args.configs.split(";")]  # loads are set per row
    tuned = json.loads(bu.CONFIGS_FILE.read_text())
    print(f"gpu {torch.cuda.get_device_name()} torch {torch.__version__}")
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        for t in (int(v) for v in args.tokens.split(",")):
            for regime in args.regimes.split(","):
                layer = bu.Layer(n, k, t, regime)
                torch_ms, entry, tuned_ms = bu.torch_and_tuned(layer, regime, t, tuned)
                print(f"{n}x{k} T={t:5d} {regime:7s} torch captured {torch_ms:.4f}  tuned {entry} {tuned_ms:.4f} "
                      f"({torch_ms / tuned_ms:.3f}x)", flush=True)
                for config in configs:
                    row, bits = [], []
                    for loads in ("pointers", "tma"):
                        variant = dataclasses.replace(config, operand_loads=loads)
                        try:
                            step = bu.kernel_step(layer, variant)
                            handle = step()
                            ms = bu.timed(bu.capture(step)[0].replay)[0]
                            row.append(f"{loads} {ms:.4f} ms ({torch_ms / ms:.3f}x torch, {tuned_ms / ms:.3f}x tuned) "
                                       f"{handle.n_regs} regs {handle.n_spills} spills")
                            bits.append(stepped_bits(n, k, t, regime, variant))
                        except Exception as error:  # e.g. out of shared memory: named, not hidden
                            row.append(f"{loads} {type(error).__name__}: {str(error)[:100]}")
                    same = same_bits(*bits) if len(bits) == 2 else "not compared"
                    print(f"   {config}: " + " | ".join(row) + f" | bits pointers == tma: {same}", flush=True)
                del layer
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
