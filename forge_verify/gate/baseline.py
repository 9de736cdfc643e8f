"""``forge-verify gate``: has a kernel change moved a bit it should not?

The committed baseline (``forge_verify/gate/baselines/gate.json``) holds, per backend
("cpu-interpreter", "gpu") and per canonical case (``forge_verify.gate.cases``), the
case's definition, a fingerprint of its inputs, the fingerprints of everything
``fused_weight_update`` wrote and the case's deviation statistics
(``forge_verify.gate.measure``). The gate fails when

* a case's definition or inputs differ from the recorded ones: its bits belong to another
  case, so nothing else of it is compared (record again, after review);
* a bit changed: a fingerprint differs from the baseline (every regime's bits are a
  pure function of inputs and seed, so from the same inputs any difference is a kernel
  change);
* a statistic exceeds its proven bound (``gate_measure.PROVEN_BOUNDS``), whatever the
  baseline says, or is NaN;
* a statistic regressed past the margin below (larger than the baseline's by more
  than ``REGRESSION_MARGIN`` relatively plus ``REGRESSION_SLACK``);
* the canonical set and the baseline disagree (a case added or removed), or the
  current backend has no baseline.

The other backend's section cannot be checked here; a run prints one line naming where
it was recorded, the command that checks it, and whether it is stale (recorded for other
case definitions or inputs).

``forge-verify gate --update`` rewrites the current backend's section (only that one),
refusing when a proven bound is exceeded, and prints the diff for review.
"""

import ast
import dataclasses
import json
import math
import sys
from pathlib import Path

import numpy
import torch
import triton

import forge_kernels as fk

from ..checks.tables import render_table
from .cases import canonical_cases
from .measure import PROVEN_BOUNDS, measure

BASELINE = Path(__file__).resolve().parent / "baselines" / "gate.json"
BACKENDS = ("cpu-interpreter", "gpu")
#: the backend names of the tolerance table (forge_verify.numerics.tolerances), which models each one's accumulation
_TOLERANCE_BACKEND = {"cpu-interpreter": "interpreter", "gpu": "gpu"}

#: a statistic regresses when it grows past baseline * (1 + margin) + slack (in magnitude)
REGRESSION_MARGIN = 0.25
REGRESSION_SLACK = {"enclosure_use": 0.02, "reference_max_ulp": 1.0, "exact_max_ulp": 0.5,
                    "exact_bias_ulp": 0.1, "exact_spread_ulp": 0.1, "exact_relative_rms": 1e-4}
UPDATE_COMMAND = {"cpu-interpreter": "`forge-verify gate --update` on a machine without a GPU",
                  "gpu": "`bash .ci/gpu-gate --update --backend gpu` on the GPU machine"}
CHECK_COMMAND = {"cpu-interpreter": "`forge-verify gate` on a machine without a GPU",
                 "gpu": "`bash .ci/gpu-gate` on the GPU machine"}


def current_backend() -> str:
    return "cpu-interpreter" if fk.interpreting() else "gpu"


def provenance() -> dict:
    """Where a section was recorded. The CPU capability and numpy are recorded because they
    could move bits that should not move (the inputs are drawn on the CPU; the interpreter
    runs on numpy): a note names any that differ from the current run."""
    device = "cpu" if fk.interpreting() else torch.cuda.get_device_name()
    return {"device": device, "torch": torch.__version__, "triton": triton.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "numpy": numpy.__version__}


def load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {"backends": {}}


def save(path: Path, baseline: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(baseline, indent=1, sort_keys=True) + "\n")


def _where(case) -> str:
    p = case.problem
    return (f"kernel fused_weight_update, rule {case.rule_name}, regime '{case.regime_name}', "
            f"shape T={p.tokens} N={p.out_features} K={p.in_features} "
            f"({str(p.dtype).replace('torch.', '')} activations, {p.steps} steps, seed {p.seed})")


def _stat_change(name, old, new) -> str:
    return f"{name} {old:.6g} -> {new:.6g}"


