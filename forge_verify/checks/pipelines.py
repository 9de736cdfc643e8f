"""The standard (materialized) training pipeline for fused models, as the reference the
``Trainer`` is compared with: each fused layer's backward stores the fp32 weight
gradient of the fused kernel's own tile loop (``weight_gradient``) where torch keeps
``.grad``, micro-batches add into it as autograd adds into ``.grad``, then
``torch.nn.utils.clip_grad_norm_`` (``foreach=False``) runs over all parameters, the
fused weights step by the oracle's epilogue (``apply_rule``) and the rest by the torch
optimizer. Nothing here calls the Trainer.
"""

import torch

import forge_kernels as fk


class StandardPipeline:
    def __init__(self, model, optimizer, *, max_norm=None):
        self.model, self.optimizer, self.max_norm = model, optimizer, max_norm
        self.layers = fk.fused_layers(model)
        self.micro_batch_grads = {layer: [] for layer in self.layers}
        for layer in self.layers:
            layer.forge_backward = self._record

    def _record(self, layer, x2d, dy2d):
        grad = fk.weight_gradient(x2d, dy2d, config=layer.config)
        self.micro_batch_grads[layer].append(grad)
        if layer.weight.grad is None:
            layer.weight.grad = grad.clone()
        else:
            layer.weight.grad += grad

    def backward(self, closures):
        """Forward and backward each micro-batch in turn (a fused layer takes one forward
        per backward)."""
        for closure in closures:
            closure().backward()

    def clip(self, total_norm=None):
        """``clip_grad_norm_`` over every parameter, returning the total norm; with
        ``total_norm`` given, clip by that norm instead (``clip_grads_with_norm_``)."""
        if total_norm is None:
            return torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm, foreach=False)
        torch.nn.utils.clip_grads_with_norm_(self.model.parameters(), self.max_norm, total_norm, foreach=False)
        return total_norm

    def step(self):
        """Apply each fused layer's rule to its (clipped) gradient, then the torch optimizer."""
        for layer in self.layers:
            if layer.weight.grad is None:
                continue
            step = int(layer.forge_step) + 1
            fk.apply_rule(layer.weight.grad, layer.weight.data, layer.forge_state, layer.rule, step,
                          config=layer.config, rounding=layer.rounding, seed=int(layer.forge_seed))
            layer.forge_step.fill_(step)
        self.zero_grad()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def zero_grad(self):
        for layer in self.layers:
            layer.weight.grad = None
            self.micro_batch_grads[layer] = []

    def train_step(self, closures, total_norm=None):
        self.backward(closures)
        norm = self.clip(total_norm) if self.max_norm is not None else None
        self.step()
        return norm
