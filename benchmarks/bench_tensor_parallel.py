"""A tensor-parallel training step of a Llama-style MLP block: FORGE's fused layers
against ``torch.optim.AdamW(fused=True)`` on the same layout, step time and peak memory
per GPU (the two-GPU issue's table).

The block: ``x + down(silu(gate(norm(x))) * up(norm(x)))`` with Llama-3-8B's shapes
(hidden 4096, MLP 14336, RMSNorm, no biases), batch 1 x T tokens, loss the mean square
of the output. ``gate`` and ``up`` are column-parallel and ``down`` row-parallel
(PyTorch's ``ColwiseParallel``/``RowwiseParallel`` on a 1-D mesh of ``--world`` ranks,
the tokens replicated), so each rank holds 1/W of each weight's rows or columns and the
block's output is all-reduced. The same layout serves both methods:

* ``torch``: autograd's weight gradients, then ``AdamW(fused=True)`` on every parameter;
* ``forge`` / ``forge deferred``: the three weights fused (``fk.fuse`` on the DTensor
  layers: each rank steps its shard, summed over all tokens, inside the backward;
  ``report="raise"``, or ``"defer"`` with ``fk.check_updates`` once per step), the
  norm's weight stepped by a torch ``AdamW(fused=True)``.

Variants as in ``bench_model.py``: ``bf16`` (bf16 weights; FORGE keeps bf16 state with
stochastic rounding, torch bf16 state) and ``fp32-master`` (fp32 weights under bf16
autocast; fp32 state). The fused layers take the tuned config of their regime
and token count (``tuned_configs.json``) on a GPU, ``fk.PINNED`` on the CPU.

Each rank times its own steps (CUDA events, or ``perf_counter`` on the CPU) after
``--warmup`` steps; a row reports the slowest rank's median (every step waits for the
all-reduce, so the slowest rank sets the pace) and the largest per-rank peak
(``torch.cuda.max_memory_allocated`` over the timed steps; none on the CPU). A row whose
job fails on any rank is written with the error and the next row starts fresh ranks.

Ranks are started by ``forge_verify.distributed.ranks.RankPool`` (NCCL with one GPU per
rank where CUDA is available, gloo otherwise). On the GPU machine, where nothing is
installed, map the checkout's ``kernels/`` to ``forge_kernels`` for the ranks too:

    shim=$(mktemp -d); ln -s "$PWD/kernels" "$shim/forge_kernels"
    NCCL_NVLS_ENABLE=0 PYTHONPATH="$shim:$PWD" python3 benchmarks/bench_tensor_parallel.py --world 2 \\
        --out benchmarks/results/sharding/h200x2-tp-mlp.csv

``--smoke`` runs tiny shapes on two gloo ranks on the CPU, every variant and method, to
check the script (``tests/test_bench_tensor_parallel_smoke.py``).
"""

import argparse
import csv
import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_update import CONFIGS_FILE, tuned_config  # noqa: E402  (also maps kernels/ to forge_kernels)

import forge_kernels as fk  # noqa: E402
from forge_verify.distributed.ranks import RankError, RankPools  # noqa: E402

HIDDEN, MLP = 4096, 14336
SMOKE_HIDDEN, SMOKE_MLP, SMOKE_TOKENS = 32, 96, "16"
VARIANTS = ("bf16", "fp32-master")
METHODS = ("torch", "forge", "forge deferred")


