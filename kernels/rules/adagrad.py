"""Adagrad, as ``torch.optim.Adagrad`` (learning-rate decay, coupled weight decay,
initial accumulator value)."""

import triton
import triton.language as tl

from .base import Rule, check_eps, check_real


@triton.jit
def adagrad_update(w, g, state_sum, unused1, unused2, clr, weight_decay, eps, h3, h4, h5, h6, h7,
                   VARIANT: tl.constexpr):
    d = g + weight_decay * w
    state_sum = state_sum + d * d
    std = tl.sqrt_rn(state_sum) + eps
    w = w - clr * tl.div_rn(d, std)
    return w, state_sum, unused1, unused2


class Adagrad(Rule):
    update = adagrad_update
    nonnegative = ("sum",)

    def __init__(self, lr=1e-2, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.0, eps=1e-10):
        self.lr = lr
        self.lr_decay = lr_decay
        self.weight_decay = weight_decay
        self.initial_accumulator_value = initial_accumulator_value
        self.eps = eps
        self._validate()

    @property
    def slot_layout(self):
        return ("sum", None, None)

    def initial_value(self, slot):
        return float(self.initial_accumulator_value)

    def hyperparameters(self):
        return {"lr": self.lr, "lr_decay": self.lr_decay, "weight_decay": self.weight_decay,
                "initial_accumulator_value": self.initial_accumulator_value, "eps": self.eps}

    def _validate(self):
        check_real("lr", self.lr, low=0.0)
        check_real("lr_decay", self.lr_decay, low=0.0)
        check_real("weight_decay", self.weight_decay, low=0.0)
        check_real("initial_accumulator_value", self.initial_accumulator_value, low=0.0)
        check_eps(self.eps)

    def _host_scalars(self, step):
        return (self.lr / (1.0 + (step - 1) * self.lr_decay), self.weight_decay, self.eps)
