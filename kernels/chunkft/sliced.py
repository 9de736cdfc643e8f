"""Sliced weight gradients: a range of a parameter's gradient computed without the rest.

Pure torch, any floating dtype (float64 included, for the checks). Each returns the
gradient of ``start:stop`` along the parameter's cut dim, as autograd would give it
sliced; the full dX is never changed by slicing (the layers compute it as torch does).
"""

import torch


def token_sum(values):
    """Σ over dim 0 of a (T, D) tensor, each column summed in token order on its own.

    torch's ``sum(0)`` blocks the reduction by position, so a column's bits depend on the
    columns around it (a slice would not get the whole's bits); the last prefix of
    ``cumsum`` reads only its own column, in order (torch's CPU scan accumulates in the
    dtype's accumulation type, float64 for float32, and rounds each prefix once)."""
    if values.shape[0] == 0:
        return values.new_zeros(values.shape[1:])
    return values.cumsum(0)[-1]


def embedding_weight_grad(indices, dy, start, stop, *, padding_idx=None, scale_grad_by_freq=False):
    """Rows ``start:stop`` of nn.Embedding's weight gradient for ``indices`` (any shape)
    and ``dy`` (indices.shape + (D,)). Tokens outside the rows are dropped before the
    sum (order kept), so a row's sum runs over the same tokens in the same order as
    ``embedding_dense_backward`` on the whole table; the padding row gets 0, and
    ``scale_grad_by_freq`` divides by the token's count in the whole batch (a row's
    count only involves its own tokens)."""
    flat = indices.reshape(-1)
    grads = dy.reshape(flat.numel(), dy.shape[-1])
    inside = (flat >= start) & (flat < stop)
    local_padding = padding_idx - start if padding_idx is not None and start <= padding_idx < stop else -1
    return torch.ops.aten.embedding_dense_backward(grads[inside], flat[inside] - start, stop - start,
                                                   local_padding, scale_grad_by_freq)


def _llama_normalized(x, eps):
    # transformers' LlamaRMSNorm, operation for operation: statistics in float32 whatever
    # the input's dtype, x̂ rounded back to it before the weight multiplies it.
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return (hidden * torch.rsqrt(variance + eps)).to(x.dtype)


def llama_rms_norm(x, weight, eps):
    """transformers' ``LlamaRMSNorm.forward`` as a function of (x, weight): the same bits."""
    return weight * _llama_normalized(x, eps)


def rms_norm_eps(eps, dtype):
    """nn.RMSNorm's ε for an input of ``dtype``: ``eps``, or when it is None torch's
    default, the machine epsilon of the dtype rms_norm computes in: float32 for float16
    and bfloat16 inputs, the input's own for float32 and float64 (torch's
    ``_fused_rms_norm`` decomposition; tests/test_chunkft.py checks it bitwise)."""
    if eps is not None:
        return eps
    return torch.finfo(torch.promote_types(dtype, torch.float32)).eps


def normalized_input(x, kind, eps):
    """x̂ over the last dim: (x − mean)·rstd for "layer_norm", x·rstd for "rms_norm"
    (torch's default ε for x's dtype when ``eps`` is None: ``rms_norm_eps``),
    LlamaRMSNorm's x̂ (float32 statistics, rounded to x's dtype) for "llama_rms_norm"."""
    if kind == "llama_rms_norm":
        return _llama_normalized(x, eps)
    if kind == "layer_norm":
        mean = x.mean(-1, keepdim=True)
        centered = x - mean
        variance = (centered * centered).mean(-1, keepdim=True)
        return centered * torch.rsqrt(variance + eps)
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + rms_norm_eps(eps, x.dtype))


def norm_weight_grad(x, dy, start, stop, kind, eps):
    """Elements ``start:stop`` of a LayerNorm/RMSNorm weight's gradient: Σ_tokens dy·x̂ on
    those features (the statistics still read the whole feature axis)."""
    x_hat = normalized_input(x.reshape(-1, x.shape[-1]), kind, eps)[:, start:stop]
    return token_sum(dy.reshape(-1, dy.shape[-1])[:, start:stop] * x_hat.to(dy.dtype))


def bias_grad(dy, start, stop):
    """Elements ``start:stop`` of a bias's gradient (Linear or LayerNorm): Σ_tokens dy."""
    return token_sum(dy.reshape(-1, dy.shape[-1])[:, start:stop])
