"""Tensor-parallel shards (``shards={name: (full_shape, offset)}``): given the losses the
whole model saw, a shard's GRZO/MeZO estimate and step are the slice of the whole's, bit
for bit. Row shards (column-parallel Linear, vocabulary-parallel Embedding, the sharded
bias) and column shards (row-parallel Linear) are both taken.

The shard model is not run: its closure hands back the whole model's losses, which is
what every tensor-parallel rank sees (the losses of the one sharded model). The test
runs a second time with a deliberately position-dependent matmul (one ulp up wherever
row + column is odd, as a bad BLAS would be, tests/test_interpreter_reduction.py): the
update sums its examples itself, in a fixed order, so it must not notice; an update
handing that sum to a matmul fails there on every CPU, not only where BLAS misbehaves."""

import pytest
import torch
from torch import nn

import forge_kernels as fk
from forge_verify.numerics.bits import assert_bitwise_equal

pytestmark = pytest.mark.exactness

#: (embedding rows, linear rows, linear columns) of the shard, as slices of the whole
LAYOUTS = {"rows": (slice(4, 9), slice(1, 4), slice(0, 6)), "columns": (slice(0, 11), slice(0, 5), slice(1, 4))}


_real_matmul = torch.Tensor.__matmul__


def _position_dependent_matmul(a, b):
    out = _real_matmul(a, b)
    if out.dim() < 2:
        return out
    rows = torch.arange(out.shape[-2])[:, None]
    cols = torch.arange(out.shape[-1])[None, :]
    return torch.where((rows + cols) % 2 == 1, torch.nextafter(out, torch.full_like(out, float("inf"))), out)


@pytest.fixture(params=["matmul", "bad matmul"])
def blas(request, monkeypatch):
    if request.param == "bad matmul":
        monkeypatch.setattr(torch.Tensor, "__matmul__", _position_dependent_matmul)
    return request.param


def _whole():
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 6), nn.Linear(6, 5))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return model


def _shard_of(whole, layout):
    emb_rows, rows, cols = LAYOUTS[layout]
    shard = nn.Sequential(nn.Embedding(emb_rows.stop - emb_rows.start, 6),
                          nn.Linear(cols.stop - cols.start, rows.stop - rows.start))
    with torch.no_grad():
        shard[0].weight.copy_(whole[0].weight[emb_rows])
        shard[1].weight.copy_(whole[1].weight[rows, cols])
        shard[1].bias.copy_(whole[1].bias[rows])
    shards = {"0.weight": ((11, 6), (emb_rows.start, 0)), "1.weight": ((5, 6), (rows.start, cols.start))}
    if layout == "rows":
        shards["1.bias"] = ((5,), (rows.start,))
    return shard, shards


def _slices(layout):
    emb_rows, rows, cols = LAYOUTS[layout]
    return {"0.weight": (emb_rows, slice(None)), "1.weight": (rows, cols), "1.bias": (rows,)}


def _recording_closure(model, idx, method, record):
    def closure():
        out = model(idx)
        losses = (out ** 2).sum((1, 2)) + out.sum((1, 2))
        record.append(losses if method == "GRZO" else losses.mean())
        return record[-1]
    return closure


def _replaying_closure(record, shard, batch):
    """The recorded losses, after running each of the shard's modules on inputs of its
    shape (GRZO refuses targets whose module's forward did not run; their outputs are
    not used: the losses are the whole's, as on every tensor-parallel rank)."""
    replay = iter(record)

    def closure():
        shard[0](torch.zeros(batch, 1, dtype=torch.long))
        shard[1](torch.zeros(batch, shard[1].in_features))
        return next(replay)
    return closure


def _optimizer(method, model, shards=None):
    if method == "GRZO":
        return fk.GRZO(model, lr=0.1, sigma=1e-2, weight_decay=0.05, seed=3, shards=shards)
    return fk.MeZO(model, lr=0.1, eps=1e-2, weight_decay=0.05, seed=3, shards=shards)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("method", ["GRZO", "MeZO"])
def test_a_shards_estimate_and_step_are_the_slice_of_the_wholes(method, layout, blas):
    idx = torch.randint(0, 11, (4, 3), generator=torch.Generator().manual_seed(1))
    whole = _whole()
    shard, shards = _shard_of(whole, layout)
    record = []
    estimate = _optimizer(method, whole).estimate(_recording_closure(whole, idx, method, record))
    part = _optimizer(method, shard, shards).estimate(_replaying_closure(record, shard, idx.shape[0]))
    for name, where in _slices(layout).items():
        assert_bitwise_equal(part[name], estimate[name][where], f"estimate of {name}")
    record.clear()
    _optimizer(method, whole).step(_recording_closure(whole, idx, method, record))
    _optimizer(method, shard, shards).step(_replaying_closure(record, shard, idx.shape[0]))
    stepped = dict(whole.named_parameters())
    for name, param in shard.named_parameters():
        assert_bitwise_equal(param.detach(), stepped[name].detach()[_slices(layout)[name]], f"step of {name}")


@pytest.mark.parametrize("shards, error, message", [
    ({"2.weight": ((5, 6), (0, 0))}, ValueError, "not a trainable parameter"),
    ({"1.weight": ((5,), (0,))}, ValueError, "2 non-negative integers"),
    ({"1.weight": ((5, 6), (-1, 0))}, ValueError, "non-negative integers"),
    ({"1.weight": ((5, 6), (3, 0))}, ValueError, "does not fit"),
    ({"1.weight": 5}, TypeError, "Shard\\(full_shape, offset\\)"),
    (["1.weight"], TypeError, "must be a dict"),
    # the last rows of a whole past 2**32 counters: GRZO's embedding hook draws only the
    # used rows' U, so the update used to raise at this parameter after updating the others
    ({"0.weight": ((2**30, 6), (2**30 - 11, 0))}, ValueError,
     r"parameter '0.weight' draws [Uz] at counters up to 6442450943 .* past a stream's 2\*\*32"),
])
@pytest.mark.parametrize("method", ["GRZO", "MeZO"])
def test_a_bad_shard_is_refused_naming_it(method, shards, error, message):
    with pytest.raises(error, match=message):
        _optimizer(method, nn.Sequential(nn.Embedding(11, 6), nn.Linear(6, 5)), shards)
