"""Preference pairs in TRL's formats, read from JSONL or Parquet and checked record by record.

    data = load_preference("pairs.jsonl")          # a datasets.Dataset; DataError naming file:line if bad

Accepted records (TRL's preference formats; one file holds one of them):
  {"prompt": str, "chosen": str, "rejected": str}                                  plain, explicit prompt
  {"prompt": [turns], "chosen": [turns], "rejected": [turns]}                      conversational
  {"chosen": str, "rejected": str}                                                 plain, implicit prompt
  {"chosen": [turns], "rejected": [turns]}                                         conversational, implicit
A turn is {"role": "system"|"user"|"assistant", "content": non-empty str}. With an explicit prompt,
the prompt's turns end with a user turn and a completion is assistant turns; with an implicit one,
chosen and rejected share their turns up to the last and differ in it (TRL's extract_prompt splits
them there). A pair whose chosen and rejected are the same is refused: it carries no preference.

The file is read twice: line by line (so a bad line is named, with JSON's own error), then through
`datasets.load_dataset` ("json" / "parquet"), which is what DPOTrainer is given.

`hard_pairs(messages_records, seed)` builds pairs from the built-in chat task (item=count answers):
the chosen reply is the reference, the rejected one has the same format with one part wrong, one of
three kinds: the count (off by one to three, or its digits swapped), another item of the task, or
the same item without its final s (`spoon=17` for `spoons=17`). Both replies are in the format the
task asks for, so no pair is told apart by format alone; only copying the right words from the
prompt separates them.
"""
from __future__ import annotations

import json
import os
import random
from typing import Any

from lomo_ds.data.errors import DataError
from lomo_ds.data.io import read_jsonl

ROLES = ("system", "user", "assistant")
KINDS = ("plain", "conversational")


# ----------------------------------------------------------------------------- checking

