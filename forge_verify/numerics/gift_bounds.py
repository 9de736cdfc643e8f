"""Error bounds for GIFT's transform (``forge_kernels.gift.Whitening``), derived in
proofs/gift.md ("The fp32 round trip").

The stored fp32 factors define two exact maps, right-multiplications by the symmetric
K×K matrices T̄ = a·I + U diag(d) Uᵀ (``apply``: a = σ^{-1}) and S̄ = s·I + U diag(e) Uᵀ
(``invert``: s = σ). ``map_error_coefficient`` bounds the fp32 evaluation
``fl(fl(a·X) + fl(fl(fl(X U) ∘ d) Uᵀ))`` against X·M̄ as a multiple of ‖X‖_F;
``round_trip_bound`` bounds ‖invert(apply(G)) − G‖_F / ‖G‖_F. Every quantity is
computed in float64 from the stored factors (exactly converted); the float64 work is
covered by a margin far above its own rounding.
"""

import torch

U32 = 2.0 ** -24


def gamma(n: int, u: float = U32) -> float:
    """γ_n = n·u / (1 − n·u): the relative bound of an n-term fp32 dot product."""
    return n * u / (1 - n * u)


def _spectral(M: torch.Tensor) -> float:
    return float(torch.linalg.matrix_norm(M, ord=2)) if M.numel() else 0.0


def dense(a: torch.Tensor, d: torch.Tensor, U: torch.Tensor) -> torch.Tensor:
    """a·I + U diag(d) Uᵀ in float64."""
    U64 = U.to(torch.float64)
    return float(a) * torch.eye(U.shape[0], dtype=torch.float64) + (U64 * d.to(torch.float64)) @ U64.T


def map_error_coefficient(a: torch.Tensor, d: torch.Tensor, U: torch.Tensor) -> float:
    """α with ‖fl-evaluated X·M̄ − X·M̄‖_F ≤ α‖X‖_F for every fp32 X (proofs/gift.md, (T1)–(T5))."""
    K, r = U.shape
    u = U32
    a = abs(float(a))
    norm_M = _spectral(dense(torch.tensor(a), d, U)) if r else a
    if r == 0:
        return u * a
    U64 = U.to(torch.float64)
    mu = _spectral(U64.abs())             # ‖|U|‖_2
    nu = _spectral(U64)                   # ‖U‖_2
    delta = float(d.to(torch.float64).abs().max())
    dP = gamma(K) * mu                    # (T1) ‖P̂ − XU‖ / ‖X‖
    P = nu + dP                           #      ‖P̂‖ / ‖X‖
    dR = delta * (dP + u * P)             # (T2) ‖R̂ − (XU)∘d‖ / ‖X‖
    R = (1 + u) * delta * P               #      ‖R̂‖ / ‖X‖
    dQ = gamma(r) * mu * R + nu * dR      # (T3) ‖Q̂ − X U D Uᵀ‖ / ‖X‖
    dS = u * a                            # (T4) ‖fl(aX) − aX‖ / ‖X‖
    return dS + dQ + u * (norm_M + dS + dQ)  # (T5) the final addition


def round_trip_bound(whitening) -> float:
    """β with ‖invert(apply(G)) − G‖_F ≤ β‖G‖_F for every fp32 G (proofs/gift.md, (R))."""
    w = whitening
    T = dense(w.inv_sigma, w.d_apply, w.U)
    S = dense(w.sigma, w.d_invert, w.U)
    K = w.U.shape[0]
    norm_T, norm_S = _spectral(T), _spectral(S)
    mismatch = _spectral(T @ S - torch.eye(K, dtype=torch.float64))
    alpha_T = map_error_coefficient(w.inv_sigma, w.d_apply, w.U)
    alpha_S = map_error_coefficient(w.sigma, w.d_invert, w.U)
    float64_margin = 4 * (K + w.rank + 2) * 2.0 ** -53 * (norm_T * norm_S + norm_T + norm_S + 1)
    return mismatch + norm_S * alpha_T + alpha_S * (norm_T + alpha_T) + float64_margin


def leading_order_bound(whitening) -> float:
    """The bound's first-order size, ≈ 2 (K + r + 2) √r · κ(T) · u (proofs/gift.md), for reading."""
    K, r = whitening.U.shape
    return 2 * (K + r + 2) * max(r, 1) ** 0.5 * whitening.condition_number * U32


#: per FP8 format: (half the relative step of normal values 2^-(m+1), half the subnormal
#: step, the largest finite value)
FP8_STEPS = {"e4m3": (2.0 ** -4, 2.0 ** -10, 448.0), "e5m2": (2.0 ** -3, 2.0 ** -17, 57344.0)}


def fp8_requantization_coefficients(fmt: str):
    """(ρ, τ·s) with |fl(q(fl(z·s)) / s) − z| ≤ ρ|z| + τ for every fp32 z under a scale s
    with |z·s| ≤ max (proofs/gift.md, section 7): ρ = h(1+u) + u + u(1+u)(1+h), τ = t(1+u)/s."""
    u = U32
    h, t, _ = FP8_STEPS[fmt]
    return h * (1 + u) + u + u * (1 + u) * (1 + h), t * (1 + u)


