"""Data-parallel training of a Llama-style model with each gradient exchange of GIFT
(issue 18): step time, bytes on the wire per step and the loss after a fixed number of
steps, every method from the same initial weights and the same batches.

Ranks: ``--world`` W processes in one process group, started by
``forge_verify.distributed.ranks.RankPool`` (NCCL with one GPU per rank where CUDA is
available, otherwise gloo on the CPU). Model: ``transformers.LlamaForCausalLM``, random init
from ``--seed`` (hidden 1024, MLP 4096, 16 layers, 16 heads: 269 M parameters), character-level
on the shipped tales (``forge_verify.models.corpus``, 40 symbols); each rank draws its own
batches from a generator seeded by (seed, rank), the same for every method. AdamW (torch's;
FORGE's on the fused weights, same hyperparameters). On CUDA the forward runs under bf16
autocast (fp32 master weights and fp32 gradients, as DDP communicates them).

Methods (``--methods``, default all):

* ``ddp/fp32``: DDP's own fp32 all-reduce; ``ddp/bf16``: torch's ``bf16_compress_hook``.
* ``ddp/<fmt>/plain`` and ``ddp/<fmt>/gift`` for fmt in e4m3, e5m2, nvfp4: every gradient
  through ``fk.gift.gift_hook`` in that wire format; ``gift`` whitens the MLP down
  projections (``mlp.down_proj``, the paper's fc2) with a rank-``--rank`` transform refreshed
  every ``--refresh-every`` steps from the inputs the hook's tracker recorded at every forward
  since the last refresh; error feedback on; ``--exchange`` (default the hook's reduce-scatter).
* ``forge/fp32``, ``forge/e4m3/plain``, ``forge/e4m3/gift``: every decoder Linear fused
  (``fk.fuse``, tile config ``fk.PINNED``), each fused weight stepped in its backward by FORGE's
  materialized data-parallel step (``token_split.materialized_split_step``, ``--bucket-rows``
  rows of the fp32 gradient at a time), whose sum over the ranks is an fp32 all-reduce
  (``forge/fp32``) or ``fk.gift.GiftSplitReducer`` (e4m3; ``gift``: the down projections'
  reducers refresh their transform from that step's inputs every ``--refresh-every`` steps),
  divided by W as DDP averages. Embeddings, norms and the head stay under DDP, with the same
  format's plain ``gift_hook`` (``forge/fp32``: DDP's all-reduce); DDP ignores the fused
  layers' weights and every buffer.

``gift_hook`` runs with ``overlap`` on under gloo and off under NCCL (``--overlap``), as its
docstring asks until NCCL is tested; the FORGE rows always run it inline, so that every
collective of a step is issued from the autograd thread in the same order on every rank.

Measured per method: step time (perf_counter around each step, with ``torch.cuda.synchronize``
on CUDA; per step the slowest rank, then median, min and max over ``--steps`` timed steps after
``--warmup``); bytes per step over the whole run, the largest rank's, counted by the GIFT
states' ``wire_bytes`` (what a rank passes into the collectives: ``gradients_bytes``, plus the
scales' MAX all-reduces and the refreshes, amortized, in ``wire_bytes``) and ``received_bytes``
(what the code exchanges deliver), or, for DDP's fp32 all-reduce and the bf16 hook, derived from
the gradient bytes as a ring all-reduce receiving 2 (W - 1) / W of them (``bytes_source``); the
loss, mean of the last ``--loss-window`` steps, averaged over the ranks (each rank's is on its
own batch), and the largest rank's; whether every rank ends with the same parameter bits.

Output: a markdown table on stdout, a row per method as it finishes, and with ``--out`` a CSV
(GPU name or "cpu", torch, triton and transformers versions, world, backend, commit:
FORGE_COMMIT or ``git rev-parse``), rewritten after every method. A method that fails on any
rank gets a row with its error, the next starts fresh ranks, and the exit status is 1.

On a machine where nothing of this project is installed (the lent GPU machines), put the
checkout's ``kernels/`` on the path as ``forge_kernels``, as ``.ci/gpu-sharding`` does (the
ranks inherit PYTHONPATH; without it this script maps ``kernels/`` itself, in every rank)::

    shim=$(mktemp -d); ln -s "$PWD/kernels" "$shim/forge_kernels"
    PYTHONPATH="$shim:$PWD" python3 benchmarks/bench_gift_ddp.py --world 2 \\
        --out benchmarks/results/gift/h200x2-ddp.csv

(``--world 4`` or ``8`` where that many GPUs are lent.) ``--smoke``: a tiny model (hidden 64,
one decoder layer) and 3 steps, every method: on a CPU machine 2 gloo ranks with FORGE's
kernels in the Triton interpreter (``tests/test_bench_gift_ddp_smoke.py``), on a GPU machine a
quick NCCL check before the full run.
"""

