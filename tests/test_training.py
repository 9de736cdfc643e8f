"""Trainer: fused and unfused parameters in one step, a scheduler driving the fused lr,
exact global-norm clipping, gradient accumulation, layers without tokens, checkpoints.

The reference is the standard pipeline (``forge_verify.checks.pipelines``): the fused kernel's
gradient materialized where torch keeps ``.grad``, ``clip_grad_norm_``, the oracle's
epilogue. Models are tiny: kernels run in the Triton interpreter here.
"""

import copy
import io

import pytest
import torch
from torch import nn

import forge_kernels as fk
from forge_kernels.rules.sgd import SGDMicroBatch
from forge_verify import assert_bitwise_equal
from forge_verify.checks.pipelines import StandardPipeline
from forge_verify.commands.clipping_spike import spike_study
from forge_verify.models.tiny_gpt import GPT, GPTConfig
from forge_verify.numerics.tolerances import gamma, gradient_norm_bound

CONFIG = GPTConfig(vocab_size=48, block_size=16, n_layer=1, n_head=2, n_embd=32)


def _gpt(device, seed=0):
    torch.manual_seed(seed)
    return GPT(CONFIG).to(device)


def _closures(model, device, step, micro_batches=1, scale=1.0):
    gen = torch.Generator().manual_seed(100 + step)
    closures = []
    for _ in range(micro_batches):
        idx = torch.randint(0, CONFIG.vocab_size, (2, 12), generator=gen).to(device)
        tgt = torch.randint(0, CONFIG.vocab_size, (2, 12), generator=gen).to(device)
        closures.append(lambda idx=idx, tgt=tgt: model.loss(idx, tgt) * scale)
    return closures


