"""Trainer: every hyperparameter a fused rule shares with its param group follows the
group (schedulers that move momenta, OneCycleLR above all), a rule hyperparameter set
directly is adopted into the group, what cannot reach a rule is refused, and
ReduceLROnPlateau (stepped on a metric) is refused as scheduler= and works stepped by hand.

The reference is a hand-written loop: the same model's fused layers stepping in their own
backward, their rule set before each step from a torch scheduler on a torch optimizer.
"""

import copy

import pytest
import torch
from torch import nn

import forge_kernels as fk
from forge_kernels.training import _HELD_KEY as HELD_KEY
from forge_verify import assert_bitwise_equal

# The momentum each torch optimizer has, as the group key OneCycleLR cycles.
MOMENTUM_KEY = {"AdamW": "betas", "SGD": "momentum"}


def _model(device, bias=True, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 16, bias=bias), nn.Tanh(), nn.Linear(16, 4, bias=bias)).to(device)


def _loss(model, device, step):
    gen = torch.Generator().manual_seed(10 + step)
    x = torch.randn(8, 16, generator=gen).to(device)
    return lambda: model(x).square().mean()


def _build(kind, model, lr):
    rule = fk.AdamW(lr=lr) if kind == "AdamW" else fk.SGD(lr=lr, momentum=0.9)
    fk.fuse(model, rule)
    params = fk.unfused_parameters(model)
    optimizer = (torch.optim.AdamW(params, lr=lr) if kind == "AdamW" else
                 torch.optim.SGD(params, lr=lr, momentum=0.9)) if params else None
    return rule, optimizer


def _one_cycle(optimizer):
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=10)  # cycle_momentum=True


@pytest.mark.exactness
@pytest.mark.parametrize("kind, bias", [("AdamW", True), ("SGD", True), ("AdamW", False)],
                         ids=["AdamW", "SGD-momentum", "AdamW-no-torch-optimizer"])
def test_one_cycle_moves_the_fused_rules_momentum(kind, bias, device):
    """OneCycleLR cycles lr and the momentum (AdamW's beta1, SGD's momentum) of every group:
    the fused rules take both, as a hand loop setting them from a torch optimizer's
    OneCycleLR does, bitwise. Without unfused parameters the Trainer's own optimizer holds
    the fused group, and OneCycleLR finds the rule's momentum there too. A checkpoint
    carries the moved values to a resumed trainer's rules."""
    model, twin = _model(device, bias), _model(device, bias)
    rule, optimizer = _build(kind, model, 0.1)
    twin_rule, twin_optimizer = _build(kind, twin, 0.1)
    trainer = fk.Trainer(model, optimizer, scheduler=_one_cycle)
    # The twin's schedule: its own torch optimizer's, or a stand-in's of the rule's kind.
    schedule_optimizer = twin_optimizer
    if schedule_optimizer is None:
        schedule_optimizer = torch.optim.AdamW([nn.Parameter(torch.zeros(1, device=device))], lr=0.1)
    twin_scheduler = _one_cycle(schedule_optimizer)
    key = MOMENTUM_KEY[kind]
    for step in range(3):
        group = schedule_optimizer.param_groups[0]
        twin_rule.lr, twin_value = group["lr"], group[key]
        setattr(twin_rule, key, twin_value)
        assert rule.lr == twin_rule.lr and getattr(rule, key) == twin_value
        trainer.step(_loss(model, device, step))
        _loss(twin, device, step)().backward()
        schedule_optimizer.step()
        schedule_optimizer.zero_grad()
        twin_scheduler.step()
    # The Trainer's rules show the next step's values; the twin's take them too.
    twin_rule.lr = schedule_optimizer.param_groups[0]["lr"]
    setattr(twin_rule, key, schedule_optimizer.param_groups[0][key])
    assert getattr(rule, key) == getattr(twin_rule, key) != (0.9 if kind == "SGD" else (0.9, 0.999))  # it moved
    for (name, x), (_, y) in zip(model.state_dict().items(), twin.state_dict().items(), strict=True):
        assert_bitwise_equal(x, y, name)

    resumed_rule, resumed_optimizer = _build(kind, resumed := _model(device, bias, seed=1), 0.1)
    resumed_trainer = fk.Trainer(resumed, resumed_optimizer, scheduler=_one_cycle)
    resumed_trainer.load_state_dict(trainer.state_dict())
    assert resumed_rule.hyperparameters() == rule.hyperparameters()


