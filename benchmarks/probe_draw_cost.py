"""What does the stochastic-rounding draw cost the bf16-SR step? The portable kernel's
random words (``paired_words``: one Philox4x32-10 call per pair of neighbouring elements)
swapped, for this process only, for a cheaper draw or none, and the step timed with each:

* ``philox10``: the committed draw (the reference row);
* ``philox7``: the same calls with 7 Philox rounds instead of 10 (Random123's paper
  finds Philox4x32-7 Crush-resistant; 10 is its default margin);
* ``hash``: four words per pair from a 32-bit integer hash of the counter (two
  multiplies and three xor-shifts a word; not a statistically vetted generator);
* ``none``: all words zero (rounding then truncates): what the step costs with no draw.

Only ``philox10`` is the library's function; the others give different bits and are a
measurement of how much of the time the draw takes, not a proposal that passed the
statistical tests. Per draw: the streaming epilogue alone at its fastest measured shapes
(``probe_streaming_epilogue.py``), and the fused kernel (tuned bf16-SR config) replayed
from a CUDA graph at 256 and 1,024 tokens beside torch's captured step in the same
process. One draw per process (Triton compiles a kernel's helpers once per process):

    for d in philox10 philox7 hash none; do python3 benchmarks/probe_draw_cost.py --draw $d; done
"""

import argparse
import sys
from pathlib import Path

import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_update as bu  # noqa: E402  (maps this tree's kernels/ to forge_kernels)
import probe_streaming_epilogue as pse  # noqa: E402

from forge_kernels.ops import fused_weight_update as fwu  # noqa: E402

# The streaming shapes that were fastest for bf16-SR (results/tuning/h200-streaming-epilogue.log).
SHAPES = [(16, 128, 4, 2, None), (16, 128, 4, 1, None), (64, 128, 8, 2, 128)]


@triton.jit
def _mix(x):
    """A 32-bit integer hash (xor-shift and multiply, constants of the 'lowbias32' finalizer)."""
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B
    x ^= x >> 16
    return x


@triton.jit
def _pair_counters(rows, c0, global_k, BLOCK_K: tl.constexpr):
    pairs = c0 // 2 + tl.arange(0, BLOCK_K // 2)
    return (rows.to(tl.int64)[:, None] * ((global_k + 1) // 2) + pairs[None, :]).to(tl.uint32)


@triton.jit
def _interleaved(r0, r1, r2, r3):
    return (tl.interleave(r0, r0 >> 16), tl.interleave(r1, r1 >> 16), tl.interleave(r2, r2 >> 16),
            tl.interleave(r3, r3 >> 16))


@triton.jit
def philox7_words(seed, rows, c0, global_k, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ALIGNED: tl.constexpr):
    r0, r1, r2, r3 = tl.randint4x(seed, _pair_counters(rows, c0, global_k, BLOCK_K), 7)
    return _interleaved(r0, r1, r2, r3)


@triton.jit
def hash_words(seed, rows, c0, global_k, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ALIGNED: tl.constexpr):
    base = _mix(_pair_counters(rows, c0, global_k, BLOCK_K) ^ seed.to(tl.uint32))
    r0 = _mix(base ^ 0x9E3779B9)
    r1 = _mix(base ^ 0x3C6EF372)
    r2 = _mix(base ^ 0xDAA66D2B)
    r3 = _mix(base ^ 0x78DDE6E4)
    return _interleaved(r0, r1, r2, r3)


@triton.jit
def no_words(seed, rows, c0, global_k, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ALIGNED: tl.constexpr):
    zero = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.uint32)
    return zero, zero, zero, zero


DRAWS = {"philox10": fwu.paired_words, "philox7": philox7_words, "hash": hash_words, "none": no_words}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--draw", choices=sorted(DRAWS), required=True)
    parser.add_argument("--shape", default="4096x4096")
    parser.add_argument("--tokens", default="256,1024")
    args = parser.parse_args()
    fwu.paired_words = DRAWS[args.draw]  # before anything compiles: every kernel of this process draws so
    n, k = (int(v) for v in args.shape.split("x"))
    bandwidth, matrix_rate = bu.measure_ceilings()
    configs = bu.json.loads(bu.CONFIGS_FILE.read_text())
    floor = bu.floor_ms(n, k, 0, "bf16-sr", bandwidth, matrix_rate)
    print(f"draw {args.draw}: {n}x{k} bf16-sr, copy bandwidth {bandwidth / 1e12:.2f} TB/s, "
          f"epilogue floor {floor:.4f} ms", flush=True)
    layer = bu.Layer(n, k, 0, "bf16-sr")
    state = layer.fresh_state(bu.rule())
    for entry in SHAPES:
        step, _ = pse.synthetic_step(layer, state, entry)
        ms = bu.timed(step)[0]
        print(f"  {args.draw:8s} epilogue, streaming {str(entry):26s} {ms:.4f} ms  {ms / floor:.2f}x floor", flush=True)
    for t in (int(v) for v in args.tokens.split(",")):
        layer = bu.Layer(n, k, t, "bf16-sr")
        config = bu.tuned_config(configs, "bf16-sr", t)
        found = bu.methods(layer, "bf16-sr", config)
        fused = bu.timed(found["forge kernel replayed"])[0]
        torch_captured = bu.timed(found["torch captured"])[0]
        t_floor = bu.floor_ms(n, k, t, "bf16-sr", bandwidth, matrix_rate)
        print(f"  {args.draw:8s} T={t:5d} fused kernel replayed {fused:.4f} ms ({fused / t_floor:.2f}x floor)  "
              f"torch captured {torch_captured:.4f} ms  torch/fused {torch_captured / fused:.2f}", flush=True)


if __name__ == "__main__":
    main()