def _assert_same_training_state(a, b, optimizer_a, optimizer_b):
    for (name, x), (name_b, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert name == name_b
        assert_bitwise_equal(x, y, name)
    state_a, state_b = optimizer_a.state_dict()["state"], optimizer_b.state_dict()["state"]
    assert state_a.keys() == state_b.keys()
    for key in state_a:
        for slot in state_a[key]:
            assert_bitwise_equal(state_a[key][slot], state_b[key][slot], f"optimizer state {key}.{slot}")


def _pair(device, rule_factory, **fuse_kwargs):
    """The same model twice, fused with equal rules, each with its own torch AdamW."""
    models = [fk.fuse(_gpt(device), rule_factory(), **fuse_kwargs) for _ in range(2)]
    optimizers = [torch.optim.AdamW(fk.unfused_parameters(m), lr=3e-3) for m in models]
    return models, optimizers


@pytest.mark.exactness
def test_scheduler_drives_fused_and_unfused_learning_rates(device):
    """One Trainer step == a hand-written loop that sets rule.lr from the same schedule."""
    schedule = [1.0, 0.5, 0.25]
    (model, twin), (optimizer, twin_optimizer) = _pair(device, lambda: fk.AdamW(lr=1e-2))
    trainer = fk.Trainer(model, optimizer, scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(
        o, lambda s: schedule[min(s, 2)]))
    twin_scheduler = torch.optim.lr_scheduler.LambdaLR(twin_optimizer, lambda s: schedule[min(s, 2)])
    twin_rule = fk.fused_layers(twin)[0].rule
    for step in range(3):
        trainer.step(_closures(model, device, step))
        twin_rule.lr = 1e-2 * schedule[step]
        _closures(twin, device, step)[0]().backward()
        twin_optimizer.step()
        twin_optimizer.zero_grad()
        twin_scheduler.step()
    _assert_same_training_state(model, twin, optimizer, twin_optimizer)
    assert fk.fused_layers(model)[0].rule.lr == 1e-2 * schedule[2]
    assert int(fk.fused_layers(model)[0].forge_step) == 3


@pytest.mark.exactness
@pytest.mark.parametrize("max_norm", [0.05, 1e3], ids=["clips", "below-max"])
def test_exact_clipping_equals_clip_grad_norm_then_oracle_step(max_norm, device):
    (model, ref), (optimizer, ref_optimizer) = _pair(device, lambda: fk.AdamW(lr=1e-2))
    trainer = fk.Trainer(model, optimizer, max_norm=max_norm)
    pipeline = StandardPipeline(ref, ref_optimizer, max_norm=max_norm)
    for step in range(2):
        trainer.step(_closures(model, device, step))
        norm = pipeline.train_step(_closures(ref, device, step))
        assert_bitwise_equal(trainer.last_norm, norm, "total norm")
    _assert_same_training_state(model, ref, optimizer, ref_optimizer)
    assert (float(norm) > max_norm) == (max_norm == 0.05)  # each case takes the branch it names


@pytest.mark.exactness
def test_exact_clipping_rewinds_the_rng_between_its_passes(device):
    """A loss that draws from the RNG (a dropout mask over 64 ones scales it): exact
    clipping's stepping pass must draw what its measuring pass drew, so that the step
    equals the standard pipeline's one pass from the same seed (without the rewind the
    second pass draws another mask and the weights differ)."""
    (model, ref), (optimizer, ref_optimizer) = _pair(device, lambda: fk.AdamW(lr=1e-2))
    trainer = fk.Trainer(model, optimizer, max_norm=0.05)
    pipeline = StandardPipeline(ref, ref_optimizer, max_norm=0.05)

    def dropped(closures):
        ones = torch.ones(64, device=device)
        return [lambda c=c: c() * torch.nn.functional.dropout(ones, p=0.5).mean() for c in closures]
    for step in range(2):
        torch.manual_seed(7 + step)
        trainer.step(dropped(_closures(model, device, step)))
        torch.manual_seed(7 + step)
        norm = pipeline.train_step(dropped(_closures(ref, device, step)))
        assert_bitwise_equal(trainer.last_norm, norm, "total norm")
    _assert_same_training_state(model, ref, optimizer, ref_optimizer)


@pytest.mark.parametrize("clipping", fk.training.CLIPPING)
def test_tile_norms_store_no_gradient(clipping, device, monkeypatch):
    """norm="tiles": no fused layer's gradient is materialized in either clipping mode
    (the gradient kernel is made to fail), and the steps still clip."""
    model = fk.fuse(_gpt(device), fk.AdamW(lr=1e-2))
    trainer = fk.Trainer(model, torch.optim.AdamW(fk.unfused_parameters(model), lr=3e-3), max_norm=0.05,
                         clipping=clipping, norm="tiles")

    def refuse(*args, **kwargs):
        raise AssertionError("a fused layer's gradient was materialized")
    monkeypatch.setattr(fk.training, "weight_gradient", refuse)
    for step in range(2):
        trainer.step(_closures(model, device, step))
    assert float(trainer.last_norm) > 0.05  # the steps were clipped


@pytest.mark.exactness
@pytest.mark.parametrize("clipping", fk.training.CLIPPING)
def test_tile_norms_step_as_gradient_norms_where_the_factor_is_one(clipping, device):
    """Below max_norm the clip factor is 1 with either norm, so the steps are the same
    bits: the fused step (tiles) and the oracle's step from the gradient (previous-norm's
    gradient mode) agree bitwise, and nothing else differs."""
    (model, twin), (optimizer, twin_optimizer) = _pair(device, lambda: fk.AdamW(lr=1e-2))
    trainers = [fk.Trainer(model, optimizer, max_norm=1e3, clipping=clipping, norm="tiles"),
                fk.Trainer(twin, twin_optimizer, max_norm=1e3, clipping=clipping)]
    for step in range(3):
        for trainer, m in zip(trainers, (model, twin)):
            trainer.step(_closures(m, device, step))
    _assert_same_training_state(model, twin, optimizer, twin_optimizer)


@pytest.mark.exactness
def test_tile_norms_previous_norm_step_clips_by_the_previous_norm(device):
    """Previous-norm mode from the same previous norm (a resumed run's ``last_norm``, here
    one that clips by 0.05 / 2): the fused step with tile norms is bitwise the gradient
    mode's step from the materialized gradient, and unlike an unclipped step (plain SGD:
    the step is the clipped gradient itself)."""
    models, optimizers = _pair(device, lambda: fk.SGD(lr=0.1))
    unclipped = copy.deepcopy(models[0])
    trainers = [fk.Trainer(m, o, max_norm=0.05, clipping="previous-norm", norm=n)
                for m, o, n in zip(models, optimizers, fk.training.NORMS)]
    for trainer, model in zip(trainers, models):
        trainer.last_norm = torch.tensor(2.0, device=device)
        trainer.step(_closures(model, device, 0))
    _assert_same_training_state(*models, *optimizers)
    fk.Trainer(unclipped, torch.optim.AdamW(fk.unfused_parameters(unclipped), lr=3e-3)).step(
        _closures(unclipped, device, 0))
    layer = fk.fused_layers(models[0])[0].forge_name
    assert not torch.equal(models[0].state_dict()[layer + ".weight"], unclipped.state_dict()[layer + ".weight"])


@pytest.mark.parametrize("clipping", fk.training.CLIPPING)
def test_tile_norms_global_norm_is_within_the_bound_of_clip_grad_norm_s(clipping, device):
    """Clipping active: the global norm from tile norms and clip_grad_norm_'s differ by
    less than the sum of their bounds to the exact norm (proofs/gradient_norm.md: the
    tiles' bound per layer, and the same derivation for vector_norm's one sum in any
    order), plus both final norms' own roundings over the stacked per-tensor norms. In
    previous-norm mode both resume from the same previous norm (so they take the same
    step), and the tile norms are the sums the fused steps kept."""
    (model, twin), (optimizer, twin_optimizer) = _pair(device, lambda: fk.AdamW(lr=1e-2))
    tiles = fk.Trainer(model, optimizer, max_norm=0.05, clipping=clipping, norm="tiles")
    gradient = fk.Trainer(twin, twin_optimizer, max_norm=0.05, clipping=clipping)
    if clipping == "previous-norm":
        tiles.last_norm, gradient.last_norm = (torch.tensor(2.0, device=device) for _ in range(2))
    tiles.step(_closures(model, device, 0))
    gradient.step(_closures(twin, device, 0))
    configs = [layer.config or fk.PINNED for layer in tiles.layers]
    relative = max(gradient_norm_bound(1.0, *layer.weight.shape, config.block_n, config.block_k)
                   + gradient_norm_bound(1.0, *layer.weight.shape, *layer.weight.shape)
                   for layer, config in zip(tiles.layers, configs))
    stacked = sum(1 for _ in model.parameters())
    tolerance = float(gradient.last_norm) * (relative + 2 * gamma(2 * stacked + 2, 2.0**-24))
    assert abs(float(tiles.last_norm) - float(gradient.last_norm)) <= tolerance
    assert float(gradient.last_norm) > 0.05


def test_tile_norms_need_the_fused_path(device):
    model = fk.fuse(_gpt(device), fk.AdamW())
    with pytest.raises(ValueError, match="norm='tiles'"):
        fk.Trainer(model, torch.optim.AdamW(fk.unfused_parameters(model)), max_norm=1.0, gradients="materialized",
                   norm="tiles")
    with pytest.raises(ValueError, match="norm must be one of"):
        fk.Trainer(model, torch.optim.AdamW(fk.unfused_parameters(model)), max_norm=1.0, norm="tile")
    with pytest.raises(ValueError, match="without max_norm nothing clips"):
        fk.Trainer(model, torch.optim.AdamW(fk.unfused_parameters(model)), norm="tiles")


def test_clipping_mode_without_max_norm_is_refused(device):
    """clipping='previous-norm' without max_norm would clip nothing: refused with the
    CapturedStep's message (one check), as norm='tiles' is; the default mode needs no max_norm."""
    model = fk.fuse(_gpt(device), fk.AdamW())
    optimizer = torch.optim.AdamW(fk.unfused_parameters(model))
    with pytest.raises(ValueError, match="clipping='previous-norm' says how max_norm clips; without max_norm nothing "
                                         "clips: set max_norm, or leave clipping at its default"):
        fk.Trainer(model, optimizer, clipping="previous-norm")
    with pytest.raises(ValueError, match="clipping must be one of"):
        fk.Trainer(model, optimizer, clipping=None)
    assert fk.Trainer(model, optimizer, clipping="exact").max_norm is None


@pytest.mark.exactness
def test_previous_norm_clipping_scales_by_the_previous_steps_factor(device):
    """The approximate mode is exactly what it says: step 1 clipped exactly, step t by the
    factor of step t-1's global norm (clip_grads_with_norm_ with that norm, then the oracle step)."""
    (model, ref), (optimizer, ref_optimizer) = _pair(device, lambda: fk.AdamW(lr=1e-2))
    trainer = fk.Trainer(model, optimizer, max_norm=0.05, clipping="previous-norm")
    pipeline = StandardPipeline(ref, ref_optimizer, max_norm=0.05)
    previous = None
    for step in range(3):
        trainer.step(_closures(model, device, step))
        pipeline.backward(_closures(ref, device, step))
        # this step's own norm, as clip_grad_norm_ would find it
        norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters() if p.grad is not None], foreach=False)
        pipeline.clip(norm if previous is None else previous)
        pipeline.step()
        assert_bitwise_equal(trainer.last_norm, norm, "this step's norm")
        previous = norm
    _assert_same_training_state(model, ref, optimizer, ref_optimizer)