def bound_failures(case, statistics) -> list:
    """A statistic past its proven bound, or NaN anywhere (which no comparison would catch:
    every comparison with NaN is false, and a baseline must never record one)."""
    failures = [f"{_where(case)}: {name} is NaN; a statistic must be a number to be compared"
                for name in sorted(statistics) if math.isnan(statistics[name])]
    return failures + [f"{_where(case)}: {name} = {statistics[name]:.6g} exceeds its proven bound {bound} "
                       f"(proofs/reference_enclosure.md)"
                       for name, bound in PROVEN_BOUNDS.items() if name in statistics and statistics[name] > bound]


def _config_fields(text):
    """A recorded ``TileConfig(...)`` as {field: value}, every field it does not name at its
    default: a field added to ``TileConfig`` after a baseline was recorded runs the kernels
    as before at its default (that is what a new field's default must mean), so a config
    that leaves it there is the recorded one. None for anything else, a missing value
    included (compared as text)."""
    try:
        call = ast.parse(text, mode="eval").body
        if not (isinstance(call, ast.Call) and getattr(call.func, "id", None) == "TileConfig" and not call.args):
            return None
        named = {keyword.arg: ast.literal_eval(keyword.value) for keyword in call.keywords}
    except (SyntaxError, ValueError, TypeError, AttributeError):
        return None
    fields = {field.name: field.default for field in dataclasses.fields(fk.TileConfig)}
    if not set(named) <= set(fields):
        return None
    return {name: named.get(name, default) for name, default in fields.items()}


def _same_definition_value(field: str, old, new) -> bool:
    if field == "config" and old != new:
        recorded = _config_fields(old)
        return recorded is not None and recorded == _config_fields(new)
    return old == new


def _case_change(recorded: dict, measured: dict) -> str:
    """What differs between the recorded and the measured case definition ('' if nothing)."""
    old, new = recorded["case"], measured["case"]
    return "; ".join(f"{field}: {old.get(field)} -> {new.get(field)}"
                     for field in sorted(set(old) | set(new))
                     if not _same_definition_value(field, old.get(field), new.get(field)))


def _inputs_change(recorded: dict, measured: dict) -> str:
    """How the recorded inputs differ from the measured ones ('' if they do not)."""
    if "inputs" not in recorded:
        return "the baseline holds no fingerprint of its inputs (recorded before the gate took one)"
    if recorded["inputs"] != measured["inputs"]:
        return f"its inputs changed (sha256 {recorded['inputs'][:12]} -> {measured['inputs'][:12]})"
    return ""


def _staleness(recorded: dict, measured: dict) -> str:
    """Why ``recorded`` cannot be compared with ``measured`` at all ('' if it can)."""
    changed = _case_change(recorded, measured)
    reasons = [f"the case definition changed since the baseline was recorded ({changed})" if changed else "",
               _inputs_change(recorded, measured)]
    return "; ".join(reason for reason in reasons if reason)


def compare(case, recorded: dict, measured: dict) -> list:
    """Messages for every way ``measured`` (with its "case" description and inputs'
    fingerprint) fails against the ``recorded`` baseline entry. A case whose definition or
    inputs changed is not compared further: its bits and statistics belong to another case."""
    failures = bound_failures(case, measured["statistics"])
    stale = _staleness(recorded, measured)
    if stale:
        return failures + [f"{_where(case)}: {stale}, so its bits and statistics cannot be compared with this "
                           f"run's (not a kernel change); review and record the baseline again with "
                           f"{UPDATE_COMMAND[current_backend()]}"]
    old_stats, new_stats = recorded["statistics"], measured["statistics"]
    moved = [_stat_change(name, old_stats[name], new_stats[name])
             for name in sorted(new_stats) if name in old_stats and new_stats[name] != old_stats[name]]
    old_prints, new_prints = recorded["fingerprints"], measured["fingerprints"]
    for name in sorted(set(old_prints) | set(new_prints)):
        old, new = old_prints.get(name), new_prints.get(name)
        if old is None or new is None:
            failures.append(f"{_where(case)}: output {name} {'appeared' if old is None else 'disappeared'}")
        elif old != new:
            shift = new["ulp_sum"] - old["ulp_sum"]
            unit = "ulp" if new["dtype"].startswith(("float", "bfloat")) else "code steps"
            failures.append(f"{_where(case)}: {name} bits changed without a baseline update "
                            f"(net shift {shift:+d} {unit} over {old['shape']}; sha256 {old['sha256'][:12]} -> "
                            f"{new['sha256'][:12]}); statistics: {'; '.join(moved) or 'unchanged'}")
    for name, slack in REGRESSION_SLACK.items():
        if name in old_stats and name in new_stats:
            old, new = abs(old_stats[name]), abs(new_stats[name])
            if new > old * (1 + REGRESSION_MARGIN) + slack:  # a NaN is bound_failures' (one line, not two)
                failures.append(f"{_where(case)}: {name} regressed from {old:.6g} to {new:.6g} "
                                f"(+{(new - old) / max(old, 1e-300):.0%}, margin {REGRESSION_MARGIN:.0%} + {slack:g})")
    return failures


