"""Generation: replies from a causal LM, alone (lomo-ds generate / chat) or spread over the ranks
of a ZeRO-3 run (evaluation during training), scored against reference answers.

Decoding is transformers' `generate`: greedy at temperature 0, else sampling with temperature and
top-p from a seeded generator; it stops at any of `stop_ids` (the template's end-of-turn token and
EOS). Under ZeRO-3 every forward is a collective, so every rank must run as many forwards as the
others: the prompts are split over the ranks, the ranks agree on the number of generate calls (a
rank with fewer prompts answers a one-token dummy prompt), and `synced_gpus` keeps a rank whose
replies have all stopped stepping until every rank's have.
"""
from __future__ import annotations

import json
import os
from typing import Any, Sequence

import torch

from lomo_ds.evaluation.scoring import agree_on_calls


def left_padded(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """input_ids and attention_mask with the padding on the left, so every reply starts at the same column."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(list(p), dtype=torch.long, device=device)
        mask[i, width - len(p):] = 1
    return {"input_ids": ids, "attention_mask": mask}


def cut_at_stop(ids: list[int], stop_ids: Sequence[int]) -> list[int]:
    """A reply's tokens before its first stop token."""
    for k, t in enumerate(ids):
        if t in stop_ids:
            return ids[:k]
    return ids


@torch.no_grad()
def generate_ids(module: torch.nn.Module, prompts: Sequence[Sequence[int]], *, stop_ids: Sequence[int], pad_id: int,
                 max_new_tokens: int, device: torch.device, temperature: float = 0.0, top_p: float = 1.0,
                 synced: bool = False) -> list[list[int]]:
    """The reply tokens (stop token excluded) to each prompt, generated in one batch."""
    module.eval()
    batch = left_padded(prompts, pad_id, device)
    sampling: dict[str, Any] = {"do_sample": False}
    if temperature > 0:
        sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0}
    # The model's own generation_config may ask for sampling; everything decoding depends on is set here.
    # prefill_chunk_size None: a chunked prefill runs one forward per chunk of the prompt, so ranks
    # with prompts of other lengths would run other numbers of forwards (under ZeRO-3 every forward
    # gathers collectively: a hang); synced_gpus keeps only the decoding steps in line.
    out = module.generate(**batch, max_new_tokens=max_new_tokens, eos_token_id=list(stop_ids), pad_token_id=pad_id,
                          use_cache=True, synced_gpus=synced, prefill_chunk_size=None, **sampling)
    width = batch["input_ids"].shape[1]
    return [cut_at_stop(row[width:].tolist(), stop_ids) for row in out]


def score(reply: str, reference: str) -> dict[str, bool]:
    """exact_match: the stripped reply is the stripped reference; contains: the reference is in it."""
    return {"exact_match": reply.strip() == reference.strip(), "contains": reference.strip() in reply}


def evaluate_generation(module: torch.nn.Module, prompts: Sequence[dict], tokenizer, *, stop_ids: Sequence[int],
                        pad_id: int, max_new_tokens: int, batch_size: int, rank: int, world: int,
                        device: torch.device) -> tuple[dict, list[dict] | None]:
    """Collective: greedy replies to `prompts` ({"prompt_ids", "messages", "reference"}, the full
    list on every rank), rank r answering prompts r, r+world, ...

    Returns ({"exact_match", "contains", "n"}, the rows in prompt order on rank 0, None elsewhere).
    """
    mine = list(range(rank, len(prompts), world))
    batches = [mine[i:i + batch_size] for i in range(0, len(mine), batch_size)]
    n_calls = agree_on_calls(len(batches), world)
    rows = []
    for call in range(n_calls):
        chunk = batches[call] if call < len(batches) else []
        ids = [prompts[i]["prompt_ids"] for i in chunk] or [[pad_id]]  # a dummy prompt keeps this rank in step
        replies = generate_ids(module, ids, stop_ids=stop_ids, pad_id=pad_id, max_new_tokens=max_new_tokens,
                               device=device, synced=world > 1)
        if not chunk:
            continue  # the dummy prompt's reply
        for i, reply_ids in zip(chunk, replies, strict=True):
            reply = tokenizer.decode(reply_ids, skip_special_tokens=True)
            p = prompts[i]
            rows.append({"index": i, "messages": p["messages"], "reference": p["reference"], "reply": reply,
                         **score(reply, p["reference"])})
    if world > 1:
        gathered: list = [None] * world
        torch.distributed.all_gather_object(gathered, rows)
        rows = [r for part in gathered for r in part]
    rows.sort(key=lambda r: r["index"])
    n = len(rows)
    metrics = {"exact_match": sum(r["exact_match"] for r in rows) / n if n else float("nan"),
               "contains": sum(r["contains"] for r in rows) / n if n else float("nan"), "n": n}
    return metrics, rows if rank == 0 else None


def write_generations(out_dir: str, step: int, rows: list[dict]) -> str:
    """output.dir/generations/step_N.jsonl: one prompt, reference and reply per line."""
    directory = os.path.join(out_dir, "generations")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"step_{step}.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps({k: v for k, v in r.items() if k != "index"}, ensure_ascii=False) + "\n")
    return path
