"""benchmarks/bench_zeroth_order.py --smoke: the H200 benchmark's code path runs on the CPU
at tiny shapes and writes one CSV row per shape and method (the figures themselves are
measured on the GPU only; benchmarks/README.md)."""

import csv
import importlib.util
import math
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_zeroth_order.py"


def test_the_smoke_run_writes_every_method_and_shape(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_zeroth_order", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "zo.csv"
    assert bench.main(["--smoke", "--out", str(out), "--budget-s", "0.5"]) == 0
    with out.open() as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["batch"], r["method"]) for r in rows] == [(b, m) for b in ("1", "4") for m in bench.METHODS]
    assert all(math.isfinite(float(r["median_ms"])) and float(r["median_ms"]) > 0 for r in rows)
    assert all(r["torch"] and r["triton"] and r["gpu"] for r in rows)
    printed = capsys.readouterr().out
    assert "| 4 × 4 | GRZO |" in printed and "| 1 × 8 | MeZO |" in printed


def test_the_kernels_smoke_run_times_each_part_both_ways_and_finds_the_same_bits(tmp_path):
    """``--kernels --smoke``: every part with the kernels (the interpreter) and with the
    torch path, and the two agree bit for bit (the GPU run checks the compiled kernels)."""
    spec = importlib.util.spec_from_file_location("bench_zeroth_order", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "kernels.csv"
    assert bench.main(["--kernels", "--smoke", "--out", str(out)]) == 0
    with out.open() as handle:
        rows = list(csv.DictReader(handle))
    assert [r["path"] for r in rows] == ["kernel", "torch"] * 5
    assert all(r["bitwise_equal"] == "True" for r in rows)