import argparse
import csv
import dataclasses
import gc
import importlib.metadata
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
from torch.nn.parallel import DistributedDataParallel

ROOT = Path(__file__).resolve().parent.parent
# Spawned ranks run this module as their __main__ before they unpickle anything, with the
# parent's sys.path: the mapping below happens in them too.
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from checkout import forge_kernels  # noqa: E402

forge_kernels()
import forge_kernels as fk  # noqa: E402
from forge_kernels.token_split import materialized_split_step  # noqa: E402

from forge_verify.distributed.ranks import RankError, RankPools, default_backend  # noqa: E402
from forge_verify.models import corpus  # noqa: E402

LOW_PRECISION = ("e4m3", "e5m2", "nvfp4")
EXCHANGES = ("reduce_scatter", "all_gather")


@dataclasses.dataclass(frozen=True)
class Method:
    path: str   # "ddp": DDP over every parameter; "forge": fused decoder Linears, DDP over the rest
    fmt: str    # the wire format: fp32, bf16 or one of LOW_PRECISION
    route: str  # "plain" or "gift" (the down projections whitened)

    @property
    def name(self) -> str:
        return "/".join([self.path, self.fmt] + ([self.route] if self.fmt in LOW_PRECISION else []))


METHODS = (
    Method("ddp", "fp32", "plain"), Method("ddp", "bf16", "plain"),
    *(Method("ddp", fmt, route) for fmt in LOW_PRECISION for route in ("plain", "gift")),
    Method("forge", "fp32", "plain"), Method("forge", "e4m3", "plain"), Method("forge", "e4m3", "gift"),
)


@dataclasses.dataclass(frozen=True)
class Run:
    """What every rank needs for one method's training run."""
    hidden: int
    intermediate: int
    layers: int
    heads: int
    seq: int
    batch: int
    warmup: int
    steps: int
    lr: float
    seed: int
    gift_rank: int
    refresh_every: int
    exchange: str
    overlap: bool
    bucket_rows: int | None


MODEL_SIZES = {  # hidden, intermediate, layers, heads
    "default": (1024, 4096, 16, 16),
    "smoke": (64, 128, 1, 4),
}


def token_ids() -> tuple[torch.Tensor, int]:
    """The tales as character ids, and the vocabulary size."""
    text = corpus.load()
    lookup = {c: i for i, c in enumerate(sorted(set(text)))}
    return torch.tensor([lookup[c] for c in text], dtype=torch.int64), len(lookup)


