"""CapturedStep with the torch optimizer handed to it and global-norm clipping
(``max_norm``, ``clipping="previous-norm"``): bitwise ``fk.Trainer`` with the same
clipping at every step (weights, fused and torch optimizer state, step counts, losses,
norms), on steps that clip and steps that do not; a non-finite norm or fused step skips
the torch optimizer on the device and stops the capture where the Trainer raises,
leaving the same state; what a capture cannot do is refused, on the CPU too."""

import copy

import pytest
import torch
from torch import nn

import forge_kernels as fk
from forge_verify import assert_bitwise_equal

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
# Both sides run a capturable torch optimizer uncaptured: the Trainer always, the CapturedStep in its warm-up.
uncaptured_capturable = pytest.mark.filterwarnings("ignore:This instance was constructed with capturable=True")
REGIMES = {"fp32": (torch.float32, "fp32"), "bf16": (torch.bfloat16, "bf16"), "q8": (torch.bfloat16, "q8")}
CONFIG = fk.TileConfig(block_n=32, block_k=32, block_t=32)
# The tuned fp32 tile of the H200 benchmarks: the Hopper split kernel in row parts.
HOPPER = fk.TileConfig(128, 128, 64, 8, 3, epilogue_split=8, kernel="hopper", epilogue_axis="rows")
on_hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                               reason="the hopper kernel runs on compute capability 9.x GPUs only")
MAX_NORM = 0.25
# The loss scale of each step: the global norm goes above MAX_NORM on the scaled steps and
# stays below it on the others (about 0.2-0.3 unscaled, 0.5-0.7 scaled, on the CPU).
SCALES = (1.0, 1.0, 4.0, 1.0, 4.0, 1.0, 1.0)


