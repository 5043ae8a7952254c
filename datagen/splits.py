"""What the data generators in datagen/ share: drawing a balanced split of unique records, and writing a
split as JSONL the way the package reads it."""
from __future__ import annotations

import json
import os
import random
from operator import itemgetter
from typing import Callable, Hashable

# Words a benchmark has no need for, matched as substrings of a candidate word.
OFFENSIVE = ("fuck", "shit", "bitch", "cunt", "dick", "cock", "pussy", "whore", "slut", "fag", "nigg",
             "rape", "porn", "penis", "vagina", "anal", "tits", "boob", "nazi", "retard", "cum", "sex")


def inoffensive(word: str, blocked: tuple[str, ...] = OFFENSIVE) -> bool:
    return not any(b in word for b in blocked)


def held_out_pool(rng: random.Random, items: list, share: float) -> tuple[list, list]:
    """`items` shuffled by `rng` and cut once: (the rest; the first `share`), each sorted."""
    items = list(items)
    rng.shuffle(items)
    cut = int(len(items) * share)
    return sorted(items[cut:]), sorted(items[:cut])


def three_way_pool(rng: random.Random, items: list, share: float) -> tuple[list, list, list]:
    """`items` cut into (train, validation, heldout) pools by `held_out_pool` twice: heldout takes
    `share` of them, validation `share` of the rest; no item is in two pools."""
    rest, held = held_out_pool(rng, items, share)
    train, validation = held_out_pool(rng, rest, share)
    return train, validation, held


def balanced_unique_split(rng: random.Random, n: int, draw: Callable[[int], dict],
                          key: Callable[[dict], Hashable], seen: set) -> list[dict]:
    """`n` records, half labelled 1 (the extra one 0), each drawn by `draw(label)` until its `key` is
    not in `seen` (shared across the splits, so no record is in two of them), then shuffled."""
    records = []
    for label in [1] * (n // 2) + [0] * (n - n // 2):
        while True:
            record = draw(label)
            if key(record) not in seen:
                seen.add(key(record))
                break
        records.append(record)
    rng.shuffle(records)
    return records


def train_validation_heldout(rng: random.Random, sizes: tuple[int, int, int], pools: tuple,
                             draw_from: Callable[[object], Callable[[int], dict]]) -> dict[str, list[dict]]:
    """The three splits of a Yes/No task whose records are keyed by their passage, each drawn by
    `draw_from(pool)` from its own pool of `pools` (train, validation, heldout: `three_way_pool`'s),
    each balanced, no passage in two of them."""
    seen: set = set()
    return {name: balanced_unique_split(rng, n, draw_from(pool), itemgetter("passage"), seen)
            for name, pool, n in zip(("train", "validation", "heldout"), pools, sizes, strict=True)}


def write_split(out_dir: str, name: str, records: list[dict]) -> str:
    """Write `records` to out_dir/name.jsonl (UTF-8, one JSON object a line) and return the path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return path


def write_yes_no_splits(out_dir: str, splits: dict[str, list[dict]]) -> None:
    """A Yes/No task's splits by name, each with its size and balance printed."""
    for name, records in splits.items():
        path = write_split(out_dir, name, records)
        print(f"{os.path.relpath(path)}: {len(records)} records, {sum(r['label'] for r in records)} yes, "
              f"{os.path.getsize(path)} bytes")
