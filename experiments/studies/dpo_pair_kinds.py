"""How far the DPO example's starting model already separates each kind of hard pair: one process,
no training. For every record of a chat split, the reference reply and each wrong reply of every
kind (the count off by -3..+3 or its digits swapped, three other items of the split, the item
without its final s) are scored by their summed log-probability after the prompt (the chat
template's rendering, as TRL tokenizes a conversational pair); a pair is right when the reference
scores higher. Prints per kind the share right and the margin's median and minimum (nats), and a
few pairs it gets wrong.

    python -m experiments.studies.dpo_pair_kinds                               # validation split, built-in model
    python -m experiments.studies.dpo_pair_kinds --split train --rows 200 --model runs/cpu_chat/hf_model
"""
from __future__ import annotations

import argparse
import collections
import json
import os

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def wrong_replies(answer: str, items: list[str]) -> list[tuple[str, str]]:
    item, count = answer.split("=")
    n, out = int(count), []
    out += [(f"count{d:+d}", f"{item}={n + d}") for d in (-3, -2, -1, 1, 2, 3) if n + d >= 2]
    if n >= 10 and count[0] != count[1] and count[1] != "0":
        out.append(("count_swap", f"{item}={count[::-1]}"))
    if item.endswith("s"):
        out.append(("item_singular", f"{item[:-1]}={count}"))
    k = items.index(item)
    out += [("item_other", f"{other}={count}") for other in (items[k + 1:] + items[:k])[:3]]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:smollm2-135m")
    ap.add_argument("--split", choices=["train", "validation"], default="validation")
    ap.add_argument("--rows", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lomo_ds.integrations.models import pretrained_folders

    torch.set_num_threads(a.threads)
    model_dir, tokenizer_dir = pretrained_folders(a.model)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with open(os.path.join(ROOT, "lomo_ds", "data", "builtin", "chat", f"{a.split}.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line)["messages"] for line in f if line.strip()][:a.rows]
    items = sorted({m[-1]["content"].split("=")[0] for m in rows})

    def ids(messages: list[dict], generation_prompt: bool = False) -> list[int]:
        return tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                       return_dict=True)["input_ids"]

    margins, wrong = collections.defaultdict(list), collections.defaultdict(list)
    with torch.no_grad():
        for m in rows:
            prompt_len = len(ids(m[:-1], True))
            replies = [("reference", m[-1]["content"])] + wrong_replies(m[-1]["content"], items)
            seqs = [ids(m[:-1] + [{"role": "assistant", "content": r}]) for _, r in replies]
            width = max(map(len, seqs))
            x = torch.tensor([s + [tok.pad_token_id or 0] * (width - len(s)) for s in seqs])
            mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
            logp = torch.log_softmax(model(input_ids=x, attention_mask=mask).logits[:, :-1].float(), -1)
            token_logp = logp.gather(-1, x[:, 1:, None])[..., 0]
            score = [float(token_logp[i, prompt_len - 1:len(s) - 1].sum()) for i, s in enumerate(seqs)]
            for (kind, reply), s in zip(replies[1:], score[1:], strict=True):
                margins[kind].append(score[0] - s)
                if score[0] <= s and len(wrong[kind]) < 4:
                    wrong[kind].append(f"{m[-2]['content']!r}: {reply} ({s:.2f}) above "
                                       f"{m[-1]['content']} ({score[0]:.2f})")
    print(f"{a.model}, {a.split} split, {len(rows)} records")
    for kind, v in sorted(margins.items()):
        v = torch.tensor(v)
        print(f"{kind:14s} pairs {len(v):4d}  right {float((v > 0).float().mean()):.3f}  "
              f"margin median {float(v.median()):.2f} min {float(v.min()):.2f}")
    for kind, lines in wrong.items():
        for line in lines:
            print(f"  wrong ({kind}) {line}")


if __name__ == "__main__":
    main()
