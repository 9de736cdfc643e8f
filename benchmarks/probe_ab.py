"""A/B probe: the fused kernel of this tree against the same kernel of another tree (a
copy of its ``kernels/`` folder, imported as a second package), launched alone on the
same inputs in the same process; medians of ``do_bench`` (L2 flushed) over CUDA-graph
replays of the kernel alone, each config
checked fused == oracle (and captured == uncaptured) bitwise in this tree first. A
diagnostic for one kernel change (e.g. the Philox draw), not the benchmark table (that is
``bench_update.py``). A config the other tree's kernel refuses (a new tile, say) is timed
in this tree alone.

    python3 benchmarks/probe_ab.py --old /path/to/old/kernels --regimes bf16-sr,q8 --tokens 256,1024
"""

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_update as bu  # noqa: E402  (maps this tree's kernels/ to forge_kernels)
from checkout import config_tuple, parse_config  # noqa: E402

fk = bu.fk


def load_tree(folder: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, folder / "__init__.py", submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    importlib.import_module(f"{name}.ops.fused_weight_update")
    return module


def kernel_step(package, layer, config_tuple, r_cls_name="AdamW"):
    r = getattr(package, r_cls_name)(lr=1e-3, weight_decay=0.01)
    state = layer.fresh_state(r)
    config = package.TileConfig(*config_tuple)
    epilogue_cls = sys.modules[f"{package.__name__}.ops.fused_weight_update"]._Epilogue
    epilogue = epilogue_cls(layer.w, state, r, 1, config, layer.rounding, 0, 1.0, None)
    return lambda: epilogue.fused(layer.x, layer.dy, layer.w)


def runs(package, layer, config_tuple) -> bool:
    """Whether the other tree's kernel takes this config (a new config may not compile
    there, or name a field its TileConfig lacks)."""
    try:
        kernel_step(package, layer, config_tuple)()
    except (ValueError, TypeError) as error:
        print(f"old tree refuses {config_tuple}: {str(error)[:160]}", flush=True)
        return False
    return True


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--old", required=True, help="the other tree's kernels/ folder")
    parser.add_argument("--shapes", default="4096x4096")
    parser.add_argument("--tokens", default="256,1024")
    parser.add_argument("--regimes", default="bf16-sr")
    parser.add_argument("--configs", default=None,
                        help="';'-separated configs as the sweeps print them (default: the tuned config)")
    args = parser.parse_args()
    old = load_tree(Path(args.old), "forge_kernels_old")
    configs_file = bu.json.loads(bu.CONFIGS_FILE.read_text())
    print(f"gpu {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {bu.triton.__version__}")
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        for regime in args.regimes.split(","):
            for t in (int(v) for v in args.tokens.split(",")):
                if args.configs:
                    candidates = [parse_config(c) for c in args.configs.split(";")]
                else:
                    candidates = [config_tuple(bu.tuned_config(configs_file, regime, t))]
                for candidate in candidates:
                    config = fk.TileConfig(*candidate)
                    bu.check_fused_equals_oracle(n, k, 512, regime, config)
                    layer = bu.Layer(n, k, t, regime)
                    floor = bu.floor_ms(n, k, t, regime, 4.25e12, 684e12)
                    # Alternated, twice each, so drift between timings falls on both trees alike;
                    # replayed from a CUDA graph, so a launch's host cost cannot stand in for its time.
                    new_ms, old_ms = [], []
                    old_runs = runs(old, layer, candidate)
                    for _ in range(2):
                        new_ms.append(bu.timed(bu.capture(kernel_step(fk, layer, candidate))[0].replay)[0])
                        if old_runs:
                            old_ms.append(bu.timed(bu.capture(kernel_step(old, layer, candidate))[0].replay)[0])
                    versus = (f"old {old_ms[0]:.4f} / {old_ms[1]:.4f} ms" if old_ms
                              else "old: not run (its kernel refuses this config)")
                    ratio = f"old/new {min(old_ms) / min(new_ms):.3f}" if old_ms else ""
                    print(f"ab {n}x{k} T={t:5d} {regime:7s} {str(candidate):30s} "
                          f"{versus}  new {new_ms[0]:.4f} / {new_ms[1]:.4f} ms  "
                          f"{ratio}  new/floor(4.25TB/s) {min(new_ms) / floor:.2f}", flush=True)
                    del layer


if __name__ == "__main__":
    main()
