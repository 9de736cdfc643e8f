"""``benchmarks/bench_gift_ddp.py --smoke`` trains every method on two gloo ranks on the CPU
(the GPU run is issue 18's; this keeps the script working until a machine with two GPUs is
lent). Its FORGE rows run the kernels in the Triton interpreter, hence the marker."""

import csv
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_gift_ddp.py"

METHODS = ["ddp/fp32", "ddp/bf16", "ddp/e4m3/plain", "ddp/e4m3/gift", "ddp/e5m2/plain", "ddp/e5m2/gift",
           "ddp/nvfp4/plain", "ddp/nvfp4/gift", "forge/fp32", "forge/e4m3/plain", "forge/e4m3/gift"]

pytestmark = [pytest.mark.distributed, pytest.mark.interpreter]


def test_smoke_run_trains_every_method_and_counts_its_bytes(tmp_path):
    out = tmp_path / "ddp.csv"
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    with out.open() as f:
        rows = {row["method"]: row for row in csv.DictReader(f)}
    assert list(rows) == METHODS
    parameters = int(rows["ddp/fp32"]["parameters"])
    for name, row in rows.items():
        assert row["error"] == "" and row["world"] == "2" and row["backend"] == "gloo", row
        assert math.isfinite(float(row["loss"])) and float(row["step_ms_median"]) > 0, row
        # DDP, the hook and FORGE's reduced step leave every rank with the same parameters
        assert row["ranks_agree"] == "True", row
        assert int(row["parameters"]) == parameters, row
        if row["format"] in ("fp32", "bf16"):
            assert row["bytes_source"] == "derived (ring all-reduce)", row
            # every parameter's gradient crosses, DDP's or the fused path's; 2 ranks: a ring receives all of it
            payload = parameters * (4 if row["format"] == "fp32" else 2)
            assert int(row["gradients_bytes"]) == int(row["received_bytes"]) == payload, row
        else:
            assert row["bytes_source"] == "measured", row
            assert int(row["gradients_bytes"]) > 0 and int(row["received_bytes"]) > 0, row
            # below the bf16 all-reduce's bytes: fp8 codes are a byte, NVFP4's 4.5 bits
            assert int(row["received_bytes"]) < parameters * 2, row
    for path, fmt in [("ddp", "e4m3"), ("ddp", "e5m2"), ("ddp", "nvfp4"), ("forge", "e4m3")]:
        plain, gift = rows[f"{path}/{fmt}/plain"], rows[f"{path}/{fmt}/gift"]
        # the transform changes no payload size: the same gradient and received bytes, and
        # GIFT's refreshes (covariance all-reduce, factors' broadcast) on top
        assert plain["gradients_bytes"] == gift["gradients_bytes"], (plain, gift)
        assert plain["received_bytes"] == gift["received_bytes"], (plain, gift)
        assert int(plain["refresh_bytes"]) == 0 < int(gift["refresh_bytes"]), (plain, gift)
