"""benchmarks/bench_chunkft.py --smoke: the H200 memory benchmark runs end to end on the
CPU at tiny sizes (one layer, one chunk count, one timed step) and writes its CSV."""

import csv
import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_chunkft.py"


def test_smoke_mode_writes_a_row_per_method(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_chunkft", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "smoke.csv"
    bench.main(["--smoke", "--layers", "1", "--chunks", "2", "--steps", "1", "--out", str(out)])
    with out.open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["method"], r["state_store"], r["chunks"]) for r in rows] == [
        ("torch AdamW(fused=True)", "device", "1"), ("ChunkFT", "device", "2"), ("ChunkFT", "host", "2")]
    assert all(float(r["median_ms"]) > 0 for r in rows)
    assert float(rows[2]["host_state_gb"]) > 0 and float(rows[1]["host_state_gb"]) == 0
    assert "| ChunkFT | host | 2 |" in capsys.readouterr().out
