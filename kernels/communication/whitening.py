"""GIFT's transform: whitening with a layer's input covariance (K-FAC's factor A).

From A (K×K, symmetric positive semi-definite) with eigenvalues λ_1 ≥ … ≥ λ_K and
eigenvectors U, keep the top ``rank`` r and treat the rest as isotropic:

    T = U_r Λ_r^{-1/2} U_rᵀ + σ^{-1} (I − U_r U_rᵀ),   Λ_r = diag(λ_i + ε), i ≤ r,
    σ² = (λ_{r+1} + … + λ_K) / (K − r) + ε              (σ² = λ_r + ε when r = K),
    ε = damping · tr(A) / K                              (damping is relative to the mean eigenvalue).

A gradient G (N, K) is sent as G T; the receiver applies T^{-1} = U_r Λ_r^{1/2} U_rᵀ +
σ (I − U_r U_rᵀ). Both are computed as ``a·G + ((G U_r) ∘ d) U_rᵀ`` with
``d = Λ_r^{∓1/2} − σ^{∓1}``: O(N K r) work, no K×K product is formed. The
eigendecomposition runs in float64; the factors are stored in fp32 and define the
transform (``forge_verify/numerics/gift_bounds.py`` bounds the fp32 round trip from
them; proofs/gift.md).

The factors must be bit-identical on every rank: ``broadcast`` sends rank ``src``'s to
the others (kfac-pytorch's pattern); ``digest`` hashes them for checking.
"""

import hashlib
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Whitening:
    U: torch.Tensor            # (K, r) fp32
    d_apply: torch.Tensor      # (r,) fp32: (λ_i + ε)^{-1/2} − σ^{-1}
    d_invert: torch.Tensor     # (r,) fp32: (λ_i + ε)^{1/2} − σ
    inv_sigma: torch.Tensor    # () fp32
    sigma: torch.Tensor        # () fp32
    scales: torch.Tensor       # (r + 1,) float64: (λ_i + ε)^{1/2} and σ, for the condition number

    @property
    def features(self) -> int:
        return self.U.shape[0]

    @property
    def rank(self) -> int:
        return self.U.shape[1]

    @classmethod
    def identity(cls, features: int) -> "Whitening":
        one = torch.ones((), dtype=torch.float32)
        return cls(torch.zeros(features, 0), torch.zeros(0), torch.zeros(0), one, one.clone(),
                   torch.ones(1, dtype=torch.float64))

    @classmethod
    def from_covariance(cls, A: torch.Tensor, rank: int, damping: float = 1e-3) -> "Whitening":
        if A.ndim != 2 or A.shape[0] != A.shape[1]:
            raise ValueError(f"A must be square, got shape {tuple(A.shape)}")
        if not bool(torch.isfinite(A).all()):
            raise ValueError("A holds a NaN or an infinity")
        if damping < 0 or rank < 0:
            raise ValueError(f"rank and damping must be non-negative, got {rank}, {damping}")
        K = A.shape[0]
        r = min(rank, K)
        A64 = A.detach().to(torch.float64).cpu()
        eigenvalues, vectors = torch.linalg.eigh((A64 + A64.T) / 2)
        eigenvalues, vectors = eigenvalues.flip(0).clamp(min=0), vectors.flip(1)
        mean = float(eigenvalues.sum()) / K
        if mean == 0:
            return cls.identity(K)
        eps = damping * mean
        kept = eigenvalues[:r] + eps
        rest = eigenvalues[r:]
        sigma2 = float(rest.mean()) + eps if r < K else float(kept[-1])
        if sigma2 <= 0:
            raise ValueError("the discarded eigenvalues are all zero and damping is 0: T would be singular")
        sigma = sigma2 ** 0.5
        root = kept.sqrt()
        return cls(vectors[:, :r].to(torch.float32).contiguous(),
                   (1 / root - 1 / sigma).to(torch.float32), (root - sigma).to(torch.float32),
                   torch.tensor(1 / sigma, dtype=torch.float32), torch.tensor(sigma, dtype=torch.float32),
                   torch.cat([root, torch.tensor([sigma], dtype=torch.float64)]))

    @property
    def condition_number(self) -> float:
        """κ(T) = κ(T^{-1}): the largest over the smallest of (λ_i + ε)^{1/2} and σ."""
        return float(self.scales.max() / self.scales.min())

    def _map(self, G: torch.Tensor, a: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        if G.shape[-1] != self.features:
            raise ValueError(f"expected a last dimension of {self.features}, got shape {tuple(G.shape)}")
        G = G.to(torch.float32)
        out = G * a
        if self.rank:
            out = out + ((G @ self.U) * d) @ self.U.T
        return out

    def apply(self, G: torch.Tensor) -> torch.Tensor:
        """G T (fp32)."""
        return self._map(G, self.inv_sigma, self.d_apply)

    def invert(self, Y: torch.Tensor) -> torch.Tensor:
        """Y T^{-1} (fp32)."""
        return self._map(Y, self.sigma, self.d_invert)

    def tensors(self):
        return (self.U, self.d_apply, self.d_invert, self.inv_sigma, self.sigma, self.scales)

    def digest(self) -> str:
        h = hashlib.sha256()
        for t in self.tensors():
            h.update(str(tuple(t.shape)).encode())
            h.update(t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def broadcast(self, src: int = 0, group=None) -> "Whitening":
        """Rank ``src``'s factors on every rank of ``group`` (shapes must agree already)."""
        rank = torch.tensor([self.rank], dtype=torch.int64)
        dist.broadcast(rank, src, group=group)
        if int(rank) != self.rank:
            raise ValueError(f"rank {dist.get_rank(group)} holds a rank-{self.rank} transform, rank {src} "
                             f"a rank-{int(rank)} one")
        for t in self.tensors():
            dist.broadcast(t, src, group=group)
        return self


class CovarianceTracker:
    """fp32 sums of xᵀx over a window of forward calls, one per tracked ``nn.Linear``
    (forward pre-hooks). ``covariance(layer)`` is the window's mean; ``reset`` opens a
    new window."""

    def __init__(self, layers):
        self.layers = list(layers)
        self._sums = {}
        self._counts = {}
        self._handles = [layer.register_forward_pre_hook(self._record) for layer in self.layers]

    def _record(self, module, inputs):
        if not torch.is_grad_enabled():
            return
        x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).to(torch.float32)
        key = id(module)
        if key in self._sums:
            self._sums[key] += x.T @ x
            self._counts[key] += x.shape[0]
        else:
            self._sums[key] = x.T @ x
            self._counts[key] = x.shape[0]

    def rows(self, layer) -> int:
        return self._counts.get(id(layer), 0)

    def covariance(self, layer) -> torch.Tensor:
        if id(layer) not in self._sums:
            raise RuntimeError("no forward call of this layer was recorded in the window")
        return self._sums[id(layer)] / self._counts[id(layer)]

    def reset(self, layer=None):
        """Open a new window for ``layer`` (every layer when None)."""
        keys = list(self._sums) if layer is None else [id(layer)]
        for key in keys:
            self._sums.pop(key, None)
            self._counts.pop(key, None)

    def remove(self):
        for handle in self._handles:
            handle.remove()
