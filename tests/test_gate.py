"""The gate's bookkeeping: recording, passing, failing with a precise message, refusing
a baseline past a proven bound, and saying plainly when a backend has no baseline.
(That it catches real kernel mistakes: tests/test_gate_catches_planted_mistakes.py.)"""

import copy
import dataclasses
import json

import pytest

import forge_kernels as fk
from forge_verify.gate import baseline as gate
from forge_verify.gate.cases import canonical_cases

WHERE = "kernel fused_weight_update, rule sgd, regime 'fp32 weight, fp32 state', shape T=50 N=40 K=72"


@pytest.fixture
def sgd_case(monkeypatch):
    """The gate restricted to its SGD case, so each run takes a second."""
    case = next(c for c in canonical_cases() if c.rule_name == "sgd")
    monkeypatch.setattr(gate, "canonical_cases", lambda: [case])
    return case


def _other_backend():
    return next(b for b in gate.BACKENDS if b != gate.current_backend())


def test_record_pass_change_and_review(sgd_case, tmp_path, capsys):
    path = tmp_path / "gate.json"
    assert gate.run_gate(path) == 1
    assert f"{gate.current_backend()}: no baseline recorded for this backend" in capsys.readouterr().out

    assert gate.run_gate(path, update=True) == 0
    assert f"+ {sgd_case.key}: new case" in capsys.readouterr().out
    assert gate.run_gate(path) == 0
    out = capsys.readouterr().out
    assert "forge-verify gate: passed" in out
    assert f"{_other_backend()}: no baseline recorded yet, so this run checks nothing for it" in out

    # What a kernel change looks like to the gate: the recorded weight differs by 3 ulps in sum.
    baseline = json.loads(path.read_text())
    recorded = baseline["backends"][gate.current_backend()]["cases"][sgd_case.key]["fingerprints"]["weight"]
    recorded["sha256"], recorded["ulp_sum"] = "0" * 64, recorded["ulp_sum"] - 3
    path.write_text(json.dumps(baseline))
    assert gate.run_gate(path) == 1
    out = capsys.readouterr().out
    assert f"FAIL: {WHERE} (float32 activations, 3 steps, seed 3): weight bits changed without a baseline " \
           f"update (net shift +3 ulp over [40, 72]" in out

    assert gate.run_gate(path, update=True) == 0
    assert f"~ {sgd_case.key}: bits of weight changed" in capsys.readouterr().out
    assert gate.run_gate(path) == 0


def test_another_backends_section_is_left_alone(sgd_case, tmp_path):
    path = tmp_path / "gate.json"
    other = {"provenance": {"device": "elsewhere"}, "cases": {}}
    gate.save(path, {"backends": {_other_backend(): other}})
    assert gate.run_gate(path, update=True) == 0
    assert gate.load(path)["backends"][_other_backend()] == other


def test_another_backends_section_is_named_and_said_to_be_unchecked(sgd_case, tmp_path, capsys):
    """A run cannot check the other backend's bits; it says so, with where that section was
    recorded, and whether it was recorded from this run's case definitions and inputs."""
    path = tmp_path / "gate.json"
    gate.run_gate(path, update=True)
    baseline = json.loads(path.read_text())
    other = copy.deepcopy(baseline["backends"][gate.current_backend()])
    other["provenance"] = {"device": "elsewhere", "torch": "0.1"}
    baseline["backends"][_other_backend()] = other
    path.write_text(json.dumps(baseline))
    capsys.readouterr()
    assert gate.run_gate(path) == 0
    line = f"{_other_backend()}: baseline recorded with device elsewhere, torch 0.1; not checked by this run " \
           f"(its bits are measured only there: {gate.CHECK_COMMAND[_other_backend()]})\n"
    assert line in capsys.readouterr().out

    del other["cases"][sgd_case.key]["inputs"]
    path.write_text(json.dumps(baseline))
    assert gate.run_gate(path) == 0
    assert f"1 of the 1 cases run here were recorded there for another case definition or other inputs (or " \
           f"not at all), so it must be recorded again with {gate.UPDATE_COMMAND[_other_backend()]}" in \
           capsys.readouterr().out


