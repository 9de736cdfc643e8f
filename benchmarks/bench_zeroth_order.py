"""Zeroth-order fine-tuning on one GPU: peak memory and step time of GRZO and MeZO against
inference and against backprop + ``torch.optim.AdamW(fused=True)``, on a Llama-style model.

The model, built from constants (nothing is downloaded): ``--layers`` decoder blocks (default 1) of
Llama-3-8B's shapes (hidden 4096, 32 query and 8 key/value heads of 128, MLP 14336,
``nn.RMSNorm``, causal ``scaled_dot_product_attention``; no rotary embedding: it has no
parameters and costs the same in every method), a token embedding and an untied head of
``--vocab`` rows, all bf16. Every parameter trains (GRZO perturbs each Linear, the
embedding and the norms). Loss: each example's mean next-token cross-entropy on random
tokens.

Methods, each at each shape (``--shapes``, B × T tokens; default 1 × 512 and 16 × 128):

* ``inference``: the forward alone (``torch.no_grad``), the per-example losses;
* ``GRZO``: ``fk.GRZO(normalize="none", sigma=1e-3).step`` (two hooked forwards, the
  update regenerating U in row blocks); "none" because "std" refuses B = 1 and its
  update costs the same;
* ``MeZO``: ``fk.MeZO(eps=1e-3).step`` (three in-place shifts, two forwards, the update);
* ``AdamW``: forward, backward, ``torch.optim.AdamW(fused=True)`` step, ``zero_grad``.

Peak is ``torch.cuda.max_memory_allocated`` over a method's timed steps after
``reset_peak_memory_stats`` (the model's weights included); time is the median over up
to ``--steps`` steps after one warm-up step (fewer where a step is slow, so that the
whole run stays within ``--budget-s``; the CSV says how many, 0 meaning the warm-up
step's own time). No measurement starts after ``--deadline-s``.

Cost of the torch path (the draws before ``draw_kernel``), estimated before any GPU run: drawing one block of 2²⁰ normals is 357 torch
operations on int64 and float64 tensors (Philox and the portable Box–Muller), about 5 ms
on an H200; a GRZO step draws U three times over the Linears (two hooked forwards, the
update; 1.2 G elements with one layer and vocabulary 32,000), MeZO four times over every
parameter (1.9 G), i.e. roughly 5 and 8 s per step. Hence one layer by default, and
the 90 s limit; ``--layers 2`` about doubles it. With the kernels the step time is not
yet measured (pending the H200 run), so those limits are kept.

The memory claim checked (``claim holds`` column): a zeroth-order step's peak exceeds
inference's by at most 3A + D, where A is the fp32 bytes of the widest activation
(B · T · max(vocab, MLP width) · 4) and D the measured peak of drawing one row block
(``block_elements`` normals): by the code, GRZO's widest hook holds its fp32 output
change (A), the sign-multiplied input (at most A) and one block's product (at most A)
besides the forward's own tensors and one block of draws; MeZO holds one block of z and
of the updated weights (proofs/zeroth_order.md, "Memory bound checked by the
benchmark"). At 1 × 512 tokens a weight-sized fp32 temporary of the head would exceed
the bound; at 16 × 128 the bound is larger than one (the CSV's
``largest_weight_fp32_bytes``), so there it bounds the extra memory but cannot by
itself rule one out.

    python3 benchmarks/bench_zeroth_order.py --out benchmarks/results/zeroth_order/h200-memory-speed.csv
    python3 benchmarks/bench_zeroth_order.py --smoke --out /tmp/zo-smoke.csv   # tiny, on the CPU

Since the draws and updates run as Triton kernels on CUDA (``draw_kernel``,
``update_kernel``, ``mezo_kernel``), the GRZO and MeZO rows above time the kernels.
``--kernels`` times the parts on their own instead, each with the kernels and with the
torch path they replace (``use_kernels(False)``), and says whether the two gave the same
bits: one block of ``BLOCK_ELEMENTS`` normals; GRZO's update of one Llama-3-8B MLP
weight (4096 × 14336, bf16, B = 16 and B = 12, whose reciprocal rounds); MeZO's shift and
update of the same weight. One row per part and path (median ms over ``--steps``):

    python3 benchmarks/bench_zeroth_order.py --kernels --out benchmarks/results/zeroth_order/h200-kernels.csv
"""

import argparse
import csv
import gc
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import forge_kernels as fk
from forge_kernels.zeroth_order import draw_kernel
from forge_kernels.zeroth_order.draws import CallDraws, kernels_for, standard_normal, use_kernels
from forge_kernels.zeroth_order.grzo import BLOCK_ELEMENTS

