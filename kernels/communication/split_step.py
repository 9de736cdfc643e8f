"""GIFT on FORGE's materialized data-parallel path (``forge_kernels.token_split``).

A fused layer (``ForgeLinear``) updates its weight inside its backward and never holds a
``.grad``, so DDP, and with it ``gift_hook``, never sees its gradient. Under data
parallelism FORGE takes the step with ``materialized_split_step``: the fp32 gradient of
one bucket of weight rows at a time, summed over the ranks, then the rule. The sum is the
seam: ``materialized_split_step(..., reduce=GiftSplitReducer(...))`` sums each bucket
through GIFT's exchange (the same agreed scale, all-gather of codes, fp32 sum in rank
order and inverse transform as the hook, on either of the hook's exchanges) instead of an
fp32 all-reduce.

The transform acts on the gradient's columns (the layer's input features), so a bucket of
rows is whitened by the layer's transform as it is. ``refresh(parts)`` computes the
transform from this step's inputs (the covariance of every part's x, all-reduced, the
factors from the group's first rank, broadcast) and re-bases every bucket's residual.
What this saves is wire bytes only: the bucket's fp32 gradient is still materialized in
memory, as on this path without GIFT.
"""

from collections import Counter

import torch

from .hook import GiftState
from .whitening import Whitening, agreed_whitening, full_precision


class GiftSplitReducer:
    """``reduce=`` for ``materialized_split_step``: one per weight (its residuals are kept
    per bucket of rows). ``group`` must be the group the step is given; ``whitening``: a
    ``Whitening`` of the weight's in-features, or None for the plain route (the format
    without a transform); ``exchange`` as ``GiftState``'s."""

    def __init__(self, fmt: str, group, *, whitening=None, rank: int = 32, damping: float = 1e-3,
                 error_feedback: bool = True, scaling: str = "current", exchange: str = "reduce_scatter"):
        self.group = group
        self.state = GiftState(group, fmt, rank, layers=(), damping=damping, error_feedback=error_feedback,
                               scaling=scaling, exchange=exchange, overlap=False)
        self.whitening = whitening

    def __call__(self, grad: torch.Tensor, group, rows: slice) -> torch.Tensor:
        if group is not self.group:
            raise ValueError("GiftSplitReducer was made for another process group than the step's")
        if self.whitening is not None and grad.shape[-1] != self.whitening.features:
            raise ValueError(f"the transform has {self.whitening.features} features, the gradient's rows "
                             f"{grad.shape[-1]}")
        return self.state.exchange([((rows.start, rows.stop), grad, self.whitening)], average=False)[0]

    def refresh(self, parts) -> None:
        """The transform from the inputs of ``parts`` ([(x, dy)], this rank's), agreed by
        every rank; residuals re-based into it."""
        xs = [x.reshape(-1, x.shape[-1]).to(torch.float32) for x, _ in parts]
        rows = sum(x.shape[0] for x in xs)
        with full_precision(xs[0].device.type):
            A = sum(x.T @ x for x in xs) / rows if rows else None
        new, sent = agreed_whitening(A, xs[0].shape[-1], self.state.rank, self.state.damping, self.group,
                                     device=xs[0].device)
        self.state.wire_bytes["refresh"] += sent
        if new is None:
            return
        self.state.fold_shard_residuals()  # whole buckets of rows can be re-based, a shard of one cannot
        for key, residual in self.state.residuals.items():
            self.state.residuals[key] = new.apply(self.whitening.invert(residual) if self.whitening else residual)
        self.whitening = new

    @property
    def wire_bytes(self):
        return self.state.wire_bytes

    @property
    def received_bytes(self):
        return self.state.received_bytes

    def state_dict(self) -> dict:
        """The transform's factors and the residuals per bucket of rows (``(start, stop)``),
        with the second residuals of the shards this rank owns (reduce-scatter exchange), and
        the configuration they were made under (``GiftState.configuration``)."""
        return {"config": self.state.configuration(),
                "whitening": None if self.whitening is None else [t.clone() for t in self.whitening.tensors()],
                "residuals": {key: r.clone() for key, r in self.state.residuals.items()},
                "shard_residuals": {key: (a, b, r.clone()) for key, (a, b, r) in self.state.shard_residuals.items()},
                "wire_bytes": dict(self.state.wire_bytes), "received_bytes": dict(self.state.received_bytes)}

    def load_state_dict(self, state: dict) -> None:
        self.state.check_configuration(state.get("config"), "reducer.state")
        self.whitening = None if state["whitening"] is None else Whitening(*[t.clone() for t in state["whitening"]])
        self.state.residuals = {tuple(key): r.clone() for key, r in state["residuals"].items()}
        self.state.shard_residuals = {tuple(key): (a, b, r.clone())
                                      for key, (a, b, r) in state.get("shard_residuals", {}).items()}
        self.state.wire_bytes = Counter(state["wire_bytes"])
        self.state.received_bytes = Counter(state.get("received_bytes", {}))
