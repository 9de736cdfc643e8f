"""``forge-verify zo-demo`` at a tiny setting: it runs through the CLI, writes its JSON and
plot, every loss it reports is finite, and its output says what it compared."""

import json
import math

import pytest

import forge_verify.commands.cli as cli
from forge_verify.commands.zo_demo import METHODS


def test_zo_demo_runs_and_reports_what_it_compared(tmp_path, capsys):
    assert cli.main(["zo-demo", "--steps", "3", "--batch", "2", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "compared: GRZO and MeZO" in printed and "backprop + AdamW" in printed
    assert (tmp_path / "zo_demo_loss.png").stat().st_size > 0
    result = json.loads((tmp_path / "zo_demo.json").read_text())
    assert set(result["runs"]) == set(METHODS)
    for method, run in result["runs"].items():
        assert len(run["losses"]) == 3 and all(math.isfinite(v) for v in run["losses"]), method
        assert math.isfinite(run["held_out_loss"]) and run["memory_bytes"] > 0, method
        assert f"| {method} | {run['forwards']} |" in printed
    assert result["runs"]["GRZO"]["forwards"] == result["runs"]["MeZO"]["forwards"] == 6
    adamw, grzo = result["runs"]["AdamW"]["memory_bytes"], result["runs"]["GRZO"]["memory_bytes"]
    if result["device"] == "CPU":
        # The kept state: AdamW keeps gradients and two moments besides the parameters; GRZO and MeZO keep none.
        assert adamw > 3 * grzo
    else:
        # The peak, where this tiny model's activations and draws weigh as much as its
        # parameters (H200: 355,840 against 210,432 bytes): only the order is claimed.
        assert adamw > grzo


def test_zo_demo_refuses_a_batch_of_one(tmp_path):
    with pytest.raises(SystemExit, match="--batch at least 2"):
        cli.main(["zo-demo", "--steps", "1", "--batch", "1", "--out", str(tmp_path)])
