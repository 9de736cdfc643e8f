"""Trainer: what a closure must do, refused with a clear error before anything steps
where it does not. A closure returns the loss (the Trainer calls backward()); under exact
clipping it is called twice and must repeat itself: the same fused layers, the same loss
bit for bit. A stopped layer refuses the step before any layer steps; an error part-way
through a step names the fused layers that had already stepped.
"""

import re

import pytest
import torch
from torch import nn

import forge_kernels as fk
from forge_verify import assert_bitwise_equal


class _TwoLayers(nn.Module):
    """b(a(x)) with an unfused bias, or b alone, or a alone: what the closure picks."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8, bias=False)
        self.b = nn.Linear(8, 8, bias=False)
        self.shift = nn.Parameter(torch.zeros(8))

    def forward(self, x, layers="ab"):
        for name in layers:
            x = getattr(self, name)(x)
        return x + self.shift


def _trainer(device, rule=None, **kwargs):
    torch.manual_seed(0)
    model = fk.fuse(_TwoLayers().to(device), rule or fk.AdamW(lr=0.1))
    return model, fk.Trainer(model, torch.optim.AdamW([model.shift], lr=0.1), **kwargs)


def _snapshot(model):
    return {name: value.clone() for name, value in model.state_dict().items()}


def _assert_nothing_stepped(model, trainer, before):
    for name, value in model.state_dict().items():
        assert_bitwise_equal(value, before[name], name)
    assert not trainer.optimizer.state and all(p.grad is None for p in model.parameters())


def _batch(device, seed=0):
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(seed)).to(device)


MODES = {
    "unclipped": (None, {}, 1),
    "exact-clipping": (None, dict(max_norm=1.0), 1),
    "previous-norm": (None, dict(max_norm=1.0, clipping="previous-norm"), 1),
    "materialized-accumulation": (None, dict(gradients="materialized"), 2),
    "fused-accumulation": (fk.SGD(lr=0.1, momentum=0.9), {}, 2),
}


@pytest.mark.parametrize("mode", MODES)
def test_a_closure_that_calls_backward_is_refused_before_anything_steps(mode, device):
    """torch.optim's closure convention (zero_grad, forward, backward, return the loss) would
    step the fused layers inside the closure, before the Trainer clips or checks (the fused
    layers stepped, the torch optimizer not, and autograd's "backward through the graph a
    second time"): refused in the closure's own backward, nothing stepped."""
    rule, kwargs, micro_batches = MODES[mode]
    model, trainer = _trainer(device, rule, **kwargs)
    if mode == "previous-norm":
        trainer.last_norm = torch.tensor(2.0, device=device)  # past the exact first step
    x = _batch(device)
    before = _snapshot(model)

    def closure():
        trainer.optimizer.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        return loss
    with pytest.raises(RuntimeError, match="ran inside the closure: the closure must return the loss, and the "
                                           r"Trainer calls backward\(\)"):
        trainer.step([closure] * micro_batches)
    _assert_nothing_stepped(model, trainer, before)


def test_exact_clipping_refuses_a_closure_that_draws_its_batch(device):
    """A closure that takes next(batches) gave its two passes different batches (the norm
    of one, the steps of the other, two batches consumed): refused when the stepping pass's
    loss differs from the norm pass's, before its backward."""
    model, trainer = _trainer(device, max_norm=1.0)
    batches = iter([_batch(device, seed) for seed in range(4)])
    before = _snapshot(model)
    with pytest.raises(RuntimeError, match=r"two passes gave different losses .* the closure must compute the same "
                                           r"loss each time .* Draw the batch outside it.*nothing was stepped"):
        trainer.step(lambda: model(next(batches)).square().mean())
    _assert_nothing_stepped(model, trainer, before)
    x = next(batches)
    trainer.step(lambda: model(x).square().mean())  # the batch drawn outside: accepted
    assert all(int(layer.forge_step) == 1 for layer in fk.fused_layers(model))


def test_exact_clipping_compares_a_loss_returned_in_a_reused_buffer(device):
    """A closure that writes its loss into one buffer and returns it each time: the norm
    pass's loss must be kept as a copy, or the stepping pass overwrites it and the two
    passes compare equal whatever they computed (the steps then taken with the norm of
    another batch). A closure drawing its batch is refused as with a fresh loss tensor."""
    model, trainer = _trainer(device, max_norm=1.0)
    batches = iter([_batch(device, seed) for seed in range(2)])
    buffer = torch.zeros((), device=device)
    before = _snapshot(model)
    with pytest.raises(RuntimeError, match=r"two passes gave different losses .*nothing was stepped"):
        trainer.step(lambda: buffer.detach_().copy_(model(next(batches)).square().mean()))
    _assert_nothing_stepped(model, trainer, before)


@pytest.mark.parametrize("only_in", ["norm pass", "stepping pass"])
def test_exact_clipping_refuses_a_layer_in_one_pass_only(only_in, device):
    """Layer b runs in one pass only, with a loss of the same bits (b enters it times 0):
    its norm would be counted and the layer never stepped, or stepped clipped by a norm
    that left it out. Refused from the forward, before the stepping pass's backward."""
    model, trainer = _trainer(device, max_norm=1.0)
    x = _batch(device)
    calls = []

    def closure():
        calls.append(1)
        loss = model(x, "a").square().mean()
        return loss + 0 * model.b(x).sum() if (len(calls) == 1) == (only_in == "norm pass") else loss
    before = _snapshot(model)
    with pytest.raises(RuntimeError, match=re.escape(f"in the {only_in} only: ['b']") + ".*nothing was stepped"):
        trainer.step(closure)
    _assert_nothing_stepped(model, trainer, before)


def _stepped_layers(message):
    found = re.search(r"\[fused layers (\[.*?\]) had stepped in this step before this error", message)
    return [] if found is None else eval(found.group(1))


@pytest.mark.parametrize("only_in", ["norm pass", "stepping pass"])
def test_exact_clipping_refuses_a_backward_in_one_pass_only(only_in, device):
    """Both passes run a and b forward and give the same loss, but the loss reaches b's
    backward in one pass only (b's output is kept alive outside the loss in the other):
    the stepped layers must be the measured ones. Refused, and the error names the layers
    that had stepped by then (their steps stay taken, the torch optimizer's is not)."""
    model, trainer = _trainer(device, max_norm=1.0)
    x = _batch(device)
    kept, calls = [], []

    def closure():
        calls.append(1)
        kept.clear()
        kept.append(model.b(x))
        loss = model(x, "a").square().mean()
        return loss + 0 * kept[0].sum() if (len(calls) == 1) == (only_in == "norm pass") else loss
    with pytest.raises(RuntimeError, match=f"backward in the {only_in} but not in the") as raised:
        trainer.step(closure)
    kept.clear()
    stepped = _stepped_layers(str(raised.value))
    assert "b" not in stepped and (only_in == "stepping pass" or stepped == ["a"])
    for layer in fk.fused_layers(model):
        assert int(layer.forge_step) == (layer.forge_name in stepped)
    assert not trainer.optimizer.state


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_a_stopped_layer_refuses_the_step_before_any_layer_steps(device):
    """Layer a was stopped by an update that overflowed (its tiles at mixed steps). It
    used to raise in its own backward, after b (before it in the backward) had stepped:
    the step is refused before anything runs, and goes on once the step is accepted."""
    model, trainer = _trainer(device)
    a = model.a
    a.config = fk.TileConfig(block_n=16, block_k=16, block_t=16)
    huge = torch.ones(4, 8, device=device)
    huge[:, 3] = 1e20
    with pytest.raises(fk.NonFiniteUpdateError):
        a(huge).backward(huge)
    assert a._failed_step == 1
    b_before = model.b.weight.detach().clone()
    x = _batch(device)
    with pytest.raises(RuntimeError, match=r"fused layers stopped: 'a' at step 1 \(a non-finite update left some "
                                           r"tiles unstepped.*forge_accept_partial_step\(\) on each to go on from "
                                           "here; nothing was stepped"):
        trainer.step(lambda: model(x).square().mean())
    assert_bitwise_equal(model.b.weight.detach(), b_before, "b.weight")
    assert int(model.b.forge_step) == 0 and not trainer.optimizer.state
    a.forge_accept_partial_step()
    trainer.step(lambda: model(x).square().mean())
    assert int(a.forge_step) == 2 and int(model.b.forge_step) == 1
