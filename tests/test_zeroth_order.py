"""GRZO and MeZO (forge_kernels.zeroth_order): the counter-based draws against the numpy
Philox reference, the hooks against explicitly perturbed parameters, estimate/step/
state_dict, determinism, and every refusal (nothing written)."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import forge_kernels as fk
from forge_kernels.zeroth_order.draws import (BASE, COL, ROW, CallDraws, base_rows, example_signs,
                                              philox4x32, standard_normal, stream_key)
from forge_kernels.zeroth_order import portable_math
from forge_kernels.zeroth_order.targets import Perturbed
from forge_verify.checks.zeroth_order import flatten, quadratic_problem
from forge_verify.numerics.bits import assert_bitwise_equal
from forge_verify.numerics.philox import philox_words, standard_normal_reference
from forge_verify.numerics.tolerances import gamma


# --- draws ----------------------------------------------------------------------------

@pytest.mark.exactness
@given(key=st.integers(0, 2**63 - 1), counters=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=64))
def test_philox_matches_the_numpy_reference_bit_for_bit(key, counters):
    words = philox4x32(key, torch.tensor(counters, dtype=torch.int64))
    expected = philox_words(key, np.array(counters, dtype=np.uint64).astype(np.uint32))
    for got, want in zip(words, expected):
        assert np.array_equal(got.numpy().astype(np.uint32), want)


@pytest.mark.exactness
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_normal_equals_the_numpy_reference_bit_for_bit(dtype):
    """The normals use no library log or cos (portable_math): numpy running the same basic
    operations gives the same float64 bits, so the draws are those of every machine."""
    key = stream_key(7, 3, "layer.weight", BASE)
    counter = np.arange(2**16, dtype=np.uint32)
    expected = torch.from_numpy(standard_normal_reference(key, counter)).to(dtype)
    got = standard_normal(key, torch.from_numpy(counter.astype(np.int64)), dtype)
    assert_bitwise_equal(got, expected, "standard_normal")


#: the edges of the Box–Muller inputs: u1 = (w + 1/2) / 2**32 for w = 0 and 2**32 - 1, and
#: each quadrant boundary and octant of u2 = w / 2**32
_EDGE_U1 = [0.5 * 2.0**-32, 1.0 - 0.5 * 2.0**-32, 0.5, 0.5 - 2.0**-33, 0.7071067811865476, 0.25]
_EDGE_U2 = [k / 8 for k in range(8)] + [k / 8 + 2.0**-32 for k in range(8)] + [1.0 - 2.0**-32]


def test_portable_sqrt_log_and_cos_are_accurate():
    """Against mpmath at 100 bits: √x within one float64 ulp, ln u within 2, cos(2πu)
    within 2**-52 absolutely (its values lie in [-1, 1]), on the edges and 4,096 drawn
    words; the rounding to fp32 then hides any of them."""
    import mpmath
    words = philox_words(11, np.arange(4096, dtype=np.uint32))
    u1 = np.concatenate([_EDGE_U1, (words[0].astype(np.float64) + 0.5) * 2.0**-32])
    u2 = np.concatenate([_EDGE_U2, words[1].astype(np.float64) * 2.0**-32])
    got_log = portable_math.log(torch.from_numpy(u1)).numpy()
    got_cos = portable_math.cos_two_pi(torch.from_numpy(u2)).numpy()
    with mpmath.workprec(100):
        exact_log = np.array([float(mpmath.log(mpmath.mpf(float(u)))) for u in u1])
        exact_cos = np.array([float(mpmath.cos(2 * mpmath.pi * mpmath.mpf(float(u)))) for u in u2])
    x = -2.0 * exact_log
    got_sqrt = portable_math.sqrt(torch.from_numpy(x)).numpy()
    with mpmath.workprec(100):
        exact_sqrt = np.array([float(mpmath.sqrt(mpmath.mpf(float(v)))) for v in x])
    assert (np.abs(got_sqrt - exact_sqrt) / np.spacing(exact_sqrt)).max() <= 1
    log_ulps = np.abs(got_log - exact_log) / np.spacing(np.abs(exact_log))
    assert log_ulps.max() <= 2, f"ln: {log_ulps.max()} ulp at u = {u1[log_ulps.argmax()]!r}"
    assert np.abs(got_cos - exact_cos).max() <= 2.0**-52


def test_streams_differ_by_seed_call_name_and_kind():
    keys = {stream_key(s, c, n, k) for s in (0, 1) for c in (0, 1) for n in ("a", "b") for k in (BASE, ROW, COL)}
    assert len(keys) == 24 and all(0 <= k < 2**63 for k in keys)


@pytest.mark.exactness
def test_a_shard_draws_the_slice_of_the_whole():
    """Rows [3, 7) × columns [5, 11) of a 10 × 16 base, and signs [4, 9) of 12, drawn at
    their global offsets, are the slice of the whole's draws (tensor-parallel shards)."""
    key = stream_key(1, 2, "w", BASE)
    whole = base_rows(key, torch.arange(10), 16, torch.float32)
    shard = base_rows(key, torch.arange(4), 6, torch.float32, row_offset=3, col_offset=5, full_cols=16)
    assert_bitwise_equal(shard, whole[3:7, 5:11], "base shard")
    signs_key = stream_key(1, 2, "w", ROW)
    signs = example_signs(signs_key, 3, 12, torch.float32, "cpu")
    part = example_signs(signs_key, 3, 5, torch.float32, "cpu", offset=4, full_size=12)
    assert_bitwise_equal(part, signs[:, 4:9], "sign shard")


