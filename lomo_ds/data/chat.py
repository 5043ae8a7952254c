"""Conversations: records in several formats turned into checked message lists, rendered with the
tokenizer's chat template, and tokenized with the loss on the assistant turns only.

    messages = conversation_of(record, "train.jsonl:12")          # DataError naming the line if bad
    ex = encode_conversation(chat, messages, max_length)         # {"input_ids", "labels", ...} or None

Accepted records (each becomes [{"role", "content"}, ...], the last turn the assistant's):
  {"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}
  {"conversations": [{"from": "system"|"human"|"gpt", "value": str}, ...]}    ShareGPT
  {"instruction": str, "input": str (optional), "output": str}                 Alpaca
  {"prompt": str, "response": str}                                             lomo_ds's instruction records
A column mapping (data.columns, {our field: the dataset's column}) renames a dataset's columns first.

The loss covers every assistant turn: its content and the template's end-of-turn token (e.g.
<|im_end|>), nothing the template adds after it and nothing of the other turns. A turn's tokens are
found by rendering the conversation up to that turn with the generation prompt (the turn starts
where that prefix ends) and up to and including it (the turn ends at its first end-of-turn token).
A conversation longer than tokenizer.max_length loses whole earliest exchanges (the system message
and the last exchange are kept), or is dropped when even that does not fit.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

from lomo_ds.data.errors import DataError
from lomo_ds.data.io import load_rows, sample_indices
from lomo_ds.data.packing import finish_train_split
from lomo_ds.data.types import Datasets, check_some_left

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
FORMATS = ("messages", "sharegpt", "alpaca", "prompt_response")
_SENTINEL = "\x00lomo-ds-turn\x00"  # assistant content whose end is easy to find in a rendered probe


# ----------------------------------------------------------------------------- records -> messages

def record_format(record: dict) -> str | None:
    """Which of FORMATS a record is in, from its fields (None: none of them)."""
    if "messages" in record:
        return "messages"
    if "conversations" in record:
        return "sharegpt"
    if "instruction" in record and "output" in record:
        return "alpaca"
    if "prompt" in record and "response" in record:
        return "prompt_response"
    return None


def _text(value: Any, what: str, where: str) -> str:
    if not isinstance(value, str):
        raise DataError(f"{where}: {what}: expected a string, got {type(value).__name__} {value!r}")
    if not value.strip():
        raise DataError(f"{where}: {what}: empty content")
    return value


def checked_turn(turn: Any, i: int, where: str) -> dict[str, str]:
    if not isinstance(turn, dict):
        raise DataError(f"{where}: turn {i}: expected an object with role and content, got {type(turn).__name__}")
    if "role" in turn:
        role, content, key = turn["role"], turn.get("content"), "content"
        if role not in ROLES:
            raise DataError(f"{where}: turn {i}: unknown role {role!r}; expected one of {', '.join(ROLES)}")
    elif "from" in turn:  # ShareGPT
        role, content, key = SHAREGPT_ROLES.get(turn["from"]), turn.get("value"), "value"
        if role is None:
            raise DataError(f"{where}: turn {i}: unknown role {turn['from']!r}; expected one of "
                            f"{', '.join(SHAREGPT_ROLES)}")
    else:
        raise DataError(f"{where}: turn {i}: no 'role' (or ShareGPT 'from') field")
    return {"role": role, "content": _text(content, f"turn {i} ({role}) {key}", where)}


def conversation_of(record: Any, where: str, columns: dict[str, str] | None = None) -> list[dict[str, str]]:
    """The checked message list of one record (module docstring); DataError names `where`."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if columns:
        missing = [col for col in columns.values() if col not in record]
        if missing:
            raise DataError(f"{where}: data.columns names {missing} but the record has only {sorted(record)}")
        record = {**record, **{ours: record[theirs] for ours, theirs in columns.items()}}
    fmt = record_format(record)
    if fmt in ("messages", "sharegpt"):
        turns = record[fmt if fmt == "messages" else "conversations"]
        if not isinstance(turns, list) or not turns:
            raise DataError(f"{where}: {fmt if fmt == 'messages' else 'conversations'}: expected a non-empty list "
                            f"of turns, got {turns!r}")
        messages = [checked_turn(t, i, where) for i, t in enumerate(turns)]
    elif fmt == "alpaca":
        instruction = _text(record["instruction"], "instruction", where)
        extra = record.get("input") or ""
        if not isinstance(extra, str):
            raise DataError(f"{where}: input: expected a string, got {type(extra).__name__}")
        user = f"{instruction}\n\n{extra}" if extra.strip() else instruction
        messages = [{"role": "user", "content": user},
                    {"role": "assistant", "content": _text(record["output"], "output", where)}]
    elif fmt == "prompt_response":
        messages = [{"role": "user", "content": _text(record["prompt"], "prompt", where)},
                    {"role": "assistant", "content": _text(record["response"], "response", where)}]
    else:
        raise DataError(f"{where}: not a conversation: expected 'messages', ShareGPT 'conversations', Alpaca "
                        f"'instruction'/'output' or 'prompt'/'response' fields, got {sorted(record)} "
                        f"(data.columns maps other column names)")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: no assistant turn: nothing to train on or to compare a reply with")
    if messages[-1]["role"] != "assistant":
        raise DataError(f"{where}: the last turn is the {messages[-1]['role']}'s; a conversation ends with the "
                        f"assistant's turn")
    for i, m in enumerate(messages[1:], 1):
        if m["role"] == "system":
            raise DataError(f"{where}: turn {i}: a system message must be the first turn")
    return messages