def _base(device, dtype):
    """An MLP with unfused parameters (biases, a LayerNorm) beside its two fused weights."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(48, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 40)).to(device, dtype)


def _pair(regime, config=CONFIG):
    """The same fused model twice, each with its own fused, capturable torch AdamW."""
    dtype, state_format = REGIMES[regime]
    base = _base("cuda", dtype)
    models = [fk.fuse(copy.deepcopy(base), fk.AdamW(lr=1e-2, weight_decay=0.1), state_format=state_format,
                      config=config, seed=7, report="defer") for _ in range(2)]
    optimizers = [torch.optim.AdamW(fk.unfused_parameters(m), lr=3e-3, fused=True, capturable=True) for m in models]
    return models, optimizers


def _loss(model, x, scale):
    return model(x).float().square().mean() * scale


def _captured(model, optimizer, static_x, static_scale, **kwargs):
    def step_fn():  # forward and backward only: the CapturedStep steps the optimizer
        loss = _loss(model, static_x, static_scale)
        loss.backward()
        return loss
    return fk.CapturedStep(model, step_fn, optimizer=optimizer, **kwargs)


def _assert_same_training_state(a, b, optimizer_a, optimizer_b, where):
    for (name, x), (name_b, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert name == name_b
        assert_bitwise_equal(x, y, f"{where}: {name}")
    state_a, state_b = optimizer_a.state_dict()["state"], optimizer_b.state_dict()["state"]
    assert state_a.keys() == state_b.keys()
    for key in state_a:
        for slot in state_a[key]:
            assert_bitwise_equal(state_a[key][slot], state_b[key][slot], f"{where}: optimizer state {key}.{slot}")


def _batches(dtype):
    gen = torch.Generator(device="cpu").manual_seed(1)
    while True:
        yield torch.randn(24, 48, generator=gen).to("cuda", dtype)


@needs_cuda
@uncaptured_capturable
@pytest.mark.exactness
@pytest.mark.parametrize("regime, max_norm, norm, config", [
    *[pytest.param(regime, max_norm, norm, CONFIG, id=f"{regime}-{name}") for regime in sorted(REGIMES)
      for name, max_norm, norm in [("previous-norm", MAX_NORM, "gradient"), ("previous-norm-tiles", MAX_NORM, "tiles"),
                                   ("no-clipping", None, "gradient")]],
    # The Hopper kernel takes bf16 activations and fp32 or bf16 state (the others run portable).
    pytest.param("bf16", MAX_NORM, "tiles", HOPPER, id="bf16-previous-norm-tiles-hopper", marks=on_hopper)])
@pytest.mark.parametrize("check", ["every step", "lagged"])
def test_captured_steps_are_bitwise_the_trainers(regime, max_norm, norm, config, check):
    """Step 1 (exact, two passes, eager), one warm-up step, the capture and four replays:
    after each, the loss, the global norm, every weight, fused state slot and step count,
    and the torch optimizer's state equal those of fk.Trainer with the same clipping and
    the same fused norms (from the gradients, or from the tile loops). The captured steps
    include steps scaled by the previous norm's factor and steps not. The Hopper case
    steps through that kernel, its clip factor a device tensor inside the graph. With
    check="lagged" the steps scale by 1.0 or the clip factor where no earlier step was
    bad, which changes no bit."""
    (eager, graphed), (eager_optimizer, graphed_optimizer) = _pair(regime, config)
    clipping = None if max_norm is None else "previous-norm"
    trainer = fk.Trainer(eager, eager_optimizer, max_norm=max_norm, clipping=clipping or "exact", norm=norm)
    dtype = REGIMES[regime][0]
    static_x, static_scale = torch.empty(24, 48, device="cuda", dtype=dtype), torch.ones((), device="cuda")
    step = _captured(graphed, graphed_optimizer, static_x, static_scale, max_norm=max_norm, clipping=clipping,
                     norm=norm, check=check)
    norms = []
    for index, (x, scale) in enumerate(zip(_batches(dtype), SCALES)):
        static_x.copy_(x)
        static_scale.fill_(scale)
        loss = step()
        [eager_loss] = trainer.step(lambda: _loss(eager, x, static_scale))
        where = f"step {index + 1}"
        assert_bitwise_equal(loss, eager_loss, f"{where}: loss")
        _assert_same_training_state(graphed, eager, graphed_optimizer, eager_optimizer, where)
        if max_norm is None:
            assert step.last_norm is None and trainer.last_norm is None
        else:
            assert_bitwise_equal(step.last_norm, trainer.last_norm, f"{where}: global norm")
            norms.append(float(trainer.last_norm))
    assert step.graph is not None and int(graphed[0].forge_step) == len(SCALES)
    if max_norm is not None:
        # Steps 3..7 were captured; each was scaled by the factor of the norm before it.
        clipped = [norm > MAX_NORM for norm in norms[1:-1]]
        assert any(clipped) and not all(clipped), norms
    step.release()
    assert all(p.grad is None for p in graphed.parameters())


@needs_cuda
@uncaptured_capturable
@pytest.mark.parametrize("norm", fk.training.NORMS)
@pytest.mark.parametrize("poison", ["unfused gradient", "input", "fused state"])
@pytest.mark.parametrize("check", ["every step", "lagged"])
def test_a_non_finite_replay_skips_the_optimizer_and_stops_where_the_trainer_raises(poison, norm, check):
    """On the fifth step (a replay), an unfused gradient made infinite (the global norm is
    not finite; the fused layers have stepped), a NaN input (the fused layers write
    nothing), or an infinite first moment in one fused weight's state (its tile is not
    finite and is skipped, while the norm is finite: the step's own verdict alone skips
    the optimizer): the CapturedStep raises the Trainer's error and stops; the torch
    optimizer was skipped on the device; weights, states, step counts and the last finite
    norm are the Trainer's, bitwise, and no gradient is left. With check="lagged" the
    poisoned call returns and the next one (a sixth step, halted on the device: nothing
    written, the optimizer skipped) raises the fifth step's error."""
    (eager, graphed), (eager_optimizer, graphed_optimizer) = _pair("fp32")
    factor = torch.ones((), device="cuda")  # 1, or inf on the poisoned step: read in the graph too
    for model in (eager, graphed):
        model[1].weight.register_hook(lambda grad: grad * factor)  # the LayerNorm's weight: unfused
    trainer = fk.Trainer(eager, eager_optimizer, max_norm=MAX_NORM, clipping="previous-norm", norm=norm)
    static_x, static_scale = torch.empty(24, 48, device="cuda"), torch.ones((), device="cuda")
    step = _captured(graphed, graphed_optimizer, static_x, static_scale, max_norm=MAX_NORM, clipping="previous-norm",
                     norm=norm, check=check)
    error, message = {"unfused gradient": (FloatingPointError, "the fused layers have stepped"),
                      "input": (fk.NonFiniteInputError, "non-finite"),
                      "fused state": (fk.NonFiniteUpdateError, "non-finite")}[poison]
    for index, x in zip(range(5), _batches(torch.float32)):
        poisoned = index == 4
        if poisoned and poison == "input":
            x[3, 5] = float("nan")
        elif poisoned and poison == "fused state":
            for model in (eager, graphed):  # read in place by the replay as by the eager step
                fk.fused_layers(model)[0].forge_state["exp_avg"][2, 3] = float("inf")
        elif poisoned:
            factor.fill_(float("inf"))
        static_x.copy_(x)
        if poisoned:
            if check == "lagged":
                step()  # read during the next call, which launches a halted sixth step first
                static_x.copy_(next(iter(_batches(torch.float32))))
            with pytest.raises(error, match=message) as raised:
                step()
            assert "step 5 (CapturedStep)" in str(raised.value) and "capture is stopped" in str(raised.value)
            with pytest.raises(error, match=message):
                trainer.step(lambda: _loss(eager, x, static_scale))
            if poison == "fused state":  # a checkpoint (the state compared) refuses mixed-step tiles unaccepted
                for model in (graphed, eager):
                    fk.fused_layers(model)[0].forge_accept_partial_step()
        else:
            step()
            trainer.step(lambda: _loss(eager, x, static_scale))
        _assert_same_training_state(graphed, eager, graphed_optimizer, eager_optimizer, f"step {index + 1}")
        assert_bitwise_equal(step.last_norm, trainer.last_norm, f"step {index + 1}: last finite norm")
    assert not step.active
    stepped = 4 if poison == "input" else 5  # a layer with skipped tiles stops at the step it took
    assert [int(layer.forge_step) for layer in fk.fused_layers(graphed)] == [stepped, stepped]
    assert all(p.grad is None for model in (graphed, eager) for p in model.parameters())


