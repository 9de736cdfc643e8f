"""``forge-verify chunk-demo``: fine-tune the tiny GPT on the shipped tales with ChunkFT
and with full ``torch.optim.AdamW``, from the same initial weights and batches, and
report loss curves and memory.

Both runs use AdamW with the same hyper-parameters and the demo's warm-up + cosine
schedule (a torch LambdaLR stepped once per optimizer step; for ChunkFT it drives the
rate of whichever chunk is active). ChunkFT steps one chunk per step, so per step it
moves 1/chunks of the parameters: its curve falls more slowly per step, which is the
price of its memory.

Memory: on a GPU the peak allocated bytes of each run (``torch.cuda.max_memory_allocated``
after a reset). On the CPU the kernels run in the Triton interpreter, whose numpy
temporaries would swamp a process-level figure, so the CPU figure is the training state
each method keeps, counted from the tensors: parameters, gradients held for the
optimizer (none for ChunkFT) and optimizer state. For ChunkFT that is ``state_bytes()``
at the end (every chunk visited, split into the device's and the host store's) and the
largest device share seen after any step: with ``state_store="host"`` (the default
here) the active chunk's state, what a GPU would hold.
"""

import copy
import time
from pathlib import Path

import torch
from tqdm import tqdm

import forge_kernels as fk

from ..models.tiny_gpt import GPT, GPTConfig
from .demo import BETAS, EPS, SIZES, WEIGHT_DECAY, _data, _held_out_loss, _schedule, _state_bytes
from .demo_output import headless_pyplot, write_demo

RUNS = ("chunkft", "adamw")
#: the demo's "small" model, 40 steps: under a minute on a 2-core CPU
DEFAULT_STEPS, DEFAULT_CHUNKS = 40, 4


def _train(run, base, size, batches, chunks, state_store, device):
    model = copy.deepcopy(base)
    on_gpu = device.type == "cuda"
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    adamw = dict(lr=size.lr, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    if run == "chunkft":
        optimizer = fk.ChunkFT(model, fk.AdamW(**adamw), chunks, state_store=state_store,
                               prefetch=state_store == "host")
    else:
        optimizer = torch.optim.AdamW(model.parameters(), fused=on_gpu, **adamw)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(len(batches)))

    peak_state = 0

    def step(x, y):
        nonlocal peak_state
        if run == "chunkft":
            loss = optimizer.step(lambda: model.loss(x, y))
            peak_state = max(peak_state, optimizer.state_bytes()["device"])
        else:
            loss = model.loss(x, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        return float(loss.detach())

    start = time.perf_counter()
    losses = [step(x, y) for x, y in tqdm(batches, desc=f"{run:>7}", unit="step", leave=True)]
    if on_gpu:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    parameters = _state_bytes(model.parameters())
    if run == "chunkft":
        held = optimizer.state_bytes()
        kept = {"parameters": parameters, "gradients": 0, "state_device": held["device"], "state_host": held["host"],
                "state_device_peak": peak_state}
    else:
        state = _state_bytes(t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))
        kept = {"parameters": parameters, "gradients": parameters, "state_device": state, "state_host": 0,
                "state_device_peak": state}
    memory = {"kept": kept, "peak_allocated": torch.cuda.max_memory_allocated() if on_gpu else None}
    return model, {"losses": losses, "seconds": seconds, "memory": memory}


def run_chunk_demo(steps=DEFAULT_STEPS, chunks=DEFAULT_CHUNKS, out="chunk_demo_out", state_store="host", seed=0,
                   size_name="small", device=None) -> dict:
    """Train both runs; write ``chunk_demo.json`` and ``chunk_demo_loss.png`` under ``out``."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    size = SIZES[size_name]
    device = fk.kernel_device() if device is None else device
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab_size, batches, held_out = _data(size, steps, device, seed)
    torch.manual_seed(seed)
    base = GPT(GPTConfig(vocab_size=vocab_size, block_size=size.block_size, n_layer=size.n_layer,
                         n_head=size.n_head, n_embd=size.n_embd)).to(device)
    runs = {}
    for run in RUNS:
        model, runs[run] = _train(run, base, size, batches, chunks, state_store, device)
        runs[run]["held_out_loss"] = _held_out_loss(model, held_out)
    result = {"size": size_name, "steps": steps, "chunks": chunks, "state_store": state_store,
              "parameters": sum(p.numel() for p in base.parameters()),
              "backend": "Triton interpreter (CPU)" if fk.interpreting() else torch.cuda.get_device_name(),
              "torch": torch.__version__, "runs": runs}
    return write_demo(out, "chunk_demo", result, _plot)


def _plot(result, path):
    plt = headless_pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for run, label in (("chunkft", f"ChunkFT AdamW, {result['chunks']} chunks"), ("adamw", "torch.optim.AdamW")):
        losses = result["runs"][run]["losses"]
        ax.plot(range(1, len(losses) + 1), losses, label=label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (cross-entropy, nats)")
    ax.set_title(f"tiny GPT, ChunkFT vs full AdamW, {result['backend']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_result(result) -> str:
    mib = 2.0 ** 20
    lines = [f"{result['parameters']:,} parameters, {result['steps']} steps, {result['chunks']} chunks "
             f"(state store: {result['state_store']}), {result['backend']}, torch {result['torch']}",
             "memory kept (from the tensors, MiB): parameters + gradients + optimizer state at the end, on the "
             "device / in the host store; the largest device state after any step; peak allocated on a GPU",
             "| run | train loss, first → mean of last 5 | held-out loss | params + grads + state (device / host) | "
             "device state, largest | peak allocated | seconds |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for run in RUNS:
        r = result["runs"][run]
        kept, peak = r["memory"]["kept"], r["memory"]["peak_allocated"]
        last = r["losses"][-5:]
        lines.append(f"| {run} | {r['losses'][0]:.4f} → {sum(last) / len(last):.4f} | {r['held_out_loss']:.4f} | "
                     f"{kept['parameters'] / mib:.3f} + {kept['gradients'] / mib:.3f} + "
                     f"{kept['state_device'] / mib:.3f} / {kept['state_host'] / mib:.3f} | "
                     f"{kept['state_device_peak'] / mib:.3f} | {'-' if peak is None else f'{peak / mib:.1f}'} | "
                     f"{r['seconds']:.1f} |")
    return "\n".join(lines)
