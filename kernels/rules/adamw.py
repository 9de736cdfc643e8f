"""AdamW (decoupled weight decay, Loshchilov & Hutter) and Adam (AdamW without decay).

The formula of ``torch.optim.AdamW``'s single-tensor path (decay, moments, bias
corrections, ``sqrt(v) / sqrt(1 - beta2**step) + eps``), not its operation order: torch
updates the first moment by ``lerp_`` and the second by ``mul_``/``addcmul_``, and on CPU
its vectorized kernels may contract into FMAs, where this rule rounds each product and
sum as written (``beta1 * m + (1 - beta1) * g``). So against torch only closeness holds,
measured by ``forge-verify check`` (README, "Closeness to torch.optim"); the exactness
claims are against the oracle, which runs this same code. Square root and division round
correctly (``sqrt_rn``/``div_rn``) on every backend.
The division by the bias correction ``sqrt(1 - beta2**step)``, one scalar, is
``div_by_scalar_rn``: the same bits as ``div_rn`` for these operands (the dividend is a
square root: 0, non-finite, or at least 2**-74.5, the square root of the smallest
subnormal; the divisor lies in [2**-26.5, 1], since 1 - beta2 >= 2**-53 for a float64
beta2 below 1; so the quotient is 0, non-finite or at least 2**-74.5, normal), at a
fraction of its instructions (proofs/scalar_division.md).
"""

import triton
import triton.language as tl

from .base import Rule, bias_corrections, check_eps, check_real
from .scalar_division import div_by_scalar_rn, reciprocal_f64


@triton.jit
def adamw_update(w, g, m, v, unused, decay, beta1, one_minus_beta1, beta2, one_minus_beta2,
                 step_size, bias_correction2_sqrt, eps, VARIANT: tl.constexpr):
    w = w * decay
    m = beta1 * m + one_minus_beta1 * g
    v = beta2 * v + one_minus_beta2 * (g * g)
    denom = div_by_scalar_rn(tl.sqrt_rn(v), reciprocal_f64(bias_correction2_sqrt)) + eps
    w = w - step_size * tl.div_rn(m, denom)
    return w, m, v, unused


class AdamW(Rule):
    update = adamw_update
    nonnegative = ("exp_avg_sq",)

    def __init__(self, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        self.lr = lr
        self.betas = tuple(betas)
        self.eps = eps
        self.weight_decay = weight_decay
        self._validate()

    @property
    def slot_layout(self):
        return ("exp_avg", "exp_avg_sq", None)

    def hyperparameters(self):
        return {"lr": self.lr, "betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay}

    def _validate(self):
        check_real("lr", self.lr, low=0.0)
        if len(self.betas) != 2:
            raise ValueError(f"betas must be a pair (beta1, beta2), got {self.betas!r}")
        check_real("betas[0]", self.betas[0], low=0.0, high=1.0, high_open=True)
        check_real("betas[1]", self.betas[1], low=0.0, high=1.0, high_open=True)
        check_eps(self.eps)
        check_real("weight_decay", self.weight_decay, low=0.0)

    def _host_scalars(self, step):
        beta1, beta2 = self.betas
        bias_correction1, bias_correction2_sqrt = bias_corrections(beta1, beta2, step)
        return (1.0 - self.lr * self.weight_decay, beta1, 1.0 - beta1, beta2, 1.0 - beta2,
                self.lr / bias_correction1, bias_correction2_sqrt, self.eps)


class Adam(AdamW):
    """Adam: AdamW with ``weight_decay=0``.

    torch.optim.Adam's ``weight_decay`` is an L2 term added to the gradient, which is
    a different rule; it is refused rather than silently reinterpreted as decoupled decay.
    """

    def __init__(self, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        if weight_decay != 0:
            raise ValueError("Adam takes no weight_decay here: use AdamW for decoupled decay "
                             "(coupled L2 decay, torch.optim.Adam's weight_decay, is not provided)")
        super().__init__(lr=lr, betas=betas, eps=eps, weight_decay=0.0)

    def hyperparameters(self):
        return {"lr": self.lr, "betas": self.betas, "eps": self.eps}

    def _validate(self):
        super()._validate()
        if self.weight_decay != 0:
            raise ValueError("Adam.weight_decay must stay 0; use AdamW for decoupled decay")