def test_a_stream_refuses_more_than_two_to_the_32_counters():
    with pytest.raises(ValueError, match="2\\*\\*32 counters"):
        standard_normal(1, torch.tensor([2**32]), torch.float32)


# --- the hooks are the perturbed parameters -------------------------------------------

class _Small(nn.Module):
    """Every supported parameter: an embedding, LayerNorm (weight, bias), Linear (weight,
    bias), RMSNorm (weight)."""

    def __init__(self, dtype=torch.float64):
        super().__init__()
        self.tok = nn.Embedding(11, 6)
        self.norm = nn.LayerNorm(6)
        self.proj = nn.Linear(6, 5)
        self.rms = nn.RMSNorm(5, eps=1e-6)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
        self.to(dtype)

    def forward(self, idx):
        return self.rms(self.proj(self.norm(self.tok(idx)))).sum(1)


def _tokens(batch=4, length=3):
    return torch.randint(0, 11, (batch, length), generator=torch.Generator().manual_seed(1))


def _explicit_direction(target, draws, example, batch):
    u = draws.base(target, torch.arange(target.rows) if target.is_matrix else None)
    r = draws.signs(target, ROW, batch)[example]
    if target.is_matrix:
        return u * r[:, None] * draws.signs(target, COL, batch)[example][None, :]
    return (u * r).reshape(target.param.shape)


def test_hooked_forward_is_each_example_with_its_own_perturbed_parameters():
    """float64: example i's output under the hooks equals the plain forward of example i
    with every parameter moved by σ Δ_i (rounding only: within 1e-12 relative)."""
    model, idx, sigma = _Small(), _tokens(), 0.05
    opt = fk.GRZO(model, lr=0.1, normalize="none")
    draws = CallDraws(opt.seed, opt.call)
    with torch.no_grad(), Perturbed(opt.targets, draws, sigma, 1, 2**20):
        hooked = model(idx)
    for i in range(idx.shape[0]):
        params = {t.name: t.param + sigma * _explicit_direction(t, draws, i, idx.shape[0]) for t in opt.targets}
        with torch.no_grad():
            plain = torch.func.functional_call(model, params, (idx[i:i + 1],))
        torch.testing.assert_close(hooked[i:i + 1], plain, rtol=1e-12, atol=1e-12)


# --- estimate and step ----------------------------------------------------------------

def _closure(model, idx):
    return lambda: (model(idx) ** 2).sum(-1)


@pytest.mark.parametrize("normalize", ["none", "std"])
def test_estimate_is_the_mean_of_coefficients_times_directions(normalize):
    model, idx = _Small(), _tokens()
    opt = fk.GRZO(model, lr=0.1, sigma=1e-3, normalize=normalize)
    draws = CallDraws(opt.seed, opt.call)
    plus_minus = []
    for sign in (1, -1):
        with torch.no_grad(), Perturbed(opt.targets, draws, opt.sigma, sign, 2**20):
            plus_minus.append((model(idx) ** 2).sum(-1))
    delta = (plus_minus[0] - plus_minus[1]) / (2 * opt.sigma)
    c = delta if normalize == "none" else delta / (delta.std(correction=1) + opt.eps)
    estimate = opt.estimate(_closure(model, idx))
    batch = idx.shape[0]
    for t in opt.targets:
        expected = sum(c[i] * _explicit_direction(t, draws, i, batch) for i in range(batch)) / batch
        torch.testing.assert_close(estimate[t.name], expected.reshape(t.param.shape), rtol=1e-12, atol=1e-12)
    assert opt.call == 1


def test_step_applies_lr_times_estimate_plus_weight_decay_bit_for_bit():
    model, idx = _Small(torch.float32), _tokens()
    twin = _Small(torch.float32)
    kw = dict(lr=0.01, sigma=1e-2, weight_decay=0.1, seed=5)
    estimate = fk.GRZO(twin, **kw).estimate(_closure(twin, idx))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    result = fk.GRZO(model, **kw).step(_closure(model, idx))
    assert result.stepped
    for n, p in model.named_parameters():
        expected = before[n] - 0.01 * (estimate[n] + 0.1 * before[n])
        assert_bitwise_equal(p.detach(), expected, n)


def test_same_seed_same_draws_and_each_call_advances():
    idx = _tokens()
    runs = []
    for _ in range(2):
        model = _Small(torch.float32)
        opt = fk.GRZO(model, lr=0.1, seed=3)
        runs.append([opt.estimate(_closure(model, idx)) for _ in range(2)])
    for a, b in zip(runs[0], runs[1]):
        for n in a:
            assert_bitwise_equal(a[n], b[n], n)
    assert not torch.equal(runs[0][0]["proj.weight"], runs[0][1]["proj.weight"])
    other = _Small(torch.float32)
    assert not torch.equal(fk.GRZO(other, lr=0.1, seed=4).estimate(_closure(other, idx))["proj.weight"],
                           runs[0][0]["proj.weight"])


def test_row_blocks_do_not_change_the_result():
    """U regenerated one row at a time (block_elements=1) gives the default's estimate and
    step (float64; the products are formed per block, rounding alike within 1e-13)."""
    idx = _tokens()
    results = []
    for block in (1, 2**20):
        model = _Small()
        opt = fk.GRZO(model, lr=0.1, normalize="none", block_elements=block)
        estimate = opt.estimate(_closure(model, idx))
        opt.step(_closure(model, idx))
        results.append((estimate, {n: p.detach().clone() for n, p in model.named_parameters()}))
    for a, b in zip(results[0], results[1]):
        for n in a:
            torch.testing.assert_close(a[n], b[n], rtol=1e-13, atol=1e-13)


