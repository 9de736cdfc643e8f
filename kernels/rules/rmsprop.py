"""RMSprop, with optional momentum and centering, as ``torch.optim.RMSprop``."""

import triton
import triton.language as tl

from .base import Rule, check_eps, check_real

MOMENTUM_BIT, CENTERED_BIT = 1, 2


@triton.jit
def rmsprop_update(w, g, square_avg, buf, grad_avg, lr, alpha, one_minus_alpha, eps, weight_decay,
                   momentum, h6, h7, VARIANT: tl.constexpr):
    d = g + weight_decay * w
    square_avg = alpha * square_avg + one_minus_alpha * (d * d)
    if VARIANT & 2:
        grad_avg = alpha * grad_avg + one_minus_alpha * d
        # E[d^2] - E[d]^2 >= 0 exactly, but rounding (bf16 or q8 state especially) can push
        # it below zero, where torch.optim would take the square root of a negative number.
        avg = tl.sqrt_rn(tl.maximum(square_avg - grad_avg * grad_avg, 0.0)) + eps
    else:
        avg = tl.sqrt_rn(square_avg) + eps
    if VARIANT & 1:
        buf = momentum * buf + tl.div_rn(d, avg)
        w = w - lr * buf
    else:
        w = w - lr * tl.div_rn(d, avg)
    return w, square_avg, buf, grad_avg


class RMSprop(Rule):
    update = rmsprop_update
    nonnegative = ("square_avg",)

    def __init__(self, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0, centered=False):
        self.lr = lr
        self.alpha = alpha
        self.eps = eps
        self.weight_decay = weight_decay
        self.momentum = momentum
        self.centered = bool(centered)
        self._validate()
        # Fixed at construction, like SGD's: the state layout must not change under the state.
        self._has_momentum = self.momentum != 0

    @property
    def slot_layout(self):
        return ("square_avg",
                "momentum_buffer" if self._has_momentum else None,
                "grad_avg" if self.centered else None)

    @property
    def variant(self):
        return (MOMENTUM_BIT if self._has_momentum else 0) | (CENTERED_BIT if self.centered else 0)

    def hyperparameters(self):
        return {"lr": self.lr, "alpha": self.alpha, "eps": self.eps, "weight_decay": self.weight_decay,
                "momentum": self.momentum, "centered": self.centered}

    def _validate(self):
        check_real("lr", self.lr, low=0.0)
        check_real("alpha", self.alpha, low=0.0, high=1.0)
        check_eps(self.eps)
        check_real("weight_decay", self.weight_decay, low=0.0)
        check_real("momentum", self.momentum, low=0.0)
        if hasattr(self, "_has_momentum") and (self.momentum != 0) != self._has_momentum:
            raise ValueError("momentum cannot be switched between zero and non-zero after "
                             "construction: it changes which state the rule keeps")

    def _host_scalars(self, step):
        return (self.lr, self.alpha, 1.0 - self.alpha, self.eps, self.weight_decay, self.momentum)