@needs_cuda
@uncaptured_capturable
def test_tile_norms_store_no_gradient_in_any_step(monkeypatch):
    """norm="tiles": neither the exact first step, the warm-up, the capture nor a replay
    materializes a fused layer's gradient or steps one from a gradient (both are made to
    fail), and the captured steps still clip."""
    (_, graphed), (_, optimizer) = _pair("fp32")

    def refuse(*args, **kwargs):
        raise AssertionError("a fused layer's gradient was materialized")
    # Every way to a fused layer's gradient: the Trainer's and the capture's helper, the
    # kernel launch under them (and under an oracle step), and a step from a gradient.
    monkeypatch.setattr(fk.training, "weight_gradient", refuse)
    monkeypatch.setattr(fk.capture, "_layer_gradient", refuse)
    monkeypatch.setattr(fk.ops.fused_weight_update, "launch_weight_gradient", refuse)
    monkeypatch.setattr(fk.capture, "apply_rule", refuse)
    static_x, static_scale = torch.empty(24, 48, device="cuda"), torch.ones((), device="cuda")
    step = _captured(graphed, optimizer, static_x, static_scale, max_norm=MAX_NORM, clipping="previous-norm",
                     norm="tiles")
    norms = []
    for x, scale in zip(_batches(torch.float32), SCALES):
        static_x.copy_(x)
        static_scale.fill_(scale)
        step()
        norms.append(float(step.last_norm))
    assert step.graph is not None and any(norm > MAX_NORM for norm in norms[1:-1]), norms
    step.release()