class MLPBlock(nn.Module):
    """Llama's MLP with its pre-norm and residual."""

    def __init__(self, hidden, mlp):
        super().__init__()
        self.norm = nn.RMSNorm(hidden)
        self.gate = nn.Linear(hidden, mlp, bias=False)
        self.up = nn.Linear(hidden, mlp, bias=False)
        self.down = nn.Linear(mlp, hidden, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def _device():
    """Rank r's GPU under NCCL; the CPU under gloo (also on a machine with GPUs: --smoke)."""
    return torch.device("cuda", dist.get_rank()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _parallel_block(variant, hidden, mlp, device):
    """The block on this rank: the same seeded weights everywhere, then sharded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    block = MLPBlock(hidden, mlp)
    for linear in (block.gate, block.up, block.down):
        nn.init.normal_(linear.weight, std=0.02)
    block = block.to(device, torch.float32 if variant == "fp32-master" else torch.bfloat16)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    return parallelize_module(block, mesh, {"gate": ColwiseParallel(), "up": ColwiseParallel(),
                                            "down": RowwiseParallel()})


def _fused_adamw(params):
    """``AdamW(fused=True)`` over ``params``: one optimizer for the sharded (DTensor) ones
    and one for the rest (the norm's weight, outside the TP plan), since the fused kernel
    takes no mix of the two in one call."""
    from forge_kernels.tensor_parallel import is_dtensor
    groups = [[p for p in params if is_dtensor(p)], [p for p in params if not is_dtensor(p)]]
    return [torch.optim.AdamW(group, lr=1e-4, weight_decay=0.01, fused=True) for group in groups if group]


def _step_fn(variant, method, tokens, hidden, mlp, configs, device):
    block = _parallel_block(variant, hidden, mlp, device)
    deferred = method == "forge deferred"
    if method.startswith("forge"):
        regime = "bf16-sr" if variant == "bf16" else "fp32"
        config = tuned_config(configs, regime, tokens) if configs and device.type == "cuda" else fk.PINNED
        fk.fuse(block, fk.AdamW(lr=1e-4, weight_decay=0.01), state_format="bf16" if variant == "bf16" else "fp32",
                config=config, seed=1, report="defer" if deferred else "raise")
        trained = fk.unfused_parameters(block)
    else:
        trained = list(block.parameters())
    optimizers = _fused_adamw(trained)
    dtype = next(block.parameters()).dtype
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, tokens, hidden, generator=gen).to(device, dtype)
    autocast = variant == "fp32-master"  # on the CPU too, so that --smoke runs the autocast path

    def step():
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            out = block(x)
        out = out.to_local() if hasattr(out, "to_local") else out
        out.float().square().mean().backward()
        for optimizer in optimizers:
            optimizer.step()
        if deferred:
            fk.check_updates(block)
    return block, step


def measure_on_rank(variant, method, tokens, hidden, mlp, configs, warmup, steps):
    """Rank job: this rank's step times (ms), peak bytes (None on the CPU) and the step
    count of each fused layer (the steps taken in its backward, warm-up included: a row
    whose layers did not step would time nothing)."""
    device = _device()
    block, step = _step_fn(variant, method, tokens, hidden, mlp, configs, device)
    times, peak = _timed(step, device, warmup, steps)
    counts = [int(layer.forge_step) for layer in fk.fused_layers(block)]
    # The ranks outlive the row: a fused layer and its weight's hook refer to each other, so
    # without a collection this row's weights and state would count in the next row's peak.
    del block, step
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return times, peak, counts


def _timed(step, device, warmup, steps):
    for _ in range(warmup):
        step()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        for _ in range(steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        return times, torch.cuda.max_memory_allocated(device)
    for _ in range(steps):
        begin = time.perf_counter()
        step()
        times.append((time.perf_counter() - begin) * 1e3)
    return times, None


def _row(meta, variant, method, tokens, per_rank):
    medians = [statistics.median(times) for times, _, _ in per_rank]
    peaks = [peak for _, peak, _ in per_rank if peak is not None]
    slowest = max(range(len(medians)), key=medians.__getitem__)
    times = per_rank[slowest][0]
    fused_steps = sorted({count for _, _, counts in per_rank for count in counts})
    return {**meta, "tokens": tokens, "variant": variant, "method": method,
            "median_ms": f"{medians[slowest]:.3f}", "min_ms": f"{min(times):.3f}", "max_ms": f"{max(times):.3f}",
            "rank_medians_ms": " ".join(f"{m:.3f}" for m in medians),
            "peak_bytes_max_rank": max(peaks) if peaks else "",
            "fused_layers": len(per_rank[0][2]), "fused_steps": " ".join(map(str, fused_steps)), "error": ""}


def _meta(world, backend, hidden, mlp):
    import triton
    gpu = torch.cuda.get_device_name() if backend == "nccl" else "cpu"
    return {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
            "commit": os.environ.get("FORGE_COMMIT", "unknown"), "world": world, "backend": backend,
            "hidden": hidden, "mlp": mlp}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="CSV to write (required unless --smoke)")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--tokens", default="512,4096")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on two gloo ranks on the CPU")
    args = parser.parse_args(argv)
    variants, methods = args.variants.split(","), args.methods.split(",")
    unknown = [v for v in variants if v not in VARIANTS] + [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"unknown variants or methods {unknown}; variants {VARIANTS}, methods {METHODS}")
    if args.smoke:
        backend, hidden, mlp, tokens, args.world = "gloo", SMOKE_HIDDEN, SMOKE_MLP, SMOKE_TOKENS, 2
        args.warmup, args.steps = min(args.warmup, 1), min(args.steps, 2)
    else:
        if args.out is None:
            parser.error("--out is required (the CSV to write)")
        backend, hidden, mlp, tokens = ("nccl" if torch.cuda.is_available() else "gloo"), HIDDEN, MLP, args.tokens
    if backend == "nccl" and torch.cuda.device_count() < args.world:
        sys.exit(f"--world {args.world} needs {args.world} GPUs (one per rank); {torch.cuda.device_count()} visible")
    configs = json.loads(CONFIGS_FILE.read_text()) if CONFIGS_FILE.exists() and backend == "nccl" else {}
    meta = _meta(args.world, backend, hidden, mlp)
    pools = RankPools(backend)
    rows = []
    try:
        for t in (int(t) for t in tokens.split(",")):
            for variant in variants:
                for method in methods:
                    try:
                        per_rank = pools.get(args.world).run(measure_on_rank, variant, method, t, hidden, mlp,
                                                             configs, args.warmup, args.steps, timeout_s=600)
                        row = _row(meta, variant, method, t, per_rank)
                    except RankError as error:  # the pool is down; the next row starts fresh ranks
                        row = {**meta, "tokens": t, "variant": variant, "method": method,
                               "error": str(error).strip().splitlines()[-1]}
                        traceback.print_exception(error, file=sys.stderr)
                    rows.append(row)
                    peak = row.get("peak_bytes_max_rank")
                    print(f"W={args.world} T={t:5d} {variant:11s} {method:14s} "
                          + (f"ERROR {row['error']}" if row["error"] else
                             f"{float(row['median_ms']):9.3f} ms (slowest rank)"
                             + (f"  peak {peak / 2**30:6.2f} GiB (largest rank)" if peak != "" else "")),
                          flush=True)
    finally:
        # NCCL rank pools once took over 19 s to shut down (the two-GPU issue): timed here.
        begin = time.perf_counter()
        pools.close()
        print(f"rank pool shutdown: {time.perf_counter() - begin:.1f} s", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        fields = list(dict.fromkeys(key for row in rows for key in row))
        with open(args.out, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=fields)
            writer.writeheader()
            writer.writerows(rows)
    return 1 if any(row["error"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