def test_a_rule_hyperparameter_set_directly_is_adopted_into_its_group(device):
    """rule.lr = 0 under a Trainer takes effect at the next step (the weights stay) and the
    group shows it, so a scheduler goes on from it; set on the rule and in the group to
    different values since the last step, it is refused before anything steps."""
    model = _model(device, bias=False)
    rule = fk.AdamW(lr=0.1)
    fk.fuse(model, rule)
    trainer = fk.Trainer(model, scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5))
    rule.lr = 0.0
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer.step(_loss(model, device, 0))
    for layer in fk.fused_layers(model):
        assert_bitwise_equal(layer.weight.detach(), before[layer.forge_name + ".weight"], layer.forge_name)
        assert int(layer.forge_step) == 1
    assert trainer.optimizer.param_groups[0]["lr"] == rule.lr == 0.0

    rule.lr = 0.2
    trainer.optimizer.param_groups[0]["lr"] = 0.3
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"AdamW's lr was set to 0.2 on the rule and to 0.3 in its param group"):
        trainer.step(_loss(model, device, 1))
    for name, value in model.state_dict().items():
        assert_bitwise_equal(value, before[name], name)


def test_a_refused_group_value_reaches_neither_the_rule_nor_the_next_step(device):
    """group["lr"] = -1 is refused before anything steps, and the rule keeps its lr: the
    refused value must not count as one set on the rule at the next step (it would be
    copied back over the user's correction). Corrected in the group, the step goes on."""
    model = _model(device, bias=False)
    rule = fk.AdamW(lr=0.1)
    fk.fuse(model, rule)
    trainer = fk.Trainer(model)
    trainer.step(_loss(model, device, 0))
    group = trainer.optimizer.param_groups[0]
    group["lr"] = -1.0
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"fused AdamW group's lr=-1.0 \(was 0.1\) is refused: "
                                         r"lr=-1.0 is outside .*nothing was stepped"):
        trainer.step(_loss(model, device, 1))
    for name, value in model.state_dict().items():
        assert_bitwise_equal(value, before[name], name)
    assert rule.lr == 0.1
    group["lr"] = 0.05
    trainer.step(_loss(model, device, 1))
    assert rule.lr == group["lr"] == 0.05
    assert all(int(layer.forge_step) == 2 for layer in fk.fused_layers(model))


def _cyclic(optimizer):
    return torch.optim.lr_scheduler.CyclicLR(optimizer, base_lr=0.01, max_lr=0.1)  # cycle_momentum=True


# (fused rule, torch optimizer, scheduler, the momentum the scheduler cycles): OneCycleLR
# and CyclicLR cycle the optimizer's kind of momentum in every group, the fused one's too.
# With torch SGD's momentum=0.95 OneCycleLR's first value is the group's own: only the
# cycle's later steps would move it.
CYCLES_WHAT_THE_RULE_LACKS = {
    "SGD-rule-AdamW-optimizer": (lambda: fk.SGD(lr=0.1, momentum=0.9),
                                 lambda p: torch.optim.AdamW(p, lr=0.1), _one_cycle, "betas"),
    "AdamW-rule-SGD-optimizer": (lambda: fk.AdamW(lr=0.1),
                                 lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.95), _one_cycle, "momentum"),
    "AdamW-rule-SGD-optimizer-CyclicLR": (lambda: fk.AdamW(lr=0.1),
                                          lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), _cyclic, "momentum"),
}


