"""benchmarks/sass_count.py compiles the fused kernel for sm_90 offline on a machine
without a GPU (the Triton wheel's assemblers) and reports its registers and instruction
counts; a change that breaks the compiled path shows here without a GPU."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_sass_count_compiles_the_fp32_kernel_for_sm90_offline():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sass_count.py"), "--regimes", "fp32"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    line = [row for row in done.stdout.splitlines() if row.startswith("fp32")][0]
    fields = line.split()
    registers = int(fields[fields.index("registers") + 1])
    instructions = int(fields[fields.index("instructions") + 1])
    assert 32 <= registers <= 255 and instructions > 500, line
    assert "HGMMA" in line or "FFMA" in line, line  # a real SASS listing, not an empty one


def test_sass_count_compiles_the_hopper_kernel_for_sm90_offline():
    """The Gluon kernels (``kernel="hopper"``: ping-pong with 4 warps, split with 8, on 64
    rows and on 128 over two matrix warpgroups, in column and in row parts) build with
    this Triton, both storage regimes they take: a renamed or removed Gluon operation
    fails here, not on a user's GPU."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sass_count.py"), "--regimes", "fp32,bf16-sr",
                           "--configs", "64,32,128,4,2,None,1,hopper;64,128,64,8,3,None,4,hopper;"
                           "128,128,32,8,4,None,4,hopper;128,128,64,8,3,None,8,hopper,rows"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [row for row in done.stdout.splitlines() if row.startswith(("fp32", "bf16-sr"))]
    assert len(lines) == 8, done.stdout
    for line in lines:
        fields = line.split()
        assert int(fields[fields.index("wgmma") + 1]) > 0, line  # the token loop is on wgmma
        assert int(fields[fields.index("instructions") + 1]) > 1000, line


def test_epilogue_stages_reach_the_split_kernel():
    """``TileConfig.epilogue_stages`` sets the split kernel's staging slots: one more slot is
    one more part of weight and state in shared memory (AdamW in fp32: a 16 x 128 row part
    of the weight and two state slots, 24 KiB) and its two 8-byte barriers (allocations are
    aligned: 32 bytes more with triton 3.6 and 3.9); nothing else changes size."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sass_count.py"), "--regimes", "fp32",
                           "--configs", "128,128,64,8,2,None,8,hopper,rows;128,128,64,8,2,None,8,hopper,rows,3"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    shared = [int(row.split()[row.split().index("shared") + 1]) for row in done.stdout.splitlines()
              if row.startswith("fp32")]
    assert len(shared) == 2, done.stdout
    assert 16 < shared[1] - shared[0] - 16 * 128 * 4 * 3 <= 64, shared


def test_streaming_epilogue_compiles_beside_the_fused_kernel():
    """``--streaming`` compiles ``probe_streaming_epilogue.py``'s kernel, the yardstick the
    fused epilogue is timed against: it must keep building as ``_tile_epilogue`` changes
    (its call would break first), with its gradient made in the epilogue's own layout, so
    no layout conversion and no matrix instruction, in both roundings of bf16 state."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sass_count.py"), "--streaming",
                           "--regimes", "bf16-sr,bf16-rn", "--configs", "64,128,64,8,3,128,2"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [row for row in done.stdout.splitlines() if row.startswith(("bf16-sr", "bf16-rn"))]
    assert len(lines) == 2, done.stdout
    for line in lines:
        fields = line.split()
        assert "streaming" in fields, line
        assert int(fields[fields.index("conversions") + 1]) == 0, line
        assert int(fields[fields.index("wgmma") + 1]) == 0, line
        assert int(fields[fields.index("instructions") + 1]) > 500, line
    # Stochastic rounding draws Philox words: more instructions than rounding to nearest.
    counts = [int(line.split()[line.split().index("instructions") + 1]) for line in lines]
    assert counts[0] > counts[1], lines
