"""GIFT's hook on one GPU: the compute per bucket, the transform's refresh, and the bytes
on the wire per step, for Llama-style gradient shapes.

Shapes (N × K, fp32 gradients of a weight with K input features): 4096 × 4096 (q, o),
14336 × 4096 (gate, up), 4096 × 14336 (down). A layer's input covariance A = XᵀX / T
comes from T = 4096 random activations with a decaying spectrum (a rank-64 part with
scales 1 … 0.1, plus isotropic noise 0.05).

* **compute**: what ``gift_hook`` computes for one gradient of the bucket, with the
  collectives skipped (one rank: the amax needs no MAX all-reduce and the all-gather
  would return this rank's payload): transform (GIFT route), residual added, amax and
  non-finite check, scale, quantize, local decode and residual, decode of the gathered
  payload, fp32 sum, unscale, inverse transform (``GiftState.prepare``, ``encode``,
  ``combine``, error feedback on), for the all-gather exchange. The reduce-scatter
  exchange's rows leave it blank: its second quantization sits between two collectives,
  so it cannot be timed with them skipped, and it is not timed yet. The bf16 row is a
  cast to bf16 and back, what torch's ``bf16_compress_hook`` computes around its
  all-reduce; fp32 computes nothing.
* **refresh**: ``Whitening.from_covariance(A, rank, damping)`` (float64 ``eigh`` on the
  GPU) once per distinct K, median of ``--refresh-repeats`` (one at K > 4096).
* **bytes** per step for this tensor at ``--world`` ranks, counted from the codecs, per
  exchange: what one rank passes into the collectives (as ``GiftState.wire_bytes``
  counts) and what every rank receives. ``all_gather``: the payload P and the amax
  vector in; (W − 1) P received. ``reduce_scatter``: the payload padded to W shards of
  whole codec units, P', into the all-to-all and its shard P'/W into the all-gather, and
  two amax vectors; 2 (W − 1)/W · P' received. The amax vectors' MAX all-reduces and
  torch's fp32 and bf16 hooks are counted as a ring all-reduce (2 (W − 1)/W of the
  input). Plain and GIFT send the same bytes per step; GIFT adds, every
  ``--refresh-every`` steps, the all-reduce of A (K² fp32) and the factors' broadcast,
  shown amortized per step.

Medians over CUDA-event timings (``triton.testing.do_bench``, ``return_mode="median"``).
Prints a markdown table and writes a CSV (with GPU name, torch and triton versions).
``--smoke`` runs tiny shapes on the CPU (perf_counter medians) to check the script.

    python3 benchmarks/bench_gift.py --out benchmarks/results/gift/h200.csv
"""

import argparse
import csv
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkout import forge_kernels  # noqa: E402

forge_kernels()
import forge_kernels as fk  # noqa: E402
from forge_kernels.communication.codecs import CODECS  # noqa: E402

SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336))
SMOKE_SHAPES = ((48, 64), (160, 64), (64, 160))
LOW_PRECISION = ("e4m3", "e5m2", "nvfp4")
EXCHANGES = ("all_gather", "reduce_scatter")


def median_ms(fn, device, repeats: int) -> float:
    if device.type == "cuda":
        from triton.testing import do_bench
        return float(do_bench(fn, warmup=10, rep=50, return_mode="median"))
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def covariance(features: int, tokens: int, device, generator) -> torch.Tensor:
    part = min(64, features)
    basis = torch.randn(part, features, generator=generator).to(device) / part ** 0.5
    scales = torch.logspace(0, -1, part, device=device)
    x = (torch.randn(tokens, part, generator=generator).to(device) * scales) @ basis
    x += 0.05 * torch.randn(tokens, features, generator=generator).to(device)
    return x.T @ x / tokens


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_refresh(A, rank, damping, repeats, device):
    times, whitening = [], None
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        whitening = fk.gift.Whitening.from_covariance(A, rank, damping)
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), whitening


def hook_compute(fmt, G, whitening):
    """The hook's compute for one gradient on one rank (collectives skipped), as a closure."""
    state = fk.gift.GiftState(None, fmt, layers=(), error_feedback=True, exchange="all_gather")
    entries = [("g", G, whitening)]

    def run():
        sent, amax = state.prepare(entries)
        state.refuse_non_finite(entries, amax)
        payloads, decoded, contexts = state.encode(entries, sent, amax)
        out = state.combine(entries, [torch.cat(payloads)], contexts)[0]
        state.commit(entries, sent, decoded)
        return out
    return run


