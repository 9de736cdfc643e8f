"""Hugging Face ``transformers`` models and ``fuse``.

GPT-2 (and OpenAI GPT) implement their projections with ``transformers.pytorch_utils.
Conv1D``: a linear layer whose weight is stored transposed, (in, out), and applied with
``addmm``. ``fuse`` refuses it rather than leave it unfused; ``conv1d_to_linear``
replaces each one with an ``nn.Linear`` computing the same function. Models built on
``nn.Linear`` (Llama, Mistral, ...) need nothing.
"""

import torch
from torch import nn


def is_conv1d(module) -> bool:
    """A transformers ``Conv1D`` (recognised by name: transformers need not be installed)."""
    return type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers")


def conv1d_to_linear(model: nn.Module) -> nn.Module:
    """Replace every transformers ``Conv1D`` in ``model`` (in place) by an ``nn.Linear``.

    The weight becomes a new, contiguous (out, in) Parameter holding the transposed
    values (so ``state_dict()`` keys stay, their weight shapes are transposed); the bias
    Parameter is kept. Build optimizers after converting. Returns the model.
    """
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if not is_conv1d(child):
                continue
            weight = child.weight
            linear = nn.Linear(child.nx, child.nf, bias=True, device=weight.device, dtype=weight.dtype)
            with torch.no_grad():
                linear.weight = nn.Parameter(weight.detach().t().contiguous(), requires_grad=weight.requires_grad)
            linear.bias = child.bias
            setattr(module, child_name, linear)
    return model
