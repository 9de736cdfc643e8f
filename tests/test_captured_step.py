"""CapturedStep: a model's training step captured in a CUDA graph and replayed is bitwise
the eager step at every step, in every storage regime; its layers count their steps and
checkpoint as eager layers do; a non-finite replay stops the capture and leaves each
layer where the eager path would; what a capture cannot do is refused."""

import copy

import pytest
import torch
from torch import nn

import forge_kernels as fk
from forge_verify import assert_bitwise_equal
from forge_verify.checks.claims import assert_parts_kept

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
REGIMES = {"fp32": (torch.float32, "fp32"), "bf16": (torch.bfloat16, "bf16"), "q8": (torch.bfloat16, "q8")}
CONFIG = fk.TileConfig(block_n=32, block_k=32, block_t=32)


def _models(device, regime, seed=0):
    """Two identical fused MLPs (same weights, states and layer seeds) and a batch maker."""
    dtype, state_format = REGIMES[regime]
    torch.manual_seed(seed)
    base = nn.Sequential(nn.Linear(48, 64, bias=False), nn.GELU(), nn.Linear(64, 40, bias=False)).to(device, dtype)
    models = [fk.fuse(copy.deepcopy(base), fk.AdamW(lr=1e-2), state_format=state_format, config=CONFIG, seed=7,
                      report="defer") for _ in range(2)]
    gen = torch.Generator(device="cpu").manual_seed(seed + 1)

    def batch():
        return torch.randn(24, 48, generator=gen).to(device, dtype)
    return models, batch


def _loss(model, x):
    return model(x).float().square().mean()


def _assert_same_models(a, b, where):
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert_bitwise_equal(x, y, f"{where}: {name}")


def _captured(model, static_x, **kwargs):
    def step_fn():
        loss = _loss(model, static_x)
        loss.backward()
        return loss
    return fk.CapturedStep(model, step_fn, **kwargs)


@needs_cuda
@pytest.mark.exactness
@pytest.mark.parametrize("regime", sorted(REGIMES))
def test_replays_are_bitwise_the_eager_steps(regime):
    """One warm-up step, the capture, four replays: after each, every weight, state slot,
    forge_step and the loss equal the eager model's; the eager model keeps stepping after
    release and the two still agree."""
    (eager, graphed), batch = _models("cuda", regime)
    static_x = torch.empty(24, 48, device="cuda", dtype=REGIMES[regime][0])
    step = _captured(graphed, static_x)
    for index in range(6):
        x = batch()
        static_x.copy_(x)
        loss = step()
        eager_loss = _loss(eager, x)
        eager_loss.backward()
        fk.check_updates(eager)
        assert_bitwise_equal(loss, eager_loss, f"loss, step {index + 1}")
        _assert_same_models(graphed, eager, f"step {index + 1}")
    step.release()
    x = batch()
    for model in (graphed, eager):
        _loss(model, x).backward()
        fk.check_updates(model)
    _assert_same_models(graphed, eager, "after release")
    assert int(graphed[0].forge_step) == 7


@needs_cuda
def test_manual_check_and_checkpoint_of_a_captured_model():
    """check="manual" reads the previous replay at the next call; state_dict() of a captured
    model checks the latest replay and holds its step count; the checkpoint resumes."""
    (eager, graphed), batch = _models("cuda", "bf16")
    static_x = torch.empty(24, 48, device="cuda", dtype=torch.bfloat16)
    step = _captured(graphed, static_x, check="manual", warmup=2)
    for _ in range(4):
        x = batch()
        static_x.copy_(x)
        step()
        _loss(eager, x).backward()
    checkpoint = {k: v.clone() for k, v in graphed.state_dict().items()}
    assert int(checkpoint["0.forge_step"]) == 4
    fk.check_updates(eager)
    resumed = copy.deepcopy(eager)
    resumed.load_state_dict(checkpoint)
    _assert_same_models(resumed, eager, "resumed from the captured checkpoint")