def test_a_backend_is_recorded_only_where_kernels_run_on_it(sgd_case, tmp_path):
    assert gate.run_gate(tmp_path / "gate.json", update=True, backend=_other_backend()) == 2
    assert not (tmp_path / "gate.json").exists()


def test_a_case_dropped_from_the_canonical_set_fails(sgd_case, tmp_path, capsys):
    path = tmp_path / "gate.json"
    gate.run_gate(path, update=True)
    baseline = json.loads(path.read_text())
    cases = baseline["backends"][gate.current_backend()]["cases"]
    cases["retired | case"] = copy.deepcopy(cases[sgd_case.key])
    path.write_text(json.dumps(baseline))
    capsys.readouterr()
    assert gate.run_gate(path) == 1
    assert "retired | case: in the baseline but no longer a canonical case" in capsys.readouterr().out


def test_update_is_refused_past_a_proven_bound(sgd_case, tmp_path, monkeypatch, capsys):
    real_measure = gate.measure

    def outside(*args):
        result = real_measure(*args)
        result["statistics"]["outside_enclosure"] = 2
        return result

    monkeypatch.setattr(gate, "measure", outside)
    assert gate.run_gate(tmp_path / "gate.json", update=True) == 1
    out = capsys.readouterr().out
    assert f"{WHERE} (float32 activations, 3 steps, seed 3): outside_enclosure = 2 exceeds its proven bound 0" in out
    assert "refused" in out and not (tmp_path / "gate.json").exists()


def _entry(**statistics):
    return {"case": {"config": "TileConfig(block_n=16)", "kernel": "fused_weight_update"}, "inputs": "b" * 64,
            "fingerprints": {"weight": {"dtype": "float32", "shape": [2], "sha256": "a" * 64, "ulp_sum": 0}},
            "statistics": dict(outside_enclosure=0, enclosure_use=0.5, reference_max_ulp=10.0, **statistics)}


def test_statistics_fail_past_their_bound_or_margin(sgd_case):
    recorded = _entry()
    assert gate.compare(sgd_case, recorded, _entry()) == []
    within_margin = _entry()
    within_margin["statistics"]["reference_max_ulp"] = 10.0 * 1.25 + 1.0
    assert gate.compare(sgd_case, recorded, within_margin) == []

    regressed = _entry()
    regressed["statistics"]["reference_max_ulp"] = 20.0
    assert gate.compare(sgd_case, recorded, regressed) == [
        f"{WHERE} (float32 activations, 3 steps, seed 3): reference_max_ulp regressed from 10 to 20 "
        "(+100%, margin 25% + 1)"]
    past_bound = _entry()
    past_bound["statistics"]["enclosure_use"] = 1.5
    failures = gate.compare(sgd_case, recorded, past_bound)
    assert any("enclosure_use = 1.5 exceeds its proven bound 1" in f for f in failures)

    biased = _entry(exact_bias_ulp=-0.2)
    assert gate.compare(sgd_case, _entry(exact_bias_ulp=0.1), biased) == []
    biased["statistics"]["exact_bias_ulp"] = -0.3
    assert "exact_bias_ulp regressed from 0.1 to 0.3" in gate.compare(sgd_case, _entry(exact_bias_ulp=0.1),
                                                                      biased)[0]


def test_a_changed_case_definition_fails(sgd_case, tmp_path, monkeypatch, capsys):
    """The canonical tile config changed under an unchanged case key: the recorded bits
    belong to another case, whether or not they happen to match."""
    from forge_verify.gate import cases, measure

    path = tmp_path / "gate.json"
    gate.run_gate(path, update=True)
    other = fk.TileConfig(block_n=64, block_k=64, block_t=16)
    monkeypatch.setattr(cases, "CONFIG", other)
    monkeypatch.setattr(measure, "CONFIG", other)
    capsys.readouterr()
    assert gate.run_gate(path) == 1
    out = capsys.readouterr().out
    assert f"FAIL: {WHERE} (float32 activations, 3 steps, seed 3): the case definition changed since the " \
           f"baseline was recorded (config: TileConfig(block_n=16, block_k=32, block_t=16" in out
    assert "-> TileConfig(block_n=64, block_k=64, block_t=16" in out and "case changed" in out


