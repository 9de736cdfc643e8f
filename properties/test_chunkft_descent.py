"""ChunkFT on a convex quadratic with the SGD rule: every chunk step with lr = 1/L_c
satisfies the descent lemma f(θ⁺) ≤ f(θ) − ‖∇_c f‖²/(2L_c), up to the proven rounding
slack (proofs/chunkft.md), for generic inputs and for orthogonal ones, where the lemma
holds with equality in exact arithmetic."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from forge_verify.checks import chunkft
from forge_verify.checks.observations import observe


def _problem(seed, tokens, inputs, outputs, orthogonal):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, inputs, generator=gen)
    if orthogonal:  # XᵀX = 4·I: every direction is a top eigenvector, the lemma is tight
        x = torch.linalg.qr(x.double())[0].float() * 2
    return x, torch.randn(tokens, outputs, generator=gen), torch.randn(outputs, inputs, generator=gen)


@given(seed=st.integers(0, 2**31 - 1), tokens=st.integers(1, 24), inputs=st.integers(1, 12),
       outputs=st.integers(1, 12), orthogonal=st.booleans(), split=st.sampled_from(("rows", "cols")),
       chunks=st.integers(1, 3))
def test_each_sgd_chunk_step_satisfies_the_descent_lemma(seed, tokens, inputs, outputs, orthogonal, split,
                                                         chunks):
    if orthogonal:
        tokens = max(tokens, inputs)
    x, y, w0 = _problem(seed, tokens, inputs, outputs, orthogonal)
    size = outputs if split == "rows" else inputs
    share = chunkft.sgd_chunk_step_descends(x, y, w0, min(chunks, size), split, steps=4)
    observe(share, "of the achieved decrease guaranteed")
