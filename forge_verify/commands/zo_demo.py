"""``forge-verify zo-demo``: fine-tune the tiny GPT on the shipped tales three ways from
the same initial weights and batches, and report.

* ``GRZO`` (``fk.GRZO``, normalize="std", the paper's setting) and ``MeZO``
  (``fk.MeZO``): forward passes only, 2 per step, so at equal steps they spend an equal
  number of forwards;
* ``AdamW``: backprop + ``torch.optim.AdamW`` (``fused=True`` on a GPU), 1 forward and
  1 backward per step: the curve a zeroth-order method is measured against.

The position embedding is frozen in all three (GRZO refuses a module that every example
shares: it is called with arange(T), not batched); everything else trains.

The training loss of a zeroth-order step is the mean of its two perturbed losses (no
extra forward); the held-out loss is measured after training on batches none of the runs
saw. Memory: on a GPU the peak allocated bytes of each run above what was allocated
before it (``torch.cuda.max_memory_allocated``: its copy of the model, its state, its
activations; not the base model or the batches); on the CPU the state each method keeps, counted
from the tensors: parameters, plus gradients and the two AdamW moments for AdamW (GRZO
and MeZO keep no state; their transient row blocks of U and z are not counted).
"""

import copy
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

import forge_kernels as fk

from ..models import corpus
from ..models.tiny_gpt import GPT, GPTConfig
from .demo_output import headless_pyplot, write_demo

METHODS = ("GRZO", "MeZO", "AdamW")
FORWARDS_PER_STEP = {"GRZO": 2, "MeZO": 2, "AdamW": 1}
HELD_OUT_BATCHES = 4


@dataclass(frozen=True)
class ZeroOrderDemoConfig:
    n_layer: int = 1
    n_head: int = 2
    n_embd: int = 32
    block_size: int = 32
    batch: int = 8
    steps: int = 100
    grzo_lr: float = 2e-3
    mezo_lr: float = 2e-3
    sigma: float = 1e-3
    adamw_lr: float = 3e-3
    seed: int = 0


def _batches(config: ZeroOrderDemoConfig, device):
    """(vocabulary size, training batches, held-out batches), each batch (x, y) of
    ``config.batch`` windows of the shipped text, y the next characters."""
    text = corpus.load()
    vocab = sorted(set(text))
    lookup = {c: i for i, c in enumerate(vocab)}
    ids = torch.tensor([lookup[c] for c in text], dtype=torch.int64)
    split = int(0.9 * len(ids))
    generator = torch.Generator().manual_seed(config.seed)

    def batch(source):
        starts = torch.randint(0, len(source) - config.block_size - 1, (config.batch,), generator=generator)
        x = torch.stack([source[s:s + config.block_size] for s in starts])
        y = torch.stack([source[s + 1:s + config.block_size + 1] for s in starts])
        return x.to(device), y.to(device)

    train = [batch(ids[:split]) for _ in range(config.steps)]
    held_out = [batch(ids[split:]) for _ in range(HELD_OUT_BATCHES)]
    return len(vocab), train, held_out


def per_example_losses(model, x, y) -> torch.Tensor:
    """Each window's mean next-character cross-entropy, (B,)."""
    logits = model(x)
    return F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(1)


