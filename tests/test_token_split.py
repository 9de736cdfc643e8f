"""token_split refuses what it cannot do exactly, with errors that name the way out."""

import pytest
import torch

import forge_kernels as fk
from forge_kernels.token_split import linear_split_step, materialized_split_step


def _parts(device, n=2):
    return [(torch.randn(4, 6, device=device), torch.randn(4, 5, device=device)) for _ in range(n)]


def test_linear_split_refuses_a_nonlinear_rule(device):
    weight = torch.randn(5, 6, device=device)
    rule = fk.AdamW()
    with pytest.raises(ValueError, match="not linear.*materialized_split_step"):
        linear_split_step(_parts(device), weight, rule.init_state(weight), rule, 1)


def test_linear_split_refuses_bf16_storage(device):
    weight = torch.randn(5, 6, device=device).bfloat16()
    rule = fk.SGD(momentum=0.9)
    with pytest.raises(TypeError, match="fp32 weight and state"):
        linear_split_step(_parts(device), weight, rule.init_state(weight), rule, 1)


@pytest.mark.parametrize("parts", [[], None, ()])
def test_no_parts_is_refused(parts, device):
    weight = torch.randn(5, 6, device=device)
    with pytest.raises(ValueError, match="non-empty list"):
        materialized_split_step(parts, weight, {}, fk.SGD(), 1)


@pytest.mark.parametrize("bucket_rows", [0, -1, 2.0, True])
def test_bad_bucket_is_refused(bucket_rows, device):
    weight = torch.randn(5, 6, device=device)
    with pytest.raises(ValueError, match="bucket_rows"):
        materialized_split_step(_parts(device), weight, {}, fk.SGD(), 1, bucket_rows=bucket_rows)


@pytest.mark.exactness
def test_micro_batches_in_one_process_match_the_whole_batch_on_dyadic_data(device):
    """Accumulation without any process group: both alternatives give the bits of one
    fused step over the concatenated micro-batches when every sum is exact."""
    gen = torch.Generator().manual_seed(0)
    draw = lambda *shape: torch.randint(-2, 3, shape, generator=gen).float().to(device)  # noqa: E731
    weight, parts = draw(5, 6), [(draw(4, 6), draw(4, 5)) for _ in range(3)]
    rule = fk.SGD(lr=2**-3, momentum=0.5, nesterov=True)
    true_w, true_s = weight.clone(), rule.init_state(weight)
    fk.fused_weight_update(torch.cat([x for x, _ in parts]), torch.cat([dy for _, dy in parts]), true_w, true_s,
                           rule, 1)
    for split_step in (linear_split_step, materialized_split_step):
        w, s = weight.clone(), rule.init_state(weight)
        split_step(parts, w, s, rule, 1)
        assert torch.equal(w.view(torch.int32), true_w.view(torch.int32)), split_step.__name__
        assert torch.equal(s["momentum_buffer"].view(torch.int32), true_s["momentum_buffer"].view(torch.int32))


@pytest.mark.parametrize("damage", ["dy-columns", "nan-in-second-part"])
def test_materialized_split_refuses_a_bad_part_before_any_bucket_is_written(damage, device):
    """Every part is checked before the first bucket: a second part whose dy has the
    wrong width, or holds a NaN, changes no row (each bucket had been checked in turn, so
    the rows of the buckets before it had stepped, under "nothing was updated")."""
    torch.manual_seed(0)
    rule = fk.AdamW(lr=1e-2)
    weight = torch.randn(5, 6, device=device)
    state = rule.init_state(weight)
    second = torch.randn(4, 4 if damage == "dy-columns" else 5, device=device)
    if damage == "nan-in-second-part":
        second[0, 4] = float("nan")
    parts = [(torch.randn(4, 6, device=device), torch.randn(4, 5, device=device)),
             (torch.randn(4, 6, device=device), second)]
    before = [weight.clone(), *(tensor.clone() for tensor in state.values())]
    error = ValueError if damage == "dy-columns" else fk.NonFiniteInputError
    with pytest.raises(error, match="dy has 4 output features" if damage == "dy-columns" else r"parts \[1\]"):
        materialized_split_step(parts, weight, state, rule, 1, bucket_rows=2)
    for after, was in zip([weight, *state.values()], before):
        assert torch.equal(after, was)


def test_materialized_split_names_the_rows_stepped_before_an_overflowing_bucket(device):
    """A bucket's own sum can overflow with finite inputs (or, across ranks, hold another
    rank's non-finite part): the step stops there, and the error says the rows before it
    had stepped."""
    rule = fk.SGD(lr=1e-2)
    weight = torch.zeros(5, 6, device=device)
    x = torch.full((4, 6), 1e30, device=device)
    dy = torch.ones(4, 5, device=device)
    dy[:, 3] = 1e30  # rows 3 of dW = 4e60: inf in fp32
    with pytest.raises(fk.NonFiniteInputError, match=r"rows 2\.\.3; rows 0\.\.1 had stepped already"):
        materialized_split_step([(x, dy)], weight, rule.init_state(weight), rule, 1, bucket_rows=2)
    assert torch.all(weight[:2] != 0) and torch.all(weight[2:] == 0)


@pytest.mark.parametrize("damage", ["nan", "overflow"])
def test_linear_split_refusing_a_later_part_writes_nothing(damage, device):
    """The first part had stepped the weight in place before a later part's step was
    refused (a NaN in its dy, or a tile whose step overflows), while the error said
    nothing was updated: the steps now go into copies, written back only when all passed."""
    rule = fk.SGD(lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(8, 16, generator=gen).to(device)
    state = rule.init_state(weight)
    parts = [(torch.randn(4, 16, generator=gen).to(device), torch.randn(4, 8, generator=gen).to(device))
             for _ in range(2)]
    x, dy = parts[1]
    if damage == "nan":
        dy[1, 2] = float("nan")
    else:  # finite inputs whose product overflows fp32 in dW[2, 5] alone
        x[:, 5], dy[:, 2] = 1e20, 1e20
    before = weight.clone(), state["momentum_buffer"].clone()
    with pytest.raises(FloatingPointError):
        linear_split_step(parts, weight, state, rule, 1)
    assert torch.equal(weight, before[0]) and torch.equal(state["momentum_buffer"], before[1])


def test_linear_split_steps_a_parameter_that_requires_grad(device):
    """As the optimizer's step does, in place and without autograd history, with the bits
    it gives a plain tensor (the write-back into the Parameter raised "a leaf Variable
    that requires grad is being used in an in-place operation")."""
    rule = fk.SGD(lr=0.1)
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(8, 16, generator=gen).to(device)
    x, dy = torch.randn(4, 16, generator=gen).to(device), torch.randn(4, 8, generator=gen).to(device)
    for parts in ([(x, dy)], [(x[:2], dy[:2]), (x[2:], dy[2:])]):
        expected = weight.clone()
        linear_split_step(parts, expected, rule.init_state(expected), rule, 1)
        w = torch.nn.Parameter(weight.clone())
        linear_split_step(parts, w, rule.init_state(w), rule, 1)
        assert w.grad_fn is None and w.requires_grad
        assert torch.equal(w.detach().view(torch.int32), expected.view(torch.int32))
