"""The README's code is run, so what it shows works."""

import importlib
import re
from pathlib import Path

import pytest
import torch

import forge_kernels as fk

README = Path(__file__).resolve().parent.parent / "README.md"


def _python_block(section: str) -> str:
    text = README.read_text().split(f"## {section}", 1)[1]
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


def test_adding_a_rule_example_runs(device, tmp_path, monkeypatch):
    # Imported from a real file: compiled Triton reads a kernel's source from it.
    source = _python_block("Adding a rule").replace("from .base import", "from forge_kernels.rules.base import")
    (tmp_path / "readme_signsgd.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    rule = importlib.import_module("readme_signsgd").SignSGD(lr=0.5)
    w = torch.zeros(3, 4, device=device)
    x, dy = torch.randn(5, 4, device=device), torch.randn(5, 3, device=device)
    fk.fused_weight_update(x, dy, w, rule.init_state(w), rule, 1)
    assert torch.equal(w, -0.5 * torch.sign(fk.weight_gradient(x, dy)))


def test_use_example_runs(device):
    weight = torch.randn(6, 5, device=device)
    x, dy = torch.randn(7, 5, device=device), torch.randn(7, 6, device=device)
    names = {"weight": weight, "x": x, "dy": dy,
             "model": torch.nn.Sequential(torch.nn.Linear(5, 6)).to(device),
             "twin": torch.nn.Sequential(torch.nn.Linear(5, 6)).to(device)}
    before = weight.clone()
    exec(compile(_python_block("Use"), "README.md", "exec"), names)
    assert not torch.equal(weight, before)
    assert isinstance(names["model"][0], fk.ForgeLinear) and names["twin"][0].oracle


def test_training_example_runs(device, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # it saves a checkpoint
    idx = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0)).to(device)
    names = {"batches": [(idx, idx)]}
    with torch.device(device):
        exec(compile(_python_block("Training integration"), "README.md", "exec"), names)
    assert int(fk.fused_layers(names["model"])[0].forge_step) == 1
    assert "model" in torch.load(tmp_path / "checkpoint.pt", weights_only=True)


def _run_parallelism_example(source):
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from forge_verify.distributed.sharding import device
    dev = device()
    rule = fk.AdamW()
    shard = torch.randn(2, 4, device=dev)
    names = {"fk": fk, "rule": rule, "mesh": init_device_mesh(dev.type, (dist.get_world_size(),)),
             "mlp": nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)).to(dev),
             "linear1": nn.Linear(4, 8).to(dev), "linear2": nn.Linear(8, 4, bias=False).to(dev),
             "tp_group": dist.group.WORLD, "x": torch.randn(3, 4, device=dev), "dy": torch.randn(3, 2, device=dev),
             "shard": shard, "state": rule.init_state(shard), "step": 1, "row0": 2, "col0": 0, "global_shape": (4, 4)}
    exec(compile(source, "README.md", "exec"), names)
    return (isinstance(names["mlp"][0], fk.ForgeLinear) and isinstance(names["col"].linear, fk.ForgeLinear)
            and isinstance(names["row"].linear, fk.ForgeLinear))


@pytest.mark.distributed
def test_parallelism_example_runs(rank_pool):
    assert rank_pool(2).run(_run_parallelism_example, _python_block("Parallelism")) == [True, True]


def test_zeroth_order_example_runs():
    from torch import nn
    from torch.nn import functional as F
    model = nn.Sequential(nn.Embedding(16, 8), nn.LayerNorm(8), nn.Linear(8, 16))
    tokens = torch.randint(0, 16, (4, 5), generator=torch.Generator().manual_seed(0))
    names = {"model": model, "tokens": tokens, "labels": tokens, "F": F,
             "loss_fn": lambda logits, labels: F.cross_entropy(logits.transpose(1, 2), labels)}
    before = model[2].weight.detach().clone()
    exec(compile(_python_block("Zeroth-order fine-tuning"), "README.md", "exec"), names)
    assert names["result"].stepped and names["state"]["call"] == 2
    assert set(names["grads"]) == {"0.weight", "1.weight", "1.bias", "2.weight", "2.bias"}
    assert not torch.equal(model[2].weight, before)


def test_readme_counts_match_the_code():
    """The counts the README states follow the code they describe."""
    from forge_verify.checks.problems import REGIMES
    from forge_verify.gate.cases import RULES, canonical_cases

    words = {10: "ten"}
    text = README.read_text()
    assert f"runs {len(canonical_cases())} canonical cases" in text
    assert f"each of the {words[len(REGIMES)]} storage regimes" in text
    assert f"{len(RULES) * len(REGIMES)} cells" in text


def _run_gift_example(source):
    from torch.nn.parallel import DistributedDataParallel

    from forge_verify.models.tiny_gpt import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    names = {"grad": torch.randn(8, 128), "A": torch.eye(128) + torch.ones(128, 128) / 128,
             "process_group": None, "model": model, "ddp": DistributedDataParallel(model)}
    exec(compile(source, "README.md", "exec"), names)
    idx = torch.randint(0, 96, (2, 8))
    model.zero_grad()
    names["ddp"](idx).sum().backward()
    return names["state"].step == 1 and len(names["state"].digests) == 2 and names["x_hat"].dtype == torch.float32


@pytest.mark.distributed
def test_gift_example_runs(rank_pool):
    assert rank_pool(2).run(_run_gift_example, _python_block("GIFT: low-precision gradient communication")) == \
        [True, True]
