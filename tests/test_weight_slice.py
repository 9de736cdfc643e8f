"""WeightSlice: a shard keyed on its global element indices rounds as the whole weight
does, on the fused path and in apply_rule; bad slices are refused."""

import pytest
import torch

import forge_kernels as fk
from forge_verify import assert_bitwise_equal

N, K, T = 24, 40, 17
# "odd columns" starts at column 13: its tiles split the column pairs that share a Philox call.
SHARDS = {"rows": (slice(8, 20), slice(None)), "columns": (slice(None), slice(16, 40)),
          "odd columns": (slice(3, 21), slice(13, 38))}


def _inputs(device):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(N, K, generator=gen).bfloat16()
    return weight.to(device), torch.randn(T, K, generator=gen).to(device), torch.randn(T, N, generator=gen).to(device)


def _step(weight, x, dy, rule, weight_slice, path):
    weight = weight.clone()
    state = rule.init_state(weight, state_format="bf16")
    if path == "fused":
        fk.fused_weight_update(x, dy, weight, state, rule, 1, seed=5, weight_slice=weight_slice)
    else:
        grad = fk.weight_gradient(x, dy)
        fk.apply_rule(grad, weight, state, rule, 1, seed=5, weight_slice=weight_slice)
    return weight, state


@pytest.mark.exactness
@pytest.mark.parametrize("path", ["fused", "apply_rule"])
@pytest.mark.parametrize("shard", sorted(SHARDS))
def test_shard_with_its_slice_rounds_as_the_whole(shard, path, device):
    rows, cols = SHARDS[shard]
    weight, x, dy = _inputs(device)
    rule = fk.AdamW(lr=1e-2)
    whole_w, whole_s = _step(weight, x, dy, rule, None, path)
    place = fk.WeightSlice(rows.start or 0, cols.start or 0, (N, K))
    local = (weight[rows, cols].contiguous(), x[:, cols].contiguous(), dy[:, rows].contiguous())
    w, s = _step(*local, rule, place, path)
    assert_bitwise_equal(w, whole_w[rows, cols], "weight")
    for key in s:
        assert_bitwise_equal(s[key], whole_s[key][rows, cols], key)
    # Keyed on its local indices instead, the shard draws other random bits.
    w_local_keys, _ = _step(*local, rule, None, path)
    assert not torch.equal(w_local_keys.view(torch.int16), whole_w[rows, cols].contiguous().view(torch.int16))


@pytest.mark.parametrize("place, message", [
    (fk.WeightSlice(20, 0, (N, K)), "does not fit"),
    (fk.WeightSlice(0, 8, (N, K)), "does not fit"),
])
def test_slice_that_does_not_fit_is_refused(place, message, device):
    weight, x, dy = _inputs(device)
    with pytest.raises(ValueError, match=message):
        fk.fused_weight_update(x, dy, weight.clone(), {}, fk.SGD(), 1, weight_slice=place)


def test_q8_shard_splitting_a_block_is_refused(device):
    weight, x, dy = _inputs(device)
    rule = fk.AdamW()
    local = weight[:, 8:40].float().contiguous()
    with pytest.raises(ValueError, match="would split them"):
        fk.fused_weight_update(x[:, 8:40], dy, local, rule.init_state(local, state_format="q8"), rule, 1,
                               weight_slice=fk.WeightSlice(0, 8, (N, K)))


@pytest.mark.parametrize("kwargs, message", [
    (dict(row_start=-1, col_start=0, global_shape=(4, 4)), "non-negative integer"),
    (dict(row_start=0, col_start=1.0, global_shape=(4, 4)), "non-negative integer"),
    (dict(row_start=0, col_start=0, global_shape=[4, 4]), "pair of non-negative integers"),
    (dict(row_start=0, col_start=0, global_shape=(2**16, 2**16 + 1)), "2\\*\\*32 counters"),
])
def test_bad_weight_slice_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        fk.WeightSlice(**kwargs)


def test_weight_slice_of_wrong_type_is_refused(device):
    weight, x, dy = _inputs(device)
    with pytest.raises(TypeError, match="WeightSlice"):
        fk.fused_weight_update(x, dy, weight.clone(), {}, fk.SGD(), 1, weight_slice=(0, 0))