def test_the_padding_row_is_neither_perturbed_nor_updated():
    model = nn.Sequential(nn.Embedding(7, 4, padding_idx=0), nn.Linear(4, 3))
    idx = torch.tensor([[0, 1, 2], [3, 0, 0], [4, 5, 6]])
    opt = fk.GRZO(model, lr=0.1, normalize="none")
    with torch.no_grad(), Perturbed(opt.targets, CallDraws(opt.seed, opt.call), 1.0, 1, 2**20):
        hooked = model[0](idx)
    assert_bitwise_equal(hooked[idx == 0], model[0].weight[0].detach().expand(3, 4), "padding outputs")
    before = model[0].weight.detach().clone()
    assert not opt.estimate(lambda: (model(idx) ** 2).sum((1, 2)))["0.weight"][0].any()
    opt.step(lambda: (model(idx) ** 2).sum((1, 2)))
    assert_bitwise_equal(model[0].weight[0].detach(), before[0], "padding row")
    assert not torch.equal(model[0].weight[1:], before[1:])


def test_estimate_writes_nothing():
    model, idx = _Small(torch.float32), _tokens()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    fk.GRZO(model, lr=0.1).estimate(_closure(model, idx))
    for n, p in model.named_parameters():
        assert_bitwise_equal(p.detach(), before[n], n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_every_supported_dtype_steps(dtype):
    """σ = 0.05: in bf16 the hooked output is rounded to bf16, and σ = 1e-3 here moves
    these outputs (magnitude ~2, bf16 ulp 2**-6) by about half an ulp: two of the
    four δ_i are 0 (measured), and at 1e-4 all four (the rounded-away test below);
    lr = 0.1: bf16 weights are stored round-to-nearest, so a step below half
    an ulp is lost (README, "Zeroth-order fine-tuning", what is not done)."""
    model, idx = _Small(dtype), _tokens()
    opt = fk.GRZO(model, lr=0.1, sigma=0.05)
    estimate = opt.estimate(_closure(model, idx))
    work = torch.float64 if dtype == torch.float64 else torch.float32
    assert all(v.dtype == work and torch.isfinite(v).all() for v in estimate.values())
    before = model.proj.weight.detach().clone()
    assert opt.step(_closure(model, idx)).stepped
    assert model.proj.weight.dtype == dtype and not torch.equal(model.proj.weight, before)


@pytest.mark.parametrize("method", ["GRZO", "MeZO"])
def test_state_dict_resumes_bit_for_bit(method):
    idx = _tokens()
    make = (lambda m: fk.GRZO(m, lr=1e-2, seed=9)) if method == "GRZO" else (lambda m: fk.MeZO(m, lr=1e-2, seed=9))
    closure = _closure if method == "GRZO" else (lambda m, i: (lambda: (m(i) ** 2).sum(-1).mean()))
    model = _Small(torch.float32)
    opt = make(model)
    for _ in range(2):
        opt.step(closure(model, idx))
    saved_state, saved_weights = opt.state_dict(), {n: p.detach().clone() for n, p in model.named_parameters()}
    for _ in range(2):
        opt.step(closure(model, idx))
    resumed = _Small(torch.float32)
    resumed.load_state_dict(saved_weights)
    opt2 = make(resumed)
    opt2.load_state_dict(saved_state)
    for _ in range(2):
        opt2.step(closure(resumed, idx))
    for (n, p), q in zip(model.named_parameters(), resumed.parameters()):
        assert_bitwise_equal(q.detach(), p.detach(), n)


def test_load_state_dict_refuses_another_model_or_method():
    opt = fk.GRZO(_Small(), lr=0.1)
    with pytest.raises(ValueError, match="cannot be loaded into GRZO"):
        opt.load_state_dict(fk.MeZO(_Small(), lr=0.1).state_dict())
    with pytest.raises(ValueError, match="saved for parameters"):
        opt.load_state_dict(fk.GRZO(nn.Linear(2, 2).double(), lr=0.1).state_dict())


def _optimizer_of(method, model, seed=1):
    return fk.GRZO(model, lr=0.1, seed=seed) if method == "GRZO" else fk.MeZO(model, lr=0.1, seed=seed)


@pytest.mark.parametrize("method", ["GRZO", "MeZO"])
def test_a_refused_state_changes_nothing(method):
    """A state with another seed, a later counter and a negative lr: refused for the lr,
    and the seed and counter are not half-loaded before the refusal."""
    opt = _optimizer_of(method, nn.Linear(3, 2))
    before = opt.state_dict()
    bad = {**_optimizer_of(method, nn.Linear(3, 2), seed=99).state_dict(), "call": 5}
    bad["param_groups"][0]["lr"] = -1.0
    with pytest.raises(ValueError, match=r"the state's param_groups\[0\]: lr must be"):
        opt.load_state_dict(bad)
    assert opt.state_dict() == before


@pytest.mark.parametrize("method", ["GRZO", "MeZO"])
def test_a_state_missing_keys_is_refused_naming_them(method):
    opt = _optimizer_of(method, nn.Linear(3, 2))
    state = opt.state_dict()
    del state["call"], state["seed"]
    with pytest.raises(ValueError, match=r"the state lacks \['seed', 'call'\]"):
        opt.load_state_dict(state)
    state = opt.state_dict()
    del state["param_groups"][0]["eps"]
    with pytest.raises(ValueError, match=r"the state's param_groups\[0\]: lacks \['eps'\]"):
        opt.load_state_dict(state)
    with pytest.raises(TypeError, match=r"the dict state_dict\(\) returns"):
        opt.load_state_dict([("seed", 1)])


def test_grzo_refuses_a_state_of_another_block_size():
    """block_elements changes the hooked outputs' rounding (a row block of U is one
    matmul: measured, a 1024-wide Linear's losses differ in the last bit between blocks of
    5 rows and the whole), so a resume with another size would not be bitwise."""
    state = fk.GRZO(nn.Linear(3, 2), lr=0.1, block_elements=64).state_dict()
    with pytest.raises(ValueError, match="saved with block_elements=64, this optimizer has 1048576"):
        fk.GRZO(nn.Linear(3, 2), lr=0.1).load_state_dict(state)


# --- torch conventions: param_groups and LR schedulers --------------------------------------

_SCHEDULERS = {
    "LambdaLR": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: [1.0, 0.0, 0.5, 0.25, 0.125][step]),
    "StepLR": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
    "OneCycleLR": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=8,
                                                                  cycle_momentum=False),
}


