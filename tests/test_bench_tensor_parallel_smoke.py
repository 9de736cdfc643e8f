"""``benchmarks/bench_tensor_parallel.py --smoke`` runs on two gloo ranks on the CPU, every
variant and method, and its fused rows really step (the two-GPU run is the two-GPU
issue's; this keeps the script from rotting until a machine with two GPUs is lent)."""

import csv
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_smoke_run_times_every_row_and_the_fused_layers_step(tmp_path):
    out = tmp_path / "tp.csv"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_tensor_parallel.py"), "--smoke",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    with out.open() as f:
        rows = list(csv.DictReader(f))
    assert [(row["variant"], row["method"]) for row in rows] == [
        (variant, method) for variant in ("bf16", "fp32-master") for method in ("torch", "forge", "forge deferred")]
    for row in rows:
        assert row["error"] == "" and row["world"] == "2" and row["backend"] == "gloo", row
        assert float(row["median_ms"]) > 0 and len(row["rank_medians_ms"].split()) == 2, row
        if row["method"] == "torch":
            assert row["fused_layers"] == "0", row
        else:  # gate, up and down, each stepped in every warm-up and timed step, on both ranks
            assert row["fused_layers"] == "3" and row["fused_steps"] == "3", row
