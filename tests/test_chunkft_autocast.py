"""ChunkFT under ``torch.autocast`` (bf16 activations, fp32 or bf16 weights): the forward
and dX are autocast's own, each nn.Linear slice is stepped by the fused kernel on the
bf16 operands autocast computes with, and a chunk step is the dense step on its slices,
bitwise.

The norms recompute dX under the forward's autocast state. On the CPU that cannot be
told apart from recomputing without it (CPU autocast casts neither layer_norm nor
rms_norm), so these tests do not catch its absence there; on CUDA, where layer_norm runs
in fp32 under autocast, it is what keeps dX autocast's. The default tier of this file,
``test_forward_and_input_gradient_are_autocasts`` included, passed compiled on the H200
at commit 8fbbc2d (benchmarks/results/h200-tests-8fbbc2d.log), and the whole file, its
slow cases included, at 62770ca (benchmarks/results/h200-tests-changed-62770ca.log, run
with ``-m 'not exactness'``; the run's four failures are in other files); the
recompute's absence was not planted there, so that this test catches it on CUDA is
argued, not shown."""

import pytest
import torch
from torch import nn

import forge_kernels as fk
from forge_kernels.chunkft import sliced
from forge_verify.checks import chunkft
from forge_verify.checks.problems import Regime
from forge_verify.numerics.bits import int_view
from forge_verify.numerics.tolerances import UNIT_ROUNDOFF


def _autocast(device):
    return torch.autocast(device.type, dtype=torch.bfloat16)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_linear_step_is_the_fused_kernel_on_autocasts_bf16_operands(weight_dtype, device):
    torch.manual_seed(0)
    layer = nn.Linear(12, 5, bias=False).to(device, weight_dtype)
    weight = layer.weight.detach().clone()
    rule = fk.AdamW(lr=1e-2)
    ctl = fk.ChunkFT(nn.Sequential(layer), rule, chunks=1, seed=3)
    x, dy = torch.randn(4, 12).to(device), torch.randn(4, 5).to(device)
    with _autocast(device):
        ctl.step(lambda: (layer(x) * dy).sum())
    # The loss's gradient reaches the bf16 output as dy rounded to bf16.
    fk.fused_weight_update(x.bfloat16(), dy.bfloat16(), weight, rule.init_state(weight), rule, 1,
                           seed=fk.chunkft.tensor_seed(3, 0))
    assert layer.weight.dtype == weight_dtype
    assert torch.equal(int_view(layer.weight.detach()), int_view(weight))


class _Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.norm, self.rms, self.b = nn.Linear(6, 40), nn.LayerNorm(40), nn.RMSNorm(40), nn.Linear(40, 5)

    def forward(self, x):
        return self.b(self.rms(self.norm(self.a(x))))


# CPU autocast leaves rms_norm out of its fp32 list: torch's own RMSNorm then warns that a
# bf16 input with an fp32 weight takes its unfused path, in the plain model as in ours.
@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
@pytest.mark.parametrize("split", ["rows", "cols"])
def test_forward_and_input_gradient_are_autocasts(split, device):
    torch.manual_seed(1)
    plain, chunked = _Stack().to(device), _Stack().to(device)
    chunked.load_state_dict(plain.state_dict())
    ctl = fk.ChunkFT(chunked, fk.AdamW(lr=1e-3), chunks=3, split=split)
    x = torch.randn(2, 3, 6).to(device)
    x_plain, x_chunked = x.clone().requires_grad_(), x.clone().requires_grad_()
    with _autocast(device):
        out = plain(x_plain)
        out.float().square().sum().backward()
        seen = []
        ctl.step(lambda: seen.append(chunked(x_chunked)) or seen[-1].float().square().sum())
    assert seen[0].dtype == out.dtype
    assert torch.equal(int_view(seen[0]), int_view(out))
    assert x_chunked.grad.dtype == torch.float32
    assert torch.equal(int_view(x_chunked.grad), int_view(x_plain.grad))


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
def test_rms_norm_step_follows_autograds_gradient_under_autocast(device):
    """nn.RMSNorm(eps=None) behind an autocast Linear gets its bf16 output: torch's default
    ε is then float32's machine epsilon (what rms_norm computes in), not bf16's. An SGD
    step of the norm's fp32 weight moves it by lr × autograd's gradient, within both
    gradients' rounding bounds and the step's (proofs/chunkft.md §8)."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(16, 16), nn.RMSNorm(16)).to(device)
    chunked = nn.Sequential(nn.Linear(16, 16), nn.RMSNorm(16)).to(device)
    chunked.load_state_dict(plain.state_dict())
    chunked[0].requires_grad_(False)  # the norm alone, whole: one chunk
    x = (torch.randn(8, 16) * 0.05).to(device)  # mean(x²) near bf16's ε: the default ε matters
    dy = torch.randn(8, 16).to(device)
    lr = 0.25
    ctl = fk.ChunkFT(chunked, fk.SGD(lr=lr), chunks=1)
    with _autocast(device):
        ctl.step(lambda: (chunked(x).float() * dy).sum())
        hidden = plain[0](x)
        out = plain[1](hidden)
        (out.float() * dy).sum().backward()
    weight = plain[1].weight.detach()
    moved = (weight.double() - chunked[1].weight.detach().double()) / lr
    autograd = plain[1].weight.grad.double()
    u = UNIT_ROUNDOFF[torch.float32]
    grad_bound = chunkft.norm_weight_grad_bound(hidden.detach(), dy.to(out.dtype), "rms_norm",
                                                sliced.rms_norm_eps(None, hidden.dtype), u).to(moved.device)
    bound = 2 * grad_bound + chunkft.sgd_step_bound(weight, lr, autograd.abs() + 2 * grad_bound, u)
    assert bool(((moved - autograd).abs() <= bound).all())


# The fp32 cases are slow only for time: the bf16-stochastic one also checks the rounding keys.
@pytest.mark.parametrize("regime, split", [
    pytest.param(Regime(), "rows", id="fp32-rows", marks=pytest.mark.slow),
    pytest.param(Regime(), "cols", id="fp32-cols", marks=pytest.mark.slow),
    pytest.param(Regime(weight=torch.bfloat16, state_format="bf16", seed=4), "cols", id="bf16-stochastic-cols")])
@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
def test_chunk_step_is_the_dense_step_on_its_slices_under_autocast(regime, split, device):
    problem = chunkft.ChunkProblem(vocab=7, width=6, hidden=5, batch=1, length=3, seed=8)
    with _autocast(device):
        chunkft.chunk_step_matches_dense(problem, fk.AdamW(lr=1e-2, weight_decay=0.1), regime, 3, split)
