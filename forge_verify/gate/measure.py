"""What the gate records for one canonical case: a fingerprint of the inputs it starts
from, bitwise fingerprints of everything the kernel wrote, and deviation statistics with
the proven bounds they must respect.

Every regime's outputs are a pure function of the inputs and the seed (stochastic
rounding is keyed on seed, step and element index), so every case is fingerprinted,
low-precision ones included. The statistics say how far a changed output moved:

* ``outside_enclosure``: elements of the weight or a state slot outside the rigorous
  enclosure of the exact steps (proofs/reference_enclosure.md, computed by
  ``forge_verify.checks.catalog.reference_step`` over ``ENCLOSURE`` along
  ``forge_verify.checks.claims.enclosure_trajectory``). Proven bound: 0.
* ``enclosure_use``: the largest |kernel - centre| / radius over those elements. Proven
  bound: 1 (the kernel lies inside).
* ``reference_max_ulp``: the largest distance of the weight to the float64 reference,
  in ulps of the weight's dtype (no bound; watched for regression).
* low-precision regimes only, against the exact trajectory (mpmath at 113 bits,
  ``forge_verify.checks.deviation.exact_trajectory``): ``exact_max_ulp``, ``exact_bias_ulp``,
  ``exact_spread_ulp``, ``exact_relative_rms`` (as in ``forge_verify.checks.deviation``), and
  ``exact_outside_enclosure``: elements of the exact weight outside the enclosure.
  Proven bound: 0 (the enclosure contains the exact step).
"""

import hashlib

import torch

from ..checks.claims import decoded_state, enclosed_run
from ..checks.deviation import exact_trajectory, measure_deviation
from ..checks.problems import make_inputs
from ..numerics.bits import int_view, ordered_bits, ulp_distance
from .cases import CONFIG

#: statistic -> proven upper bound (statistics not listed have none)
PROVEN_BOUNDS = {"outside_enclosure": 0, "enclosure_use": 1.0, "exact_outside_enclosure": 0}


def fingerprint(t: torch.Tensor) -> dict:
    """sha256 of the tensor's bytes, plus the sum of its ordered bits (floats: adjacent
    values differ by 1; integer codes: the codes): the difference of two sums is the net
    shift in ulps (or codes), which says how far a changed tensor moved."""
    t = t.detach().cpu().contiguous()
    ordered = ordered_bits(t)
    return {"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape),
            "sha256": hashlib.sha256(int_view(t).numpy().tobytes()).hexdigest(),
            "ulp_sum": int(ordered.sum())}


def inputs_fingerprint(inputs) -> str:
    """sha256 of the shapes and bits of the weight and every (x, dy) pair a case starts
    from: a baseline's bits can only be compared with a run from the same inputs."""
    digest = hashlib.sha256()
    for t in (inputs.weight, *(t for pair in inputs.batches for t in pair)):
        t = t.detach().cpu().contiguous()
        digest.update(f"{t.dtype} {tuple(t.shape)};".encode())
        digest.update(int_view(t).numpy().tobytes())
    return digest.hexdigest()


def _enclosure_statistics(enclosures: dict, values: dict) -> dict:
    outside, use = 0, 0.0
    for name, enclosure in enclosures.items():
        outside += int((~enclosure.contains(values[name].detach().cpu())).sum())
        use = max(use, enclosure.use(values[name]))
    return {"outside_enclosure": outside, "enclosure_use": use}


def enclosure_measure(case, device, backend: str) -> tuple:
    """Run ``case`` against its enclosure: (inputs, weight, enclosure of the weight,
    {"inputs": ..., "fingerprints": ..., "statistics": ...}), the dict with the inputs'
    fingerprint (``inputs_fingerprint``) and the statistics that need no exact trajectory."""
    rule, regime = case.rule, case.regime
    inputs = make_inputs(case.problem, device, regime)
    weight, state, w_ref, _, w_enc, s_enc = enclosed_run(inputs, rule, CONFIG, regime, backend)
    fingerprints = {"weight": fingerprint(weight), **{k: fingerprint(state[k]) for k in sorted(state)}}
    values = {"weight": weight, **decoded_state(rule, state)}
    statistics = _enclosure_statistics({"weight": w_enc, **s_enc}, values)
    statistics["reference_max_ulp"] = float(ulp_distance(weight.detach().cpu(), w_ref.to(weight.dtype)).max())
    return inputs, weight, w_enc, {"inputs": inputs_fingerprint(inputs), "fingerprints": fingerprints,
                                   "statistics": statistics}


def measure(case, device, backend: str, exact_cache: dict) -> dict:
    """Run ``case`` and return {"inputs": ..., "fingerprints": ..., "statistics": ...}: the
    fingerprint of its inputs (``inputs_fingerprint``), the enclosure's
    statistics and, where the regime rounds, the drift from the exact trajectory.

    ``exact_cache`` keeps exact trajectories between cases that share a rule, start and
    inputs (they cost the most)."""
    inputs, weight, w_enc, result = enclosure_measure(case, device, backend)
    if case.regime.rounds:
        w0 = inputs.weight.detach().cpu()
        key = (case.rule_name, repr(case.rule), case.problem, str(w0.dtype))
        if key not in exact_cache:
            exact_cache[key] = exact_trajectory(case.rule, w0, inputs.batches,
                                                (case.problem.steps,))[case.problem.steps]
        exact = exact_cache[key]
        row = measure_deviation(case.regime_name, "forge", case.problem.steps, weight, exact,
                                w0.double().numpy(), w0.dtype)
        result["statistics"].update(exact_max_ulp=row.max_ulp, exact_bias_ulp=row.bias_ulp,
                                    exact_spread_ulp=row.spread_ulp, exact_relative_rms=row.relative_rms,
                                    exact_outside_enclosure=int((~w_enc.contains(torch.from_numpy(exact))).sum()))
    return result
