"""The kernel-change gate and the property suite catch realistic kernel mistakes.

Each mistake is one textual edit of the kernel source (asserted to apply exactly once,
so a test cannot silently stop planting it), copied into a temporary ``forge_kernels``
package placed first on PYTHONPATH. ``forge-verify gate`` and the named properties then
run against that copy in a subprocess, exactly as they run against the real kernels,
and must fail with the expected message. README "Reports and the kernel-change gate"
gives the kill count.
"""

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from forge_verify.checks.profiles import PROFILE_VARIABLE
from forge_verify.gate.baseline import BASELINE, current_backend, load

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mistake:
    name: str
    file: str  # under kernels/
    old: str
    new: str
    #: substrings the gate's output must contain: what moved, and how it was caught
    gate_says: tuple
    #: pytest arguments selecting the properties that must fail, or None where none can
    properties: tuple = None


MISTAKES = [
    # Both paths share the rule, so fused == oracle still holds and the result stays
    # inside the enclosure (one rounding moved): only the fingerprint sees it.
    Mistake("rule operation order", "rules/adamw.py",
            "w = w - step_size * tl.div_rn(m, denom)", "w = w - tl.div_rn(step_size * m, denom)",
            ("rule adamw, regime 'fp32 weight, fp32 state'", "weight bits changed")),
    Mistake("token-tile edge mask off by one", "ops/weight_gradient.py",
            "mask_t = offs_t < T", "mask_t = offs_t < T - 1",
            ("rule adamw", "exceeds its proven bound"),
            ("properties/test_reference_closeness.py", "-k", "adamw")),
    # bf16 stores draw one Philox call per pair of columns, q8 codes one per element: each
    # stream's counter is planted keyed on the element's place in the tile.
    Mistake("bf16 stochastic rounding keyed on the tile", "ops/stochastic_round.py",
            "counter = (row_base[:, None] + pairs[None, :]).to(tl.uint32)",
            "counter = (tl.arange(0, BLOCK_N)[:, None] * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)[None, :])"
            ".to(tl.uint32)",
            ("regime 'fp32 weight, bf16 state, stochastic'", "bits changed"),
            ("properties/test_tile_invariance.py", "-k", "equivalent_configs and adamw")),
    Mistake("q8 stochastic codes keyed on the tile", "ops/fused_weight_update.py",
            "counter = ((offs_n + row0).to(tl.int64)[:, None] * global_k + (offs_k + col0)[None, :]).to(tl.uint32)",
            "counter = (tl.arange(0, BLOCK_N)[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]).to(tl.uint32)",
            ("regime 'fp32 weight, q8 state, stochastic'", "bits changed"),
            # The tile-invariance property found it on the CPU, but its GPU draws (other
            # BLOCK_T choices) held no q8-stochastic pair of tile shapes: it passed there
            # (H200, 2026-12-01). The code-for-code q8 test compares every element's code
            # with the host encoding at its global index, on every backend.
            ("tests/test_q8.py", "-k", "host_encoding_of_the_fp32_step and stochastic")),
    Mistake("bias correction applied twice", "rules/adamw.py",
            "denom = div_by_scalar_rn(tl.sqrt_rn(v), reciprocal_f64(bias_correction2_sqrt)) + eps",
            "denom = div_by_scalar_rn(div_by_scalar_rn(tl.sqrt_rn(v), reciprocal_f64(bias_correction2_sqrt)), "
            "reciprocal_f64(bias_correction2_sqrt)) + eps",
            ("rule adamw", "exceeds its proven bound"),
            ("properties/test_reference_closeness.py", "-k", "adamw")),
]

# Interpreted, the tile loop does not call tl.dot (proofs/interpreter_reduction.md), so TF32
# cannot be planted where CI runs; compiled, a TF32 dot leaves the fp32 enclosure.
TF32 = Mistake("TF32 dot instead of full fp32", "ops/weight_gradient.py",
               'input_precision="ieee"', 'input_precision="tf32"',
               ("rule adamw", "exceeds its proven bound"),
               ("properties/test_reference_closeness.py", "-k", "adamw"))


def _planted(mistake: Mistake, tmp_path: Path) -> Path:
    package = tmp_path / "forge_kernels"
    shutil.copytree(ROOT / "kernels", package, ignore=shutil.ignore_patterns("__pycache__"))
    source = package / mistake.file
    text = source.read_text()
    assert text.count(mistake.old) == 1, f"{mistake.name}: the edit no longer applies to kernels/{mistake.file}"
    source.write_text(text.replace(mistake.old, mistake.new))
    return tmp_path


def _run(args, planted: Path) -> subprocess.CompletedProcess:
    """Run ``python args`` on the planted copy as a fresh, standalone process: the outer
    run's pytest variables are dropped (under ``pytest -n`` the workers' PYTEST_XDIST_*
    made the inner pytest start pytest-benchmark in xdist mode, whose warning is an error)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_")}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(planted), os.environ.get("PYTHONPATH")])),
               **{PROFILE_VARIABLE: "ci"})
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def _check_caught(mistake: Mistake, tmp_path: Path):
    if any("bits changed" in phrase for phrase in mistake.gate_says) and \
            current_backend() not in load(BASELINE)["backends"]:
        pytest.skip(f"no {current_backend()} baseline recorded yet: a changed bit cannot be seen without one")
    planted = _planted(mistake, tmp_path)
    gate = _run(["-m", "forge_verify.commands.cli", "gate", "--fail-fast"], planted)
    output = gate.stdout + gate.stderr
    assert f"kernels {planted / 'forge_kernels'}" in output, f"the gate did not run the planted copy:\n{output}"
    assert gate.returncode == 1, f"{mistake.name}: the gate did not fail (exit {gate.returncode}):\n{output}"
    for phrase in mistake.gate_says:
        assert phrase in output, f"{mistake.name}: the gate failed without saying {phrase!r}:\n{output}"
    if mistake.properties is not None:
        suite = _run(["-m", "pytest", "-p", "no:cacheprovider", "-p", "no:benchmark", "-x", "-q",
                      *mistake.properties], planted)
        assert suite.returncode == 1 and " failed" in suite.stdout, \
            f"{mistake.name}: the properties did not catch it (exit {suite.returncode}):\n{suite.stdout[-3000:]}"


@pytest.mark.parametrize("mistake", MISTAKES, ids=[m.name for m in MISTAKES])
def test_gate_and_properties_catch_planted_mistake(mistake, tmp_path):
    _check_caught(mistake, tmp_path)


@pytest.mark.gpu
def test_gate_and_properties_catch_tf32_on_gpu(tmp_path):
    _check_caught(TF32, tmp_path)
