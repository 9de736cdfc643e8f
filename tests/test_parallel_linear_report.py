"""The Megatron-style layers take the fused layers' ``report=`` like ``fk.fuse``: with
"defer" a non-finite input's refusal surfaces at ``fk.check_updates`` (nothing written),
with "raise" at the backward, and a bad value is refused when the layer is built."""

import pytest
import torch
from torch import nn

import forge_kernels as fk
from forge_kernels.parallel_linear import ColumnParallelForgeLinear, RowParallelForgeLinear
from forge_verify.distributed.sharding import device

pytestmark = pytest.mark.distributed

LAYERS = {"column": ColumnParallelForgeLinear, "row": RowParallelForgeLinear}


def _nan_step_outcome(kind, report):
    """(where the error surfaced, whether the weight kept its bits) on this rank."""
    torch.manual_seed(0)
    layer = LAYERS[kind](nn.Linear(8, 6, bias=False).to(device()), fk.SGD(lr=0.1), report=report)
    before = layer.linear.weight.detach().clone()
    x = torch.randn(4, 8, device=device())
    x[0, 0] = float("nan")
    if kind == "row":  # input sharded on features
        x = x[:, :layer.linear.in_features].contiguous()
    try:
        layer(x).sum().backward()
    except fk.NonFiniteInputError:
        where = "backward"
    else:
        try:
            fk.check_updates(layer)
        except fk.NonFiniteInputError:
            where = "check_updates"
        else:
            where = "nowhere"
    return where, torch.equal(layer.linear.weight.detach(), before), layer.linear.report


@pytest.mark.parametrize("kind", sorted(LAYERS))
@pytest.mark.parametrize("report, where", [("defer", "check_updates"), ("raise", "backward")])
def test_megatron_layers_honour_report(kind, report, where, rank_pool):
    for outcome in rank_pool(2).run(_nan_step_outcome, kind, report):
        assert outcome == (where, True, report)


def _bad_report(kind):
    try:
        LAYERS[kind](nn.Linear(8, 6, bias=False).to(device()), fk.SGD(lr=0.1), report="later")
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_megatron_layers_refuse_an_unknown_report(kind, rank_pool):
    for error in rank_pool(2).run(_bad_report, kind):
        assert error is not None and "report" in error
