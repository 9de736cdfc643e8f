"""Hugging Face transformers models built from a config (nothing downloaded): a tiny
Llama (nn.Linear projections) and a tiny GPT-2 (transformers Conv1D projections, a head
tied to the token embedding), trained through fk.Trainer."""

import copy

import pytest
import torch
import transformers

import forge_kernels as fk
from forge_kernels.hf import conv1d_to_linear
from forge_verify import assert_bitwise_equal
from forge_verify.checks.pipelines import StandardPipeline
from forge_verify.numerics.tolerances import UNIT_ROUNDOFF, gamma

VOCAB = 64


def _llama(device):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(config).to(device)


def _gpt2(device):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).to(device)


def _closure(model, device, step):
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(step)).to(device)
    return lambda: model(input_ids=ids, labels=ids).loss


def _train_and_compare(make_model, device, **fuse_kwargs):
    """Two steps of exact clipping through the Trainer == the standard pipeline, bitwise."""
    models = [fk.fuse(make_model(device), fk.AdamW(lr=1e-2), **fuse_kwargs) for _ in range(2)]
    optimizers = [torch.optim.AdamW(fk.unfused_parameters(m), lr=3e-3) for m in models]
    trainer = fk.Trainer(models[0], optimizers[0], max_norm=0.1)
    pipeline = StandardPipeline(models[1], optimizers[1], max_norm=0.1)
    for step in range(2):
        trainer.step(_closure(models[0], device, step))
        norm = pipeline.train_step([_closure(models[1], device, step)])
        assert_bitwise_equal(trainer.last_norm, norm, "total norm")
    assert float(norm) > 0.1  # clipping acted
    for (name, a), (_, b) in zip(models[0].state_dict().items(), models[1].state_dict().items(), strict=True):
        assert_bitwise_equal(a, b, name)
    return models[0], trainer


@pytest.mark.exactness
def test_llama_trains_fused_with_exact_clipping(device):
    model, trainer = _train_and_compare(_llama, device)
    fused = fk.fused_layers(model)
    assert len(fused) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the head
    assert all(int(layer.forge_step) == 2 for layer in fused)


def test_gpt2_conv1d_is_refused_with_the_conversion_named(device):
    with pytest.raises(TypeError, match="conv1d_to_linear"):
        fk.fuse(_gpt2(device), fk.AdamW(), exclude=["lm_head"])


def test_conv1d_to_linear_keeps_the_function(device):
    """Every Conv1D becomes a Linear holding its weight transposed and its bias, bit for
    bit; on the same input the two compute the same products summed in another order, so
    each output is within 2 γ_{K+1}(u32) (|x| |W| + |b|) of the other (each within
    γ_{K+1} of the exact sum: proofs/reference_enclosure.md, the γ_n bound of a sum)."""
    model = _gpt2(device)
    convs = {name: copy.deepcopy(m) for name, m in model.named_modules() if type(m).__name__ == "Conv1D"}
    conv1d_to_linear(model)
    assert not any(type(m).__name__ == "Conv1D" for m in model.modules())
    modules = dict(model.named_modules())
    gen = torch.Generator().manual_seed(0)
    for name, conv in convs.items():
        linear = modules[name]
        assert isinstance(linear, torch.nn.Linear)
        assert_bitwise_equal(linear.weight.detach(), conv.weight.detach().T.contiguous(), f"{name}.weight")
        assert_bitwise_equal(linear.bias.detach(), conv.bias.detach(), f"{name}.bias")
        inputs = torch.randn(2, 10, conv.weight.shape[0], generator=gen).to(device)
        with torch.no_grad():
            scale = inputs.abs() @ conv.weight.abs() + conv.bias.abs()
            bound = 2 * gamma(conv.weight.shape[0] + 1, UNIT_ROUNDOFF[torch.float32]) * scale
            assert torch.all((linear(inputs) - conv(inputs)).abs() <= bound), name


def test_conv1d_to_linear_keeps_sharing(device):
    """A Conv1D reached from two parents becomes one Linear; two Conv1Ds sharing a weight
    become Linears sharing its transpose (so fuse refuses them as tied, as it refuses the
    Conv1Ds); a Conv1D weight another kind of module also uses is refused, nothing
    converted. Converting each reference on its own had made independent copies."""
    from transformers.pytorch_utils import Conv1D

    shared = Conv1D(4, 6).to(device)
    model = torch.nn.ModuleDict({"a": torch.nn.Sequential(shared), "b": torch.nn.Sequential(shared)})
    conv1d_to_linear(model)
    assert model.a[0] is model.b[0] and isinstance(model.a[0], torch.nn.Linear)
    assert len(list(model.parameters())) == 2

    first, second = Conv1D(4, 4).to(device), Conv1D(4, 4).to(device)
    second.weight = first.weight
    tied = torch.nn.Sequential(first, second)
    conv1d_to_linear(tied)
    assert tied[0].weight is tied[1].weight and tied[0].bias is not tied[1].bias
    with pytest.raises(ValueError, match="tied"):
        fk.fuse(tied, fk.AdamW())

    conv = Conv1D(4, 4).to(device)
    other = torch.nn.Linear(4, 4, device=device)
    other.weight = conv.weight
    mixed = torch.nn.Sequential(conv, other)
    with pytest.raises(ValueError, match=r"1\.weight is also a transformers Conv1D's weight.*nothing was converted"):
        conv1d_to_linear(mixed)
    assert type(mixed[0]).__name__ == "Conv1D" and mixed[1].weight is conv.weight


def test_tied_head_is_refused_with_exclude_named(device):
    with pytest.raises(ValueError, match=r"is tied.*exclude=\['lm_head'\]"):
        fk.fuse(conv1d_to_linear(_gpt2(device)), fk.AdamW())


@pytest.mark.exactness
def test_gpt2_with_tied_head_trains_the_embedding_once(device):
    """The tied head left to the torch optimizer: the shared weight is one parameter of that
    optimizer, stepped once per step with the gradient of both uses (the standard pipeline's
    result, bitwise)."""
    model, trainer = _train_and_compare(lambda d: conv1d_to_linear(_gpt2(d)), device, exclude=["lm_head"])
    assert model.lm_head.weight is model.transformer.wte.weight
    held = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    assert sum(p is model.transformer.wte.weight for p in held) == 1
    assert len(fk.fused_layers(model)) == 2 * 4  # c_attn, attn c_proj, c_fc, mlp c_proj