def test_previous_norm_clipping_lets_a_spike_through(device):
    """Labelled approximate for this reason: on the spike step the exact factor falls to
    about max_norm / (100 x the usual norm) while the approximate mode applies the previous
    step's factor, and the parameters leave the exact run's path."""
    rows = spike_study("AdamW", steps=3, spike_step=2, spike=100.0, device=device)
    (_, _, exact_1, approx_1, deviation_1), (_, _, exact_2, approx_2, deviation_2), _ = rows
    assert approx_1 == exact_1 and deviation_1 == 0.0  # step 1 clips exactly
    assert approx_2 == exact_1 and exact_2 < exact_1 / 50
    assert deviation_2 > 0.1


@pytest.mark.exactness
def test_materialized_accumulation_with_clipping_equals_standard_pipeline(device):
    """gradients='materialized': any rule, micro-batches summed as .grad is, clipped, then the rule."""
    (model, ref), (optimizer, ref_optimizer) = _pair(device, lambda: fk.AdamW(lr=1e-2))
    trainer = fk.Trainer(model, optimizer, max_norm=0.05, gradients="materialized")
    pipeline = StandardPipeline(ref, ref_optimizer, max_norm=0.05)
    for step in range(2):
        trainer.step(_closures(model, device, step, micro_batches=2, scale=0.5))
        norm = pipeline.train_step(_closures(ref, device, step, micro_batches=2, scale=0.5))
        assert_bitwise_equal(trainer.last_norm, norm, "total norm")
    _assert_same_training_state(model, ref, optimizer, ref_optimizer)


