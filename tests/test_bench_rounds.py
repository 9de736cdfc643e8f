"""benchmarks/bench_update.py times each row's methods in rounds, the order reversed each
other round, and pools every reading: at 16,384 tokens an H100 at its power cap reads a
row's first method faster than its last, so a fixed order would favour one method. The
readings are ``do_bench``'s and need a GPU; here a stand-in records the order and
returns given times, so the test runs anywhere."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_update as bu  # noqa: E402  (a benchmark script, not a package)


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


def test_rounds_below_one_are_refused():
    with pytest.raises(SystemExit) as refused:
        bu.main(["--out", "/dev/null", "--rounds", "0"])
    assert refused.value.code == 2  # argparse's usage error, not the missing GPU's message