@pytest.mark.parametrize("case", CYCLES_WHAT_THE_RULE_LACKS)
def test_a_cycled_momentum_the_rule_does_not_have_is_refused_when_built(case, device):
    """A scheduler cycling a momentum the fused rule does not have (AdamW's betas for SGD,
    SGD's momentum for AdamW) is refused when the Trainer is made, naming the scheduler,
    not after a step has been taken nor lost in silence; without momentum cycling it trains."""
    make_rule, make_optimizer, make_scheduler, key = CYCLES_WHAT_THE_RULE_LACKS[case]
    scheduler_name = "CyclicLR" if make_scheduler is _cyclic else "OneCycleLR"
    model = _model(device)
    rule = make_rule()
    fk.fuse(model, rule)
    name = type(rule).__name__
    with pytest.raises(ValueError, match=rf"{scheduler_name} cycles the '{key}' of every param group .*the fused "
                                         rf"{name} group's too, but {name} has no {key}.*cycle_momentum=False.*the "
                                         r"Trainer was not made"):
        fk.Trainer(model, make_optimizer(fk.unfused_parameters(model)), scheduler=make_scheduler)
    trainer = fk.Trainer(model, make_optimizer(fk.unfused_parameters(model)), scheduler=lambda o: (
        torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=10, cycle_momentum=False)))
    trainer.step(_loss(model, device, 0))
    assert all(int(layer.forge_step) == 1 for layer in fk.fused_layers(model))


class _MomentumHalving(torch.optim.lr_scheduler.LambdaLR):
    """A scheduler of one's own that halves every group's momentum at each step after the
    first: nothing shows it before a step has been taken."""

    def step(self, *args):
        super().step(*args)
        if self.last_epoch > 1:
            for group in self.optimizer.param_groups:
                group["momentum"] *= 0.5


def test_a_momentum_moved_only_by_a_step_says_the_step_was_taken(device):
    """A momentum the fused rule does not have, moved by a scheduler in a way nothing shows
    when it is built, is refused after the step that moved it: the error says that step was
    taken, and the next step refuses it again before anything runs."""
    model = _model(device)
    fk.fuse(model, fk.AdamW(lr=0.1))
    optimizer = torch.optim.SGD(fk.unfused_parameters(model), lr=0.1, momentum=0.9)
    trainer = fk.Trainer(model, optimizer, scheduler=lambda o: _MomentumHalving(o, lambda epoch: 1.0))
    trainer.step(_loss(model, device, 0))
    with pytest.raises(ValueError, match=r"AdamW group's 'momentum' was moved .* AdamW has no momentum.*this step "
                                         r"was taken"):
        trainer.step(_loss(model, device, 1))
    assert all(int(layer.forge_step) == 2 for layer in fk.fused_layers(model))
    with pytest.raises(ValueError, match=r"AdamW group's 'momentum' was moved .*nothing was stepped"):
        trainer.step(_loss(model, device, 2))
    assert all(int(layer.forge_step) == 2 for layer in fk.fused_layers(model))


def _plateau(optimizer):
    return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)


# (fused rule, torch optimizer's momentum, scheduler, the refusal): each refused after the
# Trainer has added its groups to the optimizer and the scheduler has set lr in them.
REFUSED_TRAINERS = {
    "ReduceLROnPlateau": (lambda: fk.AdamW(lr=0.1), 0.0, _plateau, TypeError, r"ReduceLROnPlateau steps on a metric"),
    "momentum-switched-on": (lambda: fk.SGD(lr=0.1), 0.0, _one_cycle, ValueError,
                             r"fused SGD group's momentum=0.85 is refused: momentum cannot be switched between zero "
                             r"and non-zero.*OneCycleLR cycles the fused SGD group's momentum between 0.85 and 0.95\. "
                             r"Build the scheduler with cycle_momentum=False"),
    "momentum-the-rule-lacks": (lambda: fk.AdamW(lr=0.1), 0.95, _one_cycle, ValueError,
                                r"OneCycleLR cycles the 'momentum' of every param group"),
}


@pytest.mark.parametrize("case", REFUSED_TRAINERS)
def test_a_refused_trainer_leaves_the_optimizer_and_the_rule_as_they_were(case, device):
    """A Trainer refused when built leaves the user's optimizer (no fused groups added, its
    own group's lr as it was) and the rule as they were: built again without the refused
    scheduler, it trains."""
    make_rule, momentum, make_scheduler, error, message = REFUSED_TRAINERS[case]
    model = _model(device)
    rule = make_rule()
    fk.fuse(model, rule)
    optimizer = torch.optim.SGD(fk.unfused_parameters(model), lr=0.1, momentum=momentum)
    groups = [dict(group) for group in optimizer.param_groups]
    hyperparameters = rule.hyperparameters()
    with pytest.raises(error, match=message + r".*the Trainer was not made"):
        fk.Trainer(model, optimizer, scheduler=make_scheduler)
    assert optimizer.param_groups == groups and rule.hyperparameters() == hyperparameters
    trainer = fk.Trainer(model, optimizer)
    trainer.step(_loss(model, device, 0))
    assert all(int(layer.forge_step) == 1 for layer in fk.fused_layers(model))