@needs_cuda
def test_a_non_finite_replay_stops_the_capture_and_writes_nothing():
    (eager, graphed), batch = _models("cuda", "fp32")
    static_x = torch.empty(24, 48, device="cuda")
    step = _captured(graphed, static_x)
    for _ in range(3):
        static_x.copy_(batch())
        step()
    before = {k: v.clone() for k, v in graphed.state_dict().items()}
    static_x[3, 5] = float("nan")
    with pytest.raises(fk.NonFiniteInputError, match=r"(?s)step 4 \(CapturedStep\).*capture is stopped"):
        step()
    assert not step.active
    # The first layer saw the NaN and wrote nothing; the second layer's dY came from a NaN
    # activation too: neither stepped, and both are back at step 3.
    for name, tensor in graphed.state_dict().items():
        assert_bitwise_equal(tensor, before[name], f"after the refused replay: {name}")
    with pytest.raises(RuntimeError, match="released or stopped"):
        step()
    static_x.copy_(batch())
    _loss(graphed, static_x).backward()  # eager training goes on from step 3
    fk.check_updates(graphed)
    assert int(graphed[0].forge_step) == 4


@needs_cuda
def test_unscanned_replay_fails_the_reached_tiles_and_stops_the_layer():
    """With input_check="tiles" a captured step launches no scan. One fused layer whose
    loss is a sum (its dY finite): three clean replays give the scanned steps' bits; a NaN
    at input column 5 fails the parts holding it (columns 0:32 of the 32 x 32 tiles), the
    replay raises NonFiniteUpdateError and stops the capture and the layer at step 4, the
    other parts took the scanned step's bits, and nothing non-finite is stored."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(48, 40, bias=False)).to("cuda")
    models = [fk.fuse(copy.deepcopy(base), fk.AdamW(lr=1e-2), config=CONFIG, seed=7, report="defer",
                      input_check=check) for check in ("step", "tiles")]
    inputs = [torch.empty(24, 48, device="cuda") for _ in range(2)]

    def captured(model, static_x):
        def step_fn():
            loss = model(static_x).sum()
            loss.backward()
            return loss
        return fk.CapturedStep(model, step_fn)
    steps = [captured(model, static_x) for model, static_x in zip(models, inputs)]
    gen = torch.Generator(device="cpu").manual_seed(1)
    for index in range(4):
        x = torch.randn(24, 48, generator=gen).to("cuda")
        inputs[0].copy_(x)
        steps[0]()
        if index < 3:
            inputs[1].copy_(x)
            steps[1]()
            _assert_same_models(models[1], models[0], f"clean step {index + 1}")
            kept = {name: value.clone() for name, value in [("weight", models[1][0].weight.detach())]
                    + sorted(models[1][0].forge_state.items())}
    inputs[1].copy_(x)
    inputs[1][3, 5] = float("nan")
    with pytest.raises(fk.NonFiniteUpdateError, match=r"(?s)step 4 \(CapturedStep\).*not scanned"):
        steps[1]()
    assert not steps[1].active
    layer, scanned = models[1][0], models[0][0]
    assert int(layer.forge_step) == 3 and layer._failed_step == 4
    after = {"weight": layer.weight.detach(), **layer.forge_state}
    assert_parts_kept(after, kept, {"weight": scanned.weight.detach(), **scanned.forge_state}, [(0, 40, 0, 32)],
                      "captured step 4, x[3, 5] = NaN")
    assert all(torch.isfinite(v).all() for v in after.values())


@needs_cuda
@pytest.mark.exactness
@pytest.mark.parametrize("regime", sorted(REGIMES))
def test_lagged_replays_are_bitwise_the_every_step_replays(regime):
    """check="lagged" (each step read during the next call) steps the same bits as the
    default: after each call the losses, and after the last every weight, state slot
    and forge_step, equal; reading the model (state_dict) reads every queued step."""
    (every, lagged), batch = _models("cuda", regime)
    dtype = REGIMES[regime][0]
    inputs = [torch.empty(24, 48, device="cuda", dtype=dtype) for _ in range(2)]
    steps = [_captured(every, inputs[0]), _captured(lagged, inputs[1], check="lagged")]
    for index in range(6):
        x = batch()
        losses = []
        for static_x, step in zip(inputs, steps):
            static_x.copy_(x)
            losses.append(step().clone())
        assert_bitwise_equal(losses[1], losses[0], f"loss, step {index + 1}")
    _assert_same_models(lagged, every, "after six steps")
    assert int(lagged[0].forge_step) == 6


@needs_cuda
def test_a_lagged_non_finite_replay_stops_at_its_own_step():
    """check="lagged": the call after a step with a NaN input raises that step's error; the
    step it launched meanwhile was halted on the device and wrote nothing, so the layers
    are where check="every step" leaves them (both back at step 3), and eager training
    goes on from there."""
    (_, graphed), batch = _models("cuda", "fp32")
    static_x = torch.empty(24, 48, device="cuda")
    step = _captured(graphed, static_x, check="lagged")
    for _ in range(3):
        static_x.copy_(batch())
        step()
    step.check()
    before = {k: v.clone() for k, v in graphed.state_dict().items()}
    static_x[3, 5] = float("nan")
    step()  # step 4: read during the next call
    static_x.copy_(batch())
    with pytest.raises(fk.NonFiniteInputError, match=r"(?s)step 4 \(CapturedStep\).*capture is stopped"):
        step()  # step 5 launches (halted), then step 4 is read
    assert not step.active and step.step == 4
    for name, tensor in graphed.state_dict().items():
        assert_bitwise_equal(tensor, before[name], f"after the refused and the halted replay: {name}")
    _loss(graphed, static_x).backward()
    fk.check_updates(graphed)
    assert int(graphed[0].forge_step) == 4


@needs_cuda
@pytest.mark.parametrize("read_by", ["next call", "check"])
def test_lagged_non_finite_tiles_stop_the_layer_with_its_tiles_counted(read_by):
    """A NaN in one state element: that tile is left unstepped (the other tiles and the
    other layer step); read by the next call, the lagged step raises NonFiniteUpdateError
    with the tile counted, not named (the halted replay the call launched first has reused
    the flags); read by check() before any later replay, with the tile named as
    check="every step" names it. Either way the layer stops at that step, as
    check="every step" stops it, and a halted replay wrote nothing."""
    (every, lagged), batch = _models("cuda", "fp32")
    inputs = [torch.empty(24, 48, device="cuda") for _ in range(2)]
    steps = [_captured(every, inputs[0]), _captured(lagged, inputs[1], check="lagged")]
    for _ in range(3):
        x = batch()
        for static_x, step in zip(inputs, steps):
            static_x.copy_(x)
            step()
    steps[1].check()
    for model in (every, lagged):
        model[0].forge_state["exp_avg_sq"][0, 0] = float("nan")
    x = batch()
    for static_x in inputs:
        static_x.copy_(x)
    with pytest.raises(fk.NonFiniteUpdateError) as eager:
        steps[0]()
    steps[1]()
    inputs[1].copy_(batch())
    with pytest.raises(fk.NonFiniteUpdateError, match=r"(?s)step 4 \(CapturedStep\)") as late:
        steps[1]() if read_by == "next call" else steps[1].check()
    assert eager.value.tiles
    assert late.value.tiles == ([] if read_by == "next call" else eager.value.tiles)
    for model in (every, lagged):  # a checkpoint (the state compared) refuses mixed-step tiles unaccepted
        model[0].forge_accept_partial_step()
    _assert_same_models(lagged, every, "after the stop")
    assert int(lagged[2].forge_step) == 4


@needs_cuda
def test_a_captured_layer_refuses_an_eager_backward():
    (_, graphed), batch = _models("cuda", "fp32")
    static_x = torch.empty(24, 48, device="cuda")
    step = _captured(graphed, static_x)
    static_x.copy_(batch())
    step()
    with pytest.raises(RuntimeError, match="captured by a CapturedStep"):
        _loss(graphed, batch()).backward()


def test_capture_refuses_what_it_cannot_do(device):
    (model, _), _ = _models(device, "fp32")
    if device == "cpu":
        with pytest.raises(RuntimeError, match="one CUDA device"):
            fk.CapturedStep(model, lambda: None)
    with pytest.raises(ValueError, match="no fused layers|fused layers"):
        fk.CapturedStep(nn.Sequential(nn.ReLU()), lambda: None)
    with pytest.raises(ValueError, match="check must be one of"):
        fk.CapturedStep(model, lambda: None, check="never")
    with pytest.raises(ValueError, match="warmup must be an integer >= 1"):
        fk.CapturedStep(model, lambda: None, warmup=0)
    with pytest.raises(TypeError, match="step_fn must be callable"):
        fk.CapturedStep(model, None)


class _Owner:
    """Stands in for a CapturedStep holding a layer (the CPU has no graphs)."""

    def __init__(self):
        self.checks = 0

    def check(self):
        self.checks += 1


def test_a_layer_held_by_a_capture_refuses_every_other_driver(device):
    """While a layer has an owner: its own backward, fk.Trainer, a second capture and a
    checkpoint load are refused, nothing stepped; state_dict() asks the owner to check
    its latest step first; a deep copy is nobody's."""
    (model, _), batch = _models(device, "fp32")
    owner = _Owner()
    for layer in fk.fused_layers(model):
        layer.forge_owner = owner
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert owner.checks == 2  # one per layer, for the state_dict just taken
    with pytest.raises(RuntimeError, match="captured by a CapturedStep"):
        _loss(model, batch()).backward()
    with pytest.raises(RuntimeError, match="captured by a CapturedStep: release"):
        fk.Trainer(model, None)
    with pytest.raises(RuntimeError, match="another training driver"):
        fk.CapturedStep(model, lambda: None)
    with pytest.raises(RuntimeError, match="release\\(\\) it before loading"):
        model.load_state_dict(before)
    _assert_same_models(model, _models(device, "fp32")[0][1], "after the refusals")
    clone = copy.deepcopy(model)
    assert all(layer.forge_owner is None and layer.forge_backward is None for layer in fk.fused_layers(clone))


