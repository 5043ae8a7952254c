"""A chat fine-tune end to end on a tiny LLaMA with a ChatML tokenizer, two ranks: length-grouped
batches, eval loss and greedy generation before and after (generations/step_N.jsonl), the padding
fraction in the metrics, an exact resume, and an export that `lomo-ds generate` answers from."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers_data import CHATML, chatml_tokenizer, conversation, write_jsonl
from tests.ranks import ROOT
from tests.tiny import tiny_llama_config
from tools.launch_local import run_local


def train(entry: list[str], config, out_dir, *extra):
    """A 2-rank run of the training program (entry: launch/train.py, or the lomo-ds console command's module)."""
    proc = run_local([*entry, "--config", str(config), "--output-dir", str(out_dir), *extra], 2, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return proc


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_run")
    tok = chatml_tokenizer()
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(tiny_llama_config(vocab=len(tok))).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    words = ["the cat", "sat on", "the mat", "was lovely", "went out", "it was sunny"]
    train = [conversation(*[words[(i + k) % 6] for k in range(2 + 2 * (i % 2))]) for i in range(24)]
    write_jsonl(str(root / "data" / "train.jsonl"), train)
    write_jsonl(str(root / "data" / "validation.jsonl"), [conversation(words[i], words[i - 1]) for i in range(5)])
    with open(os.path.join(ROOT, "ds_configs", "tiny_cpu.json")) as f:
        cfg = json.load(f)
    cfg["model"]["path"] = str(root / "model")
    cfg["tokenizer"]["max_length"] = 48
    cfg["data"] = {"task": "chat", "source": str(root / "data"), "seed": 3}
    cfg["train"].update({"max_steps": 4, "epochs": 1, "zero_shot_eval": True})
    cfg["eval"].update({"generate_samples": 5, "max_new_tokens": 4, "batch_size": 2})
    cfg["output"].update({"checkpoint_every": 2, "export_hf": True, "keep_last": 2})
    path = root / "run.json"
    path.write_text(json.dumps(cfg))
    return root, path


def test_chat_run_evaluates_by_generation_resumes_exactly_and_exports(chat_run, capsys):
    root, config = chat_run
    straight = root / "straight"
    out = train([os.path.join(ROOT, "launch", "train.py")], config, straight)
    assert '"train": {"read": 24, "sampled": 24, "kept": 24' in out.stdout  # every record, counted
    assert "exact match: zero-shot" in out.stdout and "--- prompt 1:" in out.stdout
    rows = [json.loads(line) for line in open(straight / "generations" / "step_4.jsonl")]
    assert len(rows) == 5 and {"messages", "reference", "reply", "exact_match", "contains"} <= set(rows[0])
    assert (straight / "generations" / "step_0.jsonl").exists()
    metrics = [json.loads(line) for line in open(straight / "metrics.jsonl")]
    steps = [m for m in metrics if "loss" in m]
    assert len(steps) == 4 and all(0 <= m["padding_fraction"] < 1 for m in steps)
    final = [m for m in metrics if m.get("phase") == "final"][0]
    assert {"eval/loss", "eval/exact_match", "eval/contains"} <= set(final)

    # Resume from the step-2 checkpoint alone: the same length-grouped batches, the same weights.
    resumed = root / "resumed"
    os.makedirs(resumed / "checkpoints")
    shutil.copytree(straight / "checkpoints" / "step_00000002", resumed / "checkpoints" / "step_00000002")
    (resumed / "checkpoints" / "latest").write_text("step_00000002")
    out = train(["-m", "lomo_ds.cli", "train"], config, resumed, "--resume")
    assert "at step 2" in out.stdout
    a, b = (load_file(d / "hf_model" / "model.safetensors") for d in (straight, resumed))
    assert max((a[k] - b[k]).abs().max().item() for k in a) == 0.0

    # The export answers through lomo-ds generate, with the template it was trained with.
    from lomo_ds import cli

    assert cli.main(["generate", "--model", str(straight / "hf_model"), "--prompt", "the cat",
                     "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.count("\n") == 1  # one reply to one prompt
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(straight / "hf_model").chat_template == CHATML
