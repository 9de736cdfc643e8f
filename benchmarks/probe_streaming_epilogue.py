"""How fast can the fused kernel's epilogue run at all? The epilogue (``_tile_epilogue``:
the rule, the rounding draws, the non-finite verdict, the loads and stores of weight and
state) launched as a plain streaming kernel, with no matrix work, no accumulator tile
and no gradient read (the gradient is made in registers from the element's indices:
one integer subtraction, one conversion and one multiply per element), swept over tile
shapes and warp counts so that occupancy is as high as the hardware allows.

Nothing the fused kernel does per element is left out, and the fused kernel must also
hold its accumulator tile and do the matrix work, so no fused configuration is expected
to beat the best time here for this rule and these bits (a measurement over the swept
configurations, not a proof over all). The committed run
(results/tuning/h200-streaming-epilogue.log) predates the 64x64 entry of the sweep, the
fused q8 config's shape, which there ran 5 % faster fused than the sweep's best. Beside it,
in the same process: a copy kernel moving the same bytes (weight and state read and
written, same tiles), the fused kernel itself with no tokens (tuned config), and
torch's fused AdamW optimizer pass alone (its gradient already made; it reads that
gradient too, so its floor is higher by the gradient's bytes).

    python3 benchmarks/probe_streaming_epilogue.py [--shape 4096x4096] [--regimes fp32,bf16-sr,bf16-rn,q8]
"""

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_update as bu  # noqa: E402  (maps this tree's kernels/ to forge_kernels)

fk = bu.fk
from forge_kernels.ops.finite_check import BAD_TILES  # noqa: E402
from forge_kernels.ops.fused_weight_update import (_device_grad_scale, _device_scalars, _Epilogue,  # noqa: E402
                                                   _tile_epilogue)

# (block_n, block_k, num_warps, epilogue_split, maxnreg): 8 to 32 elements per thread per slice,
# 2-8 warps, with and without a register cap.
# The last two are the tuned fused configs' own shapes at 256 tokens: fp32 and q8 before
# 82ea93c (64x64, 8 warps, 128 registers) and bf16-SR (64x128 split in two).
SWEEP = [(16, 128, 4, 1, None), (32, 128, 4, 1, None), (32, 128, 8, 1, None), (64, 64, 4, 1, None),
         (64, 128, 8, 1, None), (64, 128, 8, 2, None), (16, 256, 4, 1, None), (16, 128, 4, 2, None),
         (32, 64, 2, 1, None), (32, 128, 4, 1, 64), (16, 128, 2, 1, None), (64, 64, 8, 1, 128),
         (64, 128, 8, 2, 128)]