def _turns(value: Any, field: str, where: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: {field}: expected a non-empty list of turns, got {value!r}")
    out = []
    for i, t in enumerate(value):
        if not isinstance(t, dict) or set(t) - {"role", "content"} or "role" not in t:
            raise DataError(f"{where}: {field}[{i}]: expected an object with role and content, got {t!r}")
        if t["role"] not in ROLES:
            raise DataError(f"{where}: {field}[{i}]: unknown role {t['role']!r}; expected one of {', '.join(ROLES)}")
        if not isinstance(t.get("content"), str) or not t["content"].strip():
            raise DataError(f"{where}: {field}[{i}] ({t['role']}) content: expected a non-empty string, "
                            f"got {t.get('content')!r}")
        out.append({"role": t["role"], "content": t["content"]})
    return out


def _string(value: Any, field: str, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{where}: {field}: expected a non-empty string, got {value!r}")
    return value


def record_kind(record: dict) -> tuple[str, bool]:
    """(plain | conversational, explicit prompt?) of a record, from its chosen field."""
    return ("conversational" if isinstance(record.get("chosen"), list) else "plain"), "prompt" in record


def check_pair(record: Any, where: str, expect: tuple[str, bool] | None = None) -> tuple[str, bool]:
    """Check one preference record (module docstring); returns its (kind, explicit prompt). `expect`:
    the file's first record's, which every other record must share (one dataset, one schema)."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    missing = [k for k in ("chosen", "rejected") if k not in record]
    if missing:
        raise DataError(f"{where}: missing {', '.join(missing)}: a preference pair has 'chosen' and 'rejected' "
                        f"(and optionally 'prompt'); got {sorted(record)}")
    extra = sorted(set(record) - {"prompt", "chosen", "rejected"})
    if extra:
        raise DataError(f"{where}: unknown field(s) {extra}; expected prompt, chosen, rejected")
    kind, explicit = record_kind(record)
    if expect is not None and (kind, explicit) != expect:
        def name(k):
            return f"{k[0]} with {'an explicit' if k[1] else 'an implicit'} prompt"
        raise DataError(f"{where}: a {name((kind, explicit))} record in a file of {name(expect)} records")
    if kind == "plain":
        chosen, rejected = _string(record["chosen"], "chosen", where), _string(record["rejected"], "rejected", where)
        if explicit:
            _string(record["prompt"], "prompt", where)
    else:
        chosen, rejected = _turns(record["chosen"], "chosen", where), _turns(record["rejected"], "rejected", where)
        if explicit:
            prompt = _turns(record["prompt"], "prompt", where)
            if prompt[-1]["role"] != "user":
                raise DataError(f"{where}: prompt: the last turn is the {prompt[-1]['role']}'s; a prompt ends "
                                f"with the user's turn")
            for field, turns in (("chosen", chosen), ("rejected", rejected)):
                if any(t["role"] != "assistant" for t in turns):
                    raise DataError(f"{where}: {field}: a completion holds assistant turns only, got roles "
                                    f"{[t['role'] for t in turns]}")
        else:
            for field, turns in (("chosen", chosen), ("rejected", rejected)):
                if turns[-1]["role"] != "assistant":
                    raise DataError(f"{where}: {field}: the last turn is the {turns[-1]['role']}'s; it must be "
                                    f"the assistant's")
            if len(chosen) != len(rejected) or chosen[:-1] != rejected[:-1] or len(chosen) < 2:
                raise DataError(f"{where}: chosen and rejected must share every turn but the last (the implicit "
                                f"prompt) and hold at least one turn before it")
    if chosen == rejected:
        raise DataError(f"{where}: chosen and rejected are the same; the pair states no preference")
    return kind, explicit


# ----------------------------------------------------------------------------- reading

def _records(path: str) -> list[tuple[Any, str]]:
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except FileNotFoundError:
            raise DataError(f"{path}: no such file") from None
        except Exception as e:  # pyarrow's own error types for a damaged file
            raise DataError(f"{path}: cannot read as Parquet ({e})") from None
        return [({k: v for k, v in r.items() if v is not None}, f"{path}:row {i}") for i, r in enumerate(rows, 1)]
    if not path.endswith((".jsonl", ".json")):
        raise DataError(f"{path}: unknown data file type; expected .jsonl or .parquet")
    return read_jsonl(path)


def check_file(path: str) -> tuple[int, tuple[str, bool]]:
    """Every record of `path` checked; (record count, (kind, explicit prompt))."""
    records = _records(path)
    if not records:
        raise DataError(f"{path}: no records")
    expect = None
    for record, where in records:
        kind = check_pair(record, where, expect)
        expect = expect or kind
    return len(records), expect


def load_preference(path: str):
    """The checked pairs of a JSONL or Parquet file as a datasets.Dataset (DPOTrainer's input)."""
    import datasets

    n, _ = check_file(path)
    builder = "parquet" if path.endswith(".parquet") else "json"
    data = datasets.load_dataset(builder, data_files=os.path.abspath(path), split="train")
    if len(data) != n:
        raise DataError(f"{path}: datasets read {len(data)} records, the check {n}")
    return data


# ----------------------------------------------------------------------------- hard pairs from the chat task

def _wrong_count(n: int, rng: random.Random) -> int:
    swapped = int(str(n)[::-1]) if n >= 10 and str(n)[0] != str(n)[1] and str(n)[1] != "0" else None
    choices = [n + d for d in (-3, -2, -1, 1, 2, 3) if n + d >= 2] + ([swapped] * 3 if swapped else [])
    return rng.choice(choices)


HARD_KINDS = ("count", "item_other", "item_singular")


def hard_pair(messages: list[dict], items: list[str], rng: random.Random, kind: str) -> dict:
    """One conversational pair from a chat record whose last assistant turn is `item=count`:
    prompt = every turn before it; chosen = the reference; rejected = the same format with one part
    wrong: the count (`kind` "count"), another item of the task ("item_other") or the item without
    its final s ("item_singular")."""
    answer = messages[-1]["content"]
    item, count = answer.split("=")
    if kind == "count":
        wrong = f"{item}={_wrong_count(int(count), rng)}"
    elif kind == "item_other":
        wrong = f"{rng.choice([i for i in items if i != item])}={count}"
    elif kind == "item_singular":
        if not item.endswith("s") or len(item) < 2:
            raise ValueError(f"item_singular: {item!r} does not end with an s")
        wrong = f"{item[:-1]}={count}"
    else:
        raise ValueError(f"kind: expected one of {', '.join(HARD_KINDS)}, got {kind!r}")
    return {"prompt": messages[:-1], "chosen": [{"role": "assistant", "content": answer}],
            "rejected": [{"role": "assistant", "content": wrong}]}


def hard_pairs(conversations: list[list[dict]], seed: int, kinds: tuple[str, ...] = HARD_KINDS,
               per_conversation: int = 1) -> list[dict]:
    """Hard pairs (module docstring) from the chat task's conversations: for each conversation,
    `per_conversation` different kinds of wrong reply drawn with `seed` from `kinds` (every kind
    equally likely; "item_singular" only where the item ends with an s), one pair each."""
    unknown = sorted(set(kinds) - set(HARD_KINDS))
    if unknown or not kinds:
        raise ValueError(f"kinds: expected some of {', '.join(HARD_KINDS)}, got {list(kinds)}")
    rng = random.Random(seed)
    items = sorted({m[-1]["content"].split("=")[0] for m in conversations})
    out = []
    for m in conversations:
        usable = [k for k in kinds if k != "item_singular" or m[-1]["content"].split("=")[0].endswith("s")]
        out += [hard_pair(m, items, rng, k) for k in rng.sample(usable, min(per_conversation, len(usable)))]
    return out


def hard_pair_kind(pair: dict) -> str:
    """Which of HARD_KINDS a pair from hard_pair is, read from its two replies."""
    (item, count), (wrong_item, wrong_count) = (p[0]["content"].split("=") for p in (pair["chosen"], pair["rejected"]))
    if item == wrong_item:
        return "count"
    return "item_singular" if wrong_item == item[:-1] else "item_other"


def write_jsonl(path: str, records: list[dict]) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path