def diff(old_section: dict, new_section: dict) -> list:
    """Lines describing what an update changes, for review."""
    lines = []
    old_cases, new_cases = old_section.get("cases", {}), new_section["cases"]
    for key in sorted(set(old_cases) | set(new_cases)):
        old, new = old_cases.get(key), new_cases.get(key)
        if old is None:
            lines.append(f"+ {key}: new case")
            continue
        if new is None:
            lines.append(f"- {key}: removed")
            continue
        changed = [name for name in sorted(set(old["fingerprints"]) | set(new["fingerprints"]))
                   if old["fingerprints"].get(name) != new["fingerprints"].get(name)]
        stats = [_stat_change(name, old["statistics"][name], value)
                 for name, value in sorted(new["statistics"].items())
                 if old["statistics"].get(name) != value and name in old["statistics"]]
        case, inputs = _case_change(old, new), _inputs_change(old, new)
        if changed or stats or case or inputs:
            lines.append(f"~ {key}: bits of {', '.join(changed) or 'nothing'} changed"
                         + (f"; {'; '.join(stats)}" if stats else "")
                         + (f"; case definition changed ({case})" if case else "")
                         + (f"; {inputs}" if inputs else ""))
    if old_section.get("provenance") != new_section["provenance"]:
        lines.append(f"~ provenance {old_section.get('provenance')} -> {new_section['provenance']}")
    return lines


def _summary_row(case, measured, recorded) -> tuple:
    stats = measured["statistics"]
    if recorded is None:
        bits = "no baseline"
    elif _case_change(recorded, measured):
        bits = "case changed"
    elif _inputs_change(recorded, measured):
        bits = "inputs changed"
    else:
        bits = "same" if recorded["fingerprints"] == measured["fingerprints"] else "CHANGED"
    drift = f"{stats['exact_max_ulp']:.3g}" if "exact_max_ulp" in stats else "-"
    p = case.problem
    inputs = f"{str(p.dtype).replace('torch.', '')}, {p.steps} steps"
    return (case.rule_name, case.regime_name, inputs, bits, f"{stats['enclosure_use']:.3f}", drift)


