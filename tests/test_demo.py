"""forge-verify demo at its CI size: runs end to end, fused == oracle bitwise, outputs
written; the shipped text is what its generator makes."""

import json

from forge_verify.commands.cli import main
from forge_verify.models import corpus


def test_shipped_text_is_the_generators_output():
    assert corpus.load() == corpus.generate()
    assert len(corpus.PATH.read_bytes()) < 200_000


def test_demo_runs_and_fused_equals_oracle(tmp_path, capsys):
    assert main(["demo", "--size", "ci", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "demo.json").read_text())
    assert result["fused_equals_oracle_bitwise"] is True
    assert (tmp_path / "demo_loss.png").stat().st_size > 0
    assert all(len(result["runs"][run]["losses"]) == 4 for run in ("fused", "oracle", "torch"))
    assert "bitwise: yes" in capsys.readouterr().out
