"""The comparison behind the sharding property and the recorded verdicts: the slices a
shard must equal, and an equality that tells a changed bit from none."""

import torch

from forge_verify.distributed.parallel_verdicts import _equal
from forge_verify.distributed.sharding import expected_slices


def _whole():
    gen = torch.Generator().manual_seed(0)
    return {"weight": torch.randn(4, 64, generator=gen), "exp_avg": torch.randn(4, 64, generator=gen),
            "exp_avg_exponent": torch.randint(-5, 5, (4, 2), generator=gen, dtype=torch.int8)}


def test_the_matching_slice_is_equal_and_a_flipped_bit_is_not():
    whole = _whole()
    rows, cols = slice(0, 2), slice(32, 64)
    local = {"weight": whole["weight"][rows, cols].clone(), "exp_avg": whole["exp_avg"][rows, cols].clone(),
             "exp_avg_exponent": whole["exp_avg_exponent"][rows, 1:2].clone()}
    assert _equal(local, expected_slices(whole, rows, cols))
    local["exp_avg"].view(torch.int32)[1, 3] ^= 1
    assert not _equal(local, expected_slices(whole, rows, cols))


def test_a_missing_state_entry_or_a_wrong_slice_is_not_equal():
    whole = _whole()
    rows, cols = slice(0, 2), slice(0, 32)
    local = {"weight": whole["weight"][rows, cols].clone(), "exp_avg": whole["exp_avg"][rows, cols].clone()}
    assert not _equal(local, expected_slices(whole, rows, cols))
    local["exp_avg_exponent"] = whole["exp_avg_exponent"][rows, 0:1].clone()
    assert _equal(local, expected_slices(whole, rows, cols))
    assert not _equal(local, expected_slices(whole, slice(2, 4), cols))