def llama(run: Run, vocab: int, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=run.hidden, intermediate_size=run.intermediate,
                         num_hidden_layers=run.layers, num_attention_heads=run.heads,
                         num_key_value_heads=run.heads, max_position_embeddings=run.seq,
                         tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(run.seed)
    with torch.device(device):
        return LlamaForCausalLM(config)


def down_projections(model) -> list:
    return [layer.mlp.down_proj for layer in model.model.layers]


def ignored_by_ddp(model) -> list:
    """Fully qualified names of what DDP leaves alone: the fused layers' parameters (they
    never get a .grad) and every buffer (the rotary frequencies are equal on every rank,
    and a fused layer's state is its rank's own), so that DDP broadcasts none per step."""
    names = [name for name, _ in model.named_buffers()]
    for prefix, module in model.named_modules():
        if isinstance(module, fk.ForgeLinear):
            names += [f"{prefix}.{name}" for name, _ in module.named_parameters(recurse=False)]
    return names


def bf16_all_reduce(process_group, bucket):
    """torch's ``bf16_compress_hook`` under another name, for gloo: DDP refuses that hook by
    its name on a torch built without CUDA, though gloo all-reduces bf16 tensors."""
    return bf16_compress_hook(process_group, bucket)


class FusedDataParallel:
    """Every fused layer's backward takes FORGE's materialized data-parallel step: the fp32
    gradient summed over the ranks through ``reducers[layer]`` (None: an fp32 all-reduce),
    divided by the world size, then the layer's rule, at the layer's step and rounding seed."""

    def __init__(self, layers, reducers: dict, gift_layers, group, refresh_every: int, bucket_rows):
        self.layers, self.reducers, self.gift_layers, self.group = list(layers), reducers, set(gift_layers), group
        self.refresh_every, self.bucket_rows = refresh_every, bucket_rows
        self.world = dist.get_world_size(group)
        for layer in self.layers:
            layer.forge_backward = self.step_layer

    def step_layer(self, layer, x2d, dy2d):
        # The layer's own counters (host copies: no synchronization) and bookkeeping, as its
        # own step keeps them.
        step, seed = layer._counters()
        step += 1
        parts = [(x2d, dy2d)]
        if layer in self.gift_layers and (step - 1) % self.refresh_every == 0:
            self.reducers[layer].refresh(parts)
        materialized_split_step(parts, layer.weight.data, layer.forge_state, layer.rule, step, group=self.group,
                                bucket_rows=self.bucket_rows, config=layer.config, rounding=layer.rounding,
                                seed=seed, reduce=self.mean_reduce(self.reducers.get(layer)))
        layer._bump_versions(layer.weight.data)
        layer._set_step(step)

    def mean_reduce(self, reducer):
        """``reduce=`` for materialized_split_step: its sum over the ranks, divided by the
        world size (DDP averages the unfused gradients; the fused ones must match)."""
        def mean(grad, group, rows):
            if reducer is None:
                dist.all_reduce(grad, group=group)
                total = grad
            else:
                total = reducer(grad, group, rows)
            return total.div_(self.world)
        return mean

    def close(self):
        for layer in self.layers:
            layer.forge_backward = None


def ring_bytes(payload: int, world: int) -> float:
    """What every rank receives in a ring all-reduce of ``payload`` bytes."""
    return 2 * (world - 1) / world * payload


def add_counts(total: dict, counter, prefix: str) -> None:
    for kind, count in counter.items():
        total[f"{prefix}_{kind}"] = total.get(f"{prefix}_{kind}", 0) + count


def parameter_checksum(model) -> int:
    """The sum of every parameter's bit patterns as integers: equal bits, equal sums."""
    total = 0
    for p in model.parameters():
        bits = p.detach().contiguous().view(torch.int32 if p.element_size() == 4 else torch.int16)
        total += int(bits.sum(dtype=torch.int64))
    return total


def train(run: Run, method: Method) -> dict:
    """One method's training run on this rank: per-step times and losses, byte counts, the
    parameters' checksum and the gradient elements each exchange carries per step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    ids, vocab = token_ids()
    model = llama(run, vocab, device)
    adamw = dict(lr=run.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    fused = None
    if method.path == "forge":
        fk.fuse(model, fk.AdamW(**adamw), exclude=["lm_head"])
        for layer in fk.fused_layers(model):  # DDP will not broadcast them: rank 0's, as DDP does for the rest
            dist.broadcast(layer.weight.data, 0)
        reducers, gift_layers = {}, []
        if method.fmt != "fp32":
            gift_layers = down_projections(model) if method.route == "gift" else []
            reducers = {layer: fk.gift.GiftSplitReducer(method.fmt, dist.group.WORLD, rank=run.gift_rank,
                                                        exchange=run.exchange)
                        for layer in fk.fused_layers(model)}
        fused = FusedDataParallel(fk.fused_layers(model), reducers, gift_layers, dist.group.WORLD,
                                  run.refresh_every, run.bucket_rows)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored_by_ddp(model))
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    state = None
    if method.fmt == "bf16":
        ddp.register_comm_hook(None, bf16_compress_hook if device.type == "cuda" else bf16_all_reduce)
    elif method.fmt in LOW_PRECISION:
        layers = down_projections(model) if method.path == "ddp" and method.route == "gift" else ()
        state = fk.gift.GiftState(None, method.fmt, run.gift_rank, run.refresh_every, layers=layers,
                                  exchange=run.exchange, overlap=run.overlap and method.path == "ddp")
        ddp.register_comm_hook(state, fk.gift.gift_hook)
    optimizer = torch.optim.AdamW(fk.unfused_parameters(model), **adamw)
    generator = torch.Generator().manual_seed(run.seed * 1000 + rank)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    times, losses = [], []
    for _ in range(run.warmup + run.steps):
        starts = torch.randint(0, len(ids) - run.seq - 1, (run.batch,), generator=generator)
        x = torch.stack([ids[s:s + run.seq] for s in starts]).to(device)
        y = torch.stack([ids[s + 1:s + run.seq + 1] for s in starts]).to(device)
        synchronize(device)
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            logits = ddp(input_ids=x).logits
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), y.reshape(-1))
        loss.backward()
        optimizer.step()
        synchronize(device)
        times.append((time.perf_counter() - started) * 1e3)
        losses.append(loss.detach())
    counts = {}
    if state is not None:
        state.close()
        add_counts(counts, state.wire_bytes, "wire")
        add_counts(counts, state.received_bytes, "received")
    if fused is not None:
        fused.close()
        for reducer in fused.reducers.values():
            add_counts(counts, reducer.wire_bytes, "wire")
            add_counts(counts, reducer.received_bytes, "received")
    fused_ids = {id(layer.weight) for layer in fk.fused_layers(model)}
    result = {"times_ms": times[run.warmup:], "losses": [float(v) for v in losses], "counts": counts,
              "checksum": parameter_checksum(model), "parameters": sum(p.numel() for p in model.parameters()),
              "ddp_elements": sum(p.numel() for p in model.parameters() if id(p) not in fused_ids),
              "fused_elements": sum(p.numel() for p in model.parameters() if id(p) in fused_ids)}
    del ddp, model, optimizer, state, fused
    gc.collect()  # fused layers and their weights' hooks refer to each other
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bytes_per_step(method: Method, results: list, world: int) -> dict:
    """Per step over the whole run, the largest over ranks: bytes passed into the
    collectives by kind and in all, and bytes received; measured by the GIFT states, or
    derived as a ring all-reduce of the gradients DDP's all-reduce or the bf16 hook carry."""
    steps = len(results[0]["losses"])
    out = {}
    for kind in ("gradients", "scales", "refresh"):
        out[f"{kind}_bytes"] = max(r["counts"].get(f"wire_{kind}", 0) for r in results) / steps
    out["received_bytes"] = max(r["counts"].get("received_gradients", 0) for r in results) / steps
    derived = {"fp32": 4, "bf16": 2}.get(method.fmt)
    if derived is not None:
        # The fp32 FORGE row's fused gradients go through an fp32 all-reduce too.
        elements = results[0]["ddp_elements"] + (results[0]["fused_elements"] if method.path == "forge" else 0)
        out["gradients_bytes"] = derived * elements
        out["received_bytes"] = ring_bytes(derived * elements, world)
        out["bytes_source"] = "derived (ring all-reduce)"
    else:
        out["bytes_source"] = "measured"
    out["wire_bytes"] = out["gradients_bytes"] + out["scales_bytes"] + out["refresh_bytes"]
    return {key: round(value) if isinstance(value, float) else value for key, value in out.items()}


def summarize(method: Method, results: list, run: Run, world: int, loss_window: int) -> dict:
    slowest = [max(step) for step in zip(*(r["times_ms"] for r in results))]
    final = [statistics.fmean(r["losses"][-loss_window:]) for r in results]
    return {"method": method.name, "path": method.path, "format": method.fmt,
            "route": method.route if method.fmt in LOW_PRECISION else "",
            "exchange": run.exchange if method.fmt in LOW_PRECISION else "all_reduce",
            "step_ms_median": round(statistics.median(slowest), 3), "step_ms_min": round(min(slowest), 3),
            "step_ms_max": round(max(slowest), 3), **bytes_per_step(method, results, world),
            "loss": round(statistics.fmean(final), 5), "loss_rank_max": round(max(final), 5),
            "ranks_agree": len({r["checksum"] for r in results}) == 1,
            "parameters": results[0]["parameters"]}


def environment(backend: str) -> dict:
    import triton  # imported by forge_kernels already

    gpu = torch.cuda.get_device_name() if backend == "nccl" else "cpu"
    # transformers' version from its metadata: importing it takes seconds, and only the ranks need it.
    return {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
            "transformers": importlib.metadata.version("transformers"), "commit": commit()}


def commit() -> str:
    if os.environ.get("FORGE_COMMIT"):
        return os.environ["FORGE_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def parse_methods(text: str) -> list:
    names = {m.name: m for m in METHODS}
    chosen = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in names]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"unknown methods {unknown}; choose from {', '.join(names)}")
    return [names[name] for name in chosen]


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def arguments(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=positive, default=2, help="ranks (GPUs under NCCL)")
    parser.add_argument("--methods", type=parse_methods, default=list(METHODS),
                        help="comma-separated, from: " + ", ".join(m.name for m in METHODS))
    parser.add_argument("--smoke", action="store_true", help="a tiny model and a handful of steps")
    parser.add_argument("--seq", type=positive, help="tokens per sequence (default 512; smoke 32)")
    parser.add_argument("--batch", type=positive, help="sequences per rank and step (default 8; smoke 4)")
    parser.add_argument("--warmup", type=int, help="untimed steps first (default 10; smoke 1)")
    parser.add_argument("--steps", type=positive, help="timed steps (default 100; smoke 2)")
    parser.add_argument("--loss-window", type=positive, help="the loss is the mean of this many last steps "
                                                             "(default 10; smoke 2)")
    parser.add_argument("--lr", type=float, help="AdamW's learning rate (default 3e-4; smoke 3e-3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rank", type=positive, help="GIFT's transform rank (default 32; smoke 8)")
    parser.add_argument("--refresh-every", type=positive, help="steps between GIFT refreshes (default 50; smoke 2)")
    parser.add_argument("--exchange", choices=EXCHANGES, default="reduce_scatter")
    parser.add_argument("--overlap", choices=("auto", "on", "off"), default="auto",
                        help="gift_hook's communication thread for the DDP rows (auto: on under gloo, off under NCCL)")
    parser.add_argument("--bucket-rows", type=positive, help="rows of a fused weight's gradient materialized at a "
                                                             "time on the FORGE rows (default: all)")
    parser.add_argument("--job-timeout", type=float, default=600.0, help="seconds for one method on all ranks")
    parser.add_argument("--out", type=Path, help="CSV path")
    args = parser.parse_args(argv)
    defaults = dict(seq=(512, 32), batch=(8, 4), warmup=(10, 1), steps=(100, 2), loss_window=(10, 2),
                    lr=(3e-4, 3e-3), rank=(32, 8), refresh_every=(50, 2))
    for name, (full, tiny) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.smoke else full)
    if args.warmup < 0:
        parser.error(f"--warmup must be 0 or more, got {args.warmup}")
    if args.loss_window > args.warmup + args.steps:
        parser.error(f"--loss-window {args.loss_window} is longer than the run ({args.warmup + args.steps} steps)")
    if not args.job_timeout > 0:
        parser.error(f"--job-timeout must be a positive number of seconds, got {args.job_timeout}")
    return parser, args


