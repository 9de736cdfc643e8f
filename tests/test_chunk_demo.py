"""forge-verify chunk-demo at a tiny setting: runs end to end, writes its outputs, losses
finite, and the table it prints has ChunkFT holding no gradients and, with the host
store, only the active chunk's state on the device."""

import json
import math

from forge_verify.commands.cli import main


def test_chunk_demo_writes_its_outputs_and_prints_the_table(tmp_path, capsys):
    assert main(["chunk-demo", "--steps", "3", "--chunks", "2", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "chunk_demo.json").read_text())
    assert (tmp_path / "chunk_demo_loss.png").stat().st_size > 0
    for run in ("chunkft", "adamw"):
        losses = result["runs"][run]["losses"]
        assert len(losses) == 3 and all(math.isfinite(x) for x in losses), (run, losses)
        assert math.isfinite(result["runs"][run]["held_out_loss"])
    assert result["runs"]["chunkft"]["losses"][0] == result["runs"]["adamw"]["losses"][0]  # same start, same batch
    chunk, adamw = result["runs"]["chunkft"]["memory"]["kept"], result["runs"]["adamw"]["memory"]["kept"]
    assert chunk["gradients"] == 0 and adamw["gradients"] == adamw["parameters"]
    assert 0 < chunk["state_device_peak"] < adamw["state_device"]
    # Every chunk visited: two fp32 moments of every parameter in all.
    assert chunk["state_device"] + chunk["state_host"] == 2 * chunk["parameters"]
    printed = capsys.readouterr().out
    assert "| chunkft |" in printed and "| adamw |" in printed and "2 chunks (state store: host)" in printed
    assert "chunk_demo_loss.png" in printed
