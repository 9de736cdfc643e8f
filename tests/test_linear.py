"""ForgeLinear and fuse: one fused step per backward, dX from the pre-update weight,
model-level fused == oracle, and the refusals (tied, reused, subclassed layers)."""

import json
import re

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

import forge_kernels as fk
from forge_verify import assert_bitwise_equal


def _mlp(seed, device):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 24), nn.GELU(), nn.Linear(24, 8, bias=False)).to(device)


def _train(model, batches):
    for x, target in batches:
        loss = (model(x) - target).square().mean()
        loss.backward()
        for p in model.parameters():
            p.grad = None
    return model


def _batches(device, n=3, dtype=torch.float32):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(2, 9, 12, generator=gen).to(device, dtype), torch.randn(2, 9, 8, generator=gen).to(device))
            for _ in range(n)]


@pytest.mark.exactness
@pytest.mark.parametrize("rule", [fk.AdamW(lr=1e-2), fk.SGD(lr=0.1, momentum=0.9, nesterov=True),
                                  fk.Lion(lr=1e-3), fk.RMSprop(centered=True), fk.Adagrad()], ids=repr)
def test_fused_model_equals_oracle_model(rule, device):
    fused = _train(fk.fuse(_mlp(0, device), rule), _batches(device))
    oracle = _train(fk.fuse(_mlp(0, device), rule, oracle=True), _batches(device))
    for (name, a), (_, b) in zip(fused.state_dict().items(), oracle.state_dict().items()):
        if a.is_floating_point():
            assert_bitwise_equal(a, b, name)
    assert int(fused[0].forge_step) == 3


def test_layer_step_equals_direct_kernel_call_and_dx_uses_old_weight(device):
    rule = fk.AdamW(lr=1e-2)
    torch.manual_seed(0)
    linear = nn.Linear(12, 24, bias=False).to(device)
    w0 = linear.weight.detach().clone()
    layer = fk.ForgeLinear.from_linear(linear, rule)
    x = torch.randn(2, 5, 12, device=device, requires_grad=True)
    dy = torch.randn(2, 5, 24, device=device)
    layer(x).backward(dy)

    expected_w, state = w0.clone(), rule.init_state(w0)
    fk.fused_weight_update(x.detach().reshape(10, 12), dy.reshape(10, 24), expected_w, state, rule, 1)
    assert_bitwise_equal(layer.weight.detach(), expected_w, "weight")
    assert_bitwise_equal(layer.forge_state["exp_avg_sq"], state["exp_avg_sq"], "exp_avg_sq")
    assert_bitwise_equal(x.grad, dy @ w0, "dX")
    assert layer.weight.grad is None


def test_bias_gets_an_ordinary_gradient(device):
    layer = fk.ForgeLinear(6, 4, rule=fk.SGD(lr=0.1), device=device)
    dy = torch.randn(3, 4, device=device)
    layer(torch.randn(3, 6, device=device)).backward(dy)
    assert_bitwise_equal(layer.bias.grad, dy.sum(0), "bias grad")


def test_changed_learning_rate_applies_at_next_backward(device):
    rule = fk.SGD(lr=0.1)
    layer = fk.ForgeLinear(6, 4, bias=False, rule=rule, device=device)
    x = torch.randn(3, 6, device=device)
    dy = torch.randn(3, 4, device=device)
    expected = {}
    for lr in (0.1, 0.25):
        expected[lr] = layer.weight.detach().clone()
        fk.fused_weight_update(x, dy, expected[lr], {}, fk.SGD(lr=lr), 1, oracle=True)
    rule.lr = 0.25
    layer(x).backward(dy)
    assert_bitwise_equal(layer.weight.detach(), expected[0.25], "weight")
    assert not torch.equal(expected[0.1], expected[0.25])


def test_no_grad_forward_takes_no_step(device):
    layer = fk.ForgeLinear(6, 4, rule=fk.AdamW(), device=device)
    w = layer.weight.detach().clone()
    with torch.no_grad():
        layer(torch.randn(3, 6, device=device))
    assert torch.equal(layer.weight, w) and int(layer.forge_step) == 0


