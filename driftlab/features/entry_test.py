"""``FeatureEntry.of_module``: a feature module's hooks and declarations, found under the fields' names, make its
entry; what the call gives wins, and what the module lacks keeps the field's default."""

from __future__ import annotations

import sys
import types

from driftlab.features import entry
from driftlab.features.capabilities import Requirements
from driftlab.features.entry import FeatureEntry
from driftlab.features.registry import FEATURES


def _module(monkeypatch, **names) -> str:
    module = types.ModuleType("driftlab_toy_feature")
    vars(module).update(names)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module.__name__


def test_the_modules_hooks_and_capitalised_declarations_become_the_entrys_fields(monkeypatch):
    def plan(section, facts):
        return section

    def wrap(algorithm, plan):
        return (algorithm, plan)

    needs = Requirements("[toy]")
    conflicts = Requirements("[toy]", excludes=(("[privacy]", None),))
    name = _module(
        monkeypatch, plan=plan, wrap=wrap, REQUIREMENTS=needs, CONFIG_CONFLICTS=conflicts, CONFIG_FIELD="a toy"
    )
    toy = FeatureEntry.of_module(name, "toy", dict)
    assert (toy.name, toy.section_type, toy.plan, toy.wrap) == ("toy", dict, plan, wrap)
    assert (toy.requirements, toy.config_conflicts, toy.config_field) == (needs, conflicts, "a toy")
    assert toy.wraps and toy.run_info is entry._no_info and toy.finish is entry._nothing_to_finish  # not defined
    assert toy.used_plan is None and toy.state_extra is None and toy.config_facts == ()


def test_fields_the_call_gives_win_over_the_modules(monkeypatch):
    def plan(section, facts):
        return section

    name = _module(monkeypatch, plan=plan, REQUIREMENTS=Requirements("[toy]"), CONFIG_FIELD="mine")
    given = Requirements("[toy]", excludes=(("[system]", None),))
    toy = FeatureEntry.of_module(name, "toy", requirements=given, config_field=None)
    assert toy.requirements is given and toy.config_field is None and toy.section_type is None


def test_every_built_in_entry_of_a_module_has_that_modules_hooks():
    for feature in FEATURES.values():
        module = vars(sys.modules[feature.module])
        for hook in entry.MODULE_HOOKS:
            if hook in module and module.get("FEATURE") is feature:
                assert getattr(feature, hook) is module[hook], (feature.name, hook)
