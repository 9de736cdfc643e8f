"""benchmarks/sass_count.py compiles the fused kernel for sm_90 offline on a machine
without a GPU (the Triton wheel's assemblers) and reports its registers and instruction
counts; a change that breaks the compiled path shows here without a GPU."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _sass_count(*args, timeout=600):
    """sass_count.py's report lines (one per regime and config) for ``args``; it must succeed."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sass_count.py"), *args],
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-2000:]
    return [row for row in done.stdout.splitlines() if row.split(" ", 1)[0] in ("fp32", "bf16-sr", "bf16-rn", "q8")]


def _field(line, name):
    """The number after ``name`` in a report line."""
    fields = line.split()
    return int(fields[fields.index(name) + 1])


def _split_kernel_with_and_without(config, flag_fields):
    """The fp32 report lines of the split kernel at ``config`` and with ``flag_fields``
    appended: a flag that changes its code but must leave its shared memory and its wgmma
    instructions as they are."""
    lines = _sass_count("--regimes", "fp32", "--configs", f"{config};{config},{flag_fields}")
    assert len(lines) == 2, lines
    without, with_flag = lines
    assert _field(with_flag, "shared") == _field(without, "shared"), lines
    assert _field(with_flag, "wgmma") == _field(without, "wgmma"), lines
    return without, with_flag


def test_sass_count_compiles_the_fp32_kernel_for_sm90_offline():
    line = _sass_count("--regimes", "fp32", timeout=300)[0]
    assert 32 <= _field(line, "registers") <= 255 and _field(line, "instructions") > 500, line
    assert "HGMMA" in line or "FFMA" in line, line  # a real SASS listing, not an empty one


def test_sass_count_compiles_the_hopper_kernel_for_sm90_offline():
    """The Gluon kernels (``kernel="hopper"``: ping-pong with 4 warps, split with 8, on 64
    rows and on 128 over two matrix warpgroups, in column and in row parts) build with
    this Triton, both storage regimes they take: a renamed or removed Gluon operation
    fails here, not on a user's GPU."""
    lines = _sass_count("--regimes", "fp32,bf16-sr",
                        "--configs", "64,32,128,4,2,None,1,hopper;64,128,64,8,3,None,4,hopper;"
                        "128,128,32,8,4,None,4,hopper;128,128,64,8,3,None,8,hopper,rows")
    assert len(lines) == 8, lines
    for line in lines:
        assert _field(line, "wgmma") > 0, line  # the token loop is on wgmma
        assert _field(line, "instructions") > 1000, line


def test_sixteen_epilogue_warps_compile_on_tiles_of_64_columns():
    """``num_warps=16`` (the split kernel with sixteen epilogue warps) builds, without
    spilling, where ``TileConfig`` allows it: tiles of at most 64 columns, in row and in
    column parts (128-column tiles are refused: their wgmma needs more registers than a
    thread gets beside sixteen epilogue warps, results/tuning/ptxas-split-16-warps-3.9.txt),
    for a rule with three state slots, the most registers an epilogue takes."""
    lines = _sass_count("--rule", "rmsprop-centered", "--regimes", "fp32,bf16-rn",
                        "--configs", "64,64,64,16,3,None,2,hopper,rows;128,64,32,16,4,None,4,hopper;128,64,64,16,4,None,4,hopper,rows")
    assert len(lines) == 6, lines
    for line in lines:
        assert _field(line, "wgmma") > 0, line
        assert _field(line, "bytes") == 0, line  # "spill bytes N"


def test_rule_is_refused_for_the_portable_kernel():
    """``--rule`` picks the Hopper kernel's rule; the portable kernel's compile is AdamW's,
    so asking it for another rule stops with what it does instead of reporting AdamW."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sass_count.py"), "--rule", "sgd-momentum",
                           "--regimes", "fp32", "--configs", "64,128,64,8,3,128,2"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "portable kernel compiles AdamW" in done.stderr, done.stderr[-2000:]


def test_epilogue_stages_reach_the_split_kernel():
    """``TileConfig.epilogue_stages`` sets the split kernel's staging slots: one more slot is
    one more part of weight and state in shared memory (AdamW in fp32: a 16 x 128 row part
    of the weight and two state slots, 24 KiB) and its two 8-byte barriers (allocations are
    aligned: 32 bytes more with triton 3.6 and 3.9); nothing else changes size."""
    lines = _sass_count("--regimes", "fp32",
                        "--configs", "128,128,64,8,2,None,8,hopper,rows;128,128,64,8,2,None,8,hopper,rows,3")
    shared = [_field(line, "shared") for line in lines]
    assert len(shared) == 2, lines
    assert 16 < shared[1] - shared[0] - 16 * 128 * 4 * 3 <= 64, shared


def test_wgmma_in_flight_reaches_the_split_kernel():
    """``TileConfig.wgmma_in_flight`` compiles another token loop into the split kernel (the
    last block's stage released after the loop, behind a barrier of its own), in the same
    shared memory and with the same wgmma instructions; were the flag lost on the way to
    the kernel, the two builds would be the same."""
    drained, in_flight = _split_kernel_with_and_without("128,128,64,8,4,None,8,hopper,rows,1", "pointers,True")
    assert _field(in_flight, "barriers") > _field(drained, "barriers"), (drained, in_flight)


def test_in_kernel_check_reaches_the_split_kernel():
    """``TileConfig.in_kernel_check`` compiles the input check (the epilogue warps' count of
    x and dy, the tickets and the wait) into the split kernel, in the same shared memory
    and with the same wgmma instructions; were the flag lost on the way to the kernel,
    the two builds would be the same."""
    separate, in_kernel = _split_kernel_with_and_without("128,128,64,8,4,None,8,hopper,rows,1,pointers,True",
                                                         "True")
    assert _field(in_kernel, "instructions") > _field(separate, "instructions"), (separate, in_kernel)


def test_streaming_epilogue_compiles_beside_the_fused_kernel():
    """``--streaming`` compiles ``probe_streaming_epilogue.py``'s kernel, the yardstick the
    fused epilogue is timed against: it must keep building as ``_tile_epilogue`` changes
    (its call would break first), with its gradient made in the epilogue's own layout, so
    no layout conversion and no matrix instruction, in both roundings of bf16 state."""
    lines = _sass_count("--streaming", "--regimes", "bf16-sr,bf16-rn", "--configs", "64,128,64,8,3,128,2")
    assert len(lines) == 2, lines
    for line in lines:
        assert "streaming" in line.split(), line
        assert _field(line, "conversions") == 0, line
        assert _field(line, "wgmma") == 0, line
        assert _field(line, "instructions") > 500, line
    # Stochastic rounding draws Philox words: more instructions than rounding to nearest.
    counts = [_field(line, "instructions") for line in lines]
    assert counts[0] > counts[1], lines