def run_gate(baseline_path: Path = BASELINE, update: bool = False, backend: str = None,
             fail_fast: bool = False) -> int:
    here = current_backend()
    if backend is not None and backend != here:
        print(f"forge-verify gate: --backend {backend} asked for, but kernels run on {here} here; a backend's "
              f"baseline can only be measured on that backend", file=sys.stderr)
        return 2
    baseline = load(baseline_path)
    section = baseline["backends"].get(here)
    recorded_cases = section["cases"] if section else {}
    cases = canonical_cases()
    device, exact_cache = fk.kernel_device(), {}
    measured, failures, rows = {}, [], []
    for case in cases:
        result = measure(case, device, _TOLERANCE_BACKEND[here], exact_cache)
        measured[case.key] = {"case": case.describe(), **result}
        recorded = recorded_cases.get(case.key)
        rows.append(_summary_row(case, measured[case.key], recorded))
        if update or section is None:
            failures += bound_failures(case, result["statistics"])
        elif recorded is None:
            failures.append(f"{case.key}: canonical case has no baseline entry on {here}")
        else:
            failures += compare(case, recorded, measured[case.key])
        if fail_fast and failures:
            break
    print(f"forge-verify gate on {here} ({provenance()['device']}, torch {torch.__version__}, "
          f"triton {triton.__version__}); kernels {Path(fk.__file__).parent}; baseline {baseline_path}")
    print(render_table(("rule", "regime", "activations", "bits vs baseline", "enclosure use (<= 1)",
                        "max ulp vs exact"), rows))
    print()
    if update:
        return _update(baseline, baseline_path, here, section, measured, failures)
    if section is not None and not (fail_fast and failures):
        stale = sorted(set(recorded_cases) - set(measured))
        failures += [f"{key}: in the baseline but no longer a canonical case" for key in stale]
    for other in BACKENDS:
        if other != here:
            print(_other_backend(other, baseline["backends"].get(other), measured))
    if section is None:
        failures.append(f"{here}: no baseline recorded for this backend; only the proven bounds were checked. "
                        f"Record one with {UPDATE_COMMAND[here]} and review the result")
    elif section["provenance"] != provenance():
        recorded, now = section["provenance"], provenance()
        moved = ", ".join(f"{key} {recorded.get(key, 'not recorded')} -> {now.get(key, 'none')}"
                          for key in sorted(set(recorded) | set(now)) if recorded.get(key) != now.get(key))
        print(f"note: this run's provenance differs from the {here} baseline's ({moved})")
    for failure in failures:
        print(f"FAIL: {failure}")
    verdict = "FAILED" if failures else "passed"
    print(f"forge-verify gate: {verdict} ({len(rows)} of {len(cases)} canonical cases run, "
          f"{len(failures)} failure(s))")
    return 1 if failures else 0


def _other_backend(other: str, section, measured: dict) -> str:
    """The line a run prints about another backend's section, which it cannot check: where
    it was recorded, how to check it, and whether it is stale against this run's cases
    (the case definitions and inputs are the same on every backend)."""
    if section is None:
        return (f"{other}: no baseline recorded yet, so this run checks nothing for it; record one with "
                f"{UPDATE_COMMAND[other]}")
    recorded = ", ".join(f"{key} {value}" for key, value in sorted(section["provenance"].items()))
    line = (f"{other}: baseline recorded with {recorded}; not checked by this run (its bits are measured only "
            f"there: {CHECK_COMMAND[other]})")
    stale = [key for key, entry in measured.items()
             if key not in section["cases"] or _staleness(section["cases"][key], entry)]
    if stale:
        line += (f"; {len(stale)} of the {len(measured)} cases run here were recorded there for another case "
                 f"definition or other inputs (or not at all), so it must be recorded again with "
                 f"{UPDATE_COMMAND[other]}")
    return line


def _update(baseline, path, here, old_section, measured, failures) -> int:
    if failures:
        for failure in failures:
            print(f"FAIL: {failure}")
        print("forge-verify gate --update: refused; a baseline is never recorded past a proven bound")
        return 1
    new_section = {"provenance": provenance(), "cases": measured}
    lines = diff(old_section or {}, new_section)
    baseline["backends"][here] = new_section
    save(path, baseline)
    print(f"forge-verify gate --update: wrote the {here} section of {path}; "
          f"{len(lines)} change(s){':' if lines else ''}")
    for line in lines:
        print(f"  {line}")
    return 0


def add_parser(commands) -> None:
    gate = commands.add_parser("gate", help="check the kernels' bits and error statistics against the "
                                            "committed baseline (kernel-change gate)")
    gate.add_argument("--update", action="store_true",
                      help="rewrite this backend's baseline section and print the diff (a reviewed act)")
    gate.add_argument("--backend", choices=BACKENDS, default=None,
                      help="the section to check or write; must be the backend kernels run on here")
    gate.add_argument("--baseline", type=Path, default=BASELINE, help=f"baseline file (default {BASELINE})")
    gate.add_argument("--fail-fast", action="store_true", help="stop at the first failing case")


def run(args) -> int:
    return run_gate(args.baseline, update=args.update, backend=args.backend, fail_fast=args.fail_fast)