METHODS = ("inference", "GRZO", "MeZO", "AdamW")


@dataclass(frozen=True)
class Shapes:
    hidden: int
    heads: int
    kv_heads: int
    mlp: int
    vocab: int
    layers: int


LLAMA3_8B = dict(hidden=4096, heads=32, kv_heads=8, mlp=14336)
SMOKE = Shapes(hidden=64, heads=4, kv_heads=2, mlp=128, vocab=97, layers=1)


class Block(nn.Module):
    def __init__(self, s: Shapes):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = s.heads, s.kv_heads, s.hidden // s.heads
        self.attn_norm = nn.RMSNorm(s.hidden)
        self.q = nn.Linear(s.hidden, s.hidden, bias=False)
        self.k = nn.Linear(s.hidden, s.kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(s.hidden, s.kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(s.hidden, s.hidden, bias=False)
        self.mlp_norm = nn.RMSNorm(s.hidden)
        self.gate = nn.Linear(s.hidden, s.mlp, bias=False)
        self.up = nn.Linear(s.hidden, s.mlp, bias=False)
        self.down = nn.Linear(s.mlp, s.hidden, bias=False)

    def forward(self, x):
        b, t, c = x.shape
        h = self.attn_norm(x)
        q = self.q(h).view(b, t, self.heads, -1).transpose(1, 2)
        k = self.k(h).view(b, t, self.kv_heads, -1).transpose(1, 2)
        v = self.v(h).view(b, t, self.kv_heads, -1).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, c))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Decoder(nn.Module):
    def __init__(self, s: Shapes):
        super().__init__()
        self.embed = nn.Embedding(s.vocab, s.hidden)
        self.blocks = nn.ModuleList(Block(s) for _ in range(s.layers))
        self.norm = nn.RMSNorm(s.hidden)
        self.head = nn.Linear(s.hidden, s.vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def per_example_losses(model, tokens):
    """Each example's mean next-token cross-entropy (fp32), (B,)."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().transpose(1, 2), tokens[:, 1:], reduction="none").mean(1)


def build(shapes: Shapes, dtype, device, seed=0):
    torch.manual_seed(seed)
    with torch.device(device):
        model = Decoder(shapes)
    for p in model.parameters():
        if p.dim() == 2:
            nn.init.normal_(p, std=0.02)
    return model.to(dtype)


def make_step(method, model, tokens):
    if method == "inference":
        def step():
            with torch.no_grad():
                per_example_losses(model, tokens)
        return step
    if method == "GRZO":
        opt = fk.GRZO(model, lr=1e-6, sigma=1e-3, normalize="none", seed=1)
        return lambda: opt.step(lambda: per_example_losses(model, tokens))
    if method == "MeZO":
        opt = fk.MeZO(model, lr=1e-6, eps=1e-3, seed=1)
        return lambda: opt.step(lambda: per_example_losses(model, tokens).mean())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=tokens.is_cuda)

    def step():
        per_example_losses(model, tokens).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(step, device, max_steps, budget_s):
    """(median ms, steps timed, peak bytes or None): one warm-up step, then up to
    ``max_steps`` timed steps, as many as fit in ``budget_s``; where the warm-up step
    alone took longer than ``budget_s`` its time is the figure (0 steps timed). The peak
    covers the warm-up step too (AdamW allocates its moments there)."""
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    step()
    _sync(device)
    warm = time.perf_counter() - start
    count = min(max_steps, int(budget_s / max(warm, 1e-6)))
    times = [1e3 * warm] if count == 0 else []
    for _ in range(count):
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(1e3 * (time.perf_counter() - start))
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    return statistics.median(times), count, peak


def draw_block_peak(device) -> int | None:
    """D: the extra peak bytes of drawing one row block of ``BLOCK_ELEMENTS`` normals."""
    if device.type != "cuda":
        return None
    _sync(device)
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    standard_normal(12345, torch.arange(BLOCK_ELEMENTS, device=device), torch.float32)
    _sync(device)
    return torch.cuda.max_memory_allocated() - before


def run(shapes: Shapes, batches, dtype, device, max_steps, budget_s, deadline_s):
    meta = {"gpu": torch.cuda.get_device_name() if device.type == "cuda" else "CPU (smoke)",
            "torch": torch.__version__, "triton": _triton_version(),
            "commit": os.environ.get("FORGE_COMMIT", "unknown"),
            "layers": shapes.layers, "hidden": shapes.hidden, "mlp": shapes.mlp, "vocab": shapes.vocab,
            "dtype": str(dtype).replace("torch.", "")}
    began = time.perf_counter()
    draws = draw_block_peak(device)
    share = budget_s / (len(batches) * len(METHODS))
    rows = []
    for batch, length in batches:
        widest = 4 * batch * length * max(shapes.vocab, shapes.mlp)
        tokens = torch.randint(0, shapes.vocab, (batch, length + 1), device=device,
                               generator=torch.Generator(device).manual_seed(0))
        peaks = {}
        for method in METHODS:
            if time.perf_counter() - began > deadline_s:
                print(f"B={batch} T={length} {method}: not measured, past --deadline-s {deadline_s:g}", flush=True)
                continue
            model = build(shapes, dtype, device)
            parameters = sum(p.numel() for p in model.parameters())
            largest = 4 * max(p.numel() for p in model.parameters())
            median, count, peak = measure(make_step(method, model, tokens), device, max_steps, share)
            peaks[method] = peak
            extra = None if peak is None or method == "inference" else peak - peaks["inference"]
            holds = "" if extra is None or method == "AdamW" else str(extra <= 3 * widest + draws)
            rows.append({**meta, "batch": batch, "tokens_per_example": length, "parameters": parameters,
                         "method": method, "median_ms": f"{median:.2f}", "steps_timed": count,
                         "peak_bytes": "" if peak is None else peak,
                         "extra_over_inference_bytes": "" if extra is None else extra,
                         "widest_activation_fp32_bytes": widest,
                         "draw_block_peak_bytes": "" if draws is None else draws,
                         "largest_weight_fp32_bytes": largest, "claim_holds": holds})
            del model
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def _triton_version():
    try:
        import triton
        return triton.__version__
    except ImportError:
        return "none"


def markdown(rows) -> str:
    def gib(value):
        return "" if value == "" else f"{int(value) / 2**30:.2f}"
    lines = [f"{rows[0]['gpu']}, torch {rows[0]['torch']}, triton {rows[0]['triton']}, commit {rows[0]['commit']}; "
             f"{rows[0]['layers']} Llama-3-8B-shaped layers, vocabulary {rows[0]['vocab']}, {rows[0]['dtype']}, "
             f"{rows[0]['parameters']:,} parameters",
             "", "| B × T | method | median ms (steps) | peak GiB | over inference GiB | 3A + D GiB | claim holds |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        bound = "" if r["draw_block_peak_bytes"] == "" or r["method"] in ("inference", "AdamW") else \
            gib(3 * r["widest_activation_fp32_bytes"] + r["draw_block_peak_bytes"])
        lines.append(f"| {r['batch']} × {r['tokens_per_example']} | {r['method']} | {r['median_ms']} "
                     f"({r['steps_timed']}) | {gib(r['peak_bytes'])} | {gib(r['extra_over_inference_bytes'])} "
                     f"| {bound} | {r['claim_holds']} |")
    return "\n".join(lines)


def _timed(fn, device, steps):
    """(median ms, last result) of ``fn()`` over ``steps`` calls after one warm-up call."""
    result = fn()
    times = []
    for _ in range(steps):
        _sync(device)
        start = time.perf_counter()
        result = fn()
        _sync(device)
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times), result


def _same_bits(a, b) -> bool:
    views = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16}
    return a.dtype == b.dtype and torch.equal(a.view(views[a.dtype]), b.view(views[b.dtype]))


def kernel_parts(device, shape, steps, draw_elements=BLOCK_ELEMENTS):
    """Rows of ``--kernels``: each part with the kernels and with the torch path."""
    rows = []

    def record(part, make, batch=""):
        results = {}
        for path, choice in (("kernel", True), ("torch", False)):
            with use_kernels(choice):
                median, result = _timed(make(), device, steps)
            results[path] = result
            rows.append({"part": part, "path": path, "batch": batch, "median_ms": f"{median:.3f}"})
        equal = all(_same_bits(a, b) for a, b in zip(results["kernel"], results["torch"]))
        for row in rows[-2:]:
            row["bitwise_equal"] = equal
        print(f"{part} B={batch}: kernel {rows[-2]['median_ms']} ms, torch {rows[-1]['median_ms']} ms, "
              f"same bits: {equal}", flush=True)

    def draw_block():
        counter = torch.arange(draw_elements, device=device)
        if kernels_for(device):
            return lambda: [draw_kernel.draw(True, 12345, draw_elements, torch.float32, device, cols=draw_elements)]
        return lambda: [standard_normal(12345, counter, torch.float32)]
    record(f"draw {draw_elements} normals", draw_block)

    torch.manual_seed(0)
    weight = (0.02 * torch.randn(shape, device=device)).to(torch.bfloat16)
    for batch in (16, 12):
        def grzo_update(batch=batch):
            layer = nn.Linear(shape[1], shape[0], bias=False, device=device, dtype=torch.bfloat16)
            opt = fk.GRZO(layer, lr=1e-3, normalize="none", weight_decay=0.01, seed=1)
            target, draws = opt.targets[0], CallDraws(1, 0)
            c = torch.randn(batch, dtype=torch.float64, generator=torch.Generator().manual_seed(batch)).to(device)

            def step():
                layer.weight.data.copy_(weight)
                with torch.no_grad():
                    opt._update(target, draws, c, batch)
                return [layer.weight.data.clone()]
            return step
        record(f"GRZO update {shape[0]}x{shape[1]} bf16", grzo_update, batch)

    for part in ("shift", "update"):
        def mezo(part=part):
            layer = nn.Linear(shape[1], shape[0], bias=False, device=device, dtype=torch.bfloat16)
            opt = fk.MeZO(layer, lr=1e-3, eps=1e-3, weight_decay=0.01, seed=1)

            def step():
                layer.weight.data.copy_(weight)
                with torch.no_grad():
                    if part == "shift":
                        opt._shift(1.0)
                    else:
                        opt._update(*opt.params[0], 0.37)
                return [layer.weight.data.clone()]
            return step
        record(f"MeZO {part} {shape[0]}x{shape[1]} bf16", mezo)
    return rows


def _batches(text):
    try:
        pairs = [tuple(int(v) for v in part.split("x")) for part in text.split(",")]
    except ValueError:
        raise SystemExit(f"--shapes must look like 1x512,16x128 (B x tokens), got {text!r}") from None
    if any(b < 1 or t < 1 for b, t in pairs):
        raise SystemExit(f"--shapes: batch and tokens must be positive, got {text!r}")
    return pairs


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="CSV path (one row per shape and method)")
    parser.add_argument("--layers", type=int, default=1, help="decoder blocks (the 90 s limit: see the docstring)")
    parser.add_argument("--vocab", type=int, default=32000, help="embedding and head rows (Llama-3: 128256)")
    parser.add_argument("--shapes", default="1x512,16x128", help="B x tokens per example, comma-separated")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per method at most")
    parser.add_argument("--budget-s", type=float, default=50.0, help="time for all the timed steps together")
    parser.add_argument("--deadline-s", type=float, default=80.0,
                        help="no new measurement starts after this many seconds (its row is left out)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, to see that it runs")
    parser.add_argument("--kernels", action="store_true",
                        help="time the draw and update kernels against the torch path, and compare their bits")
    args = parser.parse_args(argv)
    batches = _batches(args.shapes)
    if args.kernels:
        return _kernels_main(args)
    if args.smoke:
        shapes, dtype, device = SMOKE, torch.float32, torch.device("cpu")
        batches, args.steps = [(1, 8), (4, 4)], 1
    else:
        if not torch.cuda.is_available():
            sys.exit("bench_zeroth_order.py measures on a GPU; none is visible here (--smoke runs it on the CPU)")
        shapes = Shapes(**LLAMA3_8B, vocab=args.vocab, layers=args.layers)
        dtype, device = torch.bfloat16, torch.device("cuda")
    rows = run(shapes, batches, dtype, device, args.steps, args.budget_s, args.deadline_s)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(markdown(rows))
    return 0


def _kernels_main(args):
    if args.smoke:
        device, shape, steps, draw_elements = torch.device("cpu"), (8, 24), 1, 4096
    else:
        if not torch.cuda.is_available():
            sys.exit("--kernels measures on a GPU; none is visible here (add --smoke to run it on the CPU)")
        device, shape, steps, draw_elements = torch.device("cuda"), (4096, 14336), args.steps, BLOCK_ELEMENTS
    rows = kernel_parts(device, shape, steps, draw_elements)
    meta = {"gpu": torch.cuda.get_device_name() if device.type == "cuda" else "CPU (smoke)",
            "torch": torch.__version__, "triton": _triton_version(),
            "commit": os.environ.get("FORGE_COMMIT", "unknown")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(meta) + list(rows[0]))
        writer.writeheader()
        writer.writerows({**meta, **row} for row in rows)
    equal = all(row["bitwise_equal"] for row in rows)
    print("every part: the kernel's bits are the torch path's" if equal else
          "A KERNEL'S BITS DIFFER FROM THE TORCH PATH (see bitwise_equal)")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