def test_state_and_step_are_in_state_dict(device):
    model = fk.fuse(_mlp(0, device), fk.AdamW())
    keys = set(model.state_dict())
    assert {"0.forge_state_exp_avg", "0.forge_state_exp_avg_sq", "0.forge_step", "2.forge_step"} <= keys


def test_fuse_keeps_structure_and_parameters(device):
    model = _mlp(0, device)
    params = [id(p) for p in model.parameters()]
    names = [n for n, _ in model.named_modules()]
    assert fk.fuse(model, fk.AdamW()) is model
    assert [id(p) for p in model.parameters()] == params
    assert [n for n, _ in model.named_modules()] == names
    assert isinstance(model[0], fk.ForgeLinear) and model[0].forge_name == "0"


def test_reused_layer_is_refused(device):
    layer = fk.ForgeLinear(6, 6, rule=fk.AdamW(), device=device)
    x = torch.randn(3, 6, device=device)
    with pytest.raises(RuntimeError, match="called again before the backward"):
        layer(layer(x))


class _Checkpointed(nn.Module):
    """Two blocks, each run under torch.utils.checkpoint."""

    def __init__(self, use_reentrant):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 12)) for _ in range(2))
        self.use_reentrant = use_reentrant

    def forward(self, x):
        for block in self.blocks:
            x = block(x) if self.use_reentrant is None else checkpoint(block, x, use_reentrant=self.use_reentrant)
        return x


@pytest.mark.exactness
@pytest.mark.parametrize("use_reentrant, early_stop", [(False, True), (False, False), (True, True)],
                         ids=["non_reentrant", "non_reentrant_no_early_stop", "reentrant"])
def test_activation_checkpointing_trains_bitwise_as_without(use_reentrant, early_stop, device):
    """The recomputed forward is recognised (a forward with grad inside a backward) and
    steps nothing; each layer steps once, from the activations it would have saved.
    Non-reentrant checkpointing used to be refused as a reused layer."""
    models = []
    for reentrant in (None, use_reentrant):
        torch.manual_seed(0)
        models.append(fk.fuse(_Checkpointed(reentrant).to(device), fk.AdamW(lr=1e-2)))
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randn(5, 12, generator=gen).to(device).requires_grad_()
        for model in models:
            with set_checkpoint_early_stop(early_stop):
                model(x).square().mean().backward()
    plain, checkpointed = (model.state_dict() for model in models)
    for name, value in plain.items():
        assert_bitwise_equal(checkpointed[name], value, name)
    assert {int(layer.forge_step) for layer in fk.fused_layers(models[1])} == {2}


def test_layer_in_two_reentrant_checkpointed_regions_is_refused(device):
    """Reentrant checkpointing runs the first forward without grad, so a layer called in two
    regions is not refused there; the second region's replay finds the weight the first
    region's backward stepped, and is refused (it used to step the layer twice)."""
    layer = fk.ForgeLinear(8, 8, rule=fk.SGD(lr=0.1), device=device)
    block = nn.Sequential(layer, nn.Tanh())
    x = torch.randn(3, 8, device=device, requires_grad=True)
    out = checkpoint(block, checkpoint(block, x, use_reentrant=True), use_reentrant=True)
    with pytest.raises(RuntimeError, match="is run again inside a backward .* after its weight was stepped"):
        out.sum().backward()
    assert int(layer.forge_step) == 1


def test_layer_inside_a_reentrant_region_and_outside_it_is_refused(device):
    """The region's replay finds the outside call pending, so it is taken for a replay that
    steps nothing, and the reentrant backward through it is refused."""
    layer = fk.ForgeLinear(8, 8, rule=fk.SGD(lr=0.1), device=device)
    x = torch.randn(3, 8, device=device, requires_grad=True)
    out = checkpoint(nn.Sequential(layer, nn.Tanh()), layer(x), use_reentrant=True)
    with pytest.raises(RuntimeError, match="a backward ran through fused layer 'ForgeLinear' as activation "
                                           "checkpointing recomputed it"):
        out.sum().backward()
    assert int(layer.forge_step) == 0


