"""An end-to-end training step of a Llama-style decoder on one GPU: FORGE's fused layers
against ``torch.optim.AdamW(fused=True)``, step time and peak memory.

The model: ``--layers`` decoder blocks of Llama-3-8B's shapes (hidden 4096, 32 query and
8 key/value heads, MLP 14336, RMSNorm, causal attention through
``scaled_dot_product_attention``), no embedding or head, batch 1 x T tokens, loss the
mean square of the output. Every linear weight is fused (``fk.fuse``) in the FORGE
variant; the norms' weights are stepped by a torch AdamW in both variants.

Variants: ``bf16`` (bf16 weights; FORGE keeps bf16 state with stochastic rounding, torch
keeps bf16 state), ``bf16-rn`` (the same, FORGE rounding its bf16 stores to nearest as
torch does: the like-for-like comparison; its torch rows are ``bf16``'s, run under its own
name when ``bf16`` is not among the variants) and
``fp32-master`` (fp32 weights under bf16 autocast; fp32 state).
Methods: ``torch``; ``forge`` (each fused layer reads its outcome once in its backward,
``report="raise"``, the default); ``forge deferred`` (``report="defer"``: no layer
synchronizes, and ``fk.check_updates(model)`` reads every layer's outcome once at the
end of the step, as ``fk.Trainer`` does); ``forge captured`` (the whole step, forward,
backward with the fused updates and the norms' torch AdamW, in one CUDA graph through
``fk.CapturedStep``, every layer's outcome read once per step); ``forge captured lagged``
(the same with ``check="lagged"``: each step's outcome read during the next call, after
that step is launched, so the GPU does not wait for the host between steps; a step after
a non-finite one writes nothing on the device); ``torch captured`` (the
same step in one CUDA graph, ``AdamW(fused=True, capturable=True)``, as torch documents
whole-network capture). Variant ``q8`` (bf16 weights, 8-bit FORGE state; torch keeps
bf16 state: its rows are the ``bf16`` variant's torch rows, run under its own name when
``bf16`` is not among the variants) exists for the memory runs.

``--max-norm C`` clips every method's step by global norm at C: torch by
``clip_grad_norm_`` before its optimizer (in the graph for ``torch captured``); FORGE by
previous-norm clipping (APPROXIMATE: the factor of the previous step's norm), through
``fk.Trainer(..., clipping="previous-norm")`` for ``forge deferred`` and
``fk.CapturedStep(..., optimizer=, max_norm=, clipping="previous-norm")`` for ``forge
captured``, each fused layer's norm from its materialized gradient (``--norm gradient``)
or its tile loop (``--norm tiles``, no gradient stored). ``forge`` (raise) has no
clipping variant.

``--fit-under GB`` instead finds, per variant and method, the largest micro-batch of
``--tokens`` sequences whose step fits under that cap
(``torch.cuda.set_per_process_memory_fraction``), by doubling then bisection.
Times are medians over ``--steps`` timed steps after warm-up (CUDA events around
forward, backward and optimizer; the host waits for each step before the next is timed);
with ``--back-to-back N``, medians over ``--steps`` runs of N steps called one after
another, as a training loop calls them (CUDA events around the N calls, one wait at
the end), divided by N; with ``--rounds R``, every variant and method is built, warmed up
and timed once per round, the order reversed each other round, and its readings pooled
(a GPU at its power cap reads what runs first faster); ``--hand-over-optimizer`` hands the norms' AdamW of the ``forge
captured`` methods to the ``CapturedStep`` (``optimizer=``, stepped through ``found_inf``,
so a lagged step's halt covers it) instead of stepping it in ``step_fn``; peak is ``torch.cuda.max_memory_allocated`` over the
timed steps, and ``reserved`` ``torch.cuda.max_memory_reserved`` over them, the
allocator's cache emptied after warm-up: the blocks the live tensors and the steps take,
and a captured graph's private pool, which holds what its step allocates (a replayed
graph allocates nothing, so for the captured methods only ``reserved`` shows the
transient memory inside the step). Writes a CSV and prints a table.

    python3 benchmarks/bench_model.py --out benchmarks/results/model/h200.csv
"""

import argparse
import csv
import gc
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_update import CONFIGS_FILE, REGIMES, in_rounds, tuned_config  # noqa: E402  (also maps kernels/ to forge_kernels)

import forge_kernels as fk  # noqa: E402

HIDDEN, HEADS, KV_HEADS, MLP = 4096, 32, 8, 14336


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        head_dim = HIDDEN // HEADS
        self.attn_norm = nn.RMSNorm(HIDDEN)
        self.q = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.k = nn.Linear(HIDDEN, KV_HEADS * head_dim, bias=False)
        self.v = nn.Linear(HIDDEN, KV_HEADS * head_dim, bias=False)
        self.o = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.mlp_norm = nn.RMSNorm(HIDDEN)
        self.gate = nn.Linear(HIDDEN, MLP, bias=False)
        self.up = nn.Linear(HIDDEN, MLP, bias=False)
        self.down = nn.Linear(MLP, HIDDEN, bias=False)

    def forward(self, x):
        b, t = x.shape[:2]
        h = self.attn_norm(x)
        q = self.q(h).view(b, t, HEADS, -1).transpose(1, 2)
        k = self.k(h).view(b, t, KV_HEADS, -1).transpose(1, 2)
        v = self.v(h).view(b, t, KV_HEADS, -1).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, HIDDEN))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def build(layers, dtype, seed=0):
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = nn.Sequential(*[Block() for _ in range(layers)])
    for p in model.parameters():
        if p.dim() == 2:
            nn.init.normal_(p, std=0.02)
    return model.to(dtype)


