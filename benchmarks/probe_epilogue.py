"""Where the fused kernel's time goes: the kernel with no tokens (its epilogue alone: the
weight and state read, updated and written, no matrix work) and with 256 and 1,024
tokens, stochastic against nearest rounding, and the oracle's second kernel (the same
epilogue on a materialized gradient), each against the copy floor measured in the same
run. Optionally the same kernel from other trees (``--tree label=path/to/kernels``, e.g.
a copy with fewer Philox rounds). A diagnostic, not the benchmark table (that is
``bench_update.py``).

    python3 benchmarks/probe_epilogue.py [--tree r7=/tmp/kernels-r7]
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_update as bu  # noqa: E402  (maps this tree's kernels/ to forge_kernels)
from checkout import config_tuple  # noqa: E402
from probe_ab import load_tree  # noqa: E402

fk = bu.fk
CASES = (("fp32", None), ("bf16-sr", "stochastic"), ("bf16-sr", "nearest"), ("q8", "stochastic"), ("q8", "nearest"))


def epilogue_of(package, layer, config, rounding):
    r = package.AdamW(lr=1e-3, weight_decay=0.01)
    state = layer.fresh_state(r)
    cls = sys.modules[f"{package.__name__}.ops.fused_weight_update"]._Epilogue
    return cls(layer.w, state, r, 1, package.TileConfig(*config), rounding, 0, 1.0, None)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tree", action="append", default=[], help="label=folder of another kernels/ tree")
    parser.add_argument("--shape", default="4096x4096")
    parser.add_argument("--tokens", default="0,256,1024")
    args = parser.parse_args()
    trees = {"this": fk}
    for entry in args.tree:
        label, folder = entry.split("=", 1)
        trees[label] = load_tree(Path(folder), f"forge_kernels_{label}")
    n, k = (int(v) for v in args.shape.split("x"))
    bandwidth, matrix_rate = bu.measure_ceilings()
    print(f"gpu {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {bu.triton.__version__}, "
          f"copy {bandwidth / 1e12:.2f} TB/s", flush=True)
    configs = json.loads(bu.CONFIGS_FILE.read_text())
    for regime, rounding in CASES:
        for t in (int(v) for v in args.tokens.split(",")):
            config = config_tuple(bu.tuned_config(configs, regime, t))  # a tuple: other trees build their own
            layer = bu.Layer(n, k, max(t, 1), regime)
            if t == 0:  # the epilogue alone: the token loop runs no iteration
                layer.x, layer.dy = layer.x[:0], layer.dy[:0]
            floor = bu.floor_ms(n, k, t, regime, bandwidth, matrix_rate)
            cells = []
            for label, package in trees.items():
                epilogue = epilogue_of(package, layer, config, rounding)
                ms = bu.timed(lambda: epilogue.fused(layer.x, layer.dy, layer.w))[0]
                cells.append(f"{label} {ms:.4f} ms ({ms / floor:.2f}x floor)")
            grad = torch.zeros(n, k, device="cuda")
            epilogue = epilogue_of(fk, layer, config, rounding)
            ms = bu.timed(lambda: epilogue.apply(grad, layer.w))[0]
            cells.append(f"oracle's rule kernel {ms:.4f} ms")
            print(f"{regime:7s} {str(rounding):10s} T={t:5d} config {config} floor {floor:.4f} ms  " + "  ".join(cells),
                  flush=True)


if __name__ == "__main__":
    main()