def _scheduled_run(method, scheduler, steps, model, state=None):
    """``steps`` steps of GRZO/MeZO under ``scheduler`` (each step then the scheduler's),
    resumed from ``state`` (optimizer's and scheduler's) if given; the lr each step used."""
    idx = _tokens()
    if method == "GRZO":
        opt, closure = fk.GRZO(model, lr=1e-2, seed=9), _closure(model, idx)
    else:
        opt, closure = fk.MeZO(model, lr=1e-2, seed=9), (lambda: (model(idx) ** 2).sum(-1).mean())
    schedule = _SCHEDULERS[scheduler](opt)
    if state is not None:
        opt.load_state_dict(state[0])
        schedule.load_state_dict(state[1])
    used = []
    for _ in range(steps):
        used.append(opt.param_groups[0]["lr"])
        opt.step(closure)
        schedule.step()
    return opt, schedule, used


@pytest.mark.parametrize("scheduler", sorted(_SCHEDULERS))
@pytest.mark.parametrize("method", ["GRZO", "MeZO"])
def test_a_torch_scheduler_drives_lr_and_resumes_bit_for_bit(method, scheduler):
    """Four steps of one optimizer and scheduler, uninterrupted, against two, a save of
    both states, a resume on a fresh model, optimizer and scheduler, and two more: the
    same lrs and weights bitwise (only the resumed side goes through load_state_dict)."""
    model = _Small(torch.float32)
    opt, schedule, used = _scheduled_run(method, scheduler, 2, model)
    saved = (opt.state_dict(), schedule.state_dict(), _snapshot(model))
    idx = _tokens()
    closure = _closure(model, idx) if method == "GRZO" else (lambda: (model(idx) ** 2).sum(-1).mean())
    for _ in range(2):  # the uninterrupted run: the same optimizer and scheduler go on
        used.append(opt.param_groups[0]["lr"])
        opt.step(closure)
        schedule.step()
    assert len(set(used)) > 1, f"the schedule did not change lr: {used}"
    resumed = _Small(torch.float32)
    resumed.load_state_dict(saved[2])
    _, _, used_resumed = _scheduled_run(method, scheduler, 2, resumed, saved[:2])
    assert used_resumed == used[2:]
    for n, p in resumed.named_parameters():
        assert_bitwise_equal(p.detach(), dict(model.named_parameters())[n].detach(), n)


def _one_step(method, weights, lr, call):
    """The weights after one step of an optimizer built with ``lr``, at counter ``call``."""
    model, idx = _Small(torch.float32), _tokens()
    model.load_state_dict(weights)
    if method == "GRZO":
        opt, closure = fk.GRZO(model, lr=lr, seed=9), _closure(model, idx)
    else:
        opt, closure = fk.MeZO(model, lr=lr, seed=9), (lambda: (model(idx) ** 2).sum(-1).mean())
    opt.call = call
    opt.step(closure)
    return _snapshot(model)


@pytest.mark.parametrize("method", ["GRZO", "MeZO"])
def test_each_step_reads_lr_from_the_param_group(method):
    """Under LambdaLR (factors 1, 0, 0.5 of lr 1e-2) the second and third steps are those
    of optimizers built with lr 0 and 5e-3 at those counters, bitwise; GRZO's step at lr 0
    leaves the weights as they were (MeZO's is its restore's drift)."""
    model = _Small(torch.float32)
    opt, schedule, _ = _scheduled_run(method, "LambdaLR", 1, model)
    idx = _tokens()
    closure = _closure(model, idx) if method == "GRZO" else (lambda: (model(idx) ** 2).sum(-1).mean())
    for lr in (0.0, 5e-3):
        before, call = _snapshot(model), opt.call
        opt.step(closure)
        schedule.step()
        for n, value in _one_step(method, before, lr, call).items():
            assert_bitwise_equal(dict(model.named_parameters())[n].detach(), value, f"{n} at lr {lr}")
        if method == "GRZO" and lr == 0:
            _unchanged(model, before)


@pytest.mark.parametrize("method", ["GRZO", "MeZO"])
def test_a_bad_lr_set_in_the_group_is_refused_before_anything_is_written(method):
    model, idx = _Small(torch.float32), _tokens()
    opt, before = _optimizer_of(method, model), _snapshot(model)
    opt.param_groups[0]["lr"] = float("nan")
    closure = _closure(model, idx) if method == "GRZO" else (lambda: (model(idx) ** 2).sum(-1).mean())
    with pytest.raises(ValueError, match=r"param_groups\[0\]: lr must be a finite non-negative number, got nan"):
        opt.step(closure)
    _unchanged(model, before)
    assert opt.call == 0
    with pytest.raises(ValueError, match="one parameter group"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})


