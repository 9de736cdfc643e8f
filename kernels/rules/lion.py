"""Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms"):
the sign of an interpolation of momentum and gradient, with decoupled weight decay.
"""

import triton
import triton.language as tl

from .base import Rule, check_real


@triton.jit
def lion_update(w, g, m, unused1, unused2, lr, decay, beta1, one_minus_beta1, beta2,
                one_minus_beta2, h6, h7, VARIANT: tl.constexpr):
    c = beta1 * m + one_minus_beta1 * g
    direction = tl.where(c > 0, 1.0, tl.where(c < 0, -1.0, 0.0))
    w = w * decay - lr * direction
    m = beta2 * m + one_minus_beta2 * g
    return w, m, unused1, unused2


class Lion(Rule):
    update = lion_update

    def __init__(self, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        self.lr = lr
        self.betas = tuple(betas)
        self.weight_decay = weight_decay
        self._validate()

    @property
    def slot_layout(self):
        return ("exp_avg", None, None)

    def hyperparameters(self):
        return {"lr": self.lr, "betas": self.betas, "weight_decay": self.weight_decay}

    def _validate(self):
        check_real("lr", self.lr, low=0.0)
        if len(self.betas) != 2:
            raise ValueError(f"betas must be a pair (beta1, beta2), got {self.betas!r}")
        check_real("betas[0]", self.betas[0], low=0.0, high=1.0)
        check_real("betas[1]", self.betas[1], low=0.0, high=1.0)
        check_real("weight_decay", self.weight_decay, low=0.0)

    def _host_scalars(self, step):
        beta1, beta2 = self.betas
        return (self.lr, 1.0 - self.lr * self.weight_decay, beta1, 1.0 - beta1, beta2, 1.0 - beta2)
