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


def e4m3_sum_bound(whitening, sent_norms, grad_norms, scale: float, numel: int) -> float:
    """β_Σ with ‖out − Σ_r G_r‖_F ≤ β_Σ for one summing exchange (``average=False``, no
    error feedback) of E4M3 codes under the shared ``scale`` over the ranks, where rank r
    sent y_r = apply(G_r) (``sent_norms``: ‖y_r‖_F, ``grad_norms``: ‖G_r‖_F, ``numel``
    elements each) and out = invert(fl(Σ_r values_r / scale)) (proofs/gift.md, "6. A
    summed exchange"). ``whitening`` None: the plain route (T = I, exact maps)."""
    u = U32
    world = len(sent_norms)
    relative = u + 2.0 ** -4 * (1 + u)            # per element: fl(y s), then E4M3's half step
    absolute = world * 2.0 ** -10 * numel ** 0.5 / scale  # E4M3's subnormal half step, unscaled
    V = sum((1 + relative) * n for n in sent_norms) + absolute  # ‖Σ_r values_r / s‖
    W = u * V + relative * sum(sent_norms) + absolute            # ‖Z − Σ_r y_r‖
    if whitening is None:
        return W * (1 + 2.0 ** -30)
    w = whitening
    T = dense(w.inv_sigma, w.d_apply, w.U)
    S = dense(w.sigma, w.d_invert, w.U)
    norm_S = _spectral(S)
    mismatch = _spectral(T @ S - torch.eye(w.U.shape[0], dtype=torch.float64))
    alpha_T = map_error_coefficient(w.inv_sigma, w.d_apply, w.U)
    alpha_S = map_error_coefficient(w.sigma, w.d_invert, w.U)
    bound = alpha_S * (1 + u) * V + norm_S * W + (norm_S * alpha_T + mismatch) * sum(grad_norms)
    return bound * (1 + 2.0 ** -30)  # the float64 evaluation of the norms, far inside this margin
