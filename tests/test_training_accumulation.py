"""Trainer: fused gradient accumulation (SGD momentum adding into its buffer) over layers
that do not run in every micro-batch, as a mixture of experts routes them, and what a
step that fails part-way leaves.

Each layer's step is the documented split over its own calls in the step (autograd sums
only the micro-batches that reach a layer, and torch.optim skips a layer none reaches),
bitwise; the split is torch.optim.SGD on the summed gradient in exact arithmetic
(``tests/test_training.py::test_momentum_split_is_torch_sgd_in_exact_arithmetic``).
"""

import copy

import pytest
import torch
from torch import nn

import forge_kernels as fk
from forge_verify import assert_bitwise_equal
from forge_verify.checks.pipelines import StandardPipeline
from tests.test_training import _momentum_sequence

RULE = dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01)


class _Experts(nn.Module):
    """A shared layer, then each token to the expert its route names; an expert that gets
    no token is not called."""

    def __init__(self, experts=4):
        super().__init__()
        self.shared = nn.Linear(8, 8, bias=False)
        self.experts = nn.ModuleList(nn.Linear(8, 8, bias=False) for _ in range(experts))

    def forward(self, x, route):
        h = torch.tanh(self.shared(x))
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            rows = (route == e).nonzero().flatten()
            if rows.numel():
                out = out.index_add(0, rows, expert(h[rows]))
        return out


# Per step, per micro-batch: the expert of each of its 4 tokens. Step 1: expert 0 in the
# first and last micro-batches, 1 in the first only, 2 in the middle one only, 3 in none.
# Step 2: 3 (its first step) in the first only, 1 from the middle on, 0 in none.
ROUTES = [[[0, 1, 0, 1], [2, 2, 2, 2], [0, 0, 0, 0]],
          [[3, 3, 3, 3], [1, 1, 1, 1], [1, 2, 1, 2]]]
# forge_step of shared, experts 0-3 after each step.
STEPS = [[1, 1, 1, 1, 0], [2, 1, 2, 2, 1]]


def _closures(model, device, step):
    gen = torch.Generator().manual_seed(50 + step)
    closures = []
    for route in ROUTES[step]:
        x = torch.randn(4, 8, generator=gen).to(device)
        route = torch.tensor(route, device=device)
        closures.append(lambda x=x, route=route: model(x, route).square().mean())
    return closures


@pytest.mark.exactness
def test_experts_in_some_micro_batches_step_as_the_split_over_their_own_calls(device):
    """Each layer's phases follow its own calls: the first call decays the buffer and adds
    wd·w, the last steps the weight (after the last micro-batch where that is earlier),
    and a layer no micro-batch reaches keeps weight, buffer and step count. It used to
    follow the micro-batch index: an expert of the first micro-batch only never stepped,
    one first called later skipped the decay and weight decay."""
    torch.manual_seed(0)
    model = fk.fuse(_Experts().to(device), fk.SGD(**RULE))
    ref = copy.deepcopy(model)
    trainer = fk.Trainer(model)
    pipeline = StandardPipeline(ref, None)
    for step in range(2):
        trainer.step(_closures(model, device, step))
        pipeline.backward(_closures(ref, device, step))
        for layer in pipeline.layers:
            grads = pipeline.micro_batch_grads[layer]
            if not grads:
                continue
            buf = layer.forge_state["momentum_buffer"]
            with torch.no_grad():
                w, new_buf = _momentum_sequence(layer.weight, buf, grads, layer.rule, int(layer.forge_step) + 1)
                layer.weight.copy_(w)
                buf.copy_(new_buf)
            layer.forge_step += 1
        pipeline.zero_grad()
        for (name, x), (_, y) in zip(model.state_dict().items(), ref.state_dict().items(), strict=True):
            assert_bitwise_equal(x, y, f"step {step + 1}: {name}")
        assert [int(layer.forge_step) for layer in fk.fused_layers(model)] == STEPS[step]


def test_the_late_weight_step_leaves_the_buffer_bit_for_bit(device):
    """The weight step of a layer whose last call came before the last micro-batch adds
    c·(g + 0·w) with c = 0 and g = −1 to the buffer: −0, so every value stays as it is,
    −0 included (a zero gradient would add +0 and make it +0), and the weight takes
    w − lr·buf, as the last phase of the split does."""
    gen = torch.Generator().manual_seed(5)
    layer = fk.ForgeLinear(8, 16, bias=False, rule=fk.SGD(**RULE), device=device)
    buf = torch.randn(16, 8, generator=gen).to(device)
    w = torch.randn(16, 8, generator=gen).to(device)
    buf[0, :4], buf[1, :4], w[0, :2], w[1, :2] = -0.0, 0.0, -0.0, 0.0
    state = {"momentum_buffer": buf.clone()}
    weight = w.clone()
    rule = fk.training._WeightStep(layer.rule)
    fk.fused_weight_update(*fk.training._unit_gradient(layer), weight, state, rule, 2)
    assert_bitwise_equal(state["momentum_buffer"], buf, "momentum buffer")
    assert_bitwise_equal(weight, w - rule.scalars(2)[0] * buf, "weight")