def wire_bytes(fmt, numel, world, exchange="all_gather"):
    """(bytes one rank passes into the collectives, bytes every rank receives) per step
    for one tensor, on ``exchange`` (fp32 and bf16: torch's ring all-reduce)."""
    ring = 2 * (world - 1) / world
    if fmt in ("fp32", "bf16"):
        payload = numel * (4 if fmt == "fp32" else 2)
        return payload, ring * payload
    codec = CODECS[fmt, "current"]
    scales = 2 * 4  # the amax and the non-finite flag, in a MAX all-reduce
    if exchange == "all_gather":
        payload = codec.payload_bytes(numel)
        return payload + scales, (world - 1) * payload + ring * scales
    shard = -(-(-(-numel // codec.unit)) // world) * codec.unit_bytes  # whole units, equal shards
    return world * shard + shard + 2 * scales, 2 * (world - 1) * shard + 2 * ring * scales


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="CSV path")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--damping", type=float, default=1e-3)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--world", type=int, default=8, help="ranks assumed for the bytes received")
    parser.add_argument("--refresh-every", type=int, default=50)
    parser.add_argument("--refresh-repeats", type=int, default=3)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    if args.smoke:
        device, shapes, rank, tokens = torch.device("cpu"), SMOKE_SHAPES, 8, 256
        args.refresh_repeats, timing_repeats = 1, 1
    else:
        if not torch.cuda.is_available():
            parser.error("no GPU: run with --smoke for the CPU check")
        device, shapes, rank, tokens = torch.device("cuda"), SHAPES, args.rank, args.tokens
        timing_repeats = None  # do_bench chooses
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke)"
    generator = torch.Generator().manual_seed(0)
    if device.type == "cuda":  # cuSOLVER's first call initializes it: not the refresh's time
        fk.gift.Whitening.from_covariance(covariance(256, 512, device, generator), 8, args.damping)
    refresh = {}
    for features in sorted({k for _, k in shapes}):
        A = covariance(features, tokens, device, generator)
        repeats = args.refresh_repeats if features <= 4096 else 1
        ms, whitening = time_refresh(A, rank, args.damping, repeats, device)
        refresh_bytes = features * features * 4 + 8 + 8 + whitening.nbytes()
        refresh[features] = (ms, repeats, whitening, refresh_bytes)
        del A
    rows = []
    for n, k in shapes:
        G = torch.randn(n, k, generator=generator).to(device)
        ms_refresh, repeats, whitening, refresh_bytes = refresh[k]
        fp32_received = wire_bytes("fp32", G.numel(), args.world)[1]
        cases = [("fp32", "plain", None, "all_reduce"), ("bf16", "plain", None, "all_reduce")]
        cases += [(fmt, route, whitening if route == "gift" else None, exchange)
                  for fmt in LOW_PRECISION for route in ("plain", "gift") for exchange in EXCHANGES]
        for fmt, route, w, exchange in cases:
            if fmt == "fp32":
                compute = 0.0
            elif fmt == "bf16":
                compute = median_ms(lambda: G.to(torch.bfloat16).to(torch.float32), device, timing_repeats)
            elif exchange == "all_gather":
                compute = median_ms(hook_compute(fmt, G, w), device, timing_repeats)
            else:
                compute = None  # not timed (the module docstring)
            sent, received = wire_bytes(fmt, G.numel(), args.world, exchange)
            amortized = refresh_bytes / args.refresh_every if route == "gift" else 0.0
            rows.append({"gpu": gpu, "torch": torch.__version__, "triton": triton_version, "shape": f"{n}x{k}",
                         "format": fmt, "route": route, "exchange": exchange, "rank": rank if route == "gift" else "",
                         "compute_ms": "" if compute is None else round(compute, 4),
                         "refresh_ms": round(ms_refresh, 2) if route == "gift" else "",
                         "refresh_repeats": repeats if route == "gift" else "",
                         "sent_bytes": sent, "world": args.world, "received_bytes": round(received),
                         "refresh_bytes_per_step": round(amortized),
                         "received_vs_fp32": round((received + amortized) / fp32_received, 4)})
        del G
    elapsed = time.perf_counter() - started
    columns = ["shape", "format", "route", "exchange", "compute_ms", "refresh_ms", "sent_bytes", "received_bytes",
               "refresh_bytes_per_step", "received_vs_fp32"]
    print(f"GIFT hook, {gpu}, torch {torch.__version__}, triton {triton_version}, rank {rank}, "
          f"world {args.world} for the bytes, refresh every {args.refresh_every}; {elapsed:.1f} s\n")
    print("| " + " | ".join(columns) + " |")
    print("|" + " --- |" * len(columns))
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in columns) + " |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return rows


if __name__ == "__main__":
    main()
