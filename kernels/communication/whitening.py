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
them; proofs/gift.md). Everything runs on A's device (on a GPU, float64 ``eigh`` is
cuSOLVER's; the factors are computed on one rank and broadcast, so that is harmless).

The factors must be bit-identical on every rank: ``broadcast`` sends rank ``src``'s to
the others (kfac-pytorch's pattern); ``digest`` hashes them for checking;
``agreed_whitening`` does both steps for a rank-local covariance (all-reduce, compute on
the group's first rank only, broadcast into factors of the same shape on the others).
"""

import contextlib
import hashlib
import numbers
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .._collectives import wire_device
from ..errors import check_nonnegative


def full_precision(device_type: str):
    """A context in which matrix products run in their operands' precision: autocast, which
    the training step may have entered (and which carries into a backward called inside
    it), would take them in bf16 or fp16."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def check_rank_and_damping(rank, damping) -> None:
    """Refuse a transform ``rank`` that is not an integer ≥ 0 (0 keeps no eigenvector: T is
    σ^{-1} I) or a ``damping`` that is not a finite number ≥ 0 (NaN would pass a plain
    ``< 0`` and make every factor NaN)."""
    if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or rank < 0:
        raise ValueError(f"rank must be an integer >= 0 (0: T = I / sigma), got {rank!r}")
    check_nonnegative("damping", damping)


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
    def identity(cls, features: int, device=None) -> "Whitening":
        one = torch.ones((), dtype=torch.float32, device=device)
        return cls(torch.zeros(features, 0, device=device), torch.zeros(0, device=device),
                   torch.zeros(0, device=device), one, one.clone(), torch.ones(1, dtype=torch.float64, device=device))

    @classmethod
    def zeros(cls, features: int, rank: int, device=None) -> "Whitening":
        """Factors of a rank-``rank`` transform, all zero: what a broadcast is received into."""
        def f32(*shape):
            return torch.zeros(shape, dtype=torch.float32, device=device)

        return cls(f32(features, rank), f32(rank), f32(rank), f32(), f32(),
                   torch.zeros(rank + 1, dtype=torch.float64, device=device))

    @classmethod
    def from_covariance(cls, A: torch.Tensor, rank: int, damping: float = 1e-3) -> "Whitening":
        if A.ndim != 2 or A.shape[0] != A.shape[1]:
            raise ValueError(f"A must be square, got shape {tuple(A.shape)}")
        if not bool(torch.isfinite(A).all()):
            raise ValueError("A holds a NaN or an infinity")
        check_rank_and_damping(rank, damping)
        K = A.shape[0]
        r = min(rank, K)
        A64 = A.detach().to(torch.float64)
        eigenvalues, vectors = torch.linalg.eigh((A64 + A64.T) / 2)
        eigenvalues, vectors = eigenvalues.flip(0).clamp(min=0), vectors.flip(1)
        mean = float(eigenvalues.sum()) / K
        if mean == 0:
            return cls.identity(K, A.device)
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
                   torch.tensor(1 / sigma, dtype=torch.float32, device=A.device),
                   torch.tensor(sigma, dtype=torch.float32, device=A.device),
                   torch.cat([root, torch.tensor([sigma], dtype=torch.float64, device=A.device)]))

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
            with full_precision(G.device.type):
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
            h.update(t.reshape(-1).contiguous().view(torch.uint8).cpu().numpy().tobytes())
        return h.hexdigest()

    def broadcast(self, src: int = 0, group=None) -> "Whitening":
        """Rank ``src``'s factors on every rank of ``group``, in place; the shapes must agree
        already (``agreed_whitening`` broadcasts the source's rank first)."""
        for t in self.tensors():
            dist.broadcast(t, src, group=group)
        return self

    def nbytes(self) -> int:
        """Bytes of the factors (what a broadcast sends)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())


def agreed_whitening(A, features: int, rank: int, damping: float, group=None, *, device=None):
    """One transform for every rank of ``group`` from this rank's covariance ``A`` (None
    when this rank recorded nothing): the ranks' A averaged by an all-reduce (a rank that
    recorded nothing adds zeros), the factors computed on the group's first rank only (one
    float64 ``eigh``, not one per rank) and broadcast: first their rank (which the source
    knows only after computing them: 0 for an all-zero A), or -1 if it could not compute
    them, so that every rank raises instead of the others waiting for factors that never
    come; then the factors, into zeros of that shape on the other ranks. None when no rank
    recorded anything. Returns (whitening, bytes this rank put into collectives).

    ``device``: where the factors are used (the gradients' device; None: A's, or, where
    this rank recorded nothing, the collectives' bookkeeping device). The covariance and
    the factors live there on every rank, so every rank issues their collectives on the
    same device (with gloo and CUDA gradients, or a group serving CUDA by NCCL and the CPU
    by gloo, the bookkeeping device is the CPU and theirs is not); the counts and the
    factors' rank stay on the bookkeeping device, which every rank of the group shares."""
    wire = wire_device(group)
    device = torch.device(device) if device is not None else A.device if A is not None else wire
    recorded = torch.tensor([0 if A is None else 1], dtype=torch.int64, device=wire)
    dist.all_reduce(recorded, group=group)
    if int(recorded) == 0:
        return None, recorded.numel() * 8
    total = torch.zeros(features, features, device=device) if A is None else A.to(device, copy=True)
    dist.all_reduce(total, group=group)
    total /= dist.get_world_size(group)
    source = dist.get_process_group_ranks(dist.group.WORLD if group is None else group)[0]
    whitening, failure = None, None
    if dist.get_rank() == source:
        try:
            whitening = Whitening.from_covariance(total, rank, damping)
        except Exception as error:  # noqa: BLE001 - raised below, after the other ranks are told
            failure = error
    kept = torch.tensor([whitening.rank if whitening is not None else -1], dtype=torch.int64, device=wire)
    dist.broadcast(kept, source, group=group)  # the other ranks' -1 is overwritten
    if failure is not None:
        raise failure
    if int(kept) < 0:
        raise ValueError(f"the group's first rank ({source}) could not compute GIFT's transform from the "
                         "all-reduced covariance; its error says why")
    if whitening is None:
        whitening = Whitening.zeros(features, int(kept), total.device)
    whitening.broadcast(source, group)
    return whitening, recorded.numel() * 8 + total.numel() * 4 + kept.numel() * 8 + whitening.nbytes()

class CovarianceTracker:
    """fp32 sums of xᵀx over a window of forward calls, one per tracked ``nn.Linear``
    (forward pre-hooks). ``covariance(layer)`` is the window's mean; ``reset`` opens a
    new window."""

    def __init__(self, layers=()):
        self.layers = []
        self._sums = {}
        self._counts = {}
        self._handles = []
        self.add(layers)

    def add(self, layers) -> None:
        """Start tracking ``layers`` too (from their next forward call on)."""
        for layer in layers:
            self.layers.append(layer)
            self._handles.append(layer.register_forward_pre_hook(self._record))

    def _record(self, module, inputs):
        if not torch.is_grad_enabled():
            return
        x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).to(torch.float32)
        with full_precision(x.device.type):  # else the window would be summed in bf16 under autocast
            product = x.T @ x
        key = id(module)
        if key in self._sums:
            self._sums[key] += product
            self._counts[key] += x.shape[0]
        else:
            self._sums[key] = product
            self._counts[key] = x.shape[0]

    def rows(self, layer) -> int:
        return self._counts.get(id(layer), 0)

    def covariance(self, layer) -> torch.Tensor:
        if id(layer) not in self._sums:
            raise RuntimeError("no forward call of this layer was recorded in the window")
        return self._sums[id(layer)] / self._counts[id(layer)]

    def window(self, layer):
        """(the window's fp32 sum of xᵀx, its row count), or None before any recorded call."""
        key = id(layer)
        return (self._sums[key], self._counts[key]) if key in self._sums else None

    def set_window(self, layer, total: torch.Tensor, rows: int) -> None:
        """Resume ``layer``'s window from ``window``'s output."""
        self._sums[id(layer)], self._counts[id(layer)] = total.clone(), rows

    def reset(self, layer=None):
        """Open a new window for ``layer`` (every layer when None)."""
        keys = list(self._sums) if layer is None else [id(layer)]
        for key in keys:
            self._sums.pop(key, None)
            self._counts.pop(key, None)

    def remove(self):
        for handle in self._handles:
            handle.remove()