def _momentum_sequence(w, buf, grads, rule, step):
    """The documented split of one SGD-momentum step over micro-batch gradients, in torch
    operations rounding as the kernel does (one rounding per operation)."""
    last = len(grads) - 1
    for index, g in enumerate(grads):
        lr, weight_decay, buf_factor, grad_factor, _ = SGDMicroBatch(
            rule, first=index == 0, last=index == last).scalars(step)[:5]
        buf = buf_factor * buf + grad_factor * (g + weight_decay * w)
    return w - lr * buf, buf


@pytest.mark.exactness
def test_sgd_momentum_accumulates_into_its_buffer(device):
    rule_args = dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01)
    (model, ref), (optimizer, ref_optimizer) = _pair(device, lambda: fk.SGD(**rule_args))
    trainer = fk.Trainer(model, optimizer)
    pipeline = StandardPipeline(ref, ref_optimizer)
    for step in range(2):
        trainer.step(_closures(model, device, step, micro_batches=3))
        pipeline.backward(_closures(ref, device, step, micro_batches=3))
        for layer in pipeline.layers:
            buf = layer.forge_state["momentum_buffer"]
            with torch.no_grad():
                w, new_buf = _momentum_sequence(layer.weight, buf, pipeline.micro_batch_grads[layer], layer.rule,
                                                step + 1)
                layer.weight.copy_(w)
                buf.copy_(new_buf)
            layer.forge_step += 1
        pipeline.zero_grad()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    _assert_same_training_state(model, ref, optimizer, ref_optimizer)
    assert int(fk.fused_layers(model)[0].forge_step) == 2


def test_momentum_split_is_torch_sgd_in_exact_arithmetic():
    """In float64 the split sequence and torch.optim.SGD on the summed gradient agree to
    float64 rounding: the split changes the order of additions, not the step."""
    gen = torch.Generator().manual_seed(3)
    rule = fk.SGD(lr=0.125, momentum=0.875, dampening=0.25, weight_decay=0.0625)  # exact in binary
    w = torch.randn(16, 8, generator=gen, dtype=torch.float64)
    param = nn.Parameter(w.clone())
    optimizer = torch.optim.SGD([param], lr=0.125, momentum=0.875, dampening=0.25, weight_decay=0.0625)
    buf = torch.zeros_like(w)
    for step in (1, 2, 3):
        grads = [torch.randn(16, 8, generator=gen, dtype=torch.float64) for _ in range(3)]
        w, buf = _momentum_sequence(w, buf, grads, rule, step)
        param.grad = sum(grads)
        optimizer.step()
    # |w| and the summed terms are O(1); a few dozen float64 roundings stay below 1e-14.
    assert float((w - param.detach()).abs().max()) < 1e-14
    assert float((buf - optimizer.state[param]["momentum_buffer"]).abs().max()) < 1e-14