def test_a_tile_config_field_added_since_the_baseline_changes_no_case_at_its_default(sgd_case, tmp_path):
    """A baseline recorded before ``TileConfig`` had a field (its config written without
    it) is the same case for a config that leaves the field at its default, and another
    case for one that sets it; a config that is not a TileConfig repr compares as text."""
    path = tmp_path / "gate.json"
    gate.run_gate(path, update=True)
    baseline = json.loads(path.read_text())
    cases = baseline["backends"][gate.current_backend()]["cases"]
    entry = cases[next(iter(cases))]
    current = entry["case"]["config"]
    newest = dataclasses.fields(fk.TileConfig)[-1].name  # a bool defaulting to False, as the last two added
    assert current.endswith(f", {newest}=False)"), current
    entry["case"]["config"] = current.replace(f", {newest}=False)", ")")  # as recorded before the field
    path.write_text(json.dumps(baseline))
    assert gate.run_gate(path) == 0
    recorded = {"case": {"config": current.replace(f", {newest}=False)", ")")}}
    for changed in (current.replace(f"{newest}=False", f"{newest}=True"),
                    current.replace("block_t=16", "block_t=32"), "TileConfig(colour='red')", "a config"):
        assert gate._case_change(recorded, {"case": {"config": changed}}), changed


def test_changed_inputs_are_reported_as_such_not_as_a_kernel_change(sgd_case, tmp_path, monkeypatch, capsys):
    """Bits recorded from other inputs (make_inputs drew differently, or the baseline
    predates the inputs' fingerprint) say nothing about the kernel: the gate says which."""
    from forge_verify.gate import measure

    path = tmp_path / "gate.json"
    gate.run_gate(path, update=True)
    real_make_inputs = measure.make_inputs
    monkeypatch.setattr(measure, "make_inputs", lambda problem, *args: real_make_inputs(
        dataclasses.replace(problem, seed=problem.seed + 1), *args))
    capsys.readouterr()
    assert gate.run_gate(path) == 1
    out = capsys.readouterr().out
    assert f"FAIL: {WHERE} (float32 activations, 3 steps, seed 3): its inputs changed (sha256 " in out
    assert "so its bits and statistics cannot be compared with this run's (not a kernel change); review and " \
           f"record the baseline again with {gate.UPDATE_COMMAND[gate.current_backend()]}" in out
    assert "inputs changed" in out and "bits changed" not in out

    monkeypatch.undo()
    monkeypatch.setattr(gate, "canonical_cases", lambda: [sgd_case])
    baseline = json.loads(path.read_text())
    del baseline["backends"][gate.current_backend()]["cases"][sgd_case.key]["inputs"]
    path.write_text(json.dumps(baseline))
    assert gate.run_gate(path) == 1
    assert "the baseline holds no fingerprint of its inputs (recorded before the gate took one)" in \
        capsys.readouterr().out


@pytest.mark.parametrize("name", ["enclosure_use", "reference_max_ulp", "exact_bias_ulp"])
def test_a_nan_statistic_fails(sgd_case, name):
    """Every comparison with NaN is false: neither the bound nor the regression margin
    would see one without asking."""
    recorded = _entry(exact_bias_ulp=0.1)
    nan = _entry(exact_bias_ulp=0.1)
    nan["statistics"][name] = float("nan")
    assert f"{WHERE} (float32 activations, 3 steps, seed 3): {name} is NaN; a statistic must be a number to " \
           f"be compared" in gate.compare(sgd_case, recorded, nan)


def test_update_refuses_a_nan_statistic(sgd_case, tmp_path, monkeypatch, capsys):
    real_measure = gate.measure

    def nan(*args):
        result = real_measure(*args)
        result["statistics"]["reference_max_ulp"] = float("nan")
        return result

    monkeypatch.setattr(gate, "measure", nan)
    assert gate.run_gate(tmp_path / "gate.json", update=True) == 1
    assert "reference_max_ulp is NaN" in capsys.readouterr().out and not (tmp_path / "gate.json").exists()