@pytest.mark.parametrize("method", ["GRZO", "MeZO"])
def test_a_copied_optimizer_is_still_the_optimizer(method):
    """torch.optim.Optimizer pickles only defaults, state and param_groups; ours keep
    their targets, seed and counter too."""
    import copy
    opt = _optimizer_of(method, nn.Linear(3, 2))
    opt.call = 4
    assert copy.deepcopy(opt).state_dict() == opt.state_dict()


# --- bad input: nothing written -------------------------------------------------------

def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _unchanged(model, before):
    for n, p in model.named_parameters():
        assert_bitwise_equal(p.detach(), before[n], n)


def test_one_example_under_std_is_refused():
    model = _Small()
    opt, before = fk.GRZO(model, lr=0.1), _snapshot(model)
    with pytest.raises(ValueError, match="at least 2 examples"):
        opt.step(_closure(model, _tokens(batch=1)))
    _unchanged(model, before)
    assert opt.call == 0
    fk.GRZO(model, lr=0.1, normalize="none").step(_closure(model, _tokens(batch=1)))  # fine without std


def test_all_equal_differences_take_no_step_and_say_so():
    """Every example's loss the batch's total: the δ_i move but are all equal, std 0 (the
    GRZO code would divide by its 1e-8)."""
    model, idx = _Small(), _tokens()
    opt, before = fk.GRZO(model, lr=0.1), _snapshot(model)
    shared = lambda: (model(idx) ** 2).sum().expand(idx.shape[0])  # noqa: E731
    with pytest.warns(fk.NoStepWarning, match="all 4 differences δ_i are equal"):
        result = opt.step(shared)
    assert not result.stepped and result.coefficients is None
    _unchanged(model, before)
    assert opt.call == 1
    with pytest.warns(fk.NoStepWarning):
        assert all(not v.any() for v in opt.estimate(shared).values())


@pytest.mark.parametrize("normalize", ["std", "none"])
def test_losses_the_perturbation_does_not_move_take_no_step_and_say_so(normalize):
    """Constant losses: δ_i = 0 for every example; under "none" the step would be weight
    decay alone, under "std" a division by eps. Named as no loss moved (float64 here)."""
    model, idx = _Small(), _tokens()
    opt, before = fk.GRZO(model, lr=0.1, weight_decay=0.1, normalize=normalize), _snapshot(model)
    constant = lambda: (model(idx) * 0).sum(-1) + 1.0  # noqa: E731
    with pytest.warns(fk.NoStepWarning, match="sigma = 0.001 moved no loss.*float64; no step taken"):
        assert not opt.step(constant).stepped
    _unchanged(model, before)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("method", ["GRZO", "MeZO"])
def test_non_finite_loss_takes_no_step_and_raises(bad, method):
    model, idx = _Small(torch.float32), _tokens()
    before = _snapshot(model)
    if method == "GRZO":
        opt = fk.GRZO(model, lr=0.1)
        closure = lambda: (model(idx) ** 2).sum(-1) * torch.tensor([1.0, bad, 1.0, 1.0])  # noqa: E731
    else:
        opt = fk.MeZO(model, lr=0.1)
        closure = lambda: (model(idx) ** 2).mean() * bad  # noqa: E731
    with pytest.raises(fk.NonFiniteLossError, match="no step was taken"):
        opt.step(closure)
    assert opt.call == 0
    if method == "GRZO":
        _unchanged(model, before)  # MeZO's restore may drift: properties/test_zeroth_order_mezo.py


def test_a_closure_of_the_wrong_shape_is_refused():
    model, idx = _Small(), _tokens()
    with pytest.raises(TypeError, match="1-D floating tensor"):
        fk.GRZO(model, lr=0.1).step(lambda: (model(idx) ** 2).sum())
    with pytest.raises(ValueError, match="returned 3 losses but the perturbed modules saw batch 4"):
        fk.GRZO(model, lr=0.1).step(lambda: (model(idx) ** 2).sum(-1)[:3])
    with pytest.raises(TypeError, match="scalar"):
        fk.MeZO(model, lr=0.1).step(lambda: (model(idx) ** 2).sum(-1))


def test_unsupported_modules_are_refused_by_name_unless_frozen():
    model = nn.Sequential(nn.Linear(3, 4), nn.Conv1d(4, 4, 1))
    with pytest.raises(TypeError, match=r"module '1' \(Conv1d\) has trainable parameters \['weight', 'bias'\]"):
        fk.GRZO(model, lr=0.1)
    model[1].requires_grad_(False)
    assert [t.name for t in fk.GRZO(model, lr=0.1).targets] == ["0.weight", "0.bias"]


def test_a_module_not_batched_along_dim_0_is_refused_by_name():
    """The tiny GPT's position embedding is called with arange(T): shared by every
    example, not batched. Refused (T != B) naming it; frozen, the rest trains."""
    from forge_verify.models.tiny_gpt import GPT, GPTConfig
    model = GPT(GPTConfig(n_layer=1))
    idx = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))
    closure = lambda: torch.nn.functional.cross_entropy(  # noqa: E731
        model(idx).transpose(1, 2), idx, reduction="none").mean(1)
    with pytest.raises(ValueError, match="module 'pos' saw input shape \\(8,\\) after batch 2"):
        fk.GRZO(model, lr=1e-3).step(closure)
    model.pos.requires_grad_(False)
    assert fk.GRZO(model, lr=1e-3).step(closure).stepped


def test_tied_weights_and_other_dtypes_are_refused():
    tied = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False))
    tied[1].weight = tied[0].weight
    with pytest.raises(ValueError, match="tied weights"):
        fk.GRZO(tied, lr=0.1)
    with pytest.raises(TypeError, match="torch.float16"):
        fk.GRZO(nn.Linear(2, 2).half(), lr=0.1)
    with pytest.raises(TypeError, match="max_norm"):
        fk.GRZO(nn.Embedding(4, 2, max_norm=1.0), lr=0.1)


