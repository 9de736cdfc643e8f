"""Hugging Face ``transformers`` models and ``fuse``.

GPT-2 (and OpenAI GPT) implement their projections with ``transformers.pytorch_utils.
Conv1D``: a linear layer whose weight is stored transposed, (in, out), and applied with
``addmm``. ``fuse`` refuses it rather than leave it unfused; ``conv1d_to_linear``
replaces each one with an ``nn.Linear`` computing the same function. Models built on
``nn.Linear`` (Llama, Mistral, ...) need nothing.
"""

from torch import nn


def is_conv1d(module) -> bool:
    """A transformers ``Conv1D`` (recognised by name: transformers need not be installed)."""
    return type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers")


def conv1d_to_linear(model: nn.Module) -> nn.Module:
    """Replace every transformers ``Conv1D`` in ``model`` (in place) by an ``nn.Linear``.

    The weight becomes a new, contiguous (out, in) Parameter holding the transposed
    values (so ``state_dict()`` keys stay, their weight shapes are transposed); the bias
    Parameter is kept. Sharing survives: a Conv1D reached from several parents becomes one
    Linear, and Conv1Ds sharing a weight become Linears sharing its transpose (which
    ``fuse`` then refuses as tied, as it would have refused the Conv1Ds). A Conv1D weight
    that another kind of module also uses cannot be transposed for one user alone: it is
    refused, naming both, before anything changes. Build optimizers after converting.
    Returns the model.
    """
    convs = {child for module in model.modules() for child in module.children() if is_conv1d(child)}
    conv_weights = {id(conv.weight) for conv in convs}
    for name, module in model.named_modules():
        if module in convs:
            continue
        for param_name, param in module.named_parameters(recurse=False):
            if id(param) in conv_weights:
                raise ValueError(f"{name or 'the model'}.{param_name} is also a transformers Conv1D's weight; "
                                 "conv1d_to_linear would store it transposed for the Conv1D alone and untie the "
                                 "two: nothing was converted")
    linears, weights = {}, {}
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if child not in convs:
                continue
            if child not in linears:
                weight = child.weight
                linear = nn.Linear(child.nx, child.nf, bias=True, device=weight.device, dtype=weight.dtype)
                if id(weight) not in weights:
                    weights[id(weight)] = nn.Parameter(weight.detach().t().contiguous(),
                                                       requires_grad=weight.requires_grad)
                linear.weight = weights[id(weight)]
                linear.bias = child.bias
                linears[child] = linear
            setattr(module, child_name, linears[child])
    return model