def _step_lr(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def _trained(device, rule, seed, state_format="fp32", bias=True):
    # With biases the last Linear unfused: a load that goes ahead loads it whatever the fused
    # layers refuse. Without them every Linear fused: no torch optimizer, the groups' layout
    # the Trainer's own optimizer's.
    model = fk.fuse(_model(device, bias, seed), rule, state_format=state_format, exclude=("2",) if bias else ())
    params = fk.unfused_parameters(model)
    trainer = fk.Trainer(model, torch.optim.AdamW(params, lr=0.1) if params else None, scheduler=_step_lr)
    trainer.step(_loss(model, device, seed))
    return model, trainer


def _training_state(model, trainer):
    """Everything a load may change, copied: the model, the optimizer (its groups and
    state), the scheduler and the rules' hyperparameters."""
    return (copy.deepcopy(model.state_dict()), copy.deepcopy(trainer.optimizer.state_dict()),
            copy.deepcopy(trainer.scheduler.state_dict()), [rule.hyperparameters() for rule in trainer.rules])


def _assert_same_training_state(state, expected):
    (model, optimizer, scheduler, rules), (model_0, optimizer_0, scheduler_0, rules_0) = state, expected
    for name, value in model.items():
        assert_bitwise_equal(value, model_0[name], name)
    assert optimizer["param_groups"] == optimizer_0["param_groups"] and optimizer["state"].keys() == \
        optimizer_0["state"].keys()
    for index, slots in optimizer["state"].items():
        for slot, value in slots.items():
            assert_bitwise_equal(value, optimizer_0["state"][index][slot], f"optimizer state {index} {slot}")
    assert scheduler == scheduler_0 and rules == rules_0


# (the checkpoint's rule, state format and biases, this trainer's, the refusal): a
# checkpoint of another rule is refused by the Trainer (its fused group's hyperparameter
# names), one of another group layout by the Trainer too (a model without biases has no
# unfused group), one of another state format by the fused layers' record, each before
# anything is loaded.
REFUSED_CHECKPOINTS = {
    "another-rule": ((lambda: fk.AdamW(lr=0.05, weight_decay=0.3), "fp32", True),
                     (lambda: fk.SGD(lr=0.1, momentum=0.9), "fp32", True), ValueError,
                     r"the checkpoint's fused group 0 holds the hyperparameters \['lr', 'betas', 'eps', "
                     r"'weight_decay'\] of another rule: this trainer's SGD has \['lr', 'momentum', 'dampening', "
                     r"'weight_decay', 'nesterov'\].*nothing was loaded"),
    "another-layout": ((lambda: fk.AdamW(lr=0.05), "fp32", False), (lambda: fk.AdamW(lr=0.1), "fp32", True),
                       ValueError, r"the checkpoint's param groups are \['fused rule 0'\], this trainer's are "
                       r"\['unfused', 'fused rule 0'\]: it was saved by another model or optimizer; "
                       r"nothing was loaded"),
    "another-state-format": ((lambda: fk.AdamW(lr=0.05), "fp32", True), (lambda: fk.AdamW(lr=0.1), "bf16", True),
                             RuntimeError,
                             r"\(nothing was loaded\):\n\tfused layer '0' .*expected bf16 state of AdamW, found fp32 "
                             r"state of AdamW"),
}


@pytest.mark.parametrize("case", REFUSED_CHECKPOINTS)
def test_a_refused_checkpoint_changes_nothing(case, device):
    """A checkpoint the trainer cannot take is refused by name before anything is loaded:
    the model, the optimizer, the scheduler and the rules stay as they were, and training
    goes on from there (a checkpoint of AdamW loaded into an SGD trainer gave a bare
    KeyError 'betas', the SGD rule's lr changed, and every later step raised it again)."""
    (make_saved, saved_format, saved_bias), (make_rule, state_format, bias), error, message = REFUSED_CHECKPOINTS[case]
    _, saved = _trained(device, make_saved(), seed=0, state_format=saved_format, bias=saved_bias)
    model, trainer = _trained(device, make_rule(), seed=1, state_format=state_format, bias=bias)
    before = _training_state(model, trainer)
    with pytest.raises(error, match=message):
        trainer.load_state_dict(saved.state_dict())
    _assert_same_training_state(_training_state(model, trainer), before)
    trainer.step(_loss(model, device, 2))
    assert all(int(layer.forge_step) == 2 for layer in fk.fused_layers(model))


def test_a_fused_group_saved_before_it_held_every_hyperparameter_loads_and_steps(device):
    """A checkpoint whose fused group holds the lr alone (saved before groups held every
    hyperparameter: no names, the torch optimizer's defaults where add_param_group put
    them) is brought up to date by the load: the group takes the rule's other
    hyperparameters, and OneCycleLR's cycled beta1 then reaches the rule at every step
    (every step raised "'betas' was moved ... but AdamW has no betas (it has ['lr',
    'betas', ...])" before)."""
    model = _model(device)
    rule, optimizer = _build("AdamW", model, 0.1)
    trainer = fk.Trainer(model, optimizer, scheduler=_one_cycle)
    trainer.step(_loss(model, device, 0))
    saved = copy.deepcopy(trainer.state_dict())
    fused_group = saved["optimizer"]["param_groups"][1]
    for name in fused_group.pop(HELD_KEY):
        if name != "lr":
            fused_group[name] = optimizer.defaults[name]
    fused_group["weight_decay"] = 0.5  # not the rule's: the load must not take it

    resumed = _model(device, seed=1)
    resumed_rule, resumed_optimizer = _build("AdamW", resumed, 0.1)
    resumed_trainer = fk.Trainer(resumed, resumed_optimizer, scheduler=_one_cycle)
    own = resumed_rule.hyperparameters()
    # The layers' records of that time cannot be checked: vouched for, as their refusal says.
    for name, layer in resumed.named_modules():
        if isinstance(layer, fk.ForgeLinear):
            saved["model"][f"{name}._extra_state"] = layer.get_extra_state()
    resumed_trainer.load_state_dict(saved)
    group = resumed_trainer.optimizer.param_groups[1]
    assert resumed_rule.hyperparameters() == {**own, "lr": saved["optimizer"]["param_groups"][1]["lr"]}
    for step in range(1, 4):
        betas = resumed_rule.betas
        resumed_trainer.step(_loss(resumed, device, step))
        assert resumed_rule.betas == tuple(group["betas"]) != betas  # cycled, and given to the rule
        assert resumed_rule.weight_decay == own["weight_decay"]
    assert all(int(layer.forge_step) == 4 for layer in fk.fused_layers(resumed))
    assert tuple(group[HELD_KEY]) == tuple(own)


def test_reduce_lr_on_plateau_is_refused_as_scheduler_and_works_stepped_by_hand(device):
    """ReduceLROnPlateau steps on a metric the Trainer does not have: refused when built,
    before any step (it used to fail after a whole step was taken). Built on the Trainer's
    optimizer and stepped by hand, the lr it reduces reaches the fused rule at the next step."""
    model = _model(device)
    fk.fuse(model, fk.AdamW(lr=0.1))
    optimizer = torch.optim.AdamW(fk.unfused_parameters(model), lr=0.1)
    with pytest.raises(TypeError, match=r"ReduceLROnPlateau steps on a metric.*step\(metric\) yourself"):
        fk.Trainer(model, optimizer, scheduler=_plateau)
    assert all(int(layer.forge_step) == 0 for layer in fk.fused_layers(model)) and not optimizer.state

    model = _model(device)
    fk.fuse(model, fk.AdamW(lr=0.1))
    trainer = fk.Trainer(model, torch.optim.AdamW(fk.unfused_parameters(model), lr=0.1))
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(trainer.optimizer, factor=0.5, patience=0)
    for step in range(3):
        trainer.step(_loss(model, device, 0))
        plateau.step(1.0)  # no improvement after the first: the lr halves
    trainer.step(_loss(model, device, 0))
    assert trainer.rules[0].lr == 0.1 * 0.5**2
