"""ChunkFT's device memory and step time on one GPU, against ``torch.optim.AdamW(fused=True)``.

The model: a Hugging Face ``LlamaForCausalLM`` built from a ``LlamaConfig`` with
Llama-3-8B's shapes (hidden 4096, 32 query and 8 key/value heads, MLP 14336, vocabulary
128,256, untied head) and ``--layers`` decoder layers (32 in the real model), bf16
weights, batch 1 x ``--tokens`` tokens, the model's own cross-entropy loss.

Methods, each on the same model in turn:
* ``torch AdamW``: ``torch.optim.AdamW(fused=True)`` on every parameter (bf16 gradients
  and bf16 moments, as torch keeps them for bf16 parameters);
* ``ChunkFT``: ``fk.ChunkFT`` with FORGE's AdamW, fp32 moments per chunk, bf16 weights
  stepped with stochastic rounding, no gradient tensor for nn.Linear weights; device
  state store (every visited chunk's state stays on the GPU) and host state store (an
  inactive chunk's state in pinned host memory, the next chunk's prefetched), for each
  of ``--chunks``.

Measured: ``torch.cuda.max_memory_allocated`` over the timed steps (after a warm-up in
which ChunkFT visits every chunk once, so every state exists and every kernel is
compiled), the median step time (forward, backward, update; synchronized), and for the
host store the host bytes of the offloaded states (``ChunkFT.state_bytes()``). Beside
them, formulas, not measurements: BAdam's 2M + 16M/D GB (M billions of parameters, D
blocks: bf16 weights, and for the active block fp32 master weights, gradient and two
moments), ChunkFT-on-FORGE's 2M + 8M/D GB (bf16 weights, two fp32 moments of the active
chunk, no master copy, no gradient), both without activations; and the ChunkFT paper's
13.72 GB for a 7B model at 1K tokens, scaled by M/7 (an assumption: it scales the
weights and states right, but not the activations or the vocabulary's share).

    python3 benchmarks/bench_chunkft.py --out benchmarks/results/chunkft/h200.csv
    python3 benchmarks/bench_chunkft.py --smoke --out /tmp/chunkft_smoke.csv   # CPU, tiny sizes
"""

import argparse
import csv
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkout import forge_kernels  # noqa: E402

forge_kernels()
import forge_kernels as fk  # noqa: E402

GB = 1e9
PAPER_GB, PAPER_BILLIONS = 13.72, 7.0
#: Llama-3-8B's shapes, the layer count left to --layers
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
                 tie_word_embeddings=False)
SMOKE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
             rms_norm_eps=1e-5, max_position_embeddings=64, tie_word_embeddings=False)
FIELDS = ["method", "shapes", "state_store", "chunks", "layers", "tokens", "parameters", "peak_gb", "median_ms",
          "host_state_gb", "badam_formula_gb", "forge_formula_gb", "paper_scaled_gb", "gpu", "torch", "triton"]


def build_model(layers, shapes, device):
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as error:
        raise SystemExit(f"bench_chunkft needs transformers (to build the model from a LlamaConfig): {error}")
    config = LlamaConfig(num_hidden_layers=layers, attn_implementation="sdpa", **shapes)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # build the weights in bf16, on the device, directly
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.train()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _measure(step, warmup, steps, device):
    for _ in range(warmup):
        step()
    _sync(device)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    peak = torch.cuda.max_memory_allocated() / GB if device.type == "cuda" else None
    return peak, statistics.median(times)


