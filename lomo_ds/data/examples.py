"""The candidate and instruction tasks' records: checked against the task's schema (the registry in
lomo_ds/config/tasks.py), formatted into prompt and candidates, and tokenized.

The training loss is on the answer tokens and EOS only; evaluation scores every candidate by its
mean token log-probability (lomo_ds/evaluation/scoring.py). The instruction task has no candidates,
so its records are trained on their response and evaluated by their mean token loss."""
from __future__ import annotations

from typing import Any

from lomo_ds.config.tasks import TASKS
from lomo_ds.data.errors import DataError
from lomo_ds.data.types import EvalExample, PromptExample


def format_example(task: str, r: dict) -> PromptExample:
    """The prompt, candidates and answer of one record of a task with candidates (tasks.py)."""
    spec = TASKS[task]
    if not spec.has_candidates:
        raise ValueError(f"task {task!r} has no prompt: its records are prompt/response pairs")
    return PromptExample(task, spec.prompt(r), spec.candidates(r), spec.answer(r))


def check_record(task: str, r: Any, where: str) -> dict:
    """Raise DataError (naming `where`, e.g. 'file.jsonl:12') unless `r` has the task's fields."""
    fields = TASKS[task].fields
    if not isinstance(r, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(r).__name__}")
    for name, types in fields.items():
        if name not in r:
            raise DataError(f"{where}: missing field {name!r} (task {task!r} needs {sorted(fields)})")
        if not isinstance(r[name], types):
            raise DataError(f"{where}: field {name!r}: expected {'/'.join(t.__name__ for t in types)}, "
                            f"got {type(r[name]).__name__} {r[name]!r}")
    for name, allowed in TASKS[task].values.items():
        if r[name] not in allowed:
            raise DataError(f"{where}: field {name!r}: expected {' or '.join(map(repr, allowed))}, got {r[name]!r}")
    return r


def _encode(tokenizer, text: str) -> list[int]:
    ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    eos = tokenizer.eos_token_id
    if len(ids) > 1 and eos is not None and ids[-1] == eos:  # tokenizers that append EOS themselves
        ids = ids[:-1]
    return ids


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):  # a prefix: the shorter one ends it
        if x != y:
            break
        n += 1
    return n


def encode_with_candidates(tokenizer, prompt: str, candidates: list[str]) -> tuple[list[int], list[list[int]]]:
    """Token ids of the prompt and of each candidate such that context + candidate is exactly how
    the tokenizer encodes prompt + candidate as one string.

    Encoding the two parts separately is wrong at the seam: "... so " + "the" is "so", " the" as one
    string but "so", " " + "the" apart, and SentencePiece adds a space before a separately encoded
    word. So each candidate's ids are the tail of the joint encoding after the longest prefix shared
    with the prompt's encoding (shortest over candidates, so all share one context).
    """
    prompt_ids = _encode(tokenizer, prompt)
    full = [_encode(tokenizer, prompt + c) for c in candidates]
    cut = min(_common_prefix(prompt_ids, f) for f in full)
    cands = [f[cut:] for f in full]
    for c, ids in zip(candidates, cands, strict=True):
        if not ids:
            raise DataError(f"candidate {c!r} encodes to no tokens after prompt {prompt[-40:]!r}")
    return prompt_ids[:cut], cands


def _fit(context: list[int], tail_len: int, max_length: int, bos_id: int | None) -> tuple[list[int] | None, int]:
    """Drop prompt tokens from the left (after a leading BOS) until context + tail fits.
    Returns (context or None when even an empty prompt is too long, number of tokens dropped)."""
    excess = len(context) + tail_len - max_length
    if excess <= 0:
        return context, 0
    keep_bos = 1 if bos_id is not None and context[:1] == [bos_id] else 0
    # At least one context token must stay: it predicts the first answer token.
    if len(context) - excess < max(keep_bos, 1):
        return None, excess
    return context[:keep_bos] + context[keep_bos + excess:], excess


def tokenize_train_example(ex: PromptExample | dict, tokenizer, max_length: int,
                           overlong: str = "truncate") -> dict | None:
    """{"input_ids", "labels", "truncated"} for the prompt followed by the correct answer and EOS.

    labels are -100 on the prompt: the loss is on the answer tokens and EOS only. When the sequence
    is longer than max_length, "truncate" drops prompt tokens from the left (the answer is kept;
    "truncated" is the number dropped) and "reject" returns None; None is also returned when the
    answer alone does not fit. `ex` is a PromptExample or an instruction record {"prompt", "response"}.
    """
    if isinstance(ex, PromptExample):
        prompt, answer = ex.prompt, ex.candidates[ex.label]
    else:
        prompt, answer = ex["prompt"], ex["response"]
    context, (ans,) = encode_with_candidates(tokenizer, prompt, [answer])
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError("the tokenizer has no EOS token; the training target ends with one")
    tail = ans + [eos]
    dropped = 0
    if len(context) + len(tail) > max_length:
        if overlong == "reject":
            return None
        context, dropped = _fit(context, len(tail), max_length, tokenizer.bos_token_id)
        if context is None:
            return None
    return {"input_ids": context + tail, "labels": [-100] * len(context) + tail, "truncated": dropped}


def tokenize_eval_example(ex: PromptExample, tokenizer, max_length: int,
                          overlong: str = "truncate") -> tuple[EvalExample | None, int]:
    """(EvalExample or None when rejected, prompt tokens dropped); the longest candidate must fit."""
    context, cands = encode_with_candidates(tokenizer, ex.prompt, ex.candidates)
    longest = max(len(c) for c in cands)
    dropped = 0
    if len(context) + longest > max_length:
        if overlong == "reject":
            return None, 0
        context, dropped = _fit(context, longest, max_length, tokenizer.bos_token_id)
        if context is None:
            return None, 0
    return EvalExample(ex.task, context, cands, ex.label), dropped
