"""A chat fine-tune end to end on a tiny LLaMA with a ChatML tokenizer, two ranks: length-grouped
batches, eval loss and greedy generation before and after (generations/step_N.jsonl), the padding
fraction in the metrics, an exact resume, and an export that `lomo-ds generate` answers from.

The runs are the training program's, in the 2-rank launch of the multi-rank checks (tests/ranks.py
run_here): its command line, launcher and a resume in a fresh process are tests/recipe/test_train.py's."""
import json
import os
import pathlib
import shutil

import torch
from safetensors.torch import load_file

from tests.helpers_data import CHATML, chatml_tokenizer, conversation, write_jsonl
from tests.ranks import ROOT, multi_rank, ok, run_here, work_dir
from tests.tiny import save_tiny_model


def write_chat_run(root: pathlib.Path) -> pathlib.Path:
    """The tiny model and its tokenizer, the chat data and the run config, under `root` (rank 0)."""
    tok = chatml_tokenizer()
    save_tiny_model(root / "model", tok)
    words = ["the cat", "sat on", "the mat", "was lovely", "went out", "it was sunny"]
    train = [conversation(*[words[(i + k) % 6] for k in range(2 + 2 * (i % 2))]) for i in range(24)]
    write_jsonl(str(root / "data" / "train.jsonl"), train)
    write_jsonl(str(root / "data" / "validation.jsonl"), [conversation(words[i], words[i - 1]) for i in range(5)])
    with open(os.path.join(ROOT, "ds_configs", "tiny_cpu.json")) as f:
        cfg = json.load(f)
    cfg["model"]["path"] = str(root / "model")
    cfg["tokenizer"]["max_length"] = 48
    cfg["data"] = {"task": "chat", "source": str(root / "data")}
    cfg["train"].update({"max_steps": 4, "epochs": 1, "zero_shot_eval": True, "seed": 3})
    cfg["eval"].update({"generate_samples": 5, "max_new_tokens": 4, "batch_size": 2})
    cfg["output"].update({"checkpoint_every": 2, "export_hf": True, "keep_last": 2})
    path = root / "run.json"
    path.write_text(json.dumps(cfg))
    return path


@multi_rank(worlds=[2])
def chat_run() -> dict:
    """A straight run, then a second one resumed from the straight run's step-2 checkpoint alone
    (through the console command's entry point)."""
    from lomo_ds import cli
    from lomo_ds.recipe.train import main

    root = pathlib.Path(work_dir()) / "chat_run"
    config, straight, resumed = root / "run.json", root / "straight", root / "resumed"
    if torch.distributed.get_rank() == 0:
        write_chat_run(root)
    torch.distributed.barrier()
    out = {"root": str(root), "straight": run_here(main, ["--config", str(config), "--output-dir", str(straight)])}
    if torch.distributed.get_rank() == 0:
        os.makedirs(resumed / "checkpoints")
        shutil.copytree(straight / "checkpoints" / "step_00000002", resumed / "checkpoints" / "step_00000002")
        (resumed / "checkpoints" / "latest").write_text("step_00000002")
    torch.distributed.barrier()
    out["resumed"] = run_here(cli.main, ["train", "--config", str(config), "--output-dir", str(resumed), "--resume"])
    return out


def test_chat_run_evaluates_by_generation_resumes_exactly_and_exports(rank_results, capsys):
    r = ok(rank_results(2), chat_run)
    root = pathlib.Path(r["root"])
    straight, out = root / "straight", r["straight"]
    assert out["rc"] == 0
    assert '"train": {"read": 24, "sampled": 24, "kept": 24' in out["stdout"]  # every record, counted
    assert "exact match: zero-shot" in out["stdout"] and "--- prompt 1:" in out["stdout"]
    rows = [json.loads(line) for line in open(straight / "generations" / "step_4.jsonl")]
    assert len(rows) == 5 and {"messages", "reference", "reply", "exact_match", "contains"} <= set(rows[0])
    assert (straight / "generations" / "step_0.jsonl").exists()
    metrics = [json.loads(line) for line in open(straight / "metrics.jsonl")]
    steps = [m for m in metrics if "loss" in m]
    assert len(steps) == 4 and all(0 <= m["padding_fraction"] < 1 for m in steps)
    final = [m for m in metrics if m.get("phase") == "final"][0]
    assert {"eval/loss", "eval/exact_match", "eval/contains"} <= set(final)

    # Resume from the step-2 checkpoint alone: the same length-grouped batches, the same weights.
    resumed, out = root / "resumed", r["resumed"]
    assert out["rc"] == 0 and "at step 2" in out["stdout"]
    a, b = (load_file(d / "hf_model" / "model.safetensors") for d in (straight, resumed))
    assert max((a[k] - b[k]).abs().max().item() for k in a) == 0.0

    # The export answers through lomo-ds generate, with the template it was trained with.
    from lomo_ds import cli

    assert cli.main(["generate", "--model", str(straight / "hf_model"), "--prompt", "the cat",
                     "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.count("\n") == 1  # one reply to one prompt
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(straight / "hf_model").chat_template == CHATML
