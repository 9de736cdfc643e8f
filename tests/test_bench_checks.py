"""benchmarks/bench_update.py checks each timed config bit for bit before timing it: fused
against the oracle, and each captured method (with the input scan and without it, the
``forge captured unscanned`` rows the README's layer tables quote) against uncaptured
steps. The pairs need a GPU; here they are stand-ins, so the test runs anywhere and checks
which comparisons are made and that a mismatch is named."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_update as bu  # noqa: E402  (a benchmark script, not a package)

ROW = (8, 16, 512, "fp32", "config")


def _pairs(calls, label=None, differ_for=None):
    """A stand-in pair maker recording its call (as ``label``, or as its ``input_check``);
    called with ``input_check=differ_for`` its two tensors are 0.0 and -0.0, equal as
    numbers and different in their bits."""
    def pairs(*row, input_check="step"):
        calls.append((label or input_check, row))
        return [("w", torch.tensor([0.0]), torch.tensor([-0.0 if input_check == differ_for else 0.0]))]
    return pairs


def test_both_captured_methods_are_checked(monkeypatch):
    calls = []
    monkeypatch.setattr(bu, "oracle_pairs", _pairs(calls, "oracle"))
    monkeypatch.setattr(bu, "captured_pairs", _pairs(calls))
    bu.check_fused_equals_oracle(*ROW)
    assert calls == [("oracle", ROW), ("step", ROW), ("tiles", ROW)]


def test_a_mismatch_without_the_scan_is_named(monkeypatch):
    calls = []
    monkeypatch.setattr(bu, "oracle_pairs", _pairs(calls, "oracle"))
    monkeypatch.setattr(bu, "captured_pairs", _pairs(calls, differ_for="tiles"))
    with pytest.raises(AssertionError, match=r"^captured unscanned != uncaptured \(w\) for fp32 8x16 T=512"):
        bu.check_fused_equals_oracle(*ROW)