@needs_cuda
@uncaptured_capturable
@pytest.mark.parametrize("norm", fk.training.NORMS)
def test_a_non_finite_norm_in_the_exact_first_step_steps_nothing(norm):
    """The first step clips exactly, as the Trainer's: a non-finite norm is found before any
    step, and the layers are released where they were."""
    (_, graphed), (_, optimizer) = _pair("fp32")
    graphed[1].weight.register_hook(lambda grad: torch.full_like(grad, float("inf")))
    before = {k: v.clone() for k, v in graphed.state_dict().items()}
    static_x, static_scale = torch.empty(24, 48, device="cuda"), torch.ones((), device="cuda")
    step = _captured(graphed, optimizer, static_x, static_scale, max_norm=MAX_NORM, clipping="previous-norm",
                     norm=norm)
    static_x.copy_(next(_batches(torch.float32)))
    with pytest.raises(FloatingPointError, match="nothing was stepped"):
        step()
    assert not step.active and step.last_norm is None
    for name, value in graphed.state_dict().items():
        assert_bitwise_equal(value, before[name], name)
    assert not optimizer.state and all(p.grad is None for p in graphed.parameters())


def test_clipping_under_capture_refuses_what_it_cannot_do(device):
    """Every refusal comes before anything is held or run (the CPU reaches them all; it
    is refused for want of CUDA graphs only after them)."""
    model = fk.fuse(_base(device, torch.float32), fk.AdamW(), config=CONFIG)
    unfused = fk.unfused_parameters(model)

    def capture(optimizer="fused", **kwargs):
        if optimizer == "fused":
            optimizer = torch.optim.AdamW(unfused, fused=True, capturable=True)
        return fk.CapturedStep(model, lambda: None, optimizer=optimizer, **kwargs)

    for max_norm in (0, -1.0, float("inf"), float("nan"), "1.0"):
        with pytest.raises(ValueError, match="max_norm must be a finite number > 0"):
            capture(max_norm=max_norm, clipping="previous-norm")
    with pytest.raises(ValueError, match="clipping must be one of"):
        capture(max_norm=1.0, clipping="global")
    with pytest.raises(ValueError, match=r"clipping='exact' cannot be captured.*twice.*previous-norm.*fk\.Trainer"):
        capture(max_norm=1.0, clipping="exact")
    with pytest.raises(ValueError, match="APPROXIMATE.*pass clipping='previous-norm'"):
        capture(max_norm=1.0)
    with pytest.raises(ValueError, match="parameters outside its fused layers"):
        capture(optimizer=None, max_norm=1.0, clipping="previous-norm")
    with pytest.raises(ValueError, match="fused optimizers.*AdamW without fused=True"):
        capture(optimizer=torch.optim.AdamW(unfused))
    with pytest.raises(ValueError, match="capturable=False.*make it with capturable=True"):
        capture(optimizer=torch.optim.AdamW(unfused, fused=True))
    with pytest.raises(ValueError, match="clipping='previous-norm' says how max_norm clips; without max_norm"):
        capture(clipping="previous-norm")
    with pytest.raises(ValueError, match="norm must be one of"):
        capture(max_norm=1.0, clipping="previous-norm", norm="materialized")
    with pytest.raises(ValueError, match="norm='tiles'.*without max_norm nothing clips"):
        capture(norm="tiles")
    with pytest.raises(ValueError, match="last_norm= .* needs max_norm"):
        capture(last_norm=torch.tensor(0.5))
    for last_norm in (0.5, torch.tensor([0.5, 0.5]), torch.tensor(1)):
        with pytest.raises(TypeError, match="last_norm must be the one-element tensor"):
            capture(max_norm=1.0, clipping="previous-norm", last_norm=last_norm)
    for last_norm in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match="last_norm must be a finite norm >= 0"):
            capture(max_norm=1.0, clipping="previous-norm", last_norm=torch.tensor(last_norm))
    with pytest.raises(TypeError, match="must be a torch.optim.Optimizer"):
        capture(optimizer=object())
    with pytest.raises(ValueError, match="holds fused weights"):
        capture(optimizer=torch.optim.AdamW(model.parameters(), fused=True, capturable=True), max_norm=1.0,
                clipping="previous-norm")
    with pytest.raises(ValueError, match=r"nothing would step: \['1.weight', '1.bias', '3.bias'\]"):
        capture(optimizer=torch.optim.AdamW(unfused[:1], fused=True, capturable=True), max_norm=1.0,
                clipping="previous-norm")
    if device == "cpu":
        with pytest.raises(RuntimeError, match="one CUDA device"):
            capture(max_norm=1.0, clipping="previous-norm")
    assert all(layer.forge_owner is None and layer.forge_backward is None for layer in fk.fused_layers(model))