def test_checkpointed_region_backwarded_in_parts_is_refused(device):
    """A second backward into a non-reentrant region recomputes it again, by then from a
    stepped weight: the activations would not be the forward's."""
    first, second = (fk.ForgeLinear(8, 8, rule=fk.SGD(lr=0.1), device=device) for _ in range(2))

    def region(x):
        hidden = first(x)
        return hidden, second(hidden.detach().tanh())

    x = torch.randn(3, 8, device=device, requires_grad=True)
    hidden, out = checkpoint(region, x, use_reentrant=False)
    torch.autograd.grad(hidden.sum(), x)
    assert int(first.forge_step) == 1
    with pytest.raises(RuntimeError, match="'ForgeLinear' is run again inside a backward"):
        out.sum().backward()
    assert int(second.forge_step) == 0


def test_second_backward_through_retained_graph_is_refused(device):
    layer = fk.ForgeLinear(6, 6, rule=fk.AdamW(), device=device)
    out = layer(torch.randn(3, 6, device=device)).sum()
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        out.backward()
    assert int(layer.forge_step) == 1


def test_dropped_output_frees_the_layer(device):
    layer = fk.ForgeLinear(6, 6, rule=fk.AdamW(), device=device)
    x = torch.randn(3, 6, device=device)
    out = layer(x)
    del out
    layer(x).sum().backward()
    assert int(layer.forge_step) == 1


def test_tied_weights_are_refused(device):
    model = _mlp(0, device)
    model.append(nn.Linear(12, 24))
    model[3].weight = model[0].weight
    with pytest.raises(ValueError, match="is tied"):
        fk.fuse(model, fk.AdamW())


def test_linear_subclass_is_refused(device):
    attention = nn.MultiheadAttention(8, 2).to(device)
    with pytest.raises(TypeError, match="subclass of nn.Linear"):
        fk.fuse(nn.Sequential(attention), fk.AdamW())


@pytest.mark.parametrize("case", ["convolutions", "linears_excluded", "no_parameters"])
def test_model_with_nothing_to_fuse_is_refused(case, device):
    """fuse on a model where no layer would be fused says so, and names each trainable
    module it skipped and why, instead of returning the model unchanged in silence."""
    if case == "convolutions":
        model, exclude = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 1)), ()
        skipped = [r"'0' \(Conv2d, not an nn.Linear\)", r"'2' \(Conv2d, not an nn.Linear\)"]
    elif case == "linears_excluded":
        model, exclude = nn.Sequential(nn.Linear(4, 4), nn.Conv1d(4, 4, 1)), ["0"]
        skipped = [r"'0' \(Linear, excluded by exclude=\)", r"'1' \(Conv1d, not an nn.Linear\)"]
    else:
        model, exclude = nn.Sequential(nn.ReLU()), ()
        skipped = ["it has no trainable parameters"]
    model = model.to(device)
    with pytest.raises(ValueError, match="fuse fused no layer of this Sequential: only nn.Linear") as info:
        fk.fuse(model, fk.AdamW(), exclude=exclude)
    for pattern in skipped:
        assert re.search(pattern, str(info.value)), (pattern, str(info.value))
    assert not any(isinstance(m, fk.ForgeLinear) for m in model.modules())


def test_fp16_weight_is_refused(device):
    with pytest.raises(TypeError, match="float32 or bfloat16 weights"):
        fk.fuse(_mlp(0, device).half(), fk.AdamW())


