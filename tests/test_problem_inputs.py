"""The seeded problems' inputs (``make_inputs``) are the same bits on every CPU: the gate
fingerprints what the kernels make of them, and the CPU tier compares bits, so nothing
drawn may depend on the instruction set (torch's float32 randn does: it takes a
vectorized Box-Muller with an approximate log on AVX2 and AVX-512 CPUs)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from forge_verify.checks.problems import FP32, Problem, Regime, make_inputs
from forge_verify.gate.cases import canonical_cases
from forge_verify.gate.measure import inputs_fingerprint

ROOT = Path(__file__).resolve().parent.parent

#: the gate's cases, and the options the properties' problems add (scale, sparse, a
#: dimension under 16 elements, where torch draws without vectorizing anyway)
PROBLEMS = [(case.problem, case.regime) for case in canonical_cases()] + [
    (Problem(tokens=33, out_features=17, in_features=9, dtype=torch.bfloat16, steps=2, seed=5, scale=1e-3,
             sparse=True), Regime(weight=torch.bfloat16)),
    (Problem(tokens=3, out_features=2, in_features=5, dtype=torch.float32, steps=1, seed=0), FP32),
]


def fingerprints() -> list:
    return [inputs_fingerprint(make_inputs(problem, torch.device("cpu"), regime)) for problem, regime in PROBLEMS]


_DRAW_ELSEWHERE = ("import json, torch; from tests.test_problem_inputs import fingerprints; "
                   "print(json.dumps([torch.backends.cpu.get_cpu_capability(), fingerprints()]))")


def test_inputs_are_the_same_bits_under_every_cpu_capability():
    here = torch.backends.cpu.get_cpu_capability()
    if here == "DEFAULT":
        pytest.skip("this process runs torch's scalar (DEFAULT) kernels already: no vectorized "
                    "capability to compare them with")
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_")}
    run = subprocess.run([sys.executable, "-c", _DRAW_ELSEWHERE], cwd=ROOT, capture_output=True, text=True,
                         env={**env, "ATEN_CPU_CAPABILITY": "default"}, timeout=300)
    assert run.returncode == 0, run.stderr
    capability, elsewhere = json.loads(run.stdout.splitlines()[-1])
    assert capability == "DEFAULT", f"this torch build ignored ATEN_CPU_CAPABILITY=default (ran {capability})"
    assert elsewhere == fingerprints(), f"make_inputs drew other bits under DEFAULT than under {here}"