def run(args):
    # Smoke mode runs where the kernels run (the CPU here, the GPU on a GPU machine), at tiny sizes.
    device = fk.kernel_device() if args.smoke else torch.device("cuda")
    shapes = SMOKE if args.smoke else LLAMA3_8B
    torch.manual_seed(0)
    model = build_model(args.layers, shapes, device)
    parameters = sum(p.numel() for p in model.parameters())
    billions = parameters / 1e9
    tokens = torch.randint(0, shapes["vocab_size"], (1, args.tokens), device=device)

    def loss():
        return model(input_ids=tokens, labels=tokens).loss

    meta = {"shapes": "tiny (smoke)" if args.smoke else "Llama-3-8B", "layers": args.layers, "tokens": args.tokens,
            "parameters": parameters,
            "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "CPU (Triton interpreter)",
            "torch": torch.__version__, "triton": _triton_version(),
            "paper_scaled_gb": round(PAPER_GB * billions / PAPER_BILLIONS, 3)}
    rows = []
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")

    def torch_step():
        loss().backward()
        adamw.step()
        adamw.zero_grad(set_to_none=True)
    peak, median = _measure(torch_step, 2, args.steps, device)
    rows.append(meta | {"method": "torch AdamW(fused=True)", "state_store": "device", "chunks": 1,
                        "peak_gb": peak, "median_ms": median, "host_state_gb": 0.0,
                        "badam_formula_gb": None, "forge_formula_gb": None})
    del adamw
    _release(device)
    for store in ("device", "host"):
        for chunks in args.chunks:
            ctl = fk.ChunkFT(model, fk.AdamW(lr=1e-5), chunks, state_store=store, prefetch=store == "host")
            peak, median = _measure(lambda: ctl.step(loss), chunks, args.steps, device)
            rows.append(meta | {"method": "ChunkFT", "state_store": store, "chunks": chunks, "peak_gb": peak,
                                "median_ms": median, "host_state_gb": ctl.state_bytes()["host"] / GB,
                                "badam_formula_gb": round(2 * billions + 16 * billions / chunks, 3),
                                "forge_formula_gb": round(2 * billions + 8 * billions / chunks, 3)})
            ctl.remove()
            del ctl
            _release(device)
    return rows


def _release(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _triton_version():
    try:
        import triton
        return triton.__version__
    except ImportError:
        return "none"


def _cell(value, digits=2):
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def markdown(rows) -> str:
    first = rows[0]
    lines = [f"{first['gpu']}, torch {first['torch']}, triton {first['triton']}; {first['shapes']} shapes, "
             f"{first['layers']} layers, {first['parameters'] / 1e9:.3f} B parameters, 1 x {first['tokens']} tokens, "
             "bf16 weights",
             f"measured: peak allocated and median step; formulas (not measured, no activations): BAdam "
             f"2M + 16M/D, ChunkFT on FORGE 2M + 8M/D; the paper's 13.72 GB at 7B and 1K tokens scaled by M/7: "
             f"{first['paper_scaled_gb']} GB",
             "| method | state store | chunks | peak GB (measured) | median step ms (measured) | host state GB "
             "(measured) | BAdam formula GB | FORGE formula GB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['state_store']} | {r['chunks']} | {_cell(r['peak_gb'])} | "
                     f"{_cell(r['median_ms'], 1)} | {_cell(r['host_state_gb'], 3)} | {_cell(r['badam_formula_gb'])} | "
                     f"{_cell(r['forge_formula_gb'])} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 4; 2 with --smoke)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per step (default 1024; 16 with --smoke)")
    parser.add_argument("--chunks", type=int, nargs="+", default=None, help="chunk counts (default 4 16; 2 4)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per method (default 6; 2 with --smoke)")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: checks the script runs")
    parser.add_argument("--out", required=True, help="CSV to write")
    args = parser.parse_args(argv)
    for name, full, smoke in (("layers", 4, 2), ("tokens", 1024, 16), ("chunks", [4, 16], [2, 4]), ("steps", 6, 2)):
        if getattr(args, name) is None:
            setattr(args, name, smoke if args.smoke else full)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("bench_chunkft measures GPU memory: run it on a CUDA machine (or pass --smoke)")
    rows = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows({k: r[k] for k in FIELDS} for r in rows)
    print(markdown(rows))
    print(f"wrote {out}")
    return rows


if __name__ == "__main__":
    main()