def test_fuse_refusing_a_later_layer_fuses_nothing_and_names_it(device):
    """Every layer is built (and checked) before any is swapped in: a refused second layer
    used to leave the first fused, a retry then failing with "'0' is already fused", and
    the built layer's refusal hook on the first weight."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8).half()).to(device)
    with pytest.raises(TypeError, match=r"layer '2': fused layers keep float32 or bfloat16 weights; got "
                                        r"torch.float16 \(nothing was fused\)"):
        fk.fuse(model, fk.AdamW())
    assert [type(m) for m in model] == [nn.Linear, nn.Tanh, nn.Linear]
    model[2].float()
    model(torch.randn(3, 8, device=device)).sum().backward()  # a plain model: its weights take .grad
    assert model[0].weight.grad is not None
    model.zero_grad(set_to_none=True)
    fk.fuse(model, fk.AdamW())
    assert isinstance(model[0], fk.ForgeLinear) and isinstance(model[2], fk.ForgeLinear)


@pytest.mark.exactness
@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_bf16_model_fused_equals_oracle(rounding, device):
    """bf16 weights and bf16 state, no fp32 master copy: fused and oracle layers draw the
    same rounding streams, so three training steps agree bit for bit."""
    models = [fk.fuse(_mlp(0, device).bfloat16(), fk.AdamW(lr=1e-2), oracle=oracle, state_format="bf16",
                      rounding=rounding, seed=17) for oracle in (False, True)]
    for model in models:
        _train(model, _batches(device, dtype=torch.bfloat16))
    for (name, a), (_, b) in zip(models[0].state_dict().items(), models[1].state_dict().items()):
        if a.is_floating_point():
            assert_bitwise_equal(a, b, name)
        else:
            assert torch.equal(a, b), name
    assert models[0][0].weight.dtype == torch.bfloat16
    assert models[0][0].forge_state["exp_avg"].dtype == torch.bfloat16


def test_layers_get_distinct_rounding_streams(device):
    model = fk.fuse(_mlp(0, device).bfloat16(), fk.SGD(lr=0.1), seed=5)
    assert int(model[0].forge_seed) != int(model[2].forge_seed)
    assert "0.forge_seed" in model.state_dict()


def test_bf16_activations_update_fp32_weights_under_autocast(device):
    model = fk.fuse(_mlp(0, device), fk.AdamW(lr=1e-2))
    before = model[0].weight.detach().clone()
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
        _train(model, _batches(device, n=1, dtype=torch.bfloat16))
    assert model[0].weight.dtype == torch.float32 and not torch.equal(model[0].weight, before)


@pytest.mark.parametrize("weights, inputs", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("grad", [True, False], ids=["training", "no_grad"])
def test_input_of_another_dtype_is_refused_as_nn_linear_refuses_it(weights, inputs, grad, device):
    """Without autocast nn.Linear raises on an input whose dtype is not the weight's; a
    fused layer raises too (naming itself) instead of casting its weight and stepping."""
    x = torch.randn(3, 12, device=device, dtype=inputs)
    with pytest.raises(RuntimeError, match="mat1 and mat2 must have the same dtype"):
        _mlp(0, device).to(weights)(x)
    model = fk.fuse(_mlp(0, device).to(weights), fk.AdamW(lr=1e-2))
    before = model[0].weight.detach().clone()
    with torch.set_grad_enabled(grad), pytest.raises(
            RuntimeError, match=f"fused layer '0': mat1 and mat2 must have the same dtype, but got {inputs} input "
                                f"and {weights} weight"):
        model(x)
    assert torch.equal(model[0].weight, before) and int(model[0].forge_step) == 0
    model(x.to(weights)).sum().backward()  # the refused call left no pending use behind
    assert int(model[0].forge_step) == 1


def test_error_in_a_layers_backward_names_the_layer(device):
    """An argument error the step's launcher raises inside backward (here float64
    activations after model.double()) says which fused layer it came from."""
    model = fk.fuse(_mlp(0, device), fk.AdamW(lr=1e-2)).double()
    before = model[2].weight.detach().clone()
    loss = model(torch.randn(3, 12, device=device, dtype=torch.float64)).square().sum()
    with pytest.raises(TypeError, match="fused layer '2', in its backward: x is torch.float64; activations must be"):
        loss.backward()
    assert torch.equal(model[2].weight, before) and int(model[2].forge_step) == 0


def test_weight_used_outside_its_layer_is_refused(device):
    layer = fk.ForgeLinear(6, 6, bias=False, rule=fk.SGD(lr=0.1), device=device)
    x = torch.randn(3, 6, device=device)
    out = layer(x).sum() + (x @ layer.weight.T).sum()
    with pytest.raises(RuntimeError, match="received a gradient from a use outside the layer"):
        out.backward()


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_layer_stops_after_a_partial_step_until_told_to_go_on(device):
    layer = fk.ForgeLinear(40, 40, bias=False, rule=fk.SGD(lr=0.1, momentum=0.9), device=device,
                           config=fk.TileConfig(block_n=16, block_k=16, block_t=16))
    x = torch.ones(4, 40, device=device)
    x[:, 20] = 1e20
    dy = torch.ones(4, 40, device=device)
    dy[:, 5] = 1e20
    with pytest.raises(fk.NonFiniteUpdateError):
        layer(x).backward(dy)
    assert int(layer.forge_step) == 0
    with pytest.raises(RuntimeError, match="stopped at step 1"):
        layer(torch.ones(4, 40, device=device)).backward(torch.ones(4, 40, device=device))
    layer.forge_accept_partial_step()
    assert int(layer.forge_step) == 1
    layer(torch.ones(4, 40, device=device)).backward(torch.ones(4, 40, device=device))
    assert int(layer.forge_step) == 2


def test_autocast_bf16_training_steps_every_layer(device):
    """Under autocast the saved input is cast like the output, so x and dY share a dtype."""
    model = fk.fuse(_mlp(0, device), fk.AdamW(lr=1e-2))
    before = [model[0].weight.detach().clone(), model[2].weight.detach().clone()]
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
        loss = model(torch.randn(4, 12, device=device)).float().square().mean()
    loss.backward()
    assert int(model[0].forge_step) == 1 and int(model[2].forge_step) == 1
    assert not torch.equal(model[0].weight, before[0]) and not torch.equal(model[2].weight, before[1])


def _trained(device, rule, state_format, steps=1):
    return _train(fk.fuse(_mlp(0, device), rule, state_format=state_format, seed=3), _batches(device, n=steps))


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non_strict"])
@pytest.mark.parametrize("layer, checkpoint", [
    (("bf16", fk.AdamW), ("fp32", fk.AdamW)),  # would be rounded to bf16 in silence
    (("fp32", fk.AdamW), ("bf16", fk.AdamW)),
    (("fp32", fk.AdamW), ("q8", fk.AdamW)),
    (("fp32", fk.Adam), ("fp32", fk.AdamW)),   # same slots, another rule
], ids=["bf16-loads-fp32", "fp32-loads-bf16", "fp32-loads-q8", "adam-loads-adamw"])
def test_checkpoint_of_another_state_format_or_rule_is_refused(layer, checkpoint, strict, device):
    source = _trained(device, checkpoint[1](lr=1e-2), checkpoint[0])
    target = _trained(device, layer[1](lr=1e-2), layer[0])
    before = {k: v.clone() for k, v in target.state_dict().items()}
    expected = (rf"fused layer '0' \(checkpoint entries 0\.\*\): expected {layer[0]} state of {layer[1].__name__}, "
                rf"found {checkpoint[0]} state of {checkpoint[1].__name__}; refused")
    with pytest.raises(RuntimeError, match=expected) as info:
        target.load_state_dict(source.state_dict(), strict=strict)
    assert "fused layer '2'" in str(info.value)  # every mismatched layer is named
    for name, value in target.state_dict().items():
        assert_bitwise_equal(value, before[name], name)


def test_checkpoint_records_the_rule_and_its_hyperparameters_but_not_the_learning_rate(device):
    """`_extra_state` (a uint8 tensor) holds the rule's class and hyperparameters as JSON;
    the learning rate is left out: a scheduler (or fk.Trainer's optimizer) owns it, so a
    checkpoint loads into a layer whose rule has another lr, bit for bit."""
    source = _trained(device, fk.AdamW(lr=1e-2, betas=(0.8, 0.99), eps=1e-6), "bf16")
    checkpoint = source.state_dict()
    assert json.loads(bytes(checkpoint["0._extra_state"].tolist())) == {
        "rule": "AdamW", "hyperparameters": {"betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.01}}
    target = fk.fuse(_mlp(1, device), fk.AdamW(lr=0.5, betas=(0.8, 0.99), eps=1e-6), state_format="bf16")
    target.load_state_dict(checkpoint)
    for name, value in target.state_dict().items():
        assert_bitwise_equal(value, checkpoint[name], name)


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non_strict"])
def test_checkpoint_of_other_hyperparameters_is_refused_naming_them(strict, device):
    """A layer would otherwise resume another rule's state with its own betas, eps and
    decay in silence (the state's format and slots are the same)."""
    source = _trained(device, fk.AdamW(lr=0.1, betas=(0.9, 0.999), weight_decay=0.1), "fp32")
    target = _trained(device, fk.AdamW(lr=0.1, betas=(0.5, 0.6), eps=1e-3, weight_decay=0.0), "fp32")
    before = {k: v.clone() for k, v in target.state_dict().items()}
    expected = (r"fused layer '0' \(checkpoint entries 0\.\*\): its AdamW has betas=\(0.5, 0.6\), eps=0.001, "
                r"weight_decay=0.0 where the checkpoint's has betas=\(0.9, 0.999\), eps=1e-08, weight_decay=0.1; "
                r"refused, the layer is left as it was\. .*checkpoint\['0._extra_state'\] = "
                r"model.get_submodule\('0'\).get_extra_state\(\)\. The learning rate is not recorded")
    with pytest.raises(RuntimeError, match=expected) as info:
        target.load_state_dict(source.state_dict(), strict=strict)
    assert "fused layer '2'" in str(info.value)
    for name, value in target.state_dict().items():
        assert_bitwise_equal(value, before[name], name)


@pytest.mark.parametrize("record", [None, {"rule": "AdamW"}], ids=["no_record", "class_only"])
def test_checkpoint_without_hyperparameters_is_refused_until_given_the_layers_record(record, device):
    """A checkpoint written before the hyperparameters were recorded cannot be checked, so
    it is refused; the error says how to vouch for it (the layer's own record), after which
    it loads bit for bit. Its format is still checked first."""
    checkpoint = _trained(device, fk.AdamW(lr=1e-2), "bf16").state_dict()
    old = {k: v.clone() for k, v in checkpoint.items() if not k.endswith("._extra_state")}
    if record is not None:
        for key in ("0._extra_state", "2._extra_state"):
            old[key] = torch.tensor(list(json.dumps(record).encode()), dtype=torch.uint8)
    target = fk.fuse(_mlp(1, device), fk.AdamW(lr=1e-2), state_format="bf16")
    with pytest.raises(RuntimeError, match=r"fused layer '0' \(checkpoint entries 0\.\*\): the checkpoint records "
                                           r"no hyperparameters of its rule .*checkpoint\['0._extra_state'\] = "
                                           r"model.get_submodule\('0'\).get_extra_state\(\)"):
        target.load_state_dict(old)
    found = "an unrecorded rule" if record is None else "AdamW"
    with pytest.raises(RuntimeError, match=f"expected fp32 state of AdamW, found bf16 state of {found}"):
        fk.fuse(_mlp(1, device), fk.AdamW(lr=1e-2)).load_state_dict(old)
    target.load_state_dict({**old, **{f"{name}._extra_state": target.get_submodule(name).get_extra_state()
                                      for name in ("0", "2")}})
    loaded = target.state_dict()
    for name, value in checkpoint.items():
        assert_bitwise_equal(loaded[name], value, name)


def test_checkpoint_with_other_slots_is_refused_even_when_not_strict(device):
    source = _trained(device, fk.RMSprop(centered=True), "fp32")
    target = fk.fuse(_mlp(1, device), fk.RMSprop())
    with pytest.raises(RuntimeError, match=r"found fp32 state of RMSprop with slots \['grad_avg', 'square_avg'\], "
                                           r"where it keeps \['square_avg'\]"):
        target.load_state_dict(source.state_dict(), strict=False)


def test_plain_linear_weights_load_into_a_fused_model_without_strict(device):
    plain = _mlp(1, device)
    target = fk.fuse(_mlp(0, device), fk.AdamW(), state_format="bf16")
    target.load_state_dict(plain.state_dict(), strict=False)
    assert_bitwise_equal(target[0].weight.detach(), plain[0].weight.detach(), "weight")