def reduce_scatter_element_bound(fmt: str, sent_sum: torch.Tensor, sent_abs_sum: torch.Tensor,
                                 world: int, scaling: str = "current") -> torch.Tensor:
    """Per element of one tensor, a bound on |world · out − Σ_r ŷ_r| for the reduce-scatter
    exchange without error feedback, where ŷ_r is what rank r decoded locally from its
    own codes (``last_sent``), ``sent_sum`` = Σ_r ŷ_r and ``sent_abs_sum`` = Σ_r |ŷ_r|
    (float64, the tensor's shape) and out the exchange's mean before T^{-1} (world a power
    of two, so that out · world is exact). Two parts (proofs/gift.md, section 7): the shard
    sum Z's fp32 rounding against Σ_r ŷ_r, ε = (world + 2) u Σ_r |ŷ_r|, and the second
    quantization of Z under the scale agreed from max |Z|. ``scaling`` is the hook's: under
    "power_of_two" that scale is fl(max / amax) rounded down to a power of two, so its
    reciprocal, which multiplies the subnormal step, is up to twice as large (FP8 only)."""
    if scaling not in ("current", "power_of_two"):
        raise ValueError(f"unknown scaling {scaling!r}")
    u = U32
    eps = (world + 2) * u * sent_abs_sum.to(torch.float64)
    z = sent_sum.to(torch.float64).abs() + eps          # ≥ |Z|
    amax = float(z.max()) if z.numel() else 0.0          # ≥ the agreed second amax
    if fmt == "fp32":
        return eps
    if fmt in FP8_STEPS:
        rho, tau_s = fp8_requantization_coefficients(fmt)
        inverse_scale = amax / FP8_STEPS[fmt][2] * (1 + u) / (1 - u)  # ≥ 1 / fl(max / amax)
        if scaling == "power_of_two":
            inverse_scale *= 2  # the power of two at or below fl(max / amax) is more than half of it
        return (eps + rho * z + tau_s * inverse_scale) * (1 + 2.0 ** -30)
    if fmt != "nvfp4":
        raise ValueError(f"unknown wire format {fmt!r}")
    if scaling != "current":
        raise ValueError("NVFP4 has only current scaling (its per-tensor scale is TE's)")
    flat = z.reshape(-1)
    blocks = torch.cat([flat, flat.new_zeros(-flat.numel() % 16)]).reshape(-1, 16)
    vmax = blocks.amax(dim=1, keepdim=True).expand(-1, 16).reshape(-1)[:flat.numel()].reshape(z.shape)
    s_dec = amax / 2688.0 * (1 + u) ** 2 / (1 - u) ** 2  # ≥ fl(1 / fl(2688 / amax))
    return eps + ((1 + 2.0 ** -4) * vmax / 6 + 6 * 2.0 ** -10 * s_dec) * (1 + 2.0 ** -16)


def e4m3_sum_bound(whitening, sent_norms, grad_norms, scale: float, numel: int,
                   exchange: str = "all_gather", scaling: str = "current") -> float:
    """β_Σ with ‖out − Σ_r G_r‖_F ≤ β_Σ for one summing exchange (``average=False``, no
    error feedback) of E4M3 codes under the shared ``scale`` over the ranks, where rank r
    sent y_r = apply(G_r) (``sent_norms``: ‖y_r‖_F, ``grad_norms``: ‖G_r‖_F, ``numel``
    elements each) and out = invert(fl(Σ_r values_r / scale)) (proofs/gift.md, "6. A
    summed exchange"); ``exchange="reduce_scatter"``: out = invert(Q₂(Z)), Z =
    fl(Σ_r values_r / scale) re-quantized under its own agreed scale (section 7).
    ``whitening`` None: the plain route (T = I, exact maps). ``scaling`` the hook's: under
    "power_of_two" the second scale's reciprocal is up to twice the current one's."""
    if scaling not in ("current", "power_of_two"):
        raise ValueError(f"unknown scaling {scaling!r}")
    u = U32
    world = len(sent_norms)
    relative = u + 2.0 ** -4 * (1 + u)            # per element: fl(y s), then E4M3's half step
    absolute = world * 2.0 ** -10 * numel ** 0.5 / scale  # E4M3's subnormal half step, unscaled
    V = sum((1 + relative) * n for n in sent_norms) + absolute  # ‖Σ_r values_r / s‖
    W = u * V + relative * sum(sent_norms) + absolute            # ‖Z − Σ_r y_r‖
    inverted = (1 + u) * V                                       # ≥ ‖Z‖, what T^{-1} is applied to
    if exchange == "reduce_scatter":
        rho, tau_s = fp8_requantization_coefficients("e4m3")
        # the second amax is max |Z| ≤ ‖Z‖_F ≤ (1 + u) V, so 1/s₂ ≤ (1 + u) V / (448 (1 − u))
        tau = tau_s * (1 + u) * V / (448.0 * (1 - u)) * (2 if scaling == "power_of_two" else 1)
        W += rho * inverted + tau * numel ** 0.5                 # + ‖Q₂(Z) − Z‖
        inverted = (1 + rho) * inverted + tau * numel ** 0.5     # ≥ ‖Q₂(Z)‖
    elif exchange != "all_gather":
        raise ValueError(f"unknown exchange {exchange!r}")
    if whitening is None:
        return W * (1 + 2.0 ** -30)
    w = whitening
    T = dense(w.inv_sigma, w.d_apply, w.U)
    S = dense(w.sigma, w.d_invert, w.U)
    norm_S = _spectral(S)
    mismatch = _spectral(T @ S - torch.eye(w.U.shape[0], dtype=torch.float64))
    alpha_T = map_error_coefficient(w.inv_sigma, w.d_apply, w.U)
    alpha_S = map_error_coefficient(w.sigma, w.d_invert, w.U)
    bound = alpha_S * inverted + norm_S * W + (norm_S * alpha_T + mismatch) * sum(grad_norms)
    return bound * (1 + 2.0 ** -30)  # the float64 evaluation of the norms, far inside this margin
