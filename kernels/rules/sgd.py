"""SGD with optional momentum, dampening, Nesterov momentum and (coupled) weight decay,
as ``torch.optim.SGD``.

torch.optim starts the momentum buffer as a copy of the first gradient, with no
dampening. Here the buffer starts at zero and the first step's scalars are
(buffer factor 0, gradient factor 1), which gives exactly that copy.
"""

import triton
import triton.language as tl

from .base import Rule, check_real

PLAIN, MOMENTUM, NESTEROV = 0, 1, 2
# A micro-batch before the last of an accumulated step: the momentum buffer takes the
# gradient, the weight waits (its forward must see the same weight in every micro-batch).
ACCUMULATE = 3


@triton.jit
def sgd_update(w, g, buf, unused1, unused2, lr, weight_decay, buf_factor, grad_factor, momentum,
               h5, h6, h7, VARIANT: tl.constexpr):
    d = g + weight_decay * w
    if VARIANT != 0:
        buf = buf_factor * buf + grad_factor * d
        if VARIANT == 2:
            d = d + momentum * buf
        else:
            d = buf
    if VARIANT != 3:
        w = w - lr * d
    return w, buf, unused1, unused2


class SGD(Rule):
    update = sgd_update
    # w - lr * (g + wd * w), buf = b * buf + c * (g + wd * w) and Nesterov's sum: linear in
    # (w, buf, g) for every setting, the first step (b = 0, c = 1) included.
    linear = True

    def __init__(self, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False):
        self.lr = lr
        self.momentum = momentum
        self.dampening = dampening
        self.weight_decay = weight_decay
        self.nesterov = bool(nesterov)
        self._validate()
        # The slot layout is fixed at construction: state made for one layout must not
        # silently change meaning if momentum is switched on later.
        self._has_momentum = self.momentum != 0

    @property
    def slot_layout(self):
        return ("momentum_buffer" if self._has_momentum else None, None, None)

    @property
    def variant(self):
        if not self._has_momentum:
            return PLAIN
        return NESTEROV if self.nesterov else MOMENTUM

    def hyperparameters(self):
        return {"lr": self.lr, "momentum": self.momentum, "dampening": self.dampening,
                "weight_decay": self.weight_decay, "nesterov": self.nesterov}

    def _validate(self):
        check_real("lr", self.lr, low=0.0)
        check_real("momentum", self.momentum, low=0.0)
        check_real("dampening", self.dampening, low=0.0, high=1.0)
        check_real("weight_decay", self.weight_decay, low=0.0)
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum > 0 and zero dampening")
        if hasattr(self, "_has_momentum") and (self.momentum != 0) != self._has_momentum:
            raise ValueError("momentum cannot be switched between zero and non-zero after "
                             "construction: it changes which state the rule keeps")

    def _host_scalars(self, step):
        if step == 1:
            buf_factor, grad_factor = 0.0, 1.0
        else:
            buf_factor, grad_factor = self.momentum, 1.0 - self.dampening
        return (self.lr, self.weight_decay, buf_factor, grad_factor, self.momentum)


class SGDMicroBatch(SGD):
    """SGD with momentum over one micro-batch of an accumulated step, accumulating into
    the momentum buffer (no gradient buffer). SGD is affine in the gradient, so with
    g = g_1 + ... + g_M the step of ``torch.optim.SGD`` on g splits exactly (in real
    arithmetic) into::

        first micro-batch:  buf <- b_t * buf + c_t * (g_1 + weight_decay * w)   (w waits)
        later ones:         buf <- 1 * buf + c_t * (g_j + 0 * w)                 (w waits)
        last one, also:     w <- w - lr * buf

    where (b_t, c_t) are the step's buffer and gradient factors ((0, 1) on step 1, else
    (momentum, 1 - dampening)). In floating point the sum is rounded in this order, not
    as torch's (g_1 + ... + g_M) first. Nesterov momentum needs the whole gradient
    again after the buffer is updated, so it cannot be split this way.
    """

    def __init__(self, sgd: SGD, *, first: bool, last: bool):
        if not sgd._has_momentum or sgd.nesterov:
            raise ValueError("accumulating into the momentum buffer needs SGD with momentum > 0 and without "
                             "Nesterov (plain SGD keeps no state to accumulate into; Nesterov needs the whole "
                             "gradient after the buffer is updated)")
        super().__init__(lr=sgd.lr, momentum=sgd.momentum, dampening=sgd.dampening,
                         weight_decay=sgd.weight_decay)
        self.first, self.last = bool(first), bool(last)

    @property
    def variant(self):
        return MOMENTUM if self.last else ACCUMULATE

    def _host_scalars(self, step):
        lr, weight_decay, buf_factor, grad_factor, momentum = super()._host_scalars(step)
        if not self.first:
            weight_decay, buf_factor = 0.0, 1.0
        return (lr, weight_decay, buf_factor, grad_factor, momentum)
