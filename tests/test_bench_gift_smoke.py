"""``benchmarks/bench_gift.py --smoke`` runs on the CPU and its byte counts are the codecs'
(the GPU run is the lead's; this keeps the script from rotting)."""

import csv
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _bench():
    spec = importlib.util.spec_from_file_location("bench_gift", ROOT / "benchmarks" / "bench_gift.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_run_writes_every_case_with_the_codecs_byte_counts(tmp_path):
    out = tmp_path / "gift.csv"
    rows = _bench().main(["--smoke", "--out", str(out), "--world", "4"])
    with out.open() as f:
        written = list(csv.DictReader(f))
    # 3 shapes × (fp32, bf16, 3 formats × plain, GIFT × all-gather, reduce-scatter)
    assert len(rows) == len(written) == 3 * 14
    for row in rows:
        n, k = map(int, row["shape"].split("x"))
        numel = n * k
        payload = {"fp32": 4 * numel, "bf16": 2 * numel, "e4m3": numel, "e5m2": numel,
                   "nvfp4": -(-numel // 16) * 9}[row["format"]]
        if row["format"] in ("fp32", "bf16"):
            assert row["sent_bytes"] == payload, row
            assert row["received_bytes"] == round(2 * 3 / 4 * payload), row  # ring all-reduce, 4 ranks
        elif row["exchange"] == "all_gather":
            assert row["sent_bytes"] == payload + 8, row
            assert row["received_bytes"] == round(3 * payload + 2 * 3 / 4 * 8), row
            assert row["compute_ms"] >= 0
        else:  # every smoke shape's units divide by 4 ranks: no padding
            assert row["sent_bytes"] == payload + payload // 4 + 16, row
            assert row["received_bytes"] == round(2 * 3 / 4 * payload + 2 * 2 * 3 / 4 * 8), row
            assert row["compute_ms"] == "", row  # not timed
        assert (row["refresh_bytes_per_step"] > 0) == (row["route"] == "gift"), row