# ----------------------------------------------------------------------------- the template

def read_template_setting(value: str | None) -> str | None:
    """tokenizer.chat_template: a Jinja template inline, or the path of a file holding one."""
    if value is None or "{" in value:
        return value
    if not os.path.isfile(value):
        raise DataError(f"tokenizer.chat_template: {value!r} is neither a Jinja template nor a file")
    with open(value, encoding="utf-8") as f:
        return f.read()


def apply_template_setting(tokenizer, value: str | None):
    """Give `tokenizer` the configured template (kept: the export carries it); a tokenizer that
    ends up with none is an error, since conversations cannot be rendered without one."""
    template = read_template_setting(value)
    if template is not None:
        tokenizer.chat_template = template
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"the tokenizer ({getattr(tokenizer, 'name_or_path', '?') or '?'}) has no chat template; "
                        f"set tokenizer.chat_template (or --chat-template) to a Jinja template or a file holding one")
    return tokenizer


@dataclass
class ChatFormat:
    """A tokenizer with a chat template, and the token that ends an assistant turn in it."""

    tokenizer: Any
    end_of_turn_id: int

    @property
    def stop_ids(self) -> list[int]:
        """Where generation stops: the end of the turn, and the tokenizer's EOS."""
        eos = self.tokenizer.eos_token_id
        return [self.end_of_turn_id] + ([eos] if eos is not None and eos != self.end_of_turn_id else [])

    def render(self, messages: list[dict], generation_prompt: bool = False) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as e:  # jinja raises its own errors (a template that wants alternating roles, ...)
            raise DataError(f"the chat template cannot render this conversation: {e}") from None

    def ids(self, messages: list[dict], generation_prompt: bool = False) -> list[int]:
        # The template writes every special token itself (BOS included where the model wants one).
        return list(self.tokenizer(self.render(messages, generation_prompt), add_special_tokens=False)["input_ids"])


def chat_format(tokenizer, template_setting: str | None = None) -> ChatFormat:
    """The tokenizer's ChatFormat: the end-of-turn token is the first special token the template
    writes after an assistant turn's content (<|im_end|>, <|eot_id|>, </s>)."""
    apply_template_setting(tokenizer, template_setting)
    fmt = ChatFormat(tokenizer, -1)
    probe = fmt.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": _SENTINEL}])
    tail = probe[probe.rindex(_SENTINEL) + len(_SENTINEL):]
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    for i in tokenizer(tail, add_special_tokens=False)["input_ids"]:
        if i in special:
            fmt.end_of_turn_id = int(i)
            return fmt
    raise DataError(f"the chat template ends an assistant turn with {tail!r}, which holds no special token; "
                    f"the loss and generation need an end-of-turn token")


# ----------------------------------------------------------------------------- fitting and tokenizing

def drop_earliest_turns(messages: list[dict], fits: Callable[[list[dict]], bool]) -> tuple[list[dict] | None, int]:
    """(the longest tail of whole exchanges that `fits`, with the system message kept, and the
    number of turns dropped); (None, n) when even the last exchange does not fit. An exchange
    starts at a user turn, so the turn being trained or answered is never cut."""
    system = messages[:1] if messages and messages[0]["role"] == "system" else []
    rest = messages[len(system):]
    starts = [0] + [i for i, m in enumerate(rest) if m["role"] == "user" and i > 0]
    for start in starts:
        kept = system + rest[start:]
        if fits(kept):
            return kept, start
    return None, starts[-1]


def _prefix_of(full: list[int], part: list[int], where: str) -> int:
    if full[:len(part)] != part:
        raise DataError(f"{where}: the chat template renders an earlier part of this conversation differently "
                        f"from the whole, so the assistant turns cannot be located")
    return len(part)