@pytest.mark.parametrize("kwargs, message", [
    (dict(lr=-1.0), "lr must be"), (dict(lr=float("nan")), "lr must be"), (dict(sigma=0.0), "sigma must be"),
    (dict(normalize="mean"), "normalize must be"), (dict(eps=-1.0), "eps must be"),
    (dict(weight_decay=-0.1), "weight_decay must be"), (dict(seed=-1), "seed must be"),
    (dict(block_elements=0), "block_elements"),
])
def test_bad_hyperparameters_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        fk.GRZO(nn.Linear(2, 2), **{"lr": 0.1, **kwargs})


@pytest.mark.filterwarnings("ignore:.*Profiler clears events:UserWarning")  # torch 2.11 on CUDA builds: one cycle here
@pytest.mark.parametrize("method", ["GRZO", "MeZO"])
def test_a_step_allocates_nothing_weight_sized(method):
    """A 256 × 256 fp32 Linear (256 KiB) with block_elements = 2,048: the largest single
    allocation of a step (both forwards, the update) is one block's worth of a draw's
    temporaries, 12 bytes per element (the portable logarithm's frexp: a float64 mantissa
    and an int32 exponent), 24 KiB, under an eighth of the weight (torch's CPU profiler;
    peak memory is not measured)."""
    from torch.profiler import ProfilerActivity, profile
    model = nn.Linear(256, 256)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(0))
    if method == "GRZO":
        opt = fk.GRZO(model, lr=1e-3, block_elements=2048)
        closure = lambda: (model(x) ** 2).sum(-1)  # noqa: E731
    else:
        opt = fk.MeZO(model, lr=1e-3, block_elements=2048)
        closure = lambda: (model(x) ** 2).mean()  # noqa: E731
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        opt.step(closure)
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert largest <= 12 * 2048 < model.weight.numel() * 4 // 8


def test_grzo_and_mezo_are_not_element_wise_rules():
    assert not issubclass(fk.GRZO, fk.Rule) and not issubclass(fk.MeZO, fk.Rule)


# --- MeZO -----------------------------------------------------------------------------

def test_mezo_estimate_is_the_projected_difference_times_z():
    problem = quadratic_problem(3, 4, 5, identical=False)
    opt = fk.MeZO(problem.model, lr=0.1, eps=1e-3, seed=2)
    names = [n for n, _ in problem.model.named_parameters()]
    losses = []
    def closure():
        losses.append(problem.losses().mean())
        return losses[-1]
    estimate = flatten(opt.estimate(closure), names)
    z = torch.cat([standard_normal(stream_key(2, 0, n, BASE), torch.arange(p.numel()), torch.float64)
                   for n, p in problem.model.named_parameters()])
    torch.testing.assert_close(estimate, (losses[0] - losses[1]) / 2e-3 * z, rtol=1e-12, atol=0)
    # the quadratic's central difference is ⟨ḡ, z⟩ up to float64 rounding of the losses
    mean_grad = problem.per_example_gradients().mean(0)
    bound = 4 * gamma(64, 2.0**-53) * float(max(losses).abs()) / 2e-3
    assert abs(float((losses[0] - losses[1]) / 2e-3 - z @ mean_grad)) <= bound


@pytest.mark.parametrize("method", ["GRZO-std", "GRZO-none", "MeZO"])
def test_training_lowers_a_quadratic_loss(method):
    """300 steps on a float64 least-squares problem (8 examples, d = 15) more than halve
    the mean loss: a smoke test of the whole loop with fixed seeds, not a statistical claim."""
    problem = quadratic_problem(3, 4, 8, identical=False, seed=0)
    with torch.no_grad():
        problem.targets.copy_(problem.model(problem.inputs) + 0.1 * problem.targets)  # start near a fit
        problem.model.weight.add_(0.5)
    with torch.no_grad():
        start = float(problem.losses().mean())
    if method == "MeZO":
        opt = fk.MeZO(problem.model, lr=0.02, eps=1e-3, seed=1)
        closure = lambda: problem.losses().mean()  # noqa: E731
    else:
        normalize = method.split("-")[1]
        opt = fk.GRZO(problem.model, lr=0.02 if normalize == "none" else 0.01, normalize=normalize, seed=1)
        closure = problem.closure()
    for _ in range(300):
        opt.step(closure)
    with torch.no_grad():
        assert float(problem.losses().mean()) < 0.5 * start


@pytest.mark.gpu
@pytest.mark.exactness
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_normals_on_cuda_equal_the_cpus_bit_for_bit(dtype):
    """The same draws on every device: 2**20 normals computed on CUDA and on the CPU. (Run
    on an H200, 2026-12-01, as benchmarks/results/zeroth_order/h200-draws-cpu-vs-cuda.log
    records: equal in every dtype, where the library sqrt(-2 ln u) differed in 13,419 of
    the 2**20 float64 values between the two.)"""
    key = stream_key(7, 3, "layer.weight", BASE)
    counter = torch.arange(2**20, dtype=torch.int64)
    cpu = standard_normal(key, counter, dtype)
    cuda = standard_normal(key, counter.cuda(), dtype).cpu()
    assert_bitwise_equal(cuda, cpu, "standard_normal on CUDA")


# --- a perturbation rounded away (bf16) -------------------------------------------------

