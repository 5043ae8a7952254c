"""The studies' plumbing (no training): their runs are valid run configs and their tables add up."""
from __future__ import annotations

import importlib

import pytest

from tests.module_help import help_text


def _load(name: str):
    return importlib.import_module(f"experiments.studies.{name}")


@pytest.mark.parametrize("script, flags", [("update_norms", ("--steps", "--lomo-clip-value", "--adamw-lr"))])
def test_help(script, flags):
    out = help_text(f"experiments.studies.{script}")
    assert all(f in out for f in flags), out


def test_dpo_pair_kinds_wrong_replies():
    """Each wrong reply keeps the format and gets exactly one part wrong, named by its kind."""
    pk = _load("dpo_pair_kinds")
    replies = pk.wrong_replies("spoons=17", ["cups", "forks", "plates", "spoons"])
    assert dict((r, k) for k, r in replies) == {
        "spoons=14": "count-3", "spoons=15": "count-2", "spoons=16": "count-1", "spoons=18": "count+1",
        "spoons=19": "count+2", "spoons=20": "count+3", "spoons=71": "count_swap", "spoon=17": "item_singular",
        "cups=17": "item_other", "forks=17": "item_other", "plates=17": "item_other"}
    assert [k for k, _ in pk.wrong_replies("eggs=2", ["eggs", "rings"])] == [
        "count+1", "count+2", "count+3", "item_singular", "item_other"]  # the one other item


def test_accumulation_quality_runs_validate_and_report():
    """Each run of the accumulation comparison is a valid run config (K through DeepSpeed's key, every
    validation example), and the table gives mean and minimum per K over the seeds done."""
    from lomo_ds.config.run import load_run_config

    aq = _load("accumulation_quality")
    args = aq.parse_args(["--seeds", "42", "43"])  # make demo-chat's recipe
    cfg = load_run_config(args.config, aq.overrides(args, 4, 43, "/tmp/unused"))
    assert cfg.train.accumulation_steps == 4 and cfg.train.seed == 43 and cfg.train.max_steps == 20
    assert cfg.data.eval_samples == 100 and cfg.eval.generate_samples == 100 and cfg.train.zero_shot_eval is False
    assert cfg.lomo.optimizer == "sgd"  # the rule the recorded figures used, not the config's default
    k1 = {42: {"final_exact_match": 0.8, "minutes": 3.0}, 43: {"final_exact_match": 0.7, "minutes": 3.2}}
    table = aq.report(args, {1: k1, 4: {42: {"final_exact_match": None}}})
    assert "| 1 | 8 | 2 | 75.0 | 70.0 | 42: 80.0 43: 70.0 | 3 3 |" in table, table
    assert "| 4 | 32 | 0 | - | - |" in table, table
    args = aq.parse_args(["--recipe", "default", "--task", "spelling"])
    cfg = load_run_config(args.config, aq.overrides(args, 1, 42, "/tmp/unused"))
    assert cfg.data.task == "spelling" and cfg.data.eval_samples == 500 and cfg.train.max_steps == 35
    args = aq.parse_args(["--optimizer", "adalomo"])
    assert load_run_config(args.config, aq.overrides(args, 1, 42, "/tmp/unused")).lomo.optimizer == "adalomo"


def test_update_norms_groups_every_llama_tensor():
    from experiments.studies.update_norms import GROUPS, group_of
    from tests.tiny import tiny_llama

    names = [n for n, _ in tiny_llama(tie=False).named_parameters()]
    groups = {n: group_of(n) for n in names}
    assert set(groups.values()) == {g for g, _ in GROUPS}
    assert groups["model.layers.0.input_layernorm.weight"] == "norms" and groups["model.norm.weight"] == "norms"
    assert groups["lm_head.weight"] == "embedding" and groups["model.layers.1.mlp.up_proj.weight"] == "MLP"
