"""The non-finite checks without host synchronization: the device-side input check,
``report="defer"`` on the launchers (an ``UpdateReport`` checked later), ForgeLinear's
deferred mode and host copies of its step and seed, and the Trainer's one check per
step. Each deferred path must keep the eager path's guarantees: a non-finite input
writes nothing, an overflowing tile is left unchanged and named, a clean step gives
the eager step's bits."""

import copy
import sys
import warnings

import pytest
import torch
from torch import nn

import forge_kernels as fk
from forge_kernels.ops.finite_check import BAD_TILES, STATUS_WORDS, launch_finite_check
from forge_verify import assert_bitwise_equal

def _problem(device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(20, 12, generator=gen).to(device)
    dy = torch.randn(20, 10, generator=gen).to(device)
    w = torch.randn(10, 12, generator=gen).to(device)
    rule = fk.AdamW(lr=1e-2)
    return x, dy, w, rule.init_state(w), rule


def _copy(w, state):
    return w.clone(), {k: v.clone() for k, v in state.items()}


def _assert_same(w, state, w_ref, state_ref):
    assert_bitwise_equal(w, w_ref, "weight")
    for key in state:
        assert_bitwise_equal(state[key], state_ref[key], key)


def _overflow_problem(device):
    """One tile (rows 0:16, columns 16:32 with 16x16 tiles) whose gradient overflows."""
    x = torch.ones(4, 40, device=device)
    dy = torch.ones(4, 40, device=device)
    x[:, 20] = 1e20
    dy[:, 5] = 1e20
    w = torch.ones(40, 40, device=device)
    rule = fk.SGD(lr=1e-2, momentum=0.9)
    return x, dy, w, rule.init_state(w), rule, fk.TileConfig(block_n=16, block_k=16, block_t=16)


# --- the device-side input check ---------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_finite_check_counts_every_non_finite_element_at_any_strides(device, dtype):
    """Counts equal torch's, for a contiguous and a transposed input whose bad elements
    sit on tile edges and corners (the check's tiles are 32 x 128)."""
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(70, 300, generator=gen).to(device, dtype)
    b = torch.randn(260, 33, generator=gen).to(device, dtype).t()  # (33, 260), strides (1, 33)
    status = torch.zeros(STATUS_WORDS, dtype=torch.int32, device=device)
    launch_finite_check(status, a, b)
    assert status.tolist() == [0, 0, 0]
    for r, c, v in [(0, 0, "nan"), (31, 127, "inf"), (32, 128, "-inf"), (69, 299, "nan"), (64, 256, "inf")]:
        a[r, c] = float(v)
    for r, c, v in [(32, 259, "-inf"), (0, 128, "nan")]:
        b[r, c] = float(v)
    status.zero_()
    launch_finite_check(status, a, b)
    assert status.tolist() == [int((~torch.isfinite(a)).sum()), int((~torch.isfinite(b)).sum()), 0] == [5, 2, 0]
    status.zero_()
    launch_finite_check(status, b)
    assert status.tolist() == [2, 0, 0]


def test_finite_check_of_empty_inputs_launches_nothing(device):
    status = torch.zeros(STATUS_WORDS, dtype=torch.int32, device=device)
    launch_finite_check(status, torch.empty(0, 5, device=device), torch.empty(0, 3, device=device))
    assert status.tolist() == [0, 0, 0]


# --- report="defer" on the launchers -------------------------------------------------

@pytest.mark.parametrize("oracle", [False, True])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", ["x", "dy"])
def test_deferred_non_finite_input_writes_nothing(device, where, value, oracle):
    """One bad element spoils one column (x) or row (dY) of dW, so with 16 x 16 tiles most
    tiles' own values are finite: they are held back by the input check alone."""
    config = fk.TileConfig(block_n=16, block_k=16, block_t=16)
    gen = torch.Generator().manual_seed(0)
    x, dy, w = (torch.randn(shape, generator=gen).to(device) for shape in [(20, 40), (20, 40), (40, 40)])
    rule = fk.AdamW(lr=1e-2)
    state = rule.init_state(w)
    (x if where == "x" else dy)[3, 4] = value
    before = _copy(w, state)
    report = fk.fused_weight_update(x, dy, w, state, rule, 1, oracle=oracle, config=config, report="defer")
    assert isinstance(report, fk.UpdateReport)
    if not w.is_cuda:  # on a GPU the status copy may still be in flight here
        assert report.done()
    _assert_same(w, state, *before)  # written nothing, before anyone looked
    expected = "x: 1, dy: 0" if where == "x" else "x: 0, dy: 1"
    for _ in range(2):  # checking again raises again
        with pytest.raises(fk.NonFiniteInputError, match=f"elements in {expected}; nothing was updated"):
            report.check()
    assert report.done()  # checked: the copy has landed, on a GPU too
    assert int(report.status[BAD_TILES]) == 0  # the held-back tiles are not counted as overflow tiles
    _assert_same(w, state, *before)


@pytest.mark.parametrize("oracle", [False, True])
def test_deferred_clean_step_is_the_eager_step(device, oracle):
    x, dy, w, state, rule = _problem(device)
    w_eager, state_eager = _copy(w, state)
    for step in (1, 2):
        assert fk.fused_weight_update(x, dy, w_eager, state_eager, rule, step, oracle=oracle) is None
        report = fk.fused_weight_update(x, dy, w, state, rule, step, oracle=oracle, report="defer")
        assert report.check() is None
    _assert_same(w, state, w_eager, state_eager)


# The interpreter's numpy reports the overflow these tests provoke on purpose.
@pytest.mark.parametrize("oracle", [False, True])
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_deferred_overflowing_tile_names_the_eager_tiles(device, oracle):
    x, dy, w, state, rule, config = _overflow_problem(device)
    w_eager, state_eager = _copy(w, state)
    with pytest.raises(fk.NonFiniteUpdateError) as eager:
        fk.fused_weight_update(x, dy, w_eager, state_eager, rule, 1, config=config, oracle=oracle)
    report = fk.fused_weight_update(x, dy, w, state, rule, 1, config=config, oracle=oracle, report="defer")
    with pytest.raises(fk.NonFiniteUpdateError) as deferred:
        report.check()
    assert deferred.value.tiles == eager.value.tiles == [(0, 16, 16, 32)]
    assert str(deferred.value) == str(eager.value)
    assert int(report.status[BAD_TILES]) == 1
    _assert_same(w, state, w_eager, state_eager)
    assert torch.all(w[0:16, 16:32] == 1) and not torch.all(w == 1)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_error_from_read_words_is_the_checks_error_with_tiles_counted(device):
    """``error_from`` (what a lagged CapturedStep raises from a replay's words read before a
    later replay reused them): check()'s input error as is; the tile error counting the
    tiles it can no longer name; None for a clean update."""
    x, dy, w, state, rule, config = _overflow_problem(device)
    report = fk.fused_weight_update(x, dy, w, state, rule, 1, config=config, report="defer")
    error = report.error_from([int(word) for word in report.status.tolist()])
    assert isinstance(error, fk.NonFiniteUpdateError) and error.tiles == []
    assert str(error).startswith("1 of 9 weight tiles had a non-finite gradient") and "not named" in str(error)
    x[0, 0] = float("nan")
    report = fk.fused_weight_update(x, dy, w, state, rule, 2, config=config, report="defer")
    with pytest.raises(fk.NonFiniteInputError) as checked:
        report.check()
    error = report.error_from([int(word) for word in report.status.tolist()])
    assert isinstance(error, fk.NonFiniteInputError) and str(error) == str(checked.value)
    x, dy, w, state, rule = _problem(device)
    report = fk.fused_weight_update(x, dy, w, state, rule, 1, report="defer")
    assert report.error_from([int(word) for word in report.status.tolist()]) is None


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("report", ["raise", "defer"])
def test_non_finite_input_wins_over_overflowing_tiles(device, report):
    """An input NaN together with a tile that would overflow: nothing is written at all
    (not even the tiles that would have stepped) and the error is the input's."""
    x, dy, w, state, rule, config = _overflow_problem(device)
    x[0, 0] = float("nan")
    before = _copy(w, state)
    with pytest.raises(fk.NonFiniteInputError, match="nothing was updated"):
        outcome = fk.fused_weight_update(x, dy, w, state, rule, 1, config=config, report=report)
        outcome.check()
    _assert_same(w, state, *before)


def test_deferred_apply_rule_refuses_a_non_finite_gradient(device):
    _, _, w, state, rule = _problem(device)
    grad = torch.randn_like(w)
    grad[7, 2] = float("inf")
    before = _copy(w, state)
    report = fk.apply_rule(grad, w, state, rule, 1, report="defer")
    with pytest.raises(fk.NonFiniteInputError, match="NaN or infinite elements in grad: 1; nothing was updated"):
        report.check()
    _assert_same(w, state, *before)
    grad[7, 2] = 0.5
    w_eager, state_eager = _copy(w, state)
    fk.apply_rule(grad, w_eager, state_eager, rule, 1)
    fk.apply_rule(grad, w, state, rule, 1, report="defer").check()
    _assert_same(w, state, w_eager, state_eager)


def test_bad_report_mode_is_refused(device):
    x, dy, w, state, rule = _problem(device)
    with pytest.raises(ValueError, match="report must be one of"):
        fk.fused_weight_update(x, dy, w, state, rule, 1, report="later")
    with pytest.raises(ValueError, match="report must be one of"):
        fk.fuse(nn.Sequential(nn.Linear(3, 3)), fk.SGD(), report=True)


# --- ForgeLinear ---------------------------------------------------------------------

def _mlp(device, **fuse_kwargs):
    torch.manual_seed(0)
    return fk.fuse(nn.Sequential(nn.Linear(12, 24), nn.GELU(), nn.Linear(24, 8, bias=False)).to(device),
                   fk.AdamW(lr=1e-2), **fuse_kwargs)


def _batch(device, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(9, 12, generator=gen).to(device), torch.randn(9, 8, generator=gen).to(device)


def _backward(model, x, target):
    (model(x) - target).square().mean().backward()


def test_deferred_layers_train_like_eager_ones(device):
    eager, deferred = _mlp(device), _mlp(device, report="defer")
    for seed in range(3):
        _backward(eager, *_batch(device, seed))
        _backward(deferred, *_batch(device, seed))
    fk.check_updates(deferred)
    for (name, a), (_, b) in zip(eager.state_dict().items(), deferred.state_dict().items(), strict=True):
        assert_bitwise_equal(a, b, name)
    assert int(deferred[0].forge_step) == 3


def test_a_checkpoint_holds_checked_steps_only(device):
    model = _mlp(device, report="defer")
    _backward(model, *_batch(device, 0))
    assert int(model[0].forge_step) == 0  # taken, not yet checked
    assert model.state_dict()["0.forge_step"] == 1  # state_dict checked it first
    assert int(model[0].forge_step) == 1 and model[0]._unchecked is None


def test_a_copied_layer_holds_checked_steps_only(device):
    model = _mlp(device, report="defer")
    _backward(model, *_batch(device, 0))
    twin = copy.deepcopy(model)
    assert int(twin[0].forge_step) == int(model[0].forge_step) == 1 and twin[0]._unchecked is None


def test_deferred_non_finite_input_surfaces_at_check_updates_and_counts_no_step(device):
    model, twin = _mlp(device, report="defer"), _mlp(device)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, target = _batch(device, 0)
    x[2, 3] = float("nan")
    _backward(model, x, target)  # no error yet: nothing was read back
    with pytest.raises(fk.NonFiniteInputError, match="nothing was updated"):
        fk.check_updates(model)
    for name, value in model.state_dict().items():
        assert_bitwise_equal(value, before[name], name)
    # The failed step did not happen: the next one is step 1, as for a model that never saw it.
    _backward(model, *_batch(device, 1))
    _backward(twin, *_batch(device, 1))
    fk.check_updates(model)
    for (name, a), (_, b) in zip(model.state_dict().items(), twin.state_dict().items(), strict=True):
        assert_bitwise_equal(a, b, name)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("surfaces_at", ["next backward", "check_updates"])
def test_deferred_overflow_stops_the_layer_like_the_eager_path(device, surfaces_at):
    config = fk.TileConfig(block_n=16, block_k=16, block_t=16)
    layers = {mode: fk.ForgeLinear(40, 40, bias=False, rule=fk.SGD(lr=0.1, momentum=0.9), device=device,
                                   config=config, report=mode) for mode in ("raise", "defer")}
    layers["defer"].load_state_dict(layers["raise"].state_dict())
    x, dy, w, _, _, _ = _overflow_problem(device)
    ones = torch.ones(4, 40, device=device)
    with pytest.raises(fk.NonFiniteUpdateError) as eager:
        layers["raise"](x).backward(dy)
    layer = layers["defer"]
    layer(x).backward(dy)  # the step is taken and left unchecked
    assert int(layer.forge_step) == 0 and layer._failed_step is None
    with pytest.raises(fk.NonFiniteUpdateError) as deferred:
        if surfaces_at == "check_updates":
            fk.check_updates(layer)
        else:
            layer(ones).backward(ones)
    assert deferred.value.tiles == eager.value.tiles
    assert str(deferred.value).startswith("fused layer 'ForgeLinear', step 1: ")  # whose step it was
    if surfaces_at == "next backward":  # and that the backward it surfaced in took no step of its own
        assert "checked at this layer's next backward, which took no step" in str(deferred.value)
    assert_bitwise_equal(layer.weight.detach(), layers["raise"].weight.detach(), "weight")  # nothing more ran
    assert layer._failed_step == 1 and int(layer.forge_step) == 0
    with pytest.raises(RuntimeError, match="stopped at step 1"):
        layer(ones).backward(ones)
    with pytest.raises(RuntimeError, match="forge_accept_partial_step"):  # no checkpoint of mixed steps
        layer.state_dict()
    layer.forge_accept_partial_step()
    layer.state_dict()
    assert int(layer.forge_step) == 1
    layer(ones).backward(ones)
    fk.check_updates(layer)
    assert int(layer.forge_step) == 2


def test_check_updates_checks_every_layer_and_names_the_others(device):
    model = _mlp(device, report="defer")
    x, target = _batch(device, 0)
    target[0, 0] = float("inf")  # dY is non-finite in both layers
    _backward(model, x, target)
    with pytest.raises(fk.NonFiniteInputError) as info:
        fk.check_updates(model)
    if sys.version_info >= (3, 11):  # exception notes
        assert any("fused layer '2' failed too" in note for note in info.value.__notes__)
    assert all(layer._unchecked is None for layer in fk.fused_layers(model))
    fk.check_updates(model)  # nothing left to check


def _bf16_layer(device, seed, step=0, report="raise"):
    torch.manual_seed(1)
    layer = fk.ForgeLinear(12, 10, bias=False, rule=fk.AdamW(lr=1e-2), state_format="bf16", seed=seed,
                           report=report, device=device, dtype=torch.bfloat16)
    layer.forge_step.fill_(step)
    return layer


def _expected_step(layer_state, x, dy, step, seed):
    """The step straight from the kernel, with the given step number and seed."""
    w = layer_state["weight"].clone()
    state = {k[len("forge_state_"):]: v.clone() for k, v in layer_state.items() if k.startswith("forge_state_")}
    fk.fused_weight_update(x, dy, w, state, fk.AdamW(lr=1e-2), step, seed=seed)
    return w, state


@pytest.mark.parametrize("report", ["raise", "defer"])
def test_step_and_seed_follow_a_loaded_checkpoint(device, report):
    """A layer that has stepped (its host copies of step and seed in use) then loads a
    checkpoint with another step count and seed: its next step is the kernel's step
    for those, bit for bit (bf16 stochastic rounding depends on the seed, AdamW's bias
    correction on the step)."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(6, 12, generator=gen).to(device, torch.bfloat16)
    dy = torch.randn(6, 10, generator=gen).to(device, torch.bfloat16)
    layer = _bf16_layer(device, seed=3, report=report)
    layer(x).backward(dy)
    checkpoint = {k: v.clone() for k, v in _bf16_layer(device, seed=11, step=7).state_dict().items()}
    layer.load_state_dict(checkpoint)
    layer(x).backward(dy)
    fk.check_updates(layer)
    w, state = _expected_step(checkpoint, x, dy, step=8, seed=11)
    assert_bitwise_equal(layer.weight.detach(), w, "weight")
    for key, value in state.items():
        assert_bitwise_equal(layer.forge_state[key], value, key)
    assert int(layer.forge_step) == 8 and int(layer.forge_seed) == 11
    # A step with the layer's old seed would differ: the test can fail.
    w_old_seed, _ = _expected_step(checkpoint, x, dy, step=8, seed=3)
    assert not torch.equal(w, w_old_seed)


def test_step_written_into_the_buffer_is_picked_up(device):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(6, 12, generator=gen).to(device, torch.bfloat16)
    dy = torch.randn(6, 10, generator=gen).to(device, torch.bfloat16)
    layer = _bf16_layer(device, seed=5)
    layer(x).backward(dy)
    layer.forge_step.fill_(41)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    layer(x).backward(dy)
    w, _ = _expected_step(before, x, dy, step=42, seed=5)
    assert_bitwise_equal(layer.weight.detach(), w, "weight")
    assert int(layer.forge_step) == 42


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_loading_a_checkpoint_restarts_a_stopped_layer(device):
    layer = fk.ForgeLinear(40, 40, bias=False, rule=fk.SGD(lr=0.1, momentum=0.9), device=device,
                           config=fk.TileConfig(block_n=16, block_k=16, block_t=16))
    checkpoint = {k: v.clone() for k, v in layer.state_dict().items()}
    x, dy, _, _, _, _ = _overflow_problem(device)
    with pytest.raises(fk.NonFiniteUpdateError):
        layer(x).backward(dy)
    layer.load_state_dict(checkpoint)
    ones = torch.ones(4, 40, device=device)
    layer(ones).backward(ones)
    assert int(layer.forge_step) == 1


# --- Trainer ---------------------------------------------------------------------------

def test_trainer_checks_the_fused_steps_once_at_the_end(device, monkeypatch):
    """Every fused layer launches its step before any step is read back."""
    model = _mlp(device)
    trainer = fk.Trainer(model, torch.optim.AdamW(fk.unfused_parameters(model)))
    x, target = _batch(device, 0)
    events = []
    launched, check = fk.UpdateReport.__init__, fk.UpdateReport.check

    def record_launch(report, *args, **kwargs):
        events.append("launch")
        launched(report, *args, **kwargs)

    def record_check(report):
        events.append("check")
        check(report)

    monkeypatch.setattr(fk.UpdateReport, "__init__", record_launch)
    monkeypatch.setattr(fk.UpdateReport, "check", record_check)
    trainer.step(lambda: (model(x) - target).square().mean())
    assert events == ["launch", "launch", "check", "check"]
    assert all(int(layer.forge_step) == 1 and layer._unchecked is None for layer in fk.fused_layers(model))
    events.clear()
    _backward(_mlp(device), x, target)  # the eager layers, for contrast
    assert events == ["launch", "check", "launch", "check"]


def test_trainer_non_finite_loss_without_clipping_steps_nothing(device):
    """Deferred to the end of step(): every fused layer saw a non-finite dY and wrote
    nothing, and the torch optimizer did not step."""
    model = _mlp(device)
    trainer = fk.Trainer(model, torch.optim.AdamW(fk.unfused_parameters(model)))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, target = _batch(device, 0)
    with pytest.raises(fk.NonFiniteInputError, match="nothing was updated"):
        trainer.step(lambda: (model(x) - target).square().mean() * float("inf"))
    for name, value in model.state_dict().items():
        assert_bitwise_equal(value, before[name], name)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.gpu
def test_deferred_update_and_layer_backward_do_not_synchronize():
    """Under torch's sync debug mode "error" any device-to-host synchronization raises:
    a deferred update and a deferred layer's forward and backward make none. (A CUDA
    stream exists only on a GPU; the interpreter has nothing to synchronize.)"""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(256, 128, device="cuda", generator=gen).bfloat16()
    dy = torch.randn(256, 64, device="cuda", generator=gen).bfloat16()
    w = torch.randn(64, 128, device="cuda", generator=gen)
    rule = fk.AdamW()
    state = rule.init_state(w)
    layer = fk.ForgeLinear(128, 64, rule=fk.AdamW(), report="defer", device="cuda")
    fk.fused_weight_update(x, dy, w, state, rule, 1, report="defer").check()  # compile, warm the allocators
    layer(x.float().requires_grad_()).backward(dy.float())
    fk.check_updates(layer)
    inputs = x.float().requires_grad_()
    torch.cuda.synchronize()
    try:
        with warnings.catch_warnings():  # torch warns that the mode is a prototype; tests turn warnings into errors
            warnings.simplefilter("ignore", UserWarning)
            torch.cuda.set_sync_debug_mode("error")
        with pytest.raises(RuntimeError, match="synchronizing"):  # the mode is on: a known sync raises
            torch.ones(1, device="cuda").sum().item()
        report = fk.fused_weight_update(x, dy, w, state, rule, 2, report="defer")
        layer(inputs).backward(dy.float())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    report.check()
    fk.check_updates(layer)
    assert int(layer.forge_step) == 2
