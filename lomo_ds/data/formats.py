"""The record formats of data.sources, each turned into tokenized training examples
({"input_ids", "labels"}) by one `Encoder`, record by record (so a stream can use it as well as a
loaded file):

  chat             a conversation in any of data/chat.py's formats, rendered with the chat template;
                   the loss on the assistant turns
  prompt_response  {"prompt", "response"}, as the instruction task reads it; the loss on the
                   response and EOS
  text             {"text"}, the loss on every token (EOS appended). Longer than tokenizer.max_length:
                   cut into max_length pieces when packing (no token lost), else truncated (or
                   dropped, tokenizer.overlong "reject")

A source's `columns` ({our field: the dataset's column}) renames its columns first.
"""
from __future__ import annotations

from typing import Any

from lomo_ds.data.chat import conversation_of, encode_conversation
from lomo_ds.data.errors import DataError
from lomo_ds.data.examples import check_record, tokenize_train_example


def renamed(record: Any, columns: dict[str, str], where: str) -> dict:
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    missing = [col for col in columns.values() if col not in record]
    if missing:
        raise DataError(f"{where}: the source's columns name {missing} but the record has only {sorted(record)}")
    return {**record, **{ours: record[theirs] for ours, theirs in columns.items()}}


def encode_text(tokenizer, text: str, max_length: int, split_long: bool, overlong: str) -> tuple[list[dict], bool]:
    """(examples, whether the text was cut) of one text: one example, or max_length pieces
    (`split_long`), or one truncated example; none when it is rejected or too short to predict."""
    ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError("the tokenizer has no EOS token; a text example ends with one")
    if not ids or ids[-1] != eos:
        ids.append(eos)
    cut = len(ids) > max_length
    if cut and split_long:
        pieces = [ids[s:s + max_length] for s in range(0, len(ids), max_length)]
    elif cut and overlong == "reject":
        pieces = []
    else:
        pieces = [ids[:max_length]]
    # A piece of one token has no next token to predict.
    return [{"input_ids": p, "labels": list(p)} for p in pieces if len(p) > 1], cut


class Encoder:
    """One source's records to training examples: `encoder(record, where)` -> a list of examples
    (empty: dropped as too long); `stats` counts records read, kept, truncated and dropped."""

    def __init__(self, fmt: str, tokenizer, max_length: int, overlong: str, chat=None,
                 columns: dict[str, str] | None = None, split_long: bool = False):
        if fmt == "chat" and chat is None:
            raise ValueError("a chat source needs the tokenizer's ChatFormat (data/chat.py chat_format)")
        self.fmt, self.tokenizer, self.chat = fmt, tokenizer, chat
        self.max_length, self.overlong, self.split_long = max_length, overlong, split_long
        self.columns = columns or {}
        self.stats = {"read": 0, "kept": 0, "truncated": 0, "dropped_too_long": 0}

    def __call__(self, record: Any, where: str) -> list[dict]:
        self.stats["read"] += 1
        examples, cut = self._encode(record, where)
        self.stats["truncated"] += bool(cut and examples)
        self.stats["dropped_too_long"] += not examples
        self.stats["kept"] += bool(examples)
        return examples

    def _encode(self, record: Any, where: str) -> tuple[list[dict], bool]:
        if self.fmt == "chat":
            ex = encode_conversation(self.chat, conversation_of(record, where, self.columns), self.max_length, where,
                                     self.overlong)
            return ([] if ex is None else [{"input_ids": ex["input_ids"], "labels": ex["labels"]}],
                    ex is not None and ex["turns_dropped"] > 0)
        record = renamed(record, self.columns, where)
        if self.fmt == "prompt_response":
            ex = tokenize_train_example(check_record("instruction", record, where), self.tokenizer, self.max_length,
                                        self.overlong)
            return ([] if ex is None else [{"input_ids": ex["input_ids"], "labels": ex["labels"]}],
                    ex is not None and ex["truncated"] > 0)
        if self.fmt == "text":
            text = record.get("text")
            if not isinstance(text, str) or not text.strip():
                raise DataError(f"{where}: text: expected a non-empty string, got "
                                f"{'no text field' if 'text' not in record else repr(text)[:80]} "
                                f"(fields {sorted(record)}; a source's columns map another column)")
            return encode_text(self.tokenizer, text, self.max_length, self.split_long, self.overlong)
        raise ValueError(f"unknown source format {self.fmt!r}")