@pytest.mark.parametrize("method, normalize", [("GRZO", "std"), ("GRZO", "none"), ("MeZO", None)])
def test_a_perturbation_rounded_away_in_bf16_is_named_and_takes_no_step(method, normalize):
    """σ = ε = 1e-4 on the bf16 model (outputs of magnitude ~2, ulp 2**-6; weights ~1,
    ulp 2**-7): every loss pair is equal bit for bit (measured; at 1e-3 two of GRZO's four
    δ_i are still non-zero). The warning names the knob, its value and bfloat16, and GRZO
    writes nothing (MeZO's weights are where its restore left them); the same settings in
    fp32 step (the control)."""
    def make(model):
        if method == "GRZO":
            return fk.GRZO(model, lr=0.1, sigma=1e-4, normalize=normalize)
        return fk.MeZO(model, lr=0.1, eps=1e-4)
    knob = "sigma" if method == "GRZO" else "eps"
    model, idx = _Small(torch.bfloat16), _tokens()
    closure = _closure(model, idx) if method == "GRZO" else (lambda: (model(idx) ** 2).sum(-1).mean())
    before = _snapshot(model)
    with pytest.warns(fk.NoStepWarning, match=f"{knob} = 0.0001 moved no loss.*bfloat16.*raise {knob}"):
        result = make(model).step(closure)
    assert not result.stepped
    if method == "GRZO":
        _unchanged(model, before)
    with pytest.warns(fk.NoStepWarning, match="the estimate is zero"):
        assert all(not v.any() for v in make(model).estimate(closure).values())
    control = _Small(torch.float32)
    closure = _closure(control, idx) if method == "GRZO" else (lambda: (control(idx) ** 2).sum(-1).mean())
    assert make(control).step(closure).stepped


@pytest.mark.filterwarnings("ignore:.*Profiler clears events:UserWarning")  # torch 2.11 on CUDA builds: one cycle here
def test_the_embedding_hook_draws_its_used_rows_in_blocks():
    """An Embedding(8192, 2) fed all 8,192 tokens, block_elements = 512: the largest single
    allocation of a step is torch.unique's int64 values and inverse over the tokens (16
    bytes per token, 128 KiB, an activation), not a draw of all used rows' U at once
    (12 bytes per element of 8,192 × 2: 192 KiB, what the hook allocated before it drew
    in blocks; torch's CPU profiler)."""
    from torch.profiler import ProfilerActivity, profile
    model = nn.Embedding(8192, 2)
    idx = torch.randperm(8192, generator=torch.Generator().manual_seed(0))[None, :]
    opt = fk.GRZO(model, lr=1e-3, normalize="none", block_elements=512)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        opt.step(lambda: (model(idx) ** 2).sum((1, 2)))
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert largest <= 16 * 8192 < 12 * 8192 * 2


# --- MeZO: nothing left shifted -----------------------------------------------------------

def test_mezo_refuses_a_parameter_it_cannot_shift_by_name_before_anything_is_written():
    """A transposed (non-contiguous) weight has no flat view, and a shard far into a whole
    of more than 2**32 elements has counters past the stream: refused at construction,
    naming the parameter (they used to fail inside a shift, leaving the parameters already
    shifted at θ + εz)."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    model[1].weight = nn.Parameter(torch.randn(4, 2).t())
    with pytest.raises(ValueError, match="parameter '1.weight' is not contiguous"):
        fk.MeZO(model, lr=0.1)
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 4))
    with pytest.raises(ValueError, match="parameter '1.weight' draws z at counters up to 4294967297"):
        fk.MeZO(model, lr=0.1, shards={"1.weight": ((2**31 + 1, 2), (2**31 - 3, 0))})


@pytest.mark.parametrize("failing_shift", [0, 1])
def test_a_mezo_shift_failing_part_way_shifts_back_exactly_the_parameters_it_moved(failing_shift, monkeypatch):
    """The draw of the third parameter fails in the first shift (+εz) or the second (-2εz),
    as a device error would. Zero weights make every shift exact (0 + a, a - a, a - 2a),
    so the restore must bring each parameter back bit for bit: the ones the failing
    shift moved and the ones it did not reach."""
    from forge_kernels.zeroth_order import mezo as mezo_module
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).double()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    x = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    draws_of_the_third = []

    def failing_normal(key, counter, dtype):
        if key == stream_key(0, 0, "1.weight", BASE):
            draws_of_the_third.append(key)
            if len(draws_of_the_third) == failing_shift + 1:  # this one draw only
                raise RuntimeError("a draw failed")
        return standard_normal(key, counter, dtype)
    monkeypatch.setattr(mezo_module, "standard_normal", failing_normal)
    with pytest.raises(RuntimeError, match="a draw failed"):
        fk.MeZO(model, lr=0.1, eps=1e-3).step(lambda: (model(x) ** 2).mean())
    for n, p in model.named_parameters():
        assert_bitwise_equal(p.detach(), torch.zeros_like(p), n)


# --- GRZO: a target whose module never runs -------------------------------------------------

class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.att = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.att(x, x, x, need_weights=False)[0]).squeeze(-1).pow(2).sum(-1)


def test_a_target_whose_module_forward_never_runs_is_refused_by_name():
    """nn.MultiheadAttention applies out_proj.weight through F.linear, so out_proj's own
    forward (and its hook) never runs: with in_proj frozen, as the refusal of the
    attention's own parameters advises, GRZO used to update out_proj with pure noise
    (cosine 0.13 to the true gradient over 2,000 estimates). Refused naming it, nothing
    written, the counter kept; frozen too, the rest trains."""
    torch.manual_seed(0)
    model = _Attention().double()
    with pytest.raises(TypeError, match="nn.MultiheadAttention's out_proj"):
        fk.GRZO(model, lr=0.1)
    model.att.in_proj_weight.requires_grad_(False)
    model.att.in_proj_bias.requires_grad_(False)
    x = torch.randn(4, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    opt, before = fk.GRZO(model, lr=0.1, normalize="none"), _snapshot(model)
    with pytest.raises(ValueError, match=r"\['att.out_proj.weight', 'att.out_proj.bias'\] were not perturbed"):
        opt.step(lambda: model(x))
    with pytest.raises(ValueError, match="were not perturbed"):
        opt.estimate(lambda: model(x))
    _unchanged(model, before)
    assert opt.call == 0
    model.att.out_proj.requires_grad_(False)
    assert fk.GRZO(model, lr=0.1, normalize="none").step(lambda: model(x)).stepped


def test_a_module_the_closure_skips_in_one_forward_is_refused():
    """A module that runs in the +σ forward but not in the -σ one was perturbed in one
    loss only: δ would hold its whole output change over 2σ."""
    model, idx = _Small(), _tokens()
    calls = []

    def closure():
        calls.append(None)
        h = model.proj(model.norm(model.tok(idx)))
        return ((model.rms(h) if len(calls) == 1 else h) ** 2).sum((1, 2))
    opt, before = fk.GRZO(model, lr=0.1), _snapshot(model)
    with pytest.raises(ValueError, match=r"\['rms.weight'\] were not perturbed"):
        opt.step(closure)
    _unchanged(model, before)


# --- dropout: both forwards draw the same masks -------------------------------------------

class _FixedMask(nn.Module):
    """Dropout with its mask given: h · noise, the product torch's CPU dropout forms."""

    def __init__(self, noise):
        super().__init__()
        self.noise = noise

    def forward(self, h):
        return h * self.noise