class _TwoBranches(nn.Module):
    """Two losses added: a non-finite z reaches b's operands only."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 4, bias=False)
        self.b = nn.Linear(8, 4, bias=False)

    def forward(self, x, z):
        return self.a(x).square().mean() + self.b(z).square().mean()


def _branch_closures(model, device, step, poisoned=None):
    """Two micro-batches; ``poisoned``: the micro-batch whose z is infinite."""
    gen = torch.Generator().manual_seed(70 + step)
    closures = []
    for index in range(2):
        x, z = (torch.randn(4, 8, generator=gen).to(device) for _ in range(2))
        if index == poisoned:
            z[0, 0] = float("inf")
        closures.append(lambda x=x, z=z: model(x, z))
    return closures


def _branches(device):
    torch.manual_seed(0)
    model = fk.fuse(_TwoBranches().to(device), fk.SGD(**RULE))
    trainer = fk.Trainer(model)
    trainer.step(_branch_closures(model, device, 0))
    return model, trainer


def test_a_failure_in_a_later_micro_batch_stops_the_layers_holding_a_partial_sum(device):
    """b's operands are non-finite in the last micro-batch: its last phase writes nothing,
    but the first micro-batch is in its momentum buffer already (no copy of the buffer is
    kept to undo it). The error says so, and b is stopped like a layer whose update failed:
    the next step is refused before anything steps, until a checkpoint is restored (then
    the step equals an uninterrupted run's) or the partial step is accepted. a finished
    its step, and the error says it stepped."""
    model, trainer = _branches(device)
    checkpoint = copy.deepcopy(trainer.state_dict())
    with pytest.raises(fk.NonFiniteInputError, match=r"fused layer 'b', step 2: .*nothing was updated\. The "
                       r"accumulated step stopped part-way: the momentum buffers of fused layers \['b'\] hold a "
                       r"partial sum .*\[fused layers \['a'\] had stepped in this step") as raised:
        trainer.step(_branch_closures(model, device, 1, poisoned=1))
    assert "'b'" not in str(raised.value).split("[fused layers")[1]
    assert model.b._failed_step == 2 and int(model.b.forge_step) == 1 and int(model.a.forge_step) == 2
    assert_bitwise_equal(model.b.weight.detach(), checkpoint["model"]["b.weight"], "b.weight")
    assert not torch.equal(model.b.forge_state["momentum_buffer"], checkpoint["model"]["b.forge_state_momentum_buffer"])
    weights = {name: layer.weight.detach().clone() for name, layer in (("a", model.a), ("b", model.b))}
    with pytest.raises(RuntimeError, match=r"fused layers stopped: 'b' at step 2 \(an accumulated step that failed "
                                           r"part-way left a partial sum.*nothing was stepped"):
        trainer.step(_branch_closures(model, device, 2))
    for name, layer in (("a", model.a), ("b", model.b)):
        assert_bitwise_equal(layer.weight.detach(), weights[name], name)
    # The layer itself tells the same reason (it was told, by forge_stop), not a tile's.
    with pytest.raises(RuntimeError, match=r"fused layer 'b' stopped at step 2 \(an accumulated step that failed "
                                           r"part-way left a partial sum"):
        model.state_dict()

    trainer.load_state_dict(checkpoint)
    twin, twin_trainer = _branches(device)
    for t, m in ((trainer, model), (twin_trainer, twin)):
        t.step(_branch_closures(m, device, 2))
    for (name, x), (_, y) in zip(model.state_dict().items(), twin.state_dict().items(), strict=True):
        assert_bitwise_equal(x, y, name)

    with pytest.raises(fk.NonFiniteInputError, match="partial sum"):
        trainer.step(_branch_closures(model, device, 3, poisoned=1))
    model.b.forge_accept_partial_step()
    trainer.step(_branch_closures(model, device, 4))
    assert int(model.b.forge_step) == 4 and int(model.a.forge_step) == 4


def test_a_failure_in_the_first_micro_batch_stops_only_the_layers_it_left_partial(device):
    """b's operands are non-finite in the first micro-batch: its phase writes nothing, and
    the step stops at b's next call. b's buffer holds nothing of this step, so b is not
    stopped (weight, buffer and step count as before); a's first phase had added into its
    buffer, so a is."""
    model, trainer = _branches(device)
    before = [t.detach().clone() for t in (model.b.weight, model.b.forge_state["momentum_buffer"], model.b.forge_step)]
    with pytest.raises(fk.NonFiniteInputError, match=r"fused layer 'b', step 2: .*fused layers \['a'\] hold a "
                                                     "partial sum"):
        trainer.step(_branch_closures(model, device, 1, poisoned=0))
    assert model.b._failed_step is None and model.a._failed_step == 2
    after = (model.b.weight, model.b.forge_state["momentum_buffer"], model.b.forge_step)
    for name, x, y in zip(("weight", "momentum buffer", "step"), after, before):
        assert_bitwise_equal(x.detach(), y, name)
