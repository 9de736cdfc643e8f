"""GIFT's transform (``fk.gift.Whitening``): the fp32 round trip G ↦ (G T) T^{-1} stays
within the bound derived from the stored factors (proofs/gift.md, "The fp32 round
trip"; ``forge_verify/numerics/gift_bounds.py``), and the gain it exists for: on
gradients lying in the top activation subspace the rank-32 round trip through a wire
format errs ≤ 1/3 of plain per-tensor quantization, on isotropic activations within
10 % of it (proofs/gift.md, "Where the gain comes from")."""

import math

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import forge_kernels as fk
from forge_verify.numerics.bits import assert_bitwise_equal
from forge_verify.numerics.gift_bounds import dense, map_error_coefficient, round_trip_bound

Whitening = fk.gift.Whitening
FORMATS = ("e4m3", "e5m2", "nvfp4")


def _covariance(K, log10_spread, seed):
    """A = Q diag(λ) Qᵀ with λ log-spaced over ``log10_spread`` decades, fp32."""
    g = torch.Generator().manual_seed(seed)
    Q = torch.linalg.qr(torch.randn(K, K, generator=g, dtype=torch.float64))[0]
    eigenvalues = torch.logspace(0, -log10_spread, K, dtype=torch.float64)
    return ((Q * eigenvalues) @ Q.T).to(torch.float32)


def _relative(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.exactness
@given(K=st.sampled_from([16, 48, 64, 256]), rank=st.sampled_from([0, 1, 4, 32, 10_000]),
       log10_spread=st.floats(0, 8), damping=st.sampled_from([0.0, 1e-3, 1e-1]), rows=st.sampled_from([1, 7, 32]),
       seed=st.integers(0, 2**31 - 1))
@example(K=256, rank=10_000, log10_spread=8.0, damping=0.0, rows=32, seed=1)
def test_round_trip_stays_within_the_derived_bound(K, rank, log10_spread, damping, rows, seed):
    w = Whitening.from_covariance(_covariance(K, log10_spread, seed), rank, damping)
    G = torch.randn(rows, K, generator=torch.Generator().manual_seed(seed + 1))
    assert _relative(w.invert(w.apply(G)), G) <= round_trip_bound(w)
    # each map against its exact matrix (the stored factors, in float64)
    G64 = G.double()
    exact_apply = G64 @ dense(w.inv_sigma, w.d_apply, w.U)
    assert float((w.apply(G).double() - exact_apply).norm()) <= \
        map_error_coefficient(w.inv_sigma, w.d_apply, w.U) * float(G64.norm())


def test_full_rank_transform_whitens_the_damped_covariance():
    A = _covariance(64, 3, seed=5)
    w = Whitening.from_covariance(A, rank=64, damping=1e-3)
    T = dense(w.inv_sigma, w.d_apply, w.U)
    damped = A.double() + 1e-3 * float(A.double().trace()) / 64 * torch.eye(64, dtype=torch.float64)
    assert float(torch.linalg.matrix_norm(T @ damped @ T - torch.eye(64, dtype=torch.float64), ord=2)) < 1e-4


def test_rank_zero_on_a_scaled_identity_is_an_exact_power_of_two_scaling():
    G = torch.randn(5, 32, generator=torch.Generator().manual_seed(3))
    w = Whitening.from_covariance(16 * torch.eye(32), rank=0, damping=0.0)
    assert_bitwise_equal(w.apply(G), G / 4)
    assert_bitwise_equal(w.invert(w.apply(G)), G)
    identity = Whitening.identity(32)
    assert_bitwise_equal(identity.apply(G), G)
    assert_bitwise_equal(identity.invert(G), G)


def test_from_covariance_refuses_what_it_cannot_invert():
    with pytest.raises(ValueError):
        Whitening.from_covariance(torch.ones(3, 4), 1)
    with pytest.raises(ValueError):
        Whitening.from_covariance(torch.full((4, 4), math.nan), 1)
    rank_one = torch.zeros(4, 4)
    rank_one[0, 0] = 1.0
    with pytest.raises(ValueError):
        Whitening.from_covariance(rank_one, rank=1, damping=0.0)  # the rest is 0 and undamped
    for rank, damping in ((4.0, 1e-3), (-1, 1e-3), (True, 1e-3), (4, math.nan), (4, -1e-3), (4, math.inf)):
        with pytest.raises(ValueError, match="rank must be|damping must be"):  # NaN damping made NaN factors
            Whitening.from_covariance(torch.eye(8), rank, damping)


# The gain (proofs/gift.md, "Where the gain comes from"): the wire error is roughly
# elementwise-relative, so in whitened coordinates it is spread over all K directions and
# T^{-1} shrinks all but the r it lands in the activation subspace: RelL2 ratio ≈
# sqrt(r/K + ε/λ) when G lies in the top-r subspace (0.18 here), 1 when A is isotropic.
K_GAIN, RANK, TOKENS, OUTPUTS = 1024, 32, 512, 256


def _activations(isotropic, noise, rows, generator, basis):
    if isotropic:
        return torch.randn(rows, K_GAIN, generator=generator)
    scales = torch.logspace(0, -1, RANK)  # the top subspace itself spans a decade
    return (torch.randn(rows, RANK, generator=generator) * scales) @ basis.T + \
        noise * torch.randn(rows, K_GAIN, generator=generator)


def gain_case(fmt, isotropic=False, noise=0.0, damping=1e-3, rank=RANK, seed=16):
    """(plain RelL2, rank-``rank`` GIFT RelL2) of one layer gradient G = Δᵀ X (K = 1024,
    256 outputs, 512 tokens), A from a separate 4096-token window of the same activations:
    rank-32 ones (scales 1 down to 0.1) plus ``noise`` per direction, or isotropic ones."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(K_GAIN, RANK, generator=g))[0]
    window = _activations(isotropic, noise, 4096, g, basis)
    A = window.T @ window / window.shape[0]
    G = torch.randn(TOKENS, OUTPUTS, generator=g).T @ _activations(isotropic, noise, TOKENS, g, basis)
    w = Whitening.from_covariance(A, rank, damping)
    plain = _relative(fk.gift.round_trip(G, fmt), G)
    gift = _relative(w.invert(fk.gift.round_trip(w.apply(G), fmt)), G)
    return plain, gift


@pytest.mark.stats
@pytest.mark.parametrize("fmt", FORMATS)
def test_gain_on_gradients_in_the_top_activation_subspace(fmt):
    plain, gift = gain_case(fmt)
    assert gift <= plain / 3, (plain, gift)


@pytest.mark.stats
@pytest.mark.parametrize("fmt", FORMATS)
def test_no_gain_on_isotropic_activations(fmt):
    plain, gift = gain_case(fmt, isotropic=True)
    assert abs(gift / plain - 1) <= 0.10, (plain, gift)


@pytest.mark.stats
def test_energy_outside_the_subspace_needs_damping_above_it():
    """Activation noise of 1e-2 per direction (variance 1e-4) against ε = 1e-3 · tr(A)/K ≈
    1e-5: σ^{-1} blows the noise up to dominate G T and the gain is gone; damping 1
    (ε ≈ 1e-2 ≫ 1e-4) restores it (proofs/gift.md)."""
    plain, undamped = gain_case("e4m3", noise=1e-2, damping=1e-3)
    _, damped = gain_case("e4m3", noise=1e-2, damping=1.0)
    assert undamped >= 0.8 * plain and damped <= plain / 3, (plain, undamped, damped)