@pytest.mark.parametrize("method", ["GRZO", "MeZO"])
def test_dropout_in_training_mode_draws_one_mask_for_both_forwards(method):
    """With dropout 0.1 in training mode, the estimate is bitwise the one where the mask
    that dropout draws from the generator's state at the call is applied by hand: both
    forwards saw that one mask (they used to draw two, and δ took in their difference
    over 2σ: ‖ĝ‖ 871 against 14 in eval mode for GRZO, 1,781 against 3.9 for MeZO).
    Afterwards the generator is where one forward leaves it, so the next call draws anew."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 8, dtype=torch.float64, generator=gen)
    y = torch.randn(8, 1, dtype=torch.float64, generator=gen)

    def estimate(middle):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), middle, nn.Linear(16, 1)).double()
        closure = lambda: ((model(x) - y) ** 2).sum(-1)  # noqa: E731
        torch.manual_seed(7)
        if method == "GRZO":
            return fk.GRZO(model, lr=0.1, normalize="none", seed=3).estimate(closure)
        return fk.MeZO(model, lr=0.1, seed=3).estimate(lambda: closure().mean())

    torch.manual_seed(7)
    noise = torch.nn.functional.dropout(torch.ones(8, 16, dtype=torch.float64), 0.1, training=True)
    after_one_forward = torch.get_rng_state()
    by_hand = estimate(_FixedMask(noise))
    dropout = estimate(nn.Dropout(0.1).train())
    assert torch.equal(torch.get_rng_state(), after_one_forward)
    for name, value in by_hand.items():
        assert_bitwise_equal(dropout[name], value, name)


class _ZerosRecorder(nn.Module):
    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, h):
        self.seen.append(h == 0)
        return h


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["GRZO", "MeZO"])
def test_dropout_on_cuda_draws_one_mask_for_both_forwards(method):
    """On CUDA dropout draws from the device's generator: the two forwards of a call drop
    the same elements, and the generator is then where one forward leaves it. (Not yet
    run: written where no GPU was lent.)"""
    torch.manual_seed(0)
    recorder = _ZerosRecorder()
    model = nn.Sequential(nn.Linear(8, 64), nn.Dropout(0.5), recorder, nn.Linear(64, 1)).cuda()
    x = torch.randn(8, 8, device="cuda")
    closure = lambda: (model(x) ** 2).sum(-1)  # noqa: E731
    torch.cuda.manual_seed(7)
    model(x)
    after_one_forward = torch.cuda.get_rng_state()
    torch.cuda.manual_seed(7)
    recorder.seen.clear()
    if method == "GRZO":
        fk.GRZO(model, lr=0.1, normalize="none").estimate(closure)
    else:
        fk.MeZO(model, lr=0.1).estimate(lambda: closure().mean())
    assert len(recorder.seen) == 2 and recorder.seen[0].any()
    assert torch.equal(recorder.seen[0], recorder.seen[1])
    assert torch.equal(torch.cuda.get_rng_state(), after_one_forward)


# --- data parallelism's weight digest ---------------------------------------------------

def test_the_weight_digest_sees_permutations_and_single_bits_but_not_blocks():
    """What the data-parallel ranks compare of their weights: a permutation of an
    embedding's rows (equal plain sums) or one bit of one bf16 element changes the
    digest; the block size, which ranks need not share, does not."""
    from forge_kernels.zeroth_order.data_parallel import weights_digest
    model = _Small(torch.float32)
    params = [p for p in model.parameters()]
    digest = weights_digest(params, 2**20)
    assert weights_digest(params, 1) == weights_digest(params, 7) == digest
    with torch.no_grad():
        model.tok.weight.copy_(model.tok.weight.flip(0))
    assert weights_digest(params, 2**20) != digest
    half = [p.detach().to(torch.bfloat16) for p in _Small(torch.float32).parameters()]
    flipped = [t.clone() for t in half]
    flipped[2].view(torch.int16)[0] ^= 1
    assert weights_digest(half, 2**20) != weights_digest(flipped, 2**20)