def _kept_bytes(method, model, optimizer) -> int:
    tensors = [p for p in model.parameters()]
    if method == "AdamW":
        tensors += [p for p in model.parameters() if p.requires_grad]  # the gradients
        tensors += [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    return sum(t.numel() * t.element_size() for t in tensors)


def _stepper(method, model, config):
    """(optimizer, step(x, y) -> training loss as a float)."""
    if method == "GRZO":
        opt = fk.GRZO(model, lr=config.grzo_lr, sigma=config.sigma, seed=config.seed)

        def step(x, y):
            result = opt.step(lambda: per_example_losses(model, x, y))
            return float((result.losses_plus.mean() + result.losses_minus.mean()) / 2)
    elif method == "MeZO":
        opt = fk.MeZO(model, lr=config.mezo_lr, eps=config.sigma, seed=config.seed)

        def step(x, y):
            result = opt.step(lambda: per_example_losses(model, x, y).mean())
            return float((result.losses_plus + result.losses_minus) / 2)
    else:
        trainable = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(trainable, lr=config.adamw_lr, fused=next(model.parameters()).is_cuda)

        def step(x, y):
            loss = per_example_losses(model, x, y).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(loss.detach())
    return opt, step


def _train(method, base, config, batches, device):
    on_gpu = device.type == "cuda"
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        # What was allocated before the run (the base model, every batch) is not the run's.
        allocated_before = torch.cuda.memory_allocated()
    model = copy.deepcopy(base)
    optimizer, step = _stepper(method, model, config)
    losses = []
    start = time.perf_counter()
    for x, y in tqdm(batches, desc=f"{method:>5}", unit="step"):
        losses.append(step(x, y))
    if on_gpu:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    memory = (torch.cuda.max_memory_allocated() - allocated_before if on_gpu
              else _kept_bytes(method, model, optimizer))
    return model, {"losses": losses, "seconds": seconds, "memory_bytes": memory,
                   "forwards": FORWARDS_PER_STEP[method] * len(batches),
                   "backwards": len(batches) if method == "AdamW" else 0}


def _held_out_loss(model, held_out) -> float:
    with torch.no_grad():
        return sum(float(per_example_losses(model, x, y).mean()) for x, y in held_out) / len(held_out)


def run_zo_demo(config: ZeroOrderDemoConfig, out, device=None) -> dict:
    """Train the three runs, write ``zo_demo.json`` and ``zo_demo_loss.png`` under ``out``."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu") if device is None else device
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab_size, batches, held_out = _batches(config, device)
    torch.manual_seed(config.seed)
    base = GPT(GPTConfig(vocab_size=vocab_size, block_size=config.block_size, n_layer=config.n_layer,
                         n_head=config.n_head, n_embd=config.n_embd)).to(device)
    base.pos.requires_grad_(False)
    start_loss = _held_out_loss(base, held_out)
    runs = {}
    for method in METHODS:
        model, runs[method] = _train(method, base, config, batches, device)
        runs[method]["held_out_loss"] = _held_out_loss(model, held_out)
    result = {
        "compared": "GRZO and MeZO (forward passes only, 2 per step: equal forwards at equal steps) "
                    "against backprop + AdamW (1 forward + 1 backward per step), same initial weights and batches",
        "config": asdict(config) | {"vocab_size": vocab_size},
        "trainable_parameters": sum(p.numel() for p in base.parameters() if p.requires_grad),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "CPU",
        "torch": torch.__version__,
        "memory_measure": "peak allocated bytes above those allocated before the run "
                          "(torch.cuda.max_memory_allocated)" if device.type == "cuda" else
        "kept state counted from the tensors: parameters (+ gradients and AdamW moments for AdamW)",
        "held_out_loss_at_start": start_loss,
        "runs": runs,
    }
    return write_demo(out, "zo_demo", result, _plot)


def _plot(result, path):
    plt = headless_pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method in METHODS:
        run = result["runs"][method]
        per_step = FORWARDS_PER_STEP[method]
        forwards = [per_step * (i + 1) for i in range(len(run["losses"]))]
        label = method + (" (backprop: + 1 backward per forward)" if method == "AdamW" else "")
        ax.plot(forwards, run["losses"], lw=1.2, label=label)
    ax.axhline(result["held_out_loss_at_start"], color="grey", lw=0.6, ls="--", label="held-out loss at start")
    ax.set_xlabel("forward passes")
    ax.set_ylabel("training loss (cross-entropy, nats)")
    ax.set_title(f"tiny GPT fine-tuning, {result['trainable_parameters']:,} trainable parameters "
                 f"({result['device']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_result(result) -> str:
    lines = [f"compared: {result['compared']}",
             f"{result['trainable_parameters']:,} trainable parameters, {result['config']['steps']} steps of "
             f"{result['config']['batch']} windows, {result['device']}, torch {result['torch']}; "
             f"held-out loss at start {result['held_out_loss_at_start']:.4f}",
             f"memory: {result['memory_measure']}",
             "| method | forwards | backwards | train loss, mean of last 10 steps | held-out loss | memory (KiB) "
             "| seconds |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for method in METHODS:
        r = result["runs"][method]
        last = r["losses"][-10:]
        lines.append(f"| {method} | {r['forwards']} | {r['backwards']} | {sum(last) / len(last):.4f} | "
                     f"{r['held_out_loss']:.4f} | {r['memory_bytes'] / 2**10:.1f} | {r['seconds']:.1f} |")
    return "\n".join(lines)


def add_parser(commands):
    parser = commands.add_parser("zo-demo", help="fine-tune the tiny GPT with GRZO and MeZO (forwards only) "
                                                 "against backprop + AdamW: loss curves and memory")
    parser.add_argument("--steps", type=int, default=ZeroOrderDemoConfig.steps, help="steps of each method")
    parser.add_argument("--batch", type=int, default=ZeroOrderDemoConfig.batch, help="examples per step")
    parser.add_argument("--out", default="zo_demo_out", help="output folder (zo_demo.json, zo_demo_loss.png)")


def run(args) -> int:
    if args.steps < 1 or args.batch < 2:
        raise SystemExit("zo-demo: --steps must be at least 1 and --batch at least 2 (GRZO's std needs 2)")
    result = run_zo_demo(ZeroOrderDemoConfig(steps=args.steps, batch=args.batch), args.out)
    print(format_result(result))
    print(f"wrote {Path(args.out) / 'zo_demo.json'} and {Path(args.out) / 'zo_demo_loss.png'}")
    return 0