@triton.jit(do_not_specialize=["row0", "col0", "global_k", "seed"])
def _synthetic_gradient_epilogue_kernel(w_ptr, s0_ptr, s1_ptr, s2_ptr, e0_ptr, e1_ptr, e2_ptr, flag_ptr,
                                        status_ptr, N, K, KB, row0, col0, global_k, grad_scale,
                                        h0, h1, h2, h3, h4, h5, h6, h7, seed, scalars_ptr, seed_ptr,
                                        grad_scale_ptr, RULE: tl.constexpr, VARIANT: tl.constexpr,
                                        HAS_S0: tl.constexpr, HAS_S1: tl.constexpr, HAS_S2: tl.constexpr,
                                        W_BF16: tl.constexpr, S_BF16: tl.constexpr, S_Q8: tl.constexpr,
                                        STOCHASTIC: tl.constexpr, NONNEGATIVE: tl.constexpr,
                                        ALIGNED_PAIRS: tl.constexpr, DEVICE_SCALARS: tl.constexpr,
                                        DEVICE_GRAD_SCALE: tl.constexpr, BLOCK_N: tl.constexpr,
                                        BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, ROWS: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    # A gradient of varying values in [-4e-4, 4e-4] that costs no memory traffic.
    g = (offs_k[None, :] - offs_n[:, None]).to(tl.float32) * 1e-7
    if DEVICE_SCALARS:
        h0, h1, h2, h3, h4, h5, h6, h7, seed = _device_scalars(scalars_ptr, seed_ptr)
    if DEVICE_GRAD_SCALE:
        grad_scale = _device_grad_scale(grad_scale_ptr)
    _tile_epilogue(g, w_ptr, s0_ptr, s1_ptr, s2_ptr, e0_ptr, e1_ptr, e2_ptr, flag_ptr, status_ptr,
                   pid_n * tl.num_programs(1) + pid_k, offs_n, offs_n < N, pid_k * BLOCK_K, K, KB, row0, col0,
                   global_k, grad_scale, h0, h1, h2, h3, h4, h5, h6, h7, seed,
                   RULE, VARIANT, HAS_S0, HAS_S1, HAS_S2, W_BF16, S_BF16, S_Q8, STOCHASTIC, NONNEGATIVE,
                   ALIGNED_PAIRS, BLOCK_N, BLOCK_K, SPLIT, ROWS)


@triton.jit
def _copy_kernel(w_ptr, s0_ptr, s1_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Weight and two state slots read and written back in place: the same bytes as the
    epilogue moves, in the same tiles, and nothing else."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    idx = offs_n[:, None] * K + offs_k[None, :]
    mask = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    w = tl.load(w_ptr + idx, mask=mask)
    s0 = tl.load(s0_ptr + idx, mask=mask)
    s1 = tl.load(s1_ptr + idx, mask=mask)
    tl.store(w_ptr + idx, w, mask=mask)
    tl.store(s0_ptr + idx, s0, mask=mask)
    tl.store(s1_ptr + idx, s1, mask=mask)


def synthetic_step(layer, state, entry):
    block_n, block_k, warps, split, maxnreg = entry
    config = fk.TileConfig(block_n, block_k, 64, warps, 1, maxnreg, split)
    e = _Epilogue(layer.w, state, bu.rule(), 1, config, layer.rounding, 0, 1.0, None)
    n, k = e.shape
    args = (layer.w, *e.slot_tensors, *e.exponent_tensors, e.flags, e.status, n, k, e.blocks_per_row,
            *e.place, e.grad_scale, *e.scalars, e.seed, *e.device_scalars, e.grad_scale_ptr)

    def step():
        _synthetic_gradient_epilogue_kernel[e.grid](*args, **e.rule_args, BLOCK_N=block_n, BLOCK_K=block_k,
                                                     SPLIT=split, ROWS=False, **config.launch_options())
    return step, e


def copy_step(layer, state, block_n, block_k, warps):
    s0, s1 = (state[name] for name in bu.rule().slots if name in state)
    n, k = layer.w.shape
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    return lambda: _copy_kernel[grid](layer.w, s0, s1, n, k, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)


def torch_optimizer_pass(layer):
    param = torch.nn.Parameter(layer.w.clone())
    param.grad = torch.randn_like(param) * 1e-3
    opt = torch.optim.AdamW([param], lr=1e-3, weight_decay=0.01, fused=True)
    opt.step()  # creates the state
    return opt.step, param.grad.element_size()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="4096x4096")
    parser.add_argument("--regimes", default="fp32,bf16-sr,q8")
    args = parser.parse_args()
    n, k = (int(v) for v in args.shape.split("x"))
    bandwidth, matrix_rate = bu.measure_ceilings()
    print(f"gpu {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; {n}x{k}, AdamW")
    configs = bu.json.loads(bu.CONFIGS_FILE.read_text())
    for regime in args.regimes.split(","):
        layer = bu.Layer(n, k, 0, regime)
        state = layer.fresh_state(bu.rule())
        floor = bu.floor_ms(n, k, 0, regime, bandwidth, matrix_rate)
        print(f"{regime}: floor {floor:.4f} ms (weight and state read and written once at the copy bandwidth)")
        best = None
        for entry in SWEEP:
            if regime == "q8" and entry[1] // entry[3] < fk.q8.BLOCK:
                continue
            step, e = synthetic_step(layer, state, entry)
            ms = bu.timed(step)[0]
            assert int(e.status[BAD_TILES]) == 0, "a tile was refused: the synthetic step must be finite"
            print(f"  epilogue, streaming {str(entry):28s} {ms:.4f} ms  {ms / floor:.2f}x floor", flush=True)
            best = ms if best is None else min(best, ms)
        print(f"  epilogue, streaming, best             {best:.4f} ms  {best / floor:.2f}x floor")
        if regime != "q8":
            for block_n, block_k, warps in ((16, 128, 4), (32, 128, 4), (64, 128, 8), (16, 256, 4)):
                ms = bu.timed(copy_step(layer, state, block_n, block_k, warps))[0]
                print(f"  copy of the same bytes {str((block_n, block_k, warps)):17s} {ms:.4f} ms  "
                      f"{ms / floor:.2f}x floor", flush=True)
        tuned = bu.tuned_config(configs, regime, 256)
        ms = bu.timed(bu.kernel_step(layer, tuned, bu.rule(), state))[0]
        print(f"  fused kernel, no tokens {tuned} {ms:.4f} ms  {ms / floor:.2f}x floor", flush=True)
        if regime != "q8":
            step, grad_bytes = torch_optimizer_pass(layer)
            ms = bu.timed(step)[0]
            grad_floor = floor + n * k * grad_bytes / bandwidth * 1e3
            print(f"  torch AdamW(fused=True) pass alone     {ms:.4f} ms  {ms / floor:.2f}x floor, "
                  f"{ms / grad_floor:.2f}x its own floor (with the gradient read)", flush=True)
        del layer, state


if __name__ == "__main__":
    main()
