"""``forge-verify demo``: train a small character-level GPT on the shipped tales three ways
from the same initial weights and batches, and report.

* ``fused``: every nn.Linear fused (AdamW in the kernel's epilogue), the rest stepped by
  ``torch.optim.AdamW``, exact global-norm clipping, a warm-up + cosine schedule, all
  through ``fk.Trainer``;
* ``oracle``: the same with the fused layers on the oracle path (dW materialized by the
  same tile loop, then the same epilogue): its weights must equal ``fused``'s bit for
  bit after every step count (fp32);
* ``torch``: the unfused model with ``torch.optim.AdamW`` over all parameters (``fused=True``
  on a GPU), ``clip_grad_norm_`` and the same schedule: the loss curve FORGE should follow.

Memory: on a GPU, the peak allocated bytes of each run (``torch.cuda.max_memory_allocated``).
On the CPU the kernels run in the Triton interpreter, whose numpy temporaries would swamp
any process-level measurement, so the CPU figure is the training state the method keeps:
parameters, the gradients held for the optimizer, and optimizer state, counted from
the tensors.
"""

import copy
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

import forge_kernels as fk

from ..models import corpus
from ..models.tiny_gpt import GPT, GPTConfig
from ..numerics.bits import int_view
from .demo_output import headless_pyplot, write_demo


@dataclass(frozen=True)
class DemoSize:
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    batch: int
    steps: int
    lr: float


SIZES = {
    "ci": DemoSize(n_layer=1, n_head=2, n_embd=32, block_size=16, batch=2, steps=4, lr=3e-3),
    "small": DemoSize(n_layer=1, n_head=2, n_embd=32, block_size=32, batch=4, steps=30, lr=1e-2),
    "large": DemoSize(n_layer=6, n_head=12, n_embd=768, block_size=128, batch=8, steps=200, lr=6e-4),
}
RUNS = ("fused", "oracle", "torch")
MAX_NORM = 1.0
BETAS, EPS, WEIGHT_DECAY = (0.9, 0.95), 1e-8, 0.1


def _schedule(steps):
    warmup = max(1, steps // 10)

    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))
    return factor


def _data(size: DemoSize, steps: int, device, seed: int):
    text = corpus.load()
    vocab = sorted(set(text))
    lookup = {c: i for i, c in enumerate(vocab)}
    ids = torch.tensor([lookup[c] for c in text], dtype=torch.int64)
    split = int(0.9 * len(ids))
    gen = torch.Generator().manual_seed(seed)

    def batch(source):
        starts = torch.randint(0, len(source) - size.block_size - 1, (size.batch,), generator=gen)
        x = torch.stack([source[s:s + size.block_size] for s in starts])
        y = torch.stack([source[s + 1:s + size.block_size + 1] for s in starts])
        return x.to(device), y.to(device)

    train = [batch(ids[:split]) for _ in range(steps)]
    held_out = [batch(ids[split:]) for _ in range(4)]
    return len(vocab), train, held_out


def _state_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _kept_bytes(model, optimizer, grad_params) -> int:
    """Parameters + buffers (fused state) + gradients the optimizer needs + optimizer state."""
    optimizer_state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    return _state_bytes(list(model.parameters()) + list(model.buffers()) + list(grad_params) + optimizer_state)


