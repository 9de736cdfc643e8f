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
