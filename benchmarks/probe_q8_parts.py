"""Time the fused kernel alone (``bench_update.kernel_step``) for q8 and bf16-SR state at
4096 x 4096, 256 and 1,024 tokens, on three tile configs: the probe behind
``results/tuning/h200-q8-attribution.log``. Run it once per copy of ``kernels/`` with one
part of the q8 path removed (on PYTHONPATH as ``forge_kernels``), naming the copy:

    PYTHONPATH=<folder holding forge_kernels>:. python3 benchmarks/probe_q8_parts.py <name>
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_update as bench  # noqa: E402
import forge_kernels as fk  # noqa: E402

CONFIGS = ((64, 64, 32, 8, 4, 128), (64, 64, 32, 8, 4), (64, 128, 64, 8, 3, 128, 2))


def main(name: str) -> None:
    for regime in ("q8", "bf16-sr"):
        for tokens in (256, 1024):
            layer = bench.Layer(4096, 4096, tokens, regime)
            for fields in CONFIGS:
                config = fk.TileConfig(*fields)
                if regime == "q8" and config.part_shape[1] < fk.q8.BLOCK:
                    continue
                step = bench.kernel_step(layer, config)
                compiled = step()
                median = bench.timed(step)[0]
                print(f"{name:9s} {regime:7s} T={tokens:5d} {str(fields):28s} {median:.4f} ms "
                      f"{compiled.n_regs} regs {compiled.n_spills} spills", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