@needs_cuda
def test_an_error_in_a_warm_up_step_releases_the_layers_at_the_step_they_took():
    """step_fn raises after its backward in the warm-up: both layers stepped (eagerly), so
    they are released at step 1; eager training then goes on bitwise the eager model."""
    (eager, graphed), batch = _models("cuda", "fp32")
    static_x = torch.empty(24, 48, device="cuda")

    def failing():
        _loss(graphed, static_x).backward()
        raise KeyError("after the backward")
    step = fk.CapturedStep(graphed, failing)
    x = batch()
    static_x.copy_(x)
    with pytest.raises(KeyError):
        step()
    assert not step.active and int(graphed[0].forge_step) == 1
    _loss(eager, x).backward()
    fk.check_updates(eager)
    _assert_same_models(graphed, eager, "after the failed warm-up")


@needs_cuda
def test_two_backwards_in_one_step_are_refused():
    (_, graphed), batch = _models("cuda", "fp32")
    static_x = torch.empty(24, 48, device="cuda")

    def accumulating():
        for half in (static_x[:12], static_x[12:]):
            _loss(graphed, half).backward()
    step = fk.CapturedStep(graphed, accumulating)
    static_x.copy_(batch())
    with pytest.raises(RuntimeError, match="second backward in one step"):
        step()
    assert [int(layer.forge_step) for layer in fk.fused_layers(graphed)] == [1, 1]


@needs_cuda
def test_replays_run_the_graph_not_the_python_step():
    (_, graphed), batch = _models("cuda", "fp32")
    static_x = torch.empty(24, 48, device="cuda")
    step = _captured(graphed, static_x)
    calls = []
    original = step._step_layer
    step._step_layer = lambda *args: (calls.append(1), original(*args))
    for layer in fk.fused_layers(graphed):
        layer.forge_backward = step._step_layer
    for _ in range(4):
        static_x.copy_(batch())
        step()
    assert step.graph is not None
    assert len(calls) == 2 * 2  # the warm-up's and the capture's, one per layer: replays run no Python