def _train(run, base, size, steps, batches, device):
    model = copy.deepcopy(base)
    adamw = dict(lr=size.lr, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    schedule = _schedule(steps)
    on_gpu = device.type == "cuda"
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    if run == "torch":
        optimizer = torch.optim.AdamW(model.parameters(), fused=on_gpu, **adamw)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        grad_params = list(model.parameters())

        def step(x, y):
            loss = model.loss(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            return loss.detach()
    else:
        fk.fuse(model, fk.AdamW(**adamw), oracle=run == "oracle")
        optimizer = torch.optim.AdamW(fk.unfused_parameters(model), fused=on_gpu, **adamw)
        trainer = fk.Trainer(model, optimizer, max_norm=MAX_NORM,
                             scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, schedule))
        grad_params = fk.unfused_parameters(model)

        def step(x, y):
            return trainer.step(lambda: model.loss(x, y))[0]
    losses = []
    start = time.perf_counter()
    for x, y in tqdm(batches, desc=f"{run:>6}", unit="step", leave=True):
        losses.append(float(step(x, y)))
    if on_gpu:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    memory = torch.cuda.max_memory_allocated() if on_gpu else _kept_bytes(model, optimizer, grad_params)
    return model, {"losses": losses, "seconds": seconds, "memory_bytes": memory}


def _held_out_loss(model, held_out):
    with torch.no_grad():
        return sum(float(model.loss(x, y)) for x, y in held_out) / len(held_out)


def _relative_weight_difference(a, b):
    """max |a - b| / max |b| over the parameters (the runs' GEMMs and operation orders differ)."""
    with torch.no_grad():
        return max(float((p - q).abs().max() / q.abs().max())
                   for p, q in zip(a.parameters(), b.parameters(), strict=True))


def _bitwise_equal_models(a, b):
    return all(torch.equal(int_view(x), int_view(y))
               for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def run_demo(size_name="small", steps=None, out=None, seed=0, device=None) -> dict:
    """Train the three runs, write ``demo.json`` and ``demo_loss.png`` under ``out``; return the results."""
    size = SIZES[size_name]
    steps = size.steps if steps is None else steps
    device = fk.kernel_device() if device is None else device
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab_size, batches, held_out = _data(size, steps, device, seed)
    torch.manual_seed(seed)
    config = GPTConfig(vocab_size=vocab_size, block_size=size.block_size, n_layer=size.n_layer, n_head=size.n_head,
                       n_embd=size.n_embd)
    base = GPT(config).to(device)
    models, runs = {}, {}
    for run in RUNS:
        models[run], runs[run] = _train(run, base, size, steps, batches, device)
        runs[run]["held_out_loss"] = _held_out_loss(models[run], held_out)
    result = {
        "size": size_name, "config": asdict(size) | {"steps": steps, "vocab_size": vocab_size},
        "parameters": sum(p.numel() for p in base.parameters()),
        "backend": "Triton interpreter (CPU)" if fk.interpreting() else torch.cuda.get_device_name(),
        "torch": torch.__version__, "memory_measure": "peak allocated (GPU)" if device.type == "cuda" else
        "kept training state: parameters, buffers, held gradients, optimizer state (CPU)",
        "fused_equals_oracle_bitwise": _bitwise_equal_models(models["fused"], models["oracle"]),
        "max_loss_difference_fused_vs_torch": max(abs(a - b) for a, b in zip(runs["fused"]["losses"],
                                                                              runs["torch"]["losses"])),
        "max_weight_difference_fused_vs_torch": _relative_weight_difference(models["fused"], models["torch"]),
        "runs": runs,
    }
    return write_demo(out, "demo", result, _plot)


def _plot(result, path):
    plt = headless_pyplot()
    # Fused and oracle losses are equal bit for bit, so one curve would hide the other: the
    # top panel draws the oracle as markers on the fused line, the bottom one the differences.
    fig, (ax, diff) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(2, 1))
    losses = {run: result["runs"][run]["losses"] for run in RUNS}
    steps = range(1, len(losses["fused"]) + 1)
    every = max(1, len(steps) // 20)
    ax.plot(steps, losses["fused"], lw=2.5, label="FORGE fused AdamW")
    ax.plot(steps, losses["oracle"], ls="none", marker="o", ms=4, markevery=every,
            label="FORGE oracle (materialized dW), markers")
    ax.plot(steps, losses["torch"], lw=1.2, label="torch.optim.AdamW")
    ax.set_ylabel("training loss (cross-entropy, nats)")
    ax.set_title(f"tiny GPT on the shipped tales ({result['size']}, {result['backend']})")
    ax.legend()
    diff.plot(steps, [a - b for a, b in zip(losses["fused"], losses["oracle"])], label="fused - oracle (0: bitwise)")
    diff.plot(steps, [a - b for a, b in zip(losses["fused"], losses["torch"])], label="fused - torch.optim")
    diff.axhline(0, color="black", lw=0.5)
    diff.set_xlabel("step")
    diff.set_ylabel("loss difference (nats)")
    diff.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_result(result) -> str:
    lines = [f"{result['parameters']:,} parameters, {result['config']['steps']} steps, {result['backend']}, "
             f"torch {result['torch']}",
             f"fused == oracle, every weight and state tensor bitwise: "
             f"{'yes' if result['fused_equals_oracle_bitwise'] else 'NO'}",
             f"fused vs torch.optim.AdamW: largest loss difference over the steps "
             f"{result['max_loss_difference_fused_vs_torch']:.2e}, largest weight difference "
             f"{result['max_weight_difference_fused_vs_torch']:.2e} of the weight's largest magnitude",
             f"memory: {result['memory_measure']}",
             "| run | train loss, mean of last 5 steps | held-out loss | memory (MiB) | seconds |",
             "| --- | --- | --- | --- | --- |"]
    for run in RUNS:
        r = result["runs"][run]
        last = r["losses"][-5:]
        lines.append(f"| {run} | {sum(last) / len(last):.4f} | {r['held_out_loss']:.4f} | "
                     f"{r['memory_bytes'] / 2**20:.2f} | {r['seconds']:.1f} |")
    return "\n".join(lines)


def default_out() -> str:
    """$OUT when set (the GPU machine's result folder), else ./demo_out."""
    return os.environ.get("OUT") or "demo_out"
