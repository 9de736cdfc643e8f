"""How far APPROXIMATE clipping (``clipping="previous-norm"``) strays from exact clipping
when the gradient spikes.

A tiny GPT trains a few steps from one initial state with each mode; on one step the
loss (so every gradient) is multiplied by ``spike``. Exact clipping scales that step's
gradient down to ``max_norm``; the approximate mode scales it by the previous step's
factor, so the spike goes through almost unclipped, and the next step is then scaled by
the spike's factor. Reported per step: each mode's clip factor, and the distance of the
approximate run's parameters from the exact run's, relative to how far the exact run
has moved from the start (``||θ_approx − θ_exact|| / ||θ_exact − θ_0||``).

    python -m forge_verify.commands.clipping_spike
"""

import copy

import torch

import forge_kernels as fk

from ..models.tiny_gpt import GPT, GPTConfig

CONFIG = GPTConfig(vocab_size=48, block_size=16, n_layer=1, n_head=2, n_embd=32)
RULES = {"AdamW": lambda: fk.AdamW(lr=1e-2), "SGD momentum": lambda: fk.SGD(lr=0.1, momentum=0.9)}


def _flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def spike_study(rule_name="AdamW", steps=5, spike_step=3, spike=100.0, max_norm=1.0, device=None):
    """Per step: (step, loss scale, exact factor, approximate factor, relative deviation)."""
    device = fk.kernel_device() if device is None else device
    torch.manual_seed(0)
    base = GPT(CONFIG).to(device)
    gen = torch.Generator().manual_seed(5)
    batches = [tuple(torch.randint(0, CONFIG.vocab_size, (2, 12), generator=gen).to(device) for _ in range(2))
               for _ in range(steps)]
    trainers = {}
    for mode in ("exact", "previous-norm"):
        model = fk.fuse(copy.deepcopy(base), RULES[rule_name]())
        trainers[mode] = fk.Trainer(model, torch.optim.SGD(fk.unfused_parameters(model), lr=0.1),
                                    max_norm=max_norm, clipping=mode)
    start = _flat(base)
    rows = []
    for step, (x, y) in enumerate(batches, start=1):
        scale = spike if step == spike_step else 1.0
        factors = {}
        for mode, trainer in trainers.items():
            # The factor this step applies: from this step's norm (exact, and the approximate
            # mode's first step) or from the previous step's.
            applied_from = trainer.last_norm if (mode == "previous-norm" and step > 1) else None
            trainer.step(lambda t=trainer: t.model.loss(x, y) * scale)
            norm = trainer.last_norm if applied_from is None else applied_from
            factors[mode] = float(fk.training.clip_coefficient(max_norm, norm))
        exact, approx = (_flat(trainers[m].model) for m in ("exact", "previous-norm"))
        deviation = float((approx - exact).norm() / (exact - start).norm())
        rows.append((step, scale, factors["exact"], factors["previous-norm"], deviation))
    return rows


def format_rows(rule_name, rows) -> str:
    lines = [f"{rule_name}: clip factor per step, and ||θ_approx − θ_exact|| / ||θ_exact − θ_0||",
             "| step | loss scale | exact factor | previous-norm factor | relative deviation |",
             "| --- | --- | --- | --- | --- |"]
    lines += [f"| {s} | {k:g} | {e:.4g} | {a:.4g} | {d:.3g} |" for s, k, e, a, d in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    for name in RULES:
        print(format_rows(name, spike_study(name)))