@pytest.mark.parametrize("rule", [fk.AdamW(), fk.SGD(lr=0.1, momentum=0.9, nesterov=True), fk.SGD(lr=0.1)],
                         ids=repr)
def test_accumulation_without_a_state_to_add_into_is_refused(rule, device):
    model = fk.fuse(_gpt(device), rule)
    trainer = fk.Trainer(model, torch.optim.AdamW(fk.unfused_parameters(model)))
    weights = [layer.weight.detach().clone() for layer in fk.fused_layers(model)]
    with pytest.raises(ValueError, match="gradients='materialized'"):
        trainer.step(_closures(model, device, 0, micro_batches=2))
    for layer, before in zip(fk.fused_layers(model), weights):
        assert torch.equal(layer.weight, before)


def test_clipping_with_fused_accumulation_is_refused(device):
    model = fk.fuse(_gpt(device), fk.SGD(lr=0.1, momentum=0.9))
    trainer = fk.Trainer(model, torch.optim.AdamW(fk.unfused_parameters(model)), max_norm=1.0)
    weights = [layer.weight.detach().clone() for layer in fk.fused_layers(model)]
    with pytest.raises(ValueError, match="no clipping"):
        trainer.step(_closures(model, device, 0, micro_batches=2))
    for layer, before in zip(fk.fused_layers(model), weights):  # nothing stepped
        assert torch.equal(layer.weight, before) and int(layer.forge_step) == 0


@pytest.mark.parametrize("gradients, norm", [("fused", "gradient"), ("materialized", "gradient"), ("fused", "tiles")])
@pytest.mark.parametrize("scale", [float("inf"), 1e38], ids=["inf-loss", "norm-overflows"])
def test_non_finite_gradient_norm_steps_nothing(scale, gradients, norm, device):
    """A NaN/inf gradient, or a finite one whose norm overflows, is found before any step;
    an infinite loss makes the fused layers' operands non-finite, which is named as such."""
    model = fk.fuse(_gpt(device), fk.AdamW())
    trainer = fk.Trainer(model, torch.optim.AdamW(fk.unfused_parameters(model)), max_norm=1.0, gradients=gradients,
                         norm=norm)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(FloatingPointError, match="nothing was") as raised:
        trainer.step(_closures(model, device, 0, scale=scale))
    if scale == float("inf") and gradients == "fused":
        assert isinstance(raised.value, fk.NonFiniteInputError)
    for name, value in model.state_dict().items():
        assert_bitwise_equal(value, before[name], name)
    assert all(p.grad is None for p in model.parameters())


def test_previous_norm_says_the_fused_layers_stepped_when_the_norm_is_not_finite(device):
    """Approximate clipping steps the fused layers before the norm is known: when only an
    unfused gradient is non-finite, the error says they stepped and the torch optimizer
    did not, and their step counts show it."""
    model = fk.fuse(_gpt(device), fk.AdamW())
    unfused = fk.unfused_parameters(model)
    trainer = fk.Trainer(model, torch.optim.AdamW(unfused), max_norm=1.0, clipping="previous-norm")
    trainer.step(_closures(model, device, 0))  # step 1 clips exactly; the approximate mode starts at 2
    unfused[0].register_hook(lambda grad: torch.full_like(grad, float("inf")))
    before = unfused[0].detach().clone()
    with pytest.raises(FloatingPointError, match="the fused layers have stepped"):
        trainer.step(_closures(model, device, 1))
    assert all(int(layer.forge_step) == 2 for layer in fk.fused_layers(model))
    assert_bitwise_equal(unfused[0].detach(), before, "unfused parameter")


class _TwoExperts(nn.Module):
    """Each token goes to the expert ``choice`` names; an expert with no tokens is either
    not called or called on an empty batch."""

    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(8, 8, bias=False) for _ in range(2))

    def forward(self, x, choice, call_empty):
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero().flatten()
            if call_empty or rows.numel():
                out = out.index_add(0, rows, expert(x[rows]))
        return out


