"""ChunkFT slices transformers' LlamaRMSNorm: its sliced weight gradient is autograd's
slice (float64; x̂ is the module's own bits, so only the token sum's order differs: within
twice that sum's bound), and at model level the forward and dX are the module's own,
bitwise, an SGD step moves the weight by lr × autograd's gradient within the token sums'
and the step's rounding bounds (proofs/chunkft.md §8), and a chunk step is the dense step
on its slices, bitwise."""

import pytest
import torch
from torch import nn

import forge_kernels as fk
from forge_kernels.chunkft import sliced
from forge_verify.checks import chunkft
from forge_verify.checks.problems import Regime
from forge_verify.numerics.bits import int_view
from forge_verify.numerics.tolerances import UNIT_ROUNDOFF

modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")


def _token_order_bound(x, dy, eps, dtype):
    """Twice the bound on a token sum of dy·x̂ in ``dtype`` (any order), x̂ LlamaRMSNorm's:
    the distance allowed between two such sums of the same products."""
    x_hat = sliced.normalized_input(x.reshape(-1, x.shape[-1]), "llama_rms_norm", eps)
    return 2 * chunkft.token_sum_bound(dy.reshape(-1, dy.shape[-1]).abs() * x_hat.abs(), UNIT_ROUNDOFF[dtype])


def test_sliced_llama_norm_gradient_is_autograds_slice_within_the_token_orders_bound():
    gen = torch.Generator().manual_seed(5)
    width = 24
    norm = modeling_llama.LlamaRMSNorm(width, eps=1e-5).double()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width, dtype=torch.float64, generator=gen))
    x = torch.randn(3, 7, width, dtype=torch.float64, generator=gen) * 3 + 1
    dy = torch.randn(3, 7, width, dtype=torch.float64, generator=gen)
    norm(x).backward(dy)
    bound = _token_order_bound(x, dy, 1e-5, torch.float64)
    for start, stop in [(0, width), (0, 1), (5, 13), (23, 24)]:
        grad = sliced.norm_weight_grad(x, dy, start, stop, "llama_rms_norm", 1e-5)
        assert bool(((grad - norm.weight.grad[start:stop]).abs() <= bound[start:stop]).all()), (start, stop)
    # LayerNorm's or nn.RMSNorm's mathematics is not LlamaRMSNorm's (float32 statistics).
    other = sliced.norm_weight_grad(x, dy, 0, width, "rms_norm", 1e-5)
    assert not bool(((other - norm.weight.grad).abs() <= bound).all())


class _Model(nn.Module):
    def __init__(self, dtype, norm_dtype):
        super().__init__()
        self.up = nn.Linear(6, 16, dtype=dtype)
        self.norm = modeling_llama.LlamaRMSNorm(16, eps=1e-6).to(norm_dtype)
        with torch.no_grad():
            self.norm.weight.add_(torch.randn(16, dtype=norm_dtype) * 0.3)

    def forward(self, x):
        return self.norm(self.up(x))


# bf16 activations into an fp32 weight: x̂ is rounded to bf16 before the weight multiplies
# it, which a gradient computed with nn.RMSNorm's (unrounded) x̂ misses by about 2⁻⁹.
@pytest.mark.parametrize("dtype, norm_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                               (torch.bfloat16, torch.bfloat16)])
def test_forward_input_gradient_and_sgd_step_follow_the_module(dtype, norm_dtype, device):
    torch.manual_seed(3)
    plain, chunked = _Model(dtype, norm_dtype).to(device), _Model(dtype, norm_dtype).to(device)
    chunked.load_state_dict(plain.state_dict())
    chunked.up.requires_grad_(False)  # the norm alone, whole: one chunk
    ctl = fk.ChunkFT(chunked, fk.SGD(lr=0.25), chunks=1)
    x = torch.randn(4, 3, 6, dtype=dtype).to(device)
    dy = torch.randn(4, 3, 16, dtype=dtype).to(device)
    x_plain, x_chunked = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = plain(x_plain)
    (out * dy).sum().backward()
    seen = []
    ctl.step(lambda: seen.append(chunked(x_chunked)) or (seen[-1] * dy).sum())
    assert torch.equal(int_view(seen[0]), int_view(out))
    assert torch.equal(int_view(x_chunked.grad), int_view(x_plain.grad))
    if norm_dtype == torch.float32:  # a bf16 weight rounds the step itself
        moved = (plain.norm.weight.detach().double() - chunked.norm.weight.detach().double()) / 0.25
        autograd = plain.norm.weight.grad.double()
        # x̂ is the module's own in both (forward bitwise): the token sums' orders and the step differ.
        sums = _token_order_bound(plain.up(x).detach(), dy, 1e-6, torch.float32).to(moved.device)
        bound = sums + chunkft.sgd_step_bound(plain.norm.weight.detach(), 0.25, autograd.abs() + sums,
                                              UNIT_ROUNDOFF[torch.float32])
        assert bool(((moved - autograd).abs() <= bound).all())


class _LlamaNormProblem(chunkft.ChunkProblem):
    """The properties' tiny model with its nn.RMSNorm swapped for a LlamaRMSNorm."""

    def model(self, dtype=torch.float32):
        model = super().model(dtype)
        norm = modeling_llama.LlamaRMSNorm(self.hidden, eps=1e-6).to(model.rms.weight.device, dtype)
        with torch.no_grad():
            norm.weight.copy_(model.rms.weight)
        model.rms = norm
        return model


def test_chunk_step_is_the_dense_step_on_llama_norm_slices():
    problem = _LlamaNormProblem(vocab=6, width=5, hidden=9, batch=1, length=3, seed=2)
    # 5 chunks cut the norm's weight at 2 (chunks 1 and 2 each hold part of it).
    chunkft.chunk_step_matches_dense(problem, fk.AdamW(lr=1e-2), Regime(weight=torch.bfloat16, state_format="bf16",
                                                                        seed=7), 5, "rows", cycles=1)
