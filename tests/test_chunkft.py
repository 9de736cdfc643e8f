"""ChunkFT: refusals, sliced backwards against autograd in float64, forward and dX
unchanged, the LR scheduler per optimizer step, the host state store."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import forge_kernels as fk
from forge_kernels.chunkft import sliced
from forge_verify.checks import chunkft
from forge_verify.checks.chunkft import ChunkProblem
from forge_verify.checks.problems import Regime
from forge_verify.numerics.bits import ulp_distance
from forge_verify.numerics.reference import weight_grad_radius
from forge_verify.numerics.tolerances import UNIT_ROUNDOFF


# ----- refusals --------------------------------------------------------------------------
class _MyLinear(nn.Linear):
    pass


@pytest.mark.parametrize("model, named", [
    (nn.Sequential(nn.Conv1d(2, 2, 1), nn.Linear(2, 2)), ["'0.weight' (Conv1d", "'0.bias' (Conv1d"]),
    (nn.Sequential(_MyLinear(2, 2)), ["'0.weight' (_MyLinear"]),
    (nn.Sequential(nn.Embedding(4, 2, max_norm=1.0)), ["'0.weight' (Embedding with max_norm"]),
    (nn.Sequential(nn.Linear(2, 2).double()), ["'0.weight' (torch.float64"]),
    (nn.Sequential(nn.LayerNorm((2, 3))), ["'0.weight' (LayerNorm over 2 dims"]),
])
def test_unsupported_trainable_parameters_are_refused_by_name(model, named):
    with pytest.raises(ValueError, match="ChunkFT cannot train") as error:
        fk.ChunkFT(model, fk.SGD(lr=0.1), chunks=1)
    for text in named:
        assert text in str(error.value)


def test_a_parameter_the_module_does_not_use_is_refused():
    model = nn.Sequential(nn.Linear(2, 2))
    model[0].scale = nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="'0.scale' \\(a parameter Linear does not have of its own"):
        fk.ChunkFT(model, fk.SGD(lr=0.1), chunks=1)


def test_tied_parameters_are_refused():
    model = nn.Sequential(nn.Embedding(4, 3), nn.Linear(3, 4, bias=False))
    model[1].weight = model[0].weight
    with pytest.raises(ValueError, match="tied parameters"):
        fk.ChunkFT(model, fk.SGD(lr=0.1), chunks=1)


def test_frozen_unsupported_modules_are_fine():
    model = nn.Sequential(nn.Conv1d(2, 2, 1).requires_grad_(False), nn.Linear(1, 2))
    ctl = fk.ChunkFT(model, fk.SGD(lr=0.1), chunks=2)
    assert [ctl.chunk_slices(c) for c in range(2)] == [[("1.weight", 0, 0, 2)], [("1.bias", 0, 0, 2)]]


def test_misuse_is_refused(device):
    model = nn.Sequential(nn.Linear(3, 3)).to(device)
    ctl = fk.ChunkFT(model, fk.SGD(lr=0.1), chunks=1)
    x = torch.randn(2, 3).to(device)
    with pytest.raises(TypeError, match="closure"):
        ctl.step()
    with pytest.raises(RuntimeError, match="outside ChunkFT.step"):
        model(x).sum().backward()
    with pytest.raises(RuntimeError, match="ran twice in one ChunkFT step"):
        ctl.step(lambda: model(model(x)).sum())
    with pytest.raises(ValueError, match="empty"):
        fk.ChunkFT(nn.Sequential(nn.Linear(2, 1, bias=False)), fk.SGD(lr=0.1), chunks=2)
    outside = nn.Sequential(nn.Linear(3, 3)).to(device)
    ctl = fk.ChunkFT(outside, fk.SGD(lr=0.1), chunks=1)
    with pytest.raises(RuntimeError, match="from a use outside its module"):
        ctl.step(lambda: (outside(x) + x @ outside[0].weight).sum())


def test_checkpoint_of_another_configuration_is_refused():
    model = nn.Sequential(nn.Linear(4, 4))
    saved = fk.ChunkFT(model, fk.AdamW(lr=0.1), chunks=2).state_dict()
    other = fk.ChunkFT(nn.Sequential(nn.Linear(4, 4)), fk.AdamW(lr=0.1), chunks=3)
    with pytest.raises(ValueError, match=r"another configuration: \['chunks', 'plan'\]"):
        other.load_state_dict(saved)


@pytest.mark.parametrize("changed, named", [
    (dict(rounding="nearest"), r"\['rounding'\] differ.*'stochastic'.*'nearest'"),
    (dict(rule=fk.AdamW(lr=1e-2, betas=(0.5, 0.6))), r"\['rule'\] differ.*betas=\(0.9, 0.999\).*betas=\(0.5, 0.6\)"),
    (dict(rule=fk.AdamW(lr=1e-2, weight_decay=0.0)), r"\['rule'\] differ.*weight_decay=0.01.*weight_decay=0.0"),
    (dict(rule=fk.SGD(lr=1e-2)), r"\['rule'\] differ.*SGD\(momentum"),
    (dict(config=fk.TileConfig(block_t=64)), r"\['config'\] differ")])
def test_checkpoint_with_other_rule_settings_rounding_or_tile_config_is_refused(changed, named):
    """A checkpoint resumes bit for bit only under the rounding, the tile config (its token
    block orders the sums) and the rule's settings it was saved with: any other is refused,
    naming it. The learning rate is not compared (a scheduler owns it): the checkpoint's
    own is restored."""
    problem = ChunkProblem(vocab=5, width=4, hidden=4, batch=1, length=2, seed=0)
    model = problem.model(torch.bfloat16)
    ctl = fk.ChunkFT(model, fk.AdamW(lr=1e-2), 2, state_format="bf16")
    ((tokens, targets),) = problem.batches(1)
    ctl.step(lambda: F.cross_entropy(model(tokens).float().reshape(-1, 5), targets.reshape(-1)))
    saved = ctl.state_dict()
    options = dict(rule=fk.AdamW(lr=1e-2), rounding=None, config=None) | changed
    other = fk.ChunkFT(problem.model(torch.bfloat16), options.pop("rule"), 2, state_format="bf16", **options)
    with pytest.raises(ValueError, match=named):
        other.load_state_dict(saved)
    scheduled = fk.ChunkFT(problem.model(torch.bfloat16), fk.AdamW(lr=5e-3), 2, state_format="bf16",
                           rounding="stochastic", config=fk.PINNED)
    scheduled.load_state_dict(saved)  # another initial rate, the default rounding and config named
    assert scheduled.param_groups[0]["lr"] == 1e-2


def test_checkpoint_loads_where_a_setting_is_the_same_number_written_otherwise():
    """momentum=0 and momentum=0.0 are one rule: a checkpoint of one loads into the other
    (the settings are compared as fused checkpoints record them, numbers as floats)."""
    saved = fk.ChunkFT(nn.Sequential(nn.Linear(4, 4)), fk.SGD(lr=0.1, momentum=0), chunks=2).state_dict()
    fk.ChunkFT(nn.Sequential(nn.Linear(4, 4)), fk.SGD(lr=0.1, momentum=0.0), chunks=2).load_state_dict(saved)


@pytest.mark.parametrize("state_format", ["fp32", "bf16", "q8"])
def test_one_chunk_is_the_plain_fused_update(state_format, device):
    """chunks=1 (the properties' dense step) is fk.fused_weight_update on the whole weight
    with the tensor's rounding key: bitwise, weight and state."""
    torch.manual_seed(0)
    layer = nn.Linear(40, 6, bias=False).to(device)
    weight = layer.weight.detach().clone()
    rule = fk.AdamW(lr=1e-2, weight_decay=0.1)
    ctl = fk.ChunkFT(nn.Sequential(layer), rule, chunks=1, seed=5, state_format=state_format)
    x = torch.randn(3, 40).to(device)
    dy = torch.randn(3, 6).to(device)
    ctl.step(lambda: (layer(x) * dy).sum())
    state = rule.init_state(weight, state_format=state_format)
    fk.fused_weight_update(x, dy, weight, state, rule, 1, seed=fk.chunkft.tensor_seed(5, 0))
    assert torch.equal(layer.weight.detach().view(torch.int32), weight.view(torch.int32))
    for key, tensor in ctl.chunk_state(0)["0.weight"].items():
        assert torch.equal(tensor, state[key]), key


# ----- sliced backwards against autograd, float64 -----------------------------------------
@pytest.mark.parametrize("padding_idx", [None, 3])
@pytest.mark.parametrize("scale_grad_by_freq", [False, True])
def test_sliced_embedding_gradient_is_autograds_slice_bitwise(padding_idx, scale_grad_by_freq):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(29, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    indices = torch.randint(0, 29, (4, 11), generator=gen)
    indices[0, :4] = 3  # the padding row, several times
    dy = torch.randn(4, 11, 8, dtype=torch.float64, generator=gen)
    F.embedding(indices, weight, padding_idx=padding_idx, scale_grad_by_freq=scale_grad_by_freq).backward(dy)
    for start, stop in [(0, 29), (0, 1), (3, 4), (2, 17), (17, 29)]:
        grad = sliced.embedding_weight_grad(indices, dy, start, stop, padding_idx=padding_idx,
                                            scale_grad_by_freq=scale_grad_by_freq)
        assert torch.equal(grad, weight.grad[start:stop]), (start, stop)
    if padding_idx is not None:
        assert not sliced.embedding_weight_grad(indices, dy, 0, 29, padding_idx=padding_idx)[padding_idx].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_token_sum_of_a_column_slice_is_the_slice_of_the_whole_sum_bitwise(dtype):
    """sliced.token_sum reads each column alone, in token order: a column slice's sum has
    the whole sum's bits, 1 to 1,000 tokens. The control, torch's sum(0), blocks the
    reduction by position: some of its slices' sums are not the whole's (proofs/chunkft.md §1)."""
    gen = torch.Generator().manual_seed(0)
    control_differs = 0
    for tokens in (1, 2, 3, 16, 17, 100, 257, 1000):
        x = torch.randn(tokens, 37, generator=gen, dtype=dtype)
        whole, whole_sum = sliced.token_sum(x), x.sum(0)
        for start, stop in [(0, 1), (1, 37), (3, 20), (18, 37), (36, 37), (0, 36)]:
            assert torch.equal(sliced.token_sum(x[:, start:stop]), whole[start:stop]), (tokens, start, stop)
            control_differs += not torch.equal(x[:, start:stop].sum(0), whole_sum[start:stop])
    assert control_differs > 0


def test_chunk_steps_cutting_a_bias_are_the_dense_steps():
    """A pinned case of the exactness property whose chunks cut the Linear bias inside
    (up.bias 0:6 and 6:10; 3 chunks, rows) with 16 tokens a step: a token sum whose bits
    depend on the slice (torch's sum(0) for token_sum) fails it."""
    problem = ChunkProblem(vocab=7, width=9, hidden=10, batch=2, length=8, seed=24520513)
    chunkft.chunk_step_matches_dense(problem, fk.SGD(lr=0.1), Regime(), 3, "rows", cycles=1)


@pytest.mark.parametrize("kind, bias", [("layer_norm", True), ("layer_norm", False), ("rms_norm", False)])
def test_sliced_norm_gradients_are_autograds_slice_within_their_rounding_bound(kind, bias):
    """Both gradients are float64 computations of Σ_t dy·x̂ (Σ_t dy for the bias), each
    within the bound of proofs/chunkft.md §8 of the exact value: they differ by at most
    twice it, element by element."""
    gen = torch.Generator().manual_seed(1)
    width = 24
    x = torch.randn(3, 7, width, dtype=torch.float64, generator=gen) * 3 + 1
    weight = (torch.randn(width, dtype=torch.float64, generator=gen)).requires_grad_()
    b = torch.randn(width, dtype=torch.float64, generator=gen).requires_grad_() if bias else None
    dy = torch.randn(3, 7, width, dtype=torch.float64, generator=gen)
    eps = 1e-5 if kind == "layer_norm" else None
    if kind == "layer_norm":
        F.layer_norm(x, (width,), weight, b, eps).backward(dy)
    else:
        F.rms_norm(x, (width,), weight, eps).backward(dy)
    u = UNIT_ROUNDOFF[torch.float64]
    eps_value = torch.finfo(torch.float64).eps if eps is None else eps  # torch's default for float64 input
    weight_bound = 2 * chunkft.norm_weight_grad_bound(x, dy, kind, eps_value, u)
    bias_bound = 2 * chunkft.token_sum_bound(dy.abs(), u)
    for start, stop in [(0, width), (0, 1), (5, 13), (23, 24)]:
        grad = sliced.norm_weight_grad(x, dy, start, stop, kind, eps)
        assert bool(((grad - weight.grad[start:stop]).abs() <= weight_bound[start:stop]).all()), (start, stop)
        if bias:
            bias_grad = sliced.bias_grad(dy, start, stop)
            assert bool(((bias_grad - b.grad[start:stop]).abs() <= bias_bound[start:stop]).all()), (start, stop)


class _Stack(nn.Module):
    """Every module kind, float64-free: input features in, so dX can be compared."""

    def __init__(self, norm_bias):
        super().__init__()
        self.a = nn.Linear(6, 40)
        self.norm = nn.LayerNorm(40, bias=norm_bias)
        self.rms = nn.RMSNorm(40)
        self.b = nn.Linear(40, 5, bias=False)

    def forward(self, x):
        return self.b(self.rms(self.norm(self.a(x))))


@pytest.mark.parametrize("split", ["rows", "cols"])
@pytest.mark.parametrize("norm_bias", [True, False])
def test_forward_and_input_gradient_are_unchanged(split, norm_bias, device):
    torch.manual_seed(0)
    plain = _Stack(norm_bias).to(device)
    chunked = _Stack(norm_bias).to(device)
    chunked.load_state_dict(plain.state_dict())
    ctl = fk.ChunkFT(chunked, fk.AdamW(lr=1e-3), chunks=3, split=split)
    x = torch.randn(2, 3, 6).to(device)
    x_plain, x_chunked = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = plain(x_plain)
    out.square().sum().backward()
    seen = []
    ctl.step(lambda: seen.append(chunked(x_chunked)) or seen[-1].square().sum())
    assert torch.equal(seen[0], out)
    assert torch.equal(x_chunked.grad, x_plain.grad)
    assert all(p.grad is None for p in chunked.parameters())


# ----- learning rate, state store ---------------------------------------------------------
def test_lr_scheduler_drives_the_rule_per_optimizer_step():
    problem = ChunkProblem(vocab=5, width=4, hidden=4, batch=1, length=2, seed=0)
    model = problem.model()
    rule = fk.SGD(lr=0.1)
    ctl = fk.ChunkFT(model, rule, chunks=3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(ctl, lambda t: 0.5 ** t)
    seen = []
    for tokens, targets in problem.batches(5):
        ctl.step(lambda: seen.append(rule.lr) or F.cross_entropy(model(tokens).reshape(-1, 5), targets.reshape(-1)))
        scheduler.step()
    assert seen == [0.1 * 0.5 ** t for t in range(5)]


def test_host_state_store_gives_the_device_stores_bits(device):
    """The offload is a copy in the state's own dtype, bitwise. On the CPU the host store
    makes the same fresh copy it makes from a GPU (synchronously), so a lossy offload
    (the anchor's bf16) fails here on either tier."""
    problem = ChunkProblem(vocab=6, width=5, hidden=7, batch=1, length=3, seed=2)
    runs = []
    for store in ("device", "host"):
        model = problem.model()
        ctl = fk.ChunkFT(model, fk.AdamW(lr=1e-2), chunks=2, state_store=store)
        for tokens, targets in problem.batches(5):
            ctl.step(lambda: F.cross_entropy(model(tokens).reshape(-1, 6), targets.reshape(-1)))
        runs.append([p.detach().clone() for p in model.parameters()])
        inactive = ctl.chunk_state(1 - ctl.active_chunk)  # the host store's is in host memory, the device's not
        where = "cpu" if store == "host" else device.type
        assert all(t.device.type == where for s in inactive.values() for t in s.values())
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_remove_gives_the_model_its_forwards_back_and_step_then_refuses():
    """After remove() the model's own backward fills .grad; a ChunkFT step would step
    nothing (and count a step): it is refused."""
    model = nn.Sequential(nn.Linear(3, 3))
    ctl = fk.ChunkFT(model, fk.SGD(lr=0.1), chunks=1)
    ctl.remove()
    x = torch.randn(2, 3)
    model(x).sum().backward()
    assert model[0].weight.grad is not None
    weight = model[0].weight.detach().clone()
    with pytest.raises(RuntimeError, match=r"ChunkFT.step after remove\(\)"):
        ctl.step(lambda: model(x).sum())
    assert ctl.steps_taken == 0 and torch.equal(model[0].weight.detach(), weight)


@pytest.mark.parametrize("index", [-1, 2, 1.0, True])
def test_a_chunk_index_out_of_range_is_refused_by_every_accessor(index):
    ctl = fk.ChunkFT(nn.Sequential(nn.Linear(3, 3)), fk.SGD(lr=0.1), chunks=2)
    for accessor in (ctl.chunk_slices, ctl.local_slices, ctl.chunk_state, ctl.slice_steps, ctl.reduced_bytes):
        with pytest.raises(ValueError, match=r"chunk index must be in \[0, 2\)"):
            accessor(index)


def test_descent_check_fails_a_step_too_long():
    """The descent property's control: on orthogonal inputs (every direction a top
    eigenvector, the lemma tight) lr = 1.2/L_c leaves f above the lemma's bound."""
    gen = torch.Generator().manual_seed(3)
    x = torch.linalg.qr(torch.randn(16, 8, generator=gen, dtype=torch.float64))[0].float() * 2
    y, w0 = torch.randn(16, 6, generator=gen), torch.randn(6, 8, generator=gen)
    for split in ("rows", "cols"):
        assert chunkft.sgd_chunk_step_descends(x, y, w0, 3, split, steps=3) <= 1
        with pytest.raises(AssertionError, match="above the descent bound"):
            chunkft.sgd_chunk_step_descends(x, y, w0, 3, split, steps=3, lr_factor=1.2)


def test_readme_example_runs(tmp_path, monkeypatch):
    import re
    from pathlib import Path
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme.split("## ChunkFT: full-parameter fine-tuning over a rotating working set", 1)[1]
    source = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    problem = ChunkProblem(vocab=7, width=6, hidden=5, batch=2, length=3, seed=4)
    model = problem.model()
    monkeypatch.chdir(tmp_path)  # it saves a checkpoint
    names = {"model": model, "batches": problem.batches(3),
             "loss_fn": lambda logits, targets: F.cross_entropy(logits.reshape(-1, 7), targets.reshape(-1))}
    exec(compile(source, "README.md", "exec"), names)
    assert names["ctl"].chunk_steps == (1, 1, 1, 0, 0, 0, 0, 0)
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert saved["chunkft"]["position"] == 3


class _Wrap(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


@pytest.mark.parametrize("padding_idx, scale_grad_by_freq", [(None, False), (2, False), (2, True)])
def test_embedding_step_is_the_rule_on_autograds_gradient(padding_idx, scale_grad_by_freq, device):
    """Model level: what ChunkFT's Embedding backward feeds the rule is autograd's gradient
    (fp32, bitwise): the padding row and the frequency scaling reach the update."""
    torch.manual_seed(1)
    embedding = nn.Embedding(9, 4, padding_idx=padding_idx, scale_grad_by_freq=scale_grad_by_freq)
    plain = nn.Embedding(9, 4, padding_idx=padding_idx, scale_grad_by_freq=scale_grad_by_freq)
    plain.load_state_dict(embedding.state_dict())
    embedding, plain = embedding.to(device), plain.to(device)
    tokens = torch.tensor([[2, 2, 5, 1, 2, 7]]).to(device)
    dy = torch.randn(1, 6, 4).to(device)
    rule = fk.SGD(lr=0.5)
    ctl = fk.ChunkFT(_Wrap(embedding), rule, chunks=1)
    ctl.step(lambda: (embedding(tokens) * dy).sum())
    (plain(tokens) * dy).sum().backward()
    expected = plain.weight.detach().clone()
    fk.apply_rule(plain.weight.grad, expected, rule.init_state(expected), rule, 1,
                  seed=fk.chunkft.tensor_seed(0, 0))
    assert torch.equal(embedding.weight.detach(), expected)
    if padding_idx is not None:
        assert torch.equal(embedding.weight.detach()[padding_idx], plain.weight.detach()[padding_idx])


def _gradient_bound(module, name, x, dy, backend):
    """Bound on |computed − exact| of parameter ``name``'s fp32 gradient, ChunkFT's and
    autograd's alike (proofs/chunkft.md §8): a norm weight's Σ dy·x̂, a bias's Σ dy, a
    Linear weight's dyᵀx through the kernel's accumulation (the tolerance table's, as the
    reference's enclosure of it)."""
    u = UNIT_ROUNDOFF[torch.float32]
    if name == "bias":
        return chunkft.token_sum_bound(dy.abs(), u)
    if isinstance(module, nn.Linear):
        return weight_grad_radius(x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1]), backend)
    if isinstance(module, nn.LayerNorm):
        return chunkft.norm_weight_grad_bound(x, dy, "layer_norm", module.eps, u)
    return chunkft.norm_weight_grad_bound(x, dy, "rms_norm", sliced.rms_norm_eps(module.eps, x.dtype), u)


@pytest.mark.parametrize("make, input_dtype", [
    (lambda: nn.LayerNorm(12), torch.float32), (lambda: nn.LayerNorm(12, bias=False), torch.float32),
    (lambda: nn.RMSNorm(12), torch.float32), (lambda: nn.RMSNorm(12, eps=1e-3), torch.float32),
    (lambda: nn.RMSNorm(12), torch.bfloat16), (lambda: nn.Linear(5, 12), torch.float32)],
    ids=["ln", "ln-nobias", "rms", "rms-eps", "rms-bf16-input", "linear"])
# A bf16 input into the fp32 weight takes torch's unfused rms_norm, which warns (as for the plain module).
@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
def test_norm_and_bias_steps_follow_autograds_gradient(make, input_dtype, device, backend):
    """Model level: an SGD step of each norm (and a Linear's bias) moves its parameters by
    lr times autograd's gradient, element by element within both gradients' rounding
    bounds and the step's (proofs/chunkft.md §8; a norm stepped with another norm's
    mathematics, the anchor's RMSNorm defect, is off by its whole gradient, and so is
    nn.RMSNorm's default ε taken as the bf16 input's machine epsilon, not torch's float32 one)."""
    torch.manual_seed(2)
    module, plain = make(), make()
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    plain.load_state_dict(module.state_dict())
    module, plain = module.to(device), plain.to(device)
    width = module.weight.shape[1] if isinstance(module, nn.Linear) else 12
    x = (torch.randn(4, 3, width) * 2 + 0.5).to(device, input_dtype)
    dy = torch.randn(4, 3, 12).to(device)
    lr = 0.25
    ctl = fk.ChunkFT(_Wrap(module), fk.SGD(lr=lr), chunks=1)
    ctl.step(lambda: (module(x) * dy).sum())
    out = plain(x)
    (out * dy).sum().backward()
    dy_seen = dy.to(out.dtype)  # a bf16 output receives dy rounded to bf16
    for (name, p), q in zip(module.named_parameters(), plain.parameters()):
        step = (q.detach().double() - p.detach().double()) / lr
        grad_bound = _gradient_bound(module, name, x, dy_seen, backend).to(step.device)
        autograd = q.grad.double()
        bound = 2 * grad_bound + chunkft.sgd_step_bound(q.detach(), lr, autograd.abs() + 2 * grad_bound,
                                                       UNIT_ROUNDOFF[torch.float32])
        assert bool(((step - autograd).abs() <= bound).all()), name


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_rms_norm_default_eps_is_torchs_for_every_input_dtype(dtype):
    """nn.RMSNorm(eps=None) takes the machine epsilon of the dtype rms_norm computes in:
    float32 for float16 and bfloat16 inputs, not theirs (the control: their own epsilon
    gives other bits)."""
    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(8, 16, generator=gen, dtype=torch.float64) * 0.01).to(dtype)  # mean(x²) near ε
    weight = torch.randn(16, generator=gen, dtype=torch.float64).to(dtype)
    default = F.rms_norm(x, (16,), weight)
    assert torch.equal(default, F.rms_norm(x, (16,), weight, sliced.rms_norm_eps(None, dtype)))
    assert sliced.rms_norm_eps(1e-3, dtype) == 1e-3
    if dtype in (torch.float16, torch.bfloat16):
        assert not torch.equal(default, F.rms_norm(x, (16,), weight, torch.finfo(dtype).eps))


@pytest.mark.parametrize("state_format", ["fp32", "q8"])
def test_state_is_made_on_first_visit_and_sized_to_the_chunks_slices(state_format):
    """Optimizer memory follows the chunk: no state before a chunk's first visit, and a
    visited chunk's state holds its slices' elements only (per slot)."""
    problem = ChunkProblem(vocab=6, width=40, hidden=36, batch=1, length=2, seed=3)
    model = problem.model()
    ctl = fk.ChunkFT(model, fk.AdamW(lr=1e-3), chunks=3, split="cols", state_format=state_format)
    assert all(not ctl.chunk_state(c) for c in range(3))
    tokens, targets = problem.batches(1)[0]
    ctl.step(lambda: F.cross_entropy(model(tokens).reshape(-1, 6), targets.reshape(-1)))
    assert all(not ctl.chunk_state(c) for c in range(1, 3))
    params = dict(model.named_parameters())
    for name, dim, start, stop in ctl.chunk_slices(0):
        shape = list(params[name].shape)
        shape[dim] = stop - start
        for slot in ("exp_avg", "exp_avg_sq"):
            assert ctl.chunk_state(0)[name][slot].numel() == torch.Size(shape).numel()


class _Branch(nn.Module):
    """``b`` runs only when asked: a conditional branch, or an MoE expert given no tokens."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)

    def forward(self, x, use_b):
        h = self.a(x)
        return self.b(h) if use_b else h


def test_a_slice_whose_module_did_not_run_keeps_its_step_count(device):
    """Each (tensor, chunk) slice counts the steps it was stepped in, as torch.optim counts
    a parameter's steps only when it has a gradient: ``b``, skipped at the first step,
    takes AdamW's first step (step 1's bias corrections) at the second, bitwise
    ``fused_weight_update``'s at step 1; torch.optim.AdamW, stepping the plain model on
    autograd's gradients, lands within the suite's 64 ulp of it (tests/test_interval.py)."""
    torch.manual_seed(0)
    model, plain = _Branch().to(device), _Branch().to(device)
    plain.load_state_dict(model.state_dict())
    rule = fk.AdamW(lr=1e-2, weight_decay=0.0)
    ctl = fk.ChunkFT(model, rule, chunks=1, seed=3)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.0)
    x = torch.randn(8, 4).to(device)
    for use_b in (False, True):
        a_before, b_before = model.a.weight.detach().clone(), model.b.weight.detach().clone()
        ctl.step(lambda: model(x, use_b).square().sum())
        optimizer.zero_grad(set_to_none=True)
        plain(x, use_b).square().sum().backward()
        optimizer.step()
    assert ctl.slice_steps(0) == {"a.weight": 2, "b.weight": 1}
    assert optimizer.state[plain.b.weight]["step"] == 1
    h = F.linear(x, a_before)
    expected = b_before.clone()
    fk.fused_weight_update(h, 2 * F.linear(h, b_before), expected, rule.init_state(expected), rule, 1,
                           seed=fk.chunkft.tensor_seed(3, 1))
    assert torch.equal(model.b.weight.detach().view(torch.int32), expected.view(torch.int32))
    assert int(ulp_distance(model.b.weight.detach(), plain.b.weight.detach()).abs().max()) < 64


def test_slice_step_counts_resume_from_a_checkpoint_and_older_checkpoints_are_refused(device):
    """A checkpoint holds each slice's step count: resumed after a step that skipped ``b``,
    the run continues bit for bit. A checkpoint without them (saved when the counts were
    per chunk, which cannot say what a step skipped) is refused by name."""
    torch.manual_seed(0)
    x = torch.randn(8, 4).to(device)
    runs = []
    for resume in (False, True):
        torch.manual_seed(1)
        model = _Branch().to(device)
        ctl = fk.ChunkFT(model, fk.AdamW(lr=1e-2), chunks=1)
        for t, use_b in enumerate((False, True, True)):
            if resume and t == 1:
                saved = ctl.state_dict()
                weights = model.state_dict()
                model = _Branch().to(device)
                model.load_state_dict(weights)
                ctl = fk.ChunkFT(model, fk.AdamW(lr=1e-2), chunks=1)
                ctl.load_state_dict(saved)
            ctl.step(lambda: model(x, use_b).square().sum())
        runs.append([p.detach().view(torch.int32) for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    del saved["steps"]
    with pytest.raises(ValueError, match=r"without per-slice step counts \('steps'\)"):
        ctl.load_state_dict(saved)


def test_clipping_finds_no_gradient_and_accumulating_micro_batches_is_refused(device):
    """What README's ChunkFT section says of the two unsupported practices: after a step no
    parameter has a .grad, so clip_grad_norm_ returns 0 and clips nothing; a micro-batch's
    backward outside step() (how accumulation starts) is refused by name."""
    model = nn.Sequential(nn.Linear(4, 4)).to(device)
    ctl = fk.ChunkFT(model, fk.SGD(lr=0.1), chunks=1)
    x = torch.randn(3, 4).to(device)
    ctl.step(lambda: model(x).square().sum())
    assert all(p.grad is None for p in model.parameters())
    assert float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)) == 0.0
    with pytest.raises(RuntimeError, match="outside ChunkFT.step"):
        model(x).square().sum().backward()