@pytest.mark.parametrize("call_empty", [False, True], ids=["not-called", "called-on-no-tokens"])
def test_expert_without_tokens_does_what_torch_optim_does(call_empty, device):
    """Not called: no gradient, so no step (state and step count untouched), as torch.optim
    skips grad=None. Called on zero tokens: autograd's gradient is zero, so the expert
    steps with a zero gradient (decay and moments act), as torch.optim does."""
    torch.manual_seed(0)
    plain = _TwoExperts().to(device)
    fused = fk.fuse(copy.deepcopy(plain), fk.AdamW(lr=1e-2, weight_decay=0.1))
    x, choice = torch.randn(6, 8, device=device), torch.zeros(6, dtype=torch.int64, device=device)
    idle = fused.experts[1]
    expected_weight, expected_state = idle.weight.detach().clone(), copy.deepcopy(idle.forge_state)
    if call_empty:
        fk.apply_rule(torch.zeros_like(expected_weight), expected_weight, expected_state, idle.rule, 1,
                      seed=int(idle.forge_seed))
    fk.Trainer(fused).step(lambda: fused(x, choice, call_empty).square().sum())
    assert_bitwise_equal(idle.weight.detach(), expected_weight, "idle expert weight")
    for slot, value in expected_state.items():
        assert_bitwise_equal(idle.forge_state[slot], value, slot)
    assert int(idle.forge_step) == int(call_empty) and int(fused.experts[0].forge_step) == 1

    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1)
    plain(x, choice, call_empty).square().sum().backward()
    optimizer.step()
    assert (plain.experts[1].weight in optimizer.state) == call_empty


@pytest.mark.exactness
@pytest.mark.parametrize("state_format", ["fp32", "bf16", "q8"])
def test_trainer_checkpoint_resumes_the_identical_next_step(state_format, device):
    """Trainer.state_dict() (model with fused state, torch optimizer, scheduler) survives
    torch.save/load bit for bit, and the resumed trainer's next step equals the running one's."""

    def build(seed):
        model = fk.fuse(_gpt(device, seed), fk.AdamW(lr=1e-2), state_format=state_format, seed=7)
        return fk.Trainer(model, torch.optim.AdamW(fk.unfused_parameters(model), lr=3e-3), max_norm=0.05,
                          scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5))

    running = build(0)
    for step in range(2):
        running.step(_closures(running.model, device, step))
    buffer = io.BytesIO()
    torch.save(running.state_dict(), buffer)
    buffer.seek(0)
    resumed = build(1)  # other initial weights: everything must come from the checkpoint
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    _assert_same_training_state(resumed.model, running.model, resumed.optimizer, running.optimizer)
    assert resumed.scheduler.state_dict() == running.scheduler.state_dict()
    assert fk.fused_layers(resumed.model)[0].rule.lr == fk.fused_layers(running.model)[0].rule.lr == 1e-2 / 4
    for trainer in (running, resumed):
        trainer.step(_closures(trainer.model, device, 2))
    _assert_same_training_state(resumed.model, running.model, resumed.optimizer, running.optimizer)


def test_trainer_refuses_parameters_nothing_would_step(device):
    model = fk.fuse(_gpt(device), fk.AdamW())
    with pytest.raises(ValueError, match="nothing would step"):
        fk.Trainer(model, torch.optim.AdamW(model.ln_f.parameters()))
    with pytest.raises(ValueError, match="holds fused weights"):
        fk.Trainer(model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(ValueError, match="outside its fused layers"):
        fk.Trainer(model)
    scheduler = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(model.ln_f.parameters()), 1)
    with pytest.raises(TypeError, match="built after the trainer"):
        fk.Trainer(model, torch.optim.AdamW(fk.unfused_parameters(model)), scheduler=scheduler)


def test_fuse_exclude_leaves_a_subtree_unfused_and_refuses_unknown_names(device):
    model = fk.fuse(_gpt(device), fk.AdamW(), exclude=["blocks.0.attn"])
    assert type(model.blocks[0].attn.qkv) is nn.Linear and isinstance(model.blocks[0].fc, fk.ForgeLinear)
    with pytest.raises(ValueError, match="does not have"):
        fk.fuse(_gpt(device), fk.AdamW(), exclude=["blocks.9"])
