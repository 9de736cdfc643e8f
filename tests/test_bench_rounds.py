"""benchmarks/bench_update.py times each row's methods in rounds, the order reversed each
other round, and pools every reading, and bench_model.py does the same with ``--rounds``:
at 16,384 tokens an H100 at its power cap reads a row's first method faster than its
last, so a fixed order would favour one method. The readings need a GPU; here a stand-in
records the order and returns given times, so the test runs anywhere."""

import csv
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_model as bm  # noqa: E402  (a benchmark script, not a package)
import bench_update as bu  # noqa: E402


def test_order_reverses_each_other_round_and_readings_pool(monkeypatch):
    order = []
    times = {"a": [[1.0, 2.0], [6.0], [3.0]], "b": [[10.0], [20.0], [30.0, 40.0]]}

    def readings(fn):
        order.append(fn)
        return times[fn].pop(0)
    monkeypatch.setattr(bu, "readings", readings)
    got = bu.timed_in_rounds({"a": "a", "b": "b"}, rounds=3)
    assert order == ["a", "b", "b", "a", "a", "b"]
    assert got == {"a": (2.5, 1.0, 6.0), "b": (25.0, 10.0, 40.0)}


@pytest.mark.parametrize("script", [bu, bm], ids=["bench_update", "bench_model"])
def test_rounds_below_one_are_refused(script):
    with pytest.raises(SystemExit) as refused:
        script.main(["--out", "/dev/null", "--rounds", "0"])
    assert refused.value.code == 2  # argparse's usage error, not the missing GPU's message


def test_cases_reverse_each_other_round():
    cases = [("512", "bf16-rn", "forge"), ("512", "bf16", "torch captured"), ("4096", "bf16", "forge")]
    assert [case for _, case in bu.in_rounds(cases, 1)] == cases
    assert [case for _, case in bu.in_rounds(cases, 3)] == cases + cases[::-1] + cases
    assert [round_ for round_, _ in bu.in_rounds(cases, 3)] == [0] * 3 + [1] * 3 + [2] * 3


def test_model_rounds_pool_each_cases_readings_in_the_csv(monkeypatch, tmp_path):
    built = []
    times = {"torch captured": [[5.0, 5.2], [5.4, 5.6]], "forge captured lagged": [[4.0, 4.2], [4.8, 5.0]]}

    def variant(name, method, layers, tokens, configs, **options):
        built.append(method)
        return object(), (lambda: None)

    def timed_steps(step, warmup, steps, back_to_back=1):
        return times[built[-1]].pop(0), 100 * len(built), 1000
    monkeypatch.setattr(bm.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bm.torch.cuda, "get_device_name", lambda: "stand-in")
    monkeypatch.setattr(bm, "variant", variant)
    monkeypatch.setattr(bm, "timed_steps", timed_steps)
    out = tmp_path / "model.csv"
    bm.main(["--out", str(out), "--layers", "2", "--tokens", "512", "--variants", "bf16",
             "--methods", "torch captured,forge captured lagged", "--rounds", "2"])
    assert built == ["torch captured", "forge captured lagged", "forge captured lagged", "torch captured"]
    with out.open() as handle:
        rows = {row["method"]: row for row in csv.DictReader(handle)}
    assert rows["torch captured"]["median_ms"] == "5.300" and rows["torch captured"]["max_ms"] == "5.600"
    assert rows["forge captured lagged"]["median_ms"] == "4.500" and rows["forge captured lagged"]["min_ms"] == "4.000"
    assert rows["torch captured"]["peak_bytes"] == "400" and rows["torch captured"]["rounds"] == "2"
