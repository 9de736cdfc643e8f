"""The zeroth-order Triton kernels against the torch path they replace, bit for bit.

``draws.py``'s torch functions are the oracle; ``draw_kernel`` must give the same bits
for the normals (float64 and float32) and the signs, at every counter, key, shape, shard
offset and example offset, and GRZO and MeZO run with the kernels must give the same
losses and the same weights as with the torch path. On the CPU the kernels run in the
Triton interpreter (``use_kernels(True)`` forces them there); on a GPU the same tests
compare the compiled kernels with torch on CUDA, and the tests marked ``gpu`` compare
the CUDA draws with the CPU oracle.
"""

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import forge_kernels as fk
from forge_kernels.zeroth_order import draw_kernel, draws
from forge_kernels.zeroth_order.draws import BASE, COL, ROW, CallDraws, philox4x32, stream_key
from forge_kernels.zeroth_order.targets import Shard, Target
from forge_verify.numerics.bits import assert_bitwise_equal
from forge_verify.numerics.philox import philox_words

exactness = pytest.mark.exactness
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="compares the compiled kernel on CUDA with the CPU oracle: needs a CUDA GPU")
counters = st.integers(0, 2**32 - 1)
keys = st.integers(0, 2**63 - 1)


@triton.jit
def _words_kernel(out_ptr, counter_ptr, n, key, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    counter = tl.load(counter_ptr + i, mask=mask, other=0).to(tl.uint32)
    w0, w1, w2, w3 = tl.randint4x(key, counter)
    # Four stores written out: the compiler has no enumerate (the interpreter does).
    tl.store(out_ptr + i, w0.to(tl.int64) & 0xFFFFFFFF, mask=mask)
    tl.store(out_ptr + n + i, w1.to(tl.int64) & 0xFFFFFFFF, mask=mask)
    tl.store(out_ptr + 2 * n + i, w2.to(tl.int64) & 0xFFFFFFFF, mask=mask)
    tl.store(out_ptr + 3 * n + i, w3.to(tl.int64) & 0xFFFFFFFF, mask=mask)


@exactness
@settings(max_examples=20)
@given(key=keys, values=st.lists(counters, min_size=1, max_size=40))
def test_triton_randint4x_is_the_philox_of_draws(key, values, device):
    """draws.py's docstring says its Philox is ``tl.randint4x(key, counter)`` with a
    32-bit counter; all four words agree with it and with the numpy reference."""
    counter = torch.tensor(values, dtype=torch.int64, device=device)
    out = torch.empty(4, len(values), dtype=torch.int64, device=device)
    _words_kernel[(1,)](out, counter, len(values), key, BLOCK=64)
    expected = philox4x32(key, counter.cpu())
    reference = philox_words(key, np.array(values, dtype=np.uint64).astype(np.uint32))
    for slot in range(4):
        assert torch.equal(out[slot].cpu(), expected[slot])
        assert np.array_equal(out[slot].cpu().numpy().astype(np.uint32), reference[slot])


def _flat(kind_normal, key, counter_start, n, dtype, device):
    return draw_kernel.draw(kind_normal, key, n, dtype, device, start=counter_start, cols=2**32)


@exactness
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("start", [0, 2**31 - 700, 2**32 - 5000], ids=["zero", "2^31", "2^32"])
def test_normals_equal_the_torch_path_on_a_counter_range(dtype, start, device):
    """5,000 consecutive counters: through 2**31 (int32 sign) and up to the last counter."""
    key = stream_key(11, 4, "blocks.0.mlp.weight", BASE)
    counter = torch.arange(start, start + 5000, dtype=torch.int64)
    assert_bitwise_equal(_flat(True, key, start, 5000, dtype, device).cpu(),
                         draws.standard_normal(key, counter, dtype), "normals")
    assert_bitwise_equal(_flat(False, key, start, 5000, dtype, device).cpu(),
                         draws.rademacher(key, counter, dtype), "signs")


@exactness
@settings(max_examples=25)
@given(key=keys, start=counters, n=st.integers(1, 300))
def test_normals_and_signs_equal_the_torch_path_at_any_key(key, start, n, device):
    start = min(start, 2**32 - n)
    counter = torch.arange(start, start + n, dtype=torch.int64)
    for dtype in (torch.float64, torch.float32):
        assert_bitwise_equal(_flat(True, key, start, n, dtype, device).cpu(),
                             draws.standard_normal(key, counter, dtype), "normals")
    assert_bitwise_equal(_flat(False, key, start, n, torch.bfloat16, device).cpu(),
                         draws.rademacher(key, counter, torch.bfloat16), "signs")


@exactness
def test_the_normals_extreme_words_equal_the_torch_path(device):
    """The Box–Muller's edges: w0 at 0 (the largest radius) and 2**32 - 1 (u1 next to 1,
    the smallest), w1 at each quadrant's ends, found by a search over counters of one key
    and drawn again by the kernel."""
    key = stream_key(0, 0, "edge", BASE)
    counter = torch.arange(0, 2**22, dtype=torch.int64)
    w0, w1, _, _ = philox4x32(key, counter)
    picks = [int(torch.argmin(w0)), int(torch.argmax(w0))]
    for edge in (0, 2**30, 2**31, 3 * 2**30, 2**32 - 1):
        picks.append(int(torch.argmin((w1 - edge).abs())))
    for pick in picks:
        expected = draws.standard_normal(key, torch.tensor([pick]), torch.float64)
        assert_bitwise_equal(_flat(True, key, pick, 1, torch.float64, device).cpu(), expected, f"counter {pick}")


class _Param:
    """A stand-in module for a target: the draws read only the parameter and the name."""


def _target(name, shape, dtype, device, shard=None, role=None):
    param = nn.Parameter(torch.zeros(shape, dtype=dtype, device=device))
    role = role or ("linear" if len(shape) == 2 else "scale")
    return Target(name, _Param(), param, role, shard)


SHAPES = [
    ((1, 1), None),
    ((7, 13), None),
    ((33, 65), None),
    ((5, 17), Shard((40, 50), (9, 31))),
    ((16, 1), Shard((2**17, 2**15), (2**17 - 16, 2**15 - 1))),  # the whole's last counters: 2**32 - 1
]


@exactness
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("shape,shard", SHAPES, ids=[str(s) for s, _ in SHAPES])
def test_call_draws_base_and_signs_equal_the_torch_path(shape, shard, dtype, device):
    """CallDraws with the kernels (``use_kernels(True)``) against the torch path: U in row
    blocks (also a gathered, unsorted row set, as embeddings draw), each kind of sign for
    examples at an offset (``first``, a data-parallel rank's), at the shard's offsets."""
    target = _target("layer.weight", shape, dtype, device, shard)
    rows = shape[0]
    row_sets = [torch.arange(rows, device=device), torch.arange(rows // 2, rows, device=device),
                torch.tensor([rows - 1, 0, rows // 2, 0], device=device)]
    for call in (0, 3):
        with draws.use_kernels(True):
            fast = CallDraws(5, call)
            got = [fast.base(target, r) for r in row_sets] + \
                  [fast.signs(target, kind, 4, first) for kind in (ROW, COL) for first in (0, 6)]
        with draws.use_kernels(False):
            oracle = CallDraws(5, call)
            want = [oracle.base(target, r) for r in row_sets] + \
                   [oracle.signs(target, kind, 4, first) for kind in (ROW, COL) for first in (0, 6)]
        for index, (a, b) in enumerate(zip(got, want)):
            assert_bitwise_equal(a, b, f"draw {index} at call {call}")


@exactness
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("size,shard", [(1, None), (37, None), (12, Shard((100,), (88,)))])
def test_call_draws_vector_base_equals_the_torch_path(size, shard, dtype, device):
    target = _target("norm.weight", (size,), dtype, device, shard)
    with draws.use_kernels(True):
        got = CallDraws(9, 2).base(target, None), CallDraws(9, 2).signs(target, ROW, 3, 1)
    with draws.use_kernels(False):
        want = CallDraws(9, 2).base(target, None), CallDraws(9, 2).signs(target, ROW, 3, 1)
    for a, b in zip(got, want):
        assert_bitwise_equal(a, b, "vector draws")


@exactness
def test_a_target_past_one_stream_takes_the_torch_path_and_its_error(device):
    """A shard whose whole has more than 2**32 elements: its rows past the last counter
    raise the torch path's error under the kernels as without them; its rows below do not."""
    target = _target("big.weight", (4, 8), torch.float32, device, Shard((2**29 + 4, 8), (2**29, 0)))
    for choice in (True, False):
        with draws.use_kernels(choice):
            with pytest.raises(ValueError, match="2\\*\\*32 counters"):
                CallDraws(1, 0).base(target, torch.arange(4, device=device))
    low = _target("big.weight", (4, 8), torch.float32, device, Shard((2**29 + 4, 8), (2**29 - 4, 0)))
    with draws.use_kernels(True):
        got = CallDraws(1, 0).base(low, torch.arange(4, device=device))
    with draws.use_kernels(False):
        want = CallDraws(1, 0).base(low, torch.arange(4, device=device))
    assert_bitwise_equal(got, want, "the rows below the last counter")


def test_kernels_run_on_cuda_by_default_and_on_the_cpu_only_when_asked():
    assert draws.kernels_for(torch.device("cuda")) is True
    assert draws.kernels_for(torch.device("cpu")) is False
    with draws.use_kernels(False):
        assert draws.kernels_for(torch.device("cuda")) is False
    with draws.use_kernels(True):
        assert draws.kernels_for(fk.kernel_device()) is True
    with pytest.raises(ValueError):
        with draws.use_kernels("yes"):
            pass


def test_the_constant_table_holds_portable_maths_constants_exactly():
    table = draw_kernel.constant_table(torch.device("cpu"))
    assert table.tolist() == draw_kernel.constant_values()


@needs_cuda
@exactness
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_the_cuda_kernel_draws_the_cpu_oracles_bits(dtype):
    """The draws are the same on every device: the compiled kernel on CUDA against the
    torch path on the CPU, over 2**20 counters of two keys (needs a CUDA GPU: the
    compiled kernel and CUDA's float64 arithmetic are what is checked)."""
    for key in (stream_key(1, 0, "w", BASE), 2**63 - 1):
        counter = torch.arange(2**32 - 2**20, 2**32, dtype=torch.int64)
        got = draw_kernel.draw(True, key, 2**20, dtype, "cuda", start=2**32 - 2**20, cols=2**32)
        assert_bitwise_equal(got.cpu(), draws.standard_normal(key, counter, dtype), "CUDA normals")


# --- whole steps: GRZO and MeZO with the kernels against the torch path --------------------

def _model(dtype, device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(37, 24, padding_idx=3), nn.LayerNorm(24), nn.Linear(24, 33),
                          nn.RMSNorm(33), nn.Linear(33, 19, bias=False))
    return model.to(device=device, dtype=dtype)


def _batch(dtype, device, batch=6):
    tokens = torch.randint(0, 37, (batch, 5), generator=torch.Generator().manual_seed(1))
    target = torch.randn(batch, 5, 19, generator=torch.Generator().manual_seed(2))
    return tokens.to(device), target.to(device=device, dtype=dtype)


def _bits(tensors):
    return [t.detach().clone() for t in tensors]


KERNEL_ENTRY_POINTS = [("draw_kernel", "draw"), ("update_kernel", "grzo_update"), ("mezo_kernel", "mezo_shift"),
                       ("mezo_kernel", "mezo_update")]


@pytest.fixture
def launches(monkeypatch):
    """Calls of each kernel entry point during a test: a run "with the kernels" that no
    longer reached them would compare the torch path with itself and pass."""
    import importlib
    counts = {}
    for module_name, function_name in KERNEL_ENTRY_POINTS:
        module = importlib.import_module(f"forge_kernels.zeroth_order.{module_name}")
        original = getattr(module, function_name)

        def counted(*args, _original=original, _name=function_name, **kwargs):
            name = _name + (" (estimate)" if kwargs.get("estimate_only") else "")
            counts[name] = counts.get(name, 0) + 1
            return _original(*args, **kwargs)
        monkeypatch.setattr(module, function_name, counted)
    return counts


def _run(method, kernels, dtype, device, shards=None, steps=2, **options):
    model = _model(dtype, device)
    tokens, target = _batch(dtype, device)
    per_example = lambda: ((model(tokens) - target).float() ** 2).mean((1, 2))  # noqa: E731
    with draws.use_kernels(kernels):
        if method == "GRZO":
            opt = fk.GRZO(model, lr=1e-2, sigma=1e-2, seed=5, block_elements=100, shards=shards, **options)
            results = [opt.step(per_example) for _ in range(steps)]
            estimate = opt.estimate(per_example)
        else:
            opt = fk.MeZO(model, lr=1e-2, eps=1e-2, seed=5, block_elements=100, shards=shards, **options)
            results = [opt.step(lambda: per_example().mean()) for _ in range(steps)]
            estimate = opt.estimate(lambda: per_example().mean())
    seen = [r.losses_plus for r in results] + [r.losses_minus for r in results]
    return seen, _bits(model.parameters()), [estimate[k] for k in sorted(estimate)]


def _assert_same_runs(fast, oracle):
    for what, got, want in zip(("losses", "weights", "estimates"), fast, oracle):
        for index, (a, b) in enumerate(zip(got, want)):
            assert_bitwise_equal(a, b, f"{what} {index}")


STEP_CASES = [
    ("GRZO", dict(normalize="std", weight_decay=0.1)),
    ("GRZO", dict(normalize="none")),
    ("MeZO", dict(weight_decay=0.1)),
]


@exactness
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("method,options", STEP_CASES, ids=["GRZO-std-wd", "GRZO-none", "MeZO-wd"])
def test_steps_with_the_kernels_equal_the_torch_path(method, options, dtype, device, launches):
    """Two steps and an estimate of every kind of target (embedding with a padding row,
    norms, Linears with and without bias), blocks of 100 elements that cut rows: the
    perturbed losses, the weights after each step and the estimates, bit for bit; the
    kernel run did launch the kernels (draws, and GRZO's update or MeZO's shifts and update),
    the torch run none."""
    fast = _run(method, True, dtype, device, **options)
    used = dict(launches)
    launches.clear()
    oracle = _run(method, False, dtype, device, **options)
    expected = ({"draw", "grzo_update", "grzo_update (estimate)"} if method == "GRZO"
                else {"mezo_shift", "mezo_update"})
    assert expected <= set(used), used
    assert not launches, launches
    _assert_same_runs(fast, oracle)


@exactness
@pytest.mark.parametrize("method", ["GRZO", "MeZO"])
def test_shard_steps_with_the_kernels_equal_the_torch_path(method, device, launches):
    """Parameters declared as tensor-parallel shards draw at the whole's indices; the
    kernels do too (and were launched)."""
    shards = {"2.weight": Shard((70, 24), (30, 0)), "4.weight": Shard((19, 99), (0, 41)),
              "1.weight": Shard((50,), (13,)), "0.weight": Shard((40, 30), (2, 5))}
    fast = _run(method, True, torch.float32, device, shards=shards)
    assert launches, "the kernel run launched no kernel"
    _assert_same_runs(fast, _run(method, False, torch.float32, device, shards=shards))


# --- the update kernel on its own -------------------------------------------------------

def _update_case(shape, dtype, device, batch, shard=None, role=None, padding=None):
    generator = torch.Generator().manual_seed(batch * 31 + len(shape))
    target = _target("layer.weight", shape, dtype, device, shard, role)
    if padding is not None:
        target.module.padding_idx = padding
    target.param.data.copy_(torch.randn(shape, generator=generator).to(dtype))
    c = torch.randn(batch, generator=generator, dtype=torch.float64).to(device)
    return target, c


def _torch_update(target, draws_, c, batch, lr, weight_decay, reciprocal):
    """The torch path's update (``GRZO.step`` over one block), with torch CUDA's division
    by a CPU scalar (a product with the reciprocal) when ``reciprocal``."""
    work = target.work_dtype
    weighted = c.to(work)[:, None] * draws_.signs(target, ROW, batch)
    if target.is_matrix:
        rows = torch.arange(target.rows, device=target.param.device)
        mixed = torch.zeros(target.rows, target.cols, dtype=work, device=target.param.device)
        columns = draws_.signs(target, COL, batch)
        for i in range(batch):
            mixed.addr_(weighted[i], columns[i])
        product = draws_.base(target, rows) * mixed
    else:
        mixed = torch.zeros_like(weighted[0])
        for term in weighted:
            mixed += term
        product = draws_.base(target, None) * mixed
    # Divided element by element (a tensor by a tensor): a true division on every device. A
    # tensor divided by a Python number is one only on the CPU (CUDA multiplies by the
    # reciprocal), so it could not stand for the divide mode on a GPU.
    estimate = (product * (torch.tensor(1.0, dtype=work) / batch).item() if reciprocal
                else product / torch.full_like(product, batch))
    padding = getattr(target.module, "padding_idx", None) if target.role == "embedding" else None
    if padding is not None:
        estimate[padding] = 0
    current = target.param.data.to(work)
    return estimate, (current - lr * (estimate + weight_decay * current)).to(target.param.dtype)


UPDATE_CASES = [((7, 13), None, None), ((33, 130), Shard((40, 300), (5, 150)), None), ((300,), None, None),
                ((19, 9), None, 4), ((1, 1), None, None)]


@exactness
@pytest.mark.parametrize("reciprocal", [False, True], ids=["divide", "reciprocal"])
@pytest.mark.parametrize("batch", [1, 3, 7, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("shape,shard,padding", UPDATE_CASES, ids=["7x13", "shard", "vector", "padding", "1x1"])
def test_update_kernel_equals_the_torch_update(shape, shard, padding, dtype, batch, reciprocal, device):
    """The update (weight written in place) and the estimate (nothing written) against
    the torch path's arithmetic, for both ways of dividing by B (``divide`` is torch on
    the CPU, ``reciprocal`` torch on CUDA), batch sizes whose reciprocals round (3, 7)
    and do not (1, 16), odd shapes, a shard, a vector, an embedding's padding row."""
    from forge_kernels.zeroth_order.update_kernel import grzo_update

    role = "embedding" if padding is not None else None
    target, c = _update_case(shape, dtype, device, batch, shard, role, padding)
    lr, weight_decay = 0.37, 0.011
    with draws.use_kernels(False):
        oracle = CallDraws(3, 1)
        want_estimate, want_weight = _torch_update(target, oracle, c, batch, lr, weight_decay, reciprocal)
    work = target.work_dtype
    fast = CallDraws(3, 1)
    weighted = c.to(work)[:, None] * oracle.signs(target, ROW, batch)
    columns = oracle.signs(target, COL, batch) if target.is_matrix else None
    before = target.param.data.clone()
    estimate = grzo_update(target, fast.key(target, BASE), weighted, columns, batch, lr, weight_decay,
                           reciprocal=reciprocal, estimate_only=True)
    assert_bitwise_equal(target.param.data, before, "the weight after estimate_only")
    assert_bitwise_equal(estimate, want_estimate.reshape(shape), "estimate")
    grzo_update(target, fast.key(target, BASE), weighted, columns, batch, lr, weight_decay, reciprocal=reciprocal)
    assert_bitwise_equal(target.param.data, want_weight.reshape(shape), "updated weight")


@exactness
def test_the_reciprocal_differs_from_the_division_somewhere(device):
    """The two ways of dividing by B are not the same bits (else the reciprocal case
    above would check nothing): at B = 3 some estimate differs in its last bit."""
    from forge_kernels.zeroth_order.update_kernel import grzo_update

    target, c = _update_case((64, 64), torch.float32, device, 3)
    fast = CallDraws(3, 1)
    weighted = c.to(torch.float32)[:, None] * fast.signs(target, ROW, 3)
    columns = fast.signs(target, COL, 3)
    results = [grzo_update(target, fast.key(target, BASE), weighted, columns, 3, 0.1, 0.0, reciprocal=r,
                           estimate_only=True) for r in (False, True)]
    assert not torch.equal(results[0], results[1])