METHODS = ("torch", "torch captured", "forge", "forge deferred", "forge captured", "forge captured lagged")
# The FORGE methods that read each layer's outcome after the backward (and so take clipping).
DEFERRED = ("forge deferred", "forge captured", "forge captured lagged")


def variant(name, method, layers, tokens, configs, batch=1, max_norm=None, norm="gradient", hand_over=False,
            input_check="step"):
    dtype = torch.float32 if name == "fp32-master" else torch.bfloat16
    model = build(layers, dtype)
    deferred = method in DEFERRED
    if method.startswith("forge"):
        regime = {"bf16": "bf16-sr", "bf16-rn": "bf16-rn", "fp32-master": "fp32", "q8": "q8"}[name]
        config = tuned_config(configs, regime, tokens * batch) if configs else fk.PINNED
        _, state_format, rounding = REGIMES[regime]
        fk.fuse(model, fk.AdamW(lr=1e-4, weight_decay=0.01), state_format=state_format, rounding=rounding,
                config=config, seed=1, report="defer" if deferred else "raise", input_check=input_check)
        others = fk.unfused_parameters(model)
    else:
        others = list(model.parameters())
    captured = "captured" in method
    optimizer = torch.optim.AdamW(others, lr=1e-4, weight_decay=0.01, fused=True, capturable=captured)
    x = torch.randn(batch, tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)

    def loss_fn():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=name == "fp32-master"):
            return model(x.to(dtype) if dtype == torch.bfloat16 else x).float().square().mean()

    def forward_backward():
        loss = loss_fn()
        loss.backward()
        return loss

    def step_fn():
        optimizer.zero_grad(set_to_none=True)
        loss = forward_backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        return loss

    check = "lagged" if method == "forge captured lagged" else "every step"
    if max_norm is not None and method.startswith("forge"):
        if method.startswith("forge captured"):
            return model, fk.CapturedStep(model, forward_backward, optimizer=optimizer, max_norm=max_norm,
                                          clipping="previous-norm", norm=norm, check=check)
        trainer = fk.Trainer(model, optimizer, max_norm=max_norm, clipping="previous-norm", norm=norm)
        return model, lambda: trainer.step(loss_fn)
    if method.startswith("forge captured"):
        if hand_over:  # the CapturedStep steps the norms' AdamW (halted with the fused layers when lagged)
            return model, fk.CapturedStep(model, forward_backward, optimizer=optimizer, check=check)
        return model, fk.CapturedStep(model, step_fn, check=check)
    if method == "torch captured":
        return model, torch_graph(step_fn)

    def step():
        step_fn()
        if deferred:
            fk.check_updates(model)
    return model, step


def torch_graph(step_fn, warmup=1):
    """``step_fn`` as torch documents whole-network capture: eager warm-up steps on a side
    stream, then one capture; every later call replays it."""
    state = {}

    def step():
        if state.get("left", warmup):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                step_fn()
            torch.cuda.current_stream().wait_stream(stream)
            state["left"] = state.get("left", warmup) - 1
            return
        if "graph" not in state:
            state["graph"] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(state["graph"]):
                step_fn()
        state["graph"].replay()
    return step


def fits(name, method, layers, tokens, configs, batch, **clipping) -> bool:
    """Whether ``batch`` sequences of ``tokens`` take three steps under the process's memory
    cap: the first makes torch's optimizer state, and a captured method has captured and
    replayed its graph by the third (with clipping a CapturedStep's first step is the exact
    eager one, its second the warm-up)."""
    model = step = None
    try:
        model, step = variant(name, method, layers, tokens, configs, batch, **clipping)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        return True
    except torch.cuda.OutOfMemoryError:
        return False
    finally:
        del model, step
        gc.collect()
        torch.cuda.empty_cache()


def largest_batch(name, method, layers, tokens, configs, limit=256, **clipping) -> int:
    low, high = 0, 1
    while high <= limit and fits(name, method, layers, tokens, configs, high, **clipping):
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(name, method, layers, tokens, configs, middle, **clipping) else (low, middle)
    return low


def measure(step, warmup, steps, back_to_back=1):
    """(median, min, max) ms per step over ``steps`` timed runs of ``back_to_back`` calls
    each, then the peak allocated and reserved bytes over them."""
    times, peak, reserved = timed_steps(step, warmup, steps, back_to_back)
    return statistics.median(times), min(times), max(times), peak, reserved


