"""Bitwise comparison and ulp distance."""

import pytest
import torch

from forge_verify.numerics.bits import assert_bitwise_equal, first_difference, ordered_bits, ulp_distance


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_ordered_bits_are_monotone_and_adjacent_floats_differ_by_one(dtype):
    values = torch.tensor([-3.0, -1.0, -1e-30, 0.0, 1e-30, 1.0, 3.0], dtype=dtype)
    bits = ordered_bits(values)
    assert torch.all(bits[1:] > bits[:-1])
    one = torch.tensor([1.0], dtype=dtype)
    assert int(ordered_bits(torch.nextafter(one, torch.tensor([2.0], dtype=dtype))) - ordered_bits(one)) == 1
    assert int(ordered_bits(one) - ordered_bits(torch.nextafter(one, torch.tensor([0.0], dtype=dtype)))) == 1


def test_ulp_distance_across_zero_and_nan():
    smallest = torch.tensor([1.4e-45])
    assert int(ulp_distance(smallest, -smallest)) == 2
    assert int(ulp_distance(torch.tensor([0.0]), torch.tensor([-0.0]))) == 0
    assert int(ulp_distance(torch.tensor([float("nan")]), torch.tensor([1.0]))) == torch.iinfo(torch.int64).max


def test_every_bf16_pattern_is_one_ulp_from_its_neighbours():
    """Exhaustive over the 65,536 bf16 patterns: the ordering has no gaps or folds."""
    patterns = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    finite = patterns[torch.isfinite(patterns)]
    ordered = torch.sort(ordered_bits(finite)).values
    steps = ordered[1:] - ordered[:-1]
    # +0 and -0 share the value 0: exactly one step of 0, every other step 1
    assert int((steps == 0).sum()) == 1 and bool(torch.all((steps == 0) | (steps == 1)))


def test_bitwise_equal_sees_signed_zero_and_reports_position():
    a = torch.zeros(3, 4)
    b = a.clone()
    b[2, 1] = -0.0
    assert first_difference(a, b) == (2, 1)
    with pytest.raises(AssertionError, match=r"w: 1 of 12 elements differ bitwise; first at \(2, 1\)"):
        assert_bitwise_equal(a, b, "w")


def test_bitwise_equal_message_has_patterns_and_ulps():
    a = torch.tensor([1.0, 2.0])
    b = torch.tensor([1.0, 2.0000004])
    with pytest.raises(AssertionError, match=r"0x40000000.*0x40000002\), 2 ulp apart"):
        assert_bitwise_equal(a, b)
    assert_bitwise_equal(a, a.clone())
    with pytest.raises(AssertionError, match="dtype"):
        assert_bitwise_equal(a, a.double())


def test_codes_compare_bitwise_with_their_difference_reported():
    a = torch.tensor([1, 2, 250], dtype=torch.uint8)
    b = torch.tensor([1, 5, 250], dtype=torch.uint8)
    assert int(ulp_distance(a, b).max()) == 3
    with pytest.raises(AssertionError, match=r"codes: 1 of 3 elements differ bitwise; first at \(1,\): 2 vs 5"):
        assert_bitwise_equal(a, b, "codes")
