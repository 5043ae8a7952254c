"""The registry of update rules (lomo_ds/config/rules.py): what it refuses, and `lomo.plugins`, which
imports a user's module (one that registers a rule) before the rest of the config is read. The
acceptance test of a plug-in rule end to end is tests/engine/test_rule_plugin.py."""
from __future__ import annotations

import sys

import pytest

from lomo_ds.config import rules
from lomo_ds.config.engine_config import ConfigError, load_config
from lomo_ds.config.presets import describe_update


def test_the_built_ins_are_registered_first():
    assert rules.names()[:2] == ["sgd", "adalomo"]
    assert rules.get("adalomo").label == "AdaLomo" and rules.get("sgd").row == "lomo"
    assert rules.by_optim("adalomo").name == "adalomo" and rules.by_optim("lomo") is None


def test_an_unknown_rule_is_refused_naming_the_registered_ones():
    with pytest.raises(rules.RuleError, match=r"unknown update rule 'lion': expected one of \['sgd', 'adalomo'"):
        rules.get("lion")


def test_a_second_rule_under_a_taken_name_is_refused():
    again = rules.RuleSpec(name="adalomo", label="another", rule="x:y")
    with pytest.raises(rules.RuleError, match=r"a rule named 'adalomo' is already registered \(AdaLomo\)"):
        rules.register(again)
    rules.register(rules.get("adalomo"))  # the same entry again (a module imported twice): no error


@pytest.mark.parametrize("spec, match", [
    (rules.RuleSpec(name="x", label="X", rule="m:c", optim=("adalomo",)), r"optim \['adalomo'\] already chooses"),
    (rules.RuleSpec(name="x", label="X", rule="m:c", plan_name="adamw"), r"the planner's row 'adamw' is DeepSpeed's"),
    (rules.RuleSpec(name="x-y", label="X", rule="m:c"), "must be an identifier"),
])
def test_an_entry_that_clashes_is_refused(spec, match):
    with pytest.raises(rules.RuleError, match=match):
        rules.register(spec)
    assert "x" not in rules.names()


PLUGIN = '''
from lomo_ds.config import rules
from lomo_ds.config.section import Section


class Options(Section):
    beta: float = 0.5


rules.register(rules.RuleSpec(name="users_rule", label="User's rule", rule="lomo_ds.engine.update.sgd:SGD",
                              config=Options, preset={"lr": 0.25}))
'''


@pytest.fixture
def users_module(tmp_path, monkeypatch):
    (tmp_path / "users_rules.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "users_rules"
    rules.unregister("users_rule")
    sys.modules.pop("users_rules", None)


def test_lomo_plugins_imports_a_module_whose_rule_the_config_names(users_module):
    lomo = {"optimizer": "users_rule", "users_rule": {"beta": 0.75}}
    with pytest.raises(ConfigError, match=r"lomo\.optimizer: expected one of \['sgd', 'adalomo'\], got 'users_rule'"):
        load_config({"lomo": {"optimizer": "users_rule"}})
    with pytest.raises(ConfigError, match=r"lomo\.users_rule: unknown key"):  # its options without its rule
        load_config({"lomo": lomo})
    _, cfg = load_config({"lomo": {"plugins": [users_module], **lomo}})
    assert (cfg.lomo.rule.name, cfg.lomo.rule_options.beta) == ("users_rule", 0.75)
    assert cfg.lomo.lr == 0.25  # the preset it is registered with fills what the config leaves out
    assert describe_update(cfg).endswith("(lr from the preset 'users_rule' is registered with)")
    _, own = load_config({"lomo": {"plugins": [users_module], "optimizer": "users_rule",
                                   "presets": {"users_rule": {"lr": 0.5}}}})
    assert own.lomo.lr == 0.5 and own.lomo.rule_options.beta == 0.5  # the config's preset wins; options' defaults
    with pytest.raises(ConfigError, match=r"lomo\.users_rule\.gamma: unknown key; expected some of \['beta'\]"):
        load_config({"lomo": {"plugins": [users_module], "users_rule": {"gamma": 1}}})


def test_a_plugin_that_cannot_be_imported_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"lomo\.plugins\[1\]: cannot import 'no_such_module_of_rules'"):
        load_config({"lomo": {"plugins": ["json", "no_such_module_of_rules"]}})


def test_an_unknown_lomo_key_still_names_the_known_ones():
    with pytest.raises(ConfigError, match=r"lomo\.beta1: unknown key; expected some of \['adalomo', "):
        load_config({"lomo": {"beta1": 0.9}})
    with pytest.raises(ConfigError, match=r"lomo\.presets\.lion: unknown key; expected some of \['adalomo', 'sgd'\]"):
        load_config({"lomo": {"presets": {"lion": {"lr": 1.0}}}})
