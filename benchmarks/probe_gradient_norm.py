"""What does clipping's norm cost without the gradient? One layer's gradient norm taken
three ways, each replayed from a CUDA graph (as a captured step launches it), beside the
fused step it accompanies, on bf16 activations with the tuned config of the regime
(``--regime``, default fp32) at the token count (``tuned_configs.json``):

* ``tiles``: ``weight_gradient_norm``, the fused kernel's tile loop keeping one sum of
  squares per tile (what ``norm="tiles"`` runs); no gradient is stored;
* ``gradient``: ``weight_gradient`` (the same tile loop, the fp32 gradient stored) then
  ``torch.linalg.vector_norm`` (what ``norm="gradient"`` runs, ``clip_grad_norm_``'s bits);
* ``cuBLAS``: ``torch.mm`` to an fp32 gradient then ``vector_norm`` (what a torch
  pipeline with ``clip_grad_norm_`` pays for the norm of a gradient it has anyway);

and the peak memory each takes beyond its inputs (measured eagerly), and how far the
tile norm is from the float64 norm of the cuBLAS gradient (relative). Then the fused step
that keeps its tiles' sums itself (``square_sums=``, what previous-norm clipping with tile
norms runs) and takes the norm from them: on the portable kernel (the q8 regime's tuned
configs, or a portable config) the sums come from its epilogue; the Hopper kernels launch
the tile loop a second time for them.

    python3 benchmarks/probe_gradient_norm.py [--shapes 4096x4096,...] [--tokens 512,1024,4096] [--regime q8]
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_update as bu  # noqa: E402  (maps this tree's kernels/ to forge_kernels)

import forge_kernels as fk  # noqa: E402
from forge_kernels.ops.fused_weight_update import _Epilogue  # noqa: E402


def norms(x, dy, config):
    """name -> zero-argument callable returning the layer's gradient norm."""
    def cublas():
        try:
            grad = torch.mm(dy.t(), x, out_dtype=torch.float32)
        except TypeError:
            grad = torch.mm(dy.t(), x).float()
        return torch.linalg.vector_norm(grad, 2.0)
    return {"tiles": lambda: fk.weight_gradient_norm(x, dy, config=config),
            "gradient": lambda: torch.linalg.vector_norm(fk.weight_gradient(x, dy, config=config), 2.0),
            "cuBLAS": cublas}


def step_keeping_sums(layer, config):
    """The fused kernel launched alone (as ``bench_update.kernel_step``), keeping its tiles'
    sums of squares, then the norm from them."""
    r = bu.rule()
    state = layer.fresh_state(r)
    epilogue = _Epilogue(layer.w, state, r, 1, config, layer.rounding, 0, 1.0, None)
    sums = fk.empty_square_sums(tuple(layer.w.shape), config, "cuda")

    def step():
        epilogue.fused(layer.x, layer.dy, layer.w, sums)
        return fk.norm_from_square_sums(sums)
    return step


def peak_extra_mib(fn):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="4096x4096,8192x8192,14336x4096,4096x14336")
    parser.add_argument("--tokens", default="512,1024,4096")
    parser.add_argument("--regime", default="fp32", choices=sorted(bu.REGIMES))
    args = parser.parse_args()
    configs = json.loads(bu.CONFIGS_FILE.read_text())
    print(f"gpu {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          "median of graph replays, ms", flush=True)
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        for t in (int(v) for v in args.tokens.split(",")):
            layer = bu.Layer(n, k, t, args.regime)
            config = bu.tuned_config(configs, args.regime, t)
            exact = torch.linalg.vector_norm(torch.mm(layer.dy.t().double(), layer.x.double()), 2.0).item()
            step_ms = bu.timed(bu.capture(bu.kernel_step(layer, config))[0].replay)[0]
            row = [f"{n}x{k} T={t:5d} fused step {step_ms:.4f}"]
            for name, fn in norms(layer.x, layer.dy, config).items():
                value = fn().item()
                mib = peak_extra_mib(fn)
                ms = bu.timed(bu.capture(fn)[0].replay)[0]
                row.append(f"{name} {ms:.4f} ({ms / step_ms:.2f}x the step, {mib:.1f} MiB, "
                           f"rel {abs(value - exact) / exact:.1e})")
            keeping = step_keeping_sums(layer, config)
            value = keeping().item()
            ms = bu.timed(bu.capture(keeping)[0].replay)[0]
            row.append(f"step keeping sums + norm {ms:.4f} ({ms / step_ms:.2f}x the step, "
                       f"rel {abs(value - exact) / exact:.1e})")
            print(" | ".join(row), f"| config {config}", flush=True)
            del layer
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