def assistant_labels(chat: ChatFormat, messages: list[dict], ids: list[int], where: str) -> list[int]:
    """-100 everywhere except each assistant turn's tokens up to and including its end-of-turn token."""
    labels = [-100] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = _prefix_of(ids, chat.ids(messages[:i], generation_prompt=True), where)
        end = _prefix_of(ids, chat.ids(messages[:i + 1]), where)
        turn = ids[start:end]
        if chat.end_of_turn_id not in turn:
            raise DataError(f"{where}: assistant turn {i} has no end-of-turn token in the rendered template")
        stop = start + turn.index(chat.end_of_turn_id) + 1
        labels[start:stop] = ids[start:stop]
    return labels


def encode_conversation(chat: ChatFormat, messages: list[dict], max_length: int, where: str = "",
                        overlong: str = "truncate") -> dict | None:
    """{"input_ids", "labels", "turns_dropped"} for training, or None when it cannot fit
    (overlong="reject": when it does not fit whole)."""
    ids = chat.ids(messages)
    dropped = 0
    if len(ids) > max_length:
        if overlong == "reject":
            return None
        messages, dropped = drop_earliest_turns(messages, lambda m: len(chat.ids(m)) <= max_length)
        if messages is None:
            return None
        ids = chat.ids(messages)
    return {"input_ids": ids, "labels": assistant_labels(chat, messages, ids, where), "turns_dropped": dropped}


def encode_prompt(chat: ChatFormat, messages: list[dict], budget: int) -> tuple[list[int] | None, int]:
    """(token ids of `messages` followed by the generation prompt, earliest turns dropped to fit
    in `budget` tokens; turns dropped); None when even the last exchange does not fit."""
    kept, dropped = drop_earliest_turns(messages, lambda m: len(chat.ids(m, generation_prompt=True)) <= budget)
    return (None if kept is None else chat.ids(kept, generation_prompt=True)), dropped


# ----------------------------------------------------------------------------- a run's chat data

def build_chat_datasets(run_cfg, tokenizer):
    """The chat task's Datasets (lomo_ds.data.types): training examples, eval examples (their
    loss), and eval prompts to answer by generation (eval.generate_samples of them).

    stats, per split: records read, kept, truncated (earliest turns dropped) and dropped (too long
    even then), and the conversation turns dropped; nothing is left out without being counted.
    """
    d, t = run_cfg.data, run_cfg.tokenizer
    chat = chat_format(tokenizer, t.chat_template)
    stats: dict[str, Any] = {"task": d.task, "end_of_turn_token": tokenizer.convert_ids_to_tokens(chat.end_of_turn_id)}
    out = Datasets(train=[], eval=[], eval_lm=[], stats=stats)
    eval_conversations = []
    for split, n_wanted in (("train", d.train_samples), ("eval", d.eval_samples)):
        rows = load_rows(d, split, run_cfg.eval.split)
        # Every record is checked, sampled or not: a bad line is an error, never skipped.
        conversations = [(conversation_of(r, where, d.columns), where) for r, where in rows]
        idx = sample_indices(len(conversations), n_wanted, run_cfg.train.seed)
        kept, truncated, dropped, turns = [], 0, 0, 0
        for i in idx:
            messages, where = conversations[i]
            ex = encode_conversation(chat, messages, t.max_length, where, t.overlong)
            if ex is None:
                dropped += 1
                continue
            truncated += ex["turns_dropped"] > 0
            turns += ex["turns_dropped"]
            kept.append(ex)
            if split == "eval":
                eval_conversations.append(messages)
        if split == "train":
            out.train = kept
        else:
            out.eval_lm = kept
        stats[split] = {"read": len(rows), "sampled": len(idx), "kept": len(kept), "truncated": truncated,
                        "dropped_too_long": dropped, "turns_dropped": turns}
    stats["train_size"], stats["eval_size"] = len(out.train), len(out.eval_lm)
    check_some_left(out, run_cfg, stats["train"]["dropped_too_long"], stats["train"]["sampled"])
    out.eval_prompts = generation_prompts(chat, eval_conversations[:run_cfg.eval.generate_samples],
                                          t.max_length - run_cfg.eval.max_new_tokens, stats)
    finish_train_split(out, run_cfg)
    return out


def generation_prompts(chat: ChatFormat, conversations: list[list[dict]], budget: int, stats: dict) -> list[dict]:
    """{"prompt_ids", "messages", "reference"} per conversation: everything before its last
    assistant turn, which is the reference answer; earliest turns dropped to fit in `budget`."""
    prompts, truncated, too_long = [], 0, 0
    for messages in conversations:
        ids, dropped = encode_prompt(chat, messages[:-1], budget)
        if ids is None:  # the last question alone leaves no room for max_new_tokens
            too_long += 1
            continue
        truncated += dropped > 0
        prompts.append({"prompt_ids": ids, "messages": messages[:-1], "reference": messages[-1]["content"]})
    if conversations:
        stats["generate"] = {"prompts": len(prompts), "truncated": truncated, "dropped_too_long": too_long}
    return prompts
