"""lm-evaluation-harness on a model folder, with local tasks only (lomo_ds/evaluation/harness.py).

The harness's `acc` picks the candidate with the highest summed log-probability; the reference here
computes that from the same examples' token ids with the model itself. The demo-scale check (the
export of a trained run against the run's own evaluation) is tests/recipe/test_recipe.py's.
"""
import importlib.util
import json
import os

import pytest
import torch
from transformers import LlamaForCausalLM

from lomo_ds.config.errors import ConfigError
from lomo_ds.config.run import load_run_config
from lomo_ds.data.loading import build_datasets
from tests.helpers_data import byte_bpe_tokenizer
from tests.tiny import tiny_llama_config

pytestmark = pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="lm-eval not installed")
EXAMPLES = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("hf_model"))
    tok = byte_bpe_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(vocab=len(tok), hidden=64))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _cfg(model_dir):
    return load_run_config({"model": {"path": model_dir}, "train": {"method": "zero_shot"},
                            "tokenizer": {"max_length": 64},
                            "data": {"task": "builtin", "train_samples": 4, "eval_samples": EXAMPLES}})


def _summed_logprob_accuracy(model_dir, cfg) -> float:
    tok = byte_bpe_tokenizer()
    model = LlamaForCausalLM.from_pretrained(model_dir).eval()
    right = 0
    for ex in build_datasets(cfg, tok).eval:
        scores = []
        for cand in ex.candidate_ids:
            ids = torch.tensor([ex.context_ids + cand])
            with torch.no_grad():
                logp = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
            start = len(ex.context_ids)
            scores.append(logp[start - 1:].gather(-1, ids[0, start:, None]).sum().item())
        right += max(range(len(scores)), key=scores.__getitem__) == ex.label
    return right / EXAMPLES


def test_a_lomo_task_written_for_the_harness_scores_its_examples_like_the_reference(model_dir, tmp_path):
    from lomo_ds.evaluation import harness

    cfg = _cfg(model_dir)
    name = harness.write_task(cfg, str(tmp_path))
    # Read back as any user's YAML task: by its name, from an include folder.
    res, model = harness.run(model_dir, [name], include=[str(tmp_path)], batch_size=8)
    assert model["dtype"] == "float32"  # "auto": the folder's own (saved in fp32)
    assert res[name]["n"] == EXAMPLES
    assert abs(res[name]["acc"] - _summed_logprob_accuracy(model_dir, cfg)) <= 1 / EXAMPLES + 1e-9, res


def test_the_cli_refuses_what_it_cannot_read_in_one_line(model_dir, tmp_path, capsys):
    from lomo_ds.cli import main

    assert main(["eval", "--model", model_dir, "--tasks", "no_such_task"]) == 2
    err = capsys.readouterr().err.strip()
    assert "harness task 'no_such_task' is not found locally" in err and "\n" not in err
    assert main(["eval", "--model", model_dir, "--tasks", "builtin", "--include", str(tmp_path / "absent")]) == 2
    assert "harness include folder" in capsys.readouterr().err
    assert main(["eval", "--model", str(tmp_path), "--tasks", "builtin"]) == 2
    assert "not a Hugging Face model folder" in capsys.readouterr().err


def _bf16_run(model_dir):
    return load_run_config({"bf16": {"enabled": True}, "model": {"path": model_dir}, "train": {"method": "zero_shot"},
                            "data": {"task": "builtin", "eval_samples": 4}, "eval": {"harness_tasks": ["builtin"]}})


def test_the_run_asks_the_harness_for_its_training_dtype(model_dir, tmp_path):
    """The recipe's harness command (the process evaluate_export starts) loads a bf16 run's export in
    bf16, an fp32 run's in fp32: not fp32 whatever the run, twice a bf16 model's bytes."""
    from lomo_ds.recipe import harness_eval

    cmd, _, _ = harness_eval.export_command(model_dir, _bf16_run(model_dir), "cpu", str(tmp_path))
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16", cmd
    fp32 = load_run_config({"model": {"path": model_dir}, "train": {"method": "zero_shot"}})
    cmd, _, _ = harness_eval.export_command(model_dir, fp32, "cpu", str(tmp_path))
    assert cmd[cmd.index("--dtype") + 1] == "float32", cmd


def test_lomo_ds_eval_loads_the_model_in_the_dtype_it_is_given(model_dir, tmp_path, capsys):
    """What lm-eval's model is once loaded (its parameters' dtype), as that command reports it."""
    from lomo_ds.cli import main

    loaded = tmp_path / "model.json"
    assert main(["eval", "--model", model_dir, "--tasks", "builtin", "--limit", "2", "--dtype", "bfloat16",
                 "--model-out", str(loaded)]) == 0
    assert "the model loaded in bfloat16 on cpu" in capsys.readouterr().out
    assert json.loads(loaded.read_text())["dtype"] == "bfloat16"


def test_the_recipe_option_is_checked_on_load(model_dir, tmp_path):
    from lomo_ds.recipe.train import check_runtime

    base = {"model": {"path": model_dir}, "train": {"method": "zero_shot"}}
    with pytest.raises(ConfigError, match="output.export_hf is false"):
        load_run_config({**base, "eval": {"harness_tasks": ["builtin"]}, "output": {"export_hf": False}})
    with pytest.raises(ConfigError, match="eval.harness_include: no such folder"):
        load_run_config({**base, "eval": {"harness_tasks": ["x"], "harness_include": [str(tmp_path / "none")]}})
    cfg = load_run_config({**base, "eval": {"harness_tasks": ["builtin", "mine"], "harness_include": [str(tmp_path)]}})
    with pytest.raises(ConfigError, match="eval.harness_tasks: harness task 'mine' is not found locally"):
        check_runtime(cfg)
    os.makedirs(tmp_path / "t", exist_ok=True)
    from lomo_ds.evaluation import harness
    harness.write_task(_cfg(model_dir), str(tmp_path / "t"))
    check_runtime(load_run_config({**base, "eval": {"harness_tasks": ["builtin", "lomo_builtin"],
                                                    "harness_include": [str(tmp_path / "t")]}}))