def timed_steps(step, warmup, steps, back_to_back=1):
    """The ms per step of each of ``steps`` timed runs of ``back_to_back`` calls, and the
    peak allocated and reserved bytes over them."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(back_to_back):
            step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / back_to_back)
    return times, torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()


def row_line(tokens, name, method, times, peak, reserved):
    return (f"T={tokens:5d} {name:11s} {method:21s} {statistics.median(times):9.2f} ms  "
            f"peak {peak / 2**30:6.2f} GiB  reserved {reserved / 2**30:6.2f} GiB")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", default="512,4096")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--hand-over-optimizer", action="store_true",
                        help="forge captured methods: hand the norms' AdamW to the CapturedStep (optimizer=) instead "
                             "of stepping it in step_fn (what --max-norm does anyway)")
    parser.add_argument("--back-to-back", type=int, default=1, metavar="N",
                        help="time runs of N steps called one after another (one wait per run)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="time every variant and method once per round, the order reversed each other round, "
                             "and pool the rounds' readings (each round builds and warms its model again)")
    parser.add_argument("--variants", default="bf16,fp32-master")
    parser.add_argument("--methods", default="torch,forge,forge deferred")
    parser.add_argument("--fit-under", type=float, default=None, metavar="GB",
                        help="find the largest micro-batch under this memory cap instead of timing")
    parser.add_argument("--max-norm", type=float, default=None, help="clip every method's step by global norm")
    parser.add_argument("--norm", choices=("gradient", "tiles"), default="gradient",
                        help="with --max-norm, how FORGE takes each fused layer's norm")
    parser.add_argument("--input-check", choices=("step", "tiles"), default="step",
                        help="the fused layers' input_check: scan x and dY before each step, or leave a non-finite "
                             "input to the tiles it reaches")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if not torch.cuda.is_available():
        sys.exit("bench_model.py measures on a GPU; none is visible here")
    configs = json.loads(CONFIGS_FILE.read_text()) if CONFIGS_FILE.exists() else {}
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "commit": os.environ.get("FORGE_COMMIT", "unknown"),
            "layers": args.layers, "max_norm": args.max_norm, "norm": args.norm if args.max_norm else None,
            "hand_over_optimizer": args.hand_over_optimizer, "input_check": args.input_check}
    rows = []
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"--methods: unknown {unknown}; known: {', '.join(METHODS)}")
    unclipped = [m for m in methods if m.startswith("forge") and m not in DEFERRED]
    if args.max_norm is not None and unclipped:
        parser.error(f"--max-norm: {unclipped} have no clipping variant (use forge deferred or forge captured)")
    if args.fit_under is not None:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(args.fit_under * 1e9 / total)
    variants = args.variants.split(",")
    # The bf16 variant's torch rows are the comparison for q8 and bf16-rn (torch has no q8
    # state, and rounds to nearest); without it they run for those variants, the same torch step.
    cases = [(tokens, name, method) for tokens in (int(t) for t in args.tokens.split(","))
             for name in variants for method in methods
             if not (name in ("q8", "bf16-rn") and not method.startswith("forge") and "bf16" in variants)]
    if args.fit_under is not None:
        for tokens, name, method in cases:
            batch = largest_batch(name, method, args.layers, tokens, configs, max_norm=args.max_norm,
                                  norm=args.norm, input_check=args.input_check)
            rows.append({**meta, "tokens": tokens, "variant": name, "method": method,
                         "cap_gb": args.fit_under, "largest_batch": batch})
            print(f"T={tokens:5d} {name:11s} {method:14s} largest micro-batch under {args.fit_under:g} GB: "
                  f"{batch}", flush=True)
    else:
        readings = {case: ([], 0, 0) for case in cases}
        for _, case in in_rounds(cases, args.rounds):
            tokens, name, method = case
            model, step = variant(name, method, args.layers, tokens, configs, max_norm=args.max_norm,
                                  norm=args.norm, hand_over=args.hand_over_optimizer,
                                  input_check=args.input_check)
            times, peak, reserved = timed_steps(step, args.warmup, args.steps, args.back_to_back)
            pooled, peak_before, reserved_before = readings[case]
            readings[case] = (pooled + times, max(peak, peak_before), max(reserved, reserved_before))
            # Each reading as it comes, so that a timeout loses nothing.
            print(("  round " if args.rounds > 1 else "") + row_line(tokens, name, method, times, peak, reserved),
                  flush=True)
            # A fused layer and its weight's hook refer to each other: without a collection
            # the model outlives `del` and its weights and state count in the next peak.
            del model, step
            gc.collect()
            torch.cuda.empty_cache()
        for (tokens, name, method), (times, peak, reserved) in readings.items():
            median = statistics.median(times)
            rows.append({**meta, "tokens": tokens, "variant": name, "method": method,
                         "back_to_back": args.back_to_back, "rounds": args.rounds, "median_ms": f"{median:.3f}",
                         "min_ms": f"{min(times):.3f}", "max_ms": f"{max(times):.3f}", "peak_bytes": peak,
                         "peak_reserved_bytes": reserved})
            if args.rounds > 1:
                print(row_line(tokens, name, method, times, peak, reserved), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