TABLE = ["method", "exchange", "step_ms_median", "step_ms_min", "step_ms_max", "gradients_bytes", "wire_bytes",
         "received_bytes", "received_vs_fp32", "bytes_source", "loss", "loss_rank_max", "ranks_agree", "error"]


def write_csv(path: Path, rows: list) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = list(dict.fromkeys(key for row in rows for key in row))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def main(argv=None):
    parser, args = arguments(argv)
    backend = default_backend()
    if backend == "nccl" and torch.cuda.device_count() < args.world:
        parser.error(f"--world {args.world} needs {args.world} GPUs under NCCL; this machine has "
                     f"{torch.cuda.device_count()}")
    hidden, intermediate, layers, heads = MODEL_SIZES["smoke" if args.smoke else "default"]
    overlap = backend == "gloo" if args.overlap == "auto" else args.overlap == "on"
    run = Run(hidden, intermediate, layers, heads, args.seq, args.batch, args.warmup, args.steps, args.lr, args.seed,
              args.rank, args.refresh_every, args.exchange, overlap, args.bucket_rows)
    context = {**environment(backend), "world": args.world, "backend": backend, "hidden": hidden,
               "intermediate": intermediate, "layers": layers, "heads": heads,
               "tokens_per_rank": args.batch * args.seq, "warmup": args.warmup, "steps": args.steps,
               "loss_window": args.loss_window, "lr": args.lr, "seed": args.seed, "gift_rank": args.rank,
               "refresh_every": args.refresh_every, "overlap": overlap, "bucket_rows": args.bucket_rows or ""}
    print(f"GIFT under DDP, {context['gpu']}, {backend}, world {args.world}, torch {context['torch']}, "
          f"triton {context['triton']}, transformers {context['transformers']}, commit {context['commit']}; "
          f"Llama hidden {hidden}, MLP {intermediate}, layers {layers}, {args.batch}x{args.seq} tokens per rank, "
          f"{args.warmup}+{args.steps} steps, loss over the last {args.loss_window}; GIFT rank {args.rank}, "
          f"refresh every {args.refresh_every}, {args.exchange}, overlap {overlap}\n", flush=True)
    print("| " + " | ".join(TABLE) + " |")
    print("|" + " --- |" * len(TABLE), flush=True)
    started = time.perf_counter()
    pools = RankPools(backend)
    rows, fp32 = [], {}
    try:
        for method in args.methods:
            try:
                results = pools.get(args.world).run(train, run, method, timeout_s=args.job_timeout)
                row = {**summarize(method, results, run, args.world, args.loss_window), "error": ""}
            except RankError as error:  # the pool is down; the next method starts fresh ranks
                traceback.print_exception(error, file=sys.stderr)
                row = {"method": method.name, "path": method.path, "format": method.fmt, "route": method.route,
                       "error": str(error).strip().splitlines()[-1]}
            if method.fmt == "fp32" and not row["error"]:
                fp32[method.path] = row["received_bytes"]
            if row.get("received_bytes") is not None and method.path in fp32:
                row["received_vs_fp32"] = round(row["received_bytes"] / fp32[method.path], 4)
            rows.append({**context, **row})
            print("| " + " | ".join(str(row.get(c, "")) for c in TABLE) + " |", flush=True)
            if args.out:  # after every method: a run cut short keeps what it measured
                write_csv(args.out, rows)
    finally:
        pools.close()
    parameters = next((row["parameters"] for row in rows if "parameters" in row), None)
    print(f"\n{len(rows)} methods in {time.perf_counter() - started:.1f} s"
          + (f"; the model has {parameters:,} parameters" if parameters else ""))
    return 1 if any(row["error"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
