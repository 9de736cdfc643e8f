"""The rule catalog is complete, and every consumer reads it: a rule exported by
forge_kernels without a catalog entry, or a consumer that leaves a catalogued rule out,
fails here instead of silently dropping the rule from the gate, a property or a study."""

import inspect

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import forge_kernels as fk
from forge_verify.checks import catalog, deviation, strategies, torch_optim
from forge_verify.checks.catalog import CATALOG, entry_for, reference_step
from forge_verify.gate import cases
from forge_verify.numerics.reference import POINT

NAMES = {entry.name for entry in CATALOG}

EXPORTED_RULES = [obj for name in fk.__all__ if inspect.isclass(obj := getattr(fk, name))
                  and issubclass(obj, fk.Rule) and obj is not fk.Rule]


def test_every_exported_rule_has_exactly_one_entry():
    assert EXPORTED_RULES, "forge_kernels exports no rule: the check below would pass vacuously"
    catalogued = [entry.rule for entry in CATALOG]
    assert sorted(map(repr, catalogued)) == sorted(map(repr, EXPORTED_RULES))
    assert len(NAMES) == len(CATALOG)


def test_every_entry_instance_is_of_its_rule():
    for entry in CATALOG:
        for field in ("gate", "sharding", "deviation", "closeness"):
            instance = getattr(entry, field)
            if instance is not None:
                assert type(instance) is entry.rule, f"{entry.name}.{field} is a {type(instance).__name__}"
        assert (entry.torch_optim is None) == (entry.closeness is None), entry.name


@pytest.mark.parametrize("entry", CATALOG, ids=lambda e: e.name)
@given(data=st.data())
@settings(max_examples=5)
def test_every_strategy_draws_its_rule(entry, data):
    assert type(data.draw(entry.strategy)) is entry.rule


@pytest.mark.parametrize("consumer, names", [
    ("strategies.RULES", set(strategies.RULES)),
    ("gate canonical cases", {case.rule_name for case in cases.canonical_cases()}),
    ("deviation.RULES", set(deviation.RULES)),
], ids=lambda v: v if isinstance(v, str) else "")
def test_consumer_covers_the_catalog(consumer, names):
    assert names == NAMES, f"{consumer} covers {sorted(names)}, the catalog {sorted(NAMES)}"


def test_torch_optim_comparison_covers_every_rule_torch_has():
    with_counterpart = {entry.name for entry in CATALOG if entry.torch_optim is not None}
    assert set(torch_optim.MEASURED_RULES) == with_counterpart
    assert "lion" not in with_counterpart  # torch.optim has no Lion


def test_every_rule_has_a_reference_and_subclasses_inherit_it():
    import torch
    w, g = torch.ones(2, 3, dtype=torch.float64), torch.full((2, 3), 0.5, dtype=torch.float64)
    for entry in CATALOG:
        state = {k: v.double() for k, v in entry.gate.init_state(torch.ones(2, 3)).items()}
        new_w, new_state = reference_step(entry.gate, w, g, state, 1, POINT)
        assert new_w.shape == w.shape and set(new_state) == set(state)
        variant = type("Variant", (entry.rule,), {})
        assert entry_for(variant.__new__(variant)) is entry


def test_an_unknown_rule_is_refused_by_name():
    class Unlisted(fk.Rule):
        pass
    with pytest.raises(TypeError, match="Unlisted is not in forge_verify.checks.catalog.CATALOG"):
        catalog.entry_for(Unlisted.__new__(Unlisted))
