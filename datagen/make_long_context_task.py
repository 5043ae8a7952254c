"""Generate lomo_ds/data/builtin/long_context/{train,validation}.jsonl: the long-context demo's task.

    python3 -m datagen.make_long_context_task     # rewrites both files, same bytes every time

Each passage opens with a key ("The code word is falcon."), goes on with about 140 tokens of
unrelated filler sentences, and the question at its end asks whether the code word was a given
word ("Was the code word falcon?"): Yes when it is the opening one, No when it is another word of
the same list. Schema: BoolQ's (passage, question, label: 1 = yes), so the task uses the BoolQ
prompt "{passage} {question}\\n" -> Yes/No.

Why this task: nothing near the question tells the answer; it depends on a token about 150
positions back. Under sequence parallelism (`make demo-long`, 3 ranks) the key and the question sit
in different ranks' slices of the row, so only attention across the split (Ulysses' all-to-all)
can answer it. The filler's sentences are drawn independently of the label, and the asked word of
a No is drawn from the same list as the key, so no word of the question gives the answer away.

No code word is in both splits (the list is cut once by the seed); labels are balanced in each.
Needs nothing beyond the standard library.
"""
from __future__ import annotations

import os
import random

from datagen.splits import write_yes_no_splits

SEED = 20261206
N_TRAIN, N_VALIDATION = 400, 100
FILLER_SENTENCES = 10  # about 140 tokens with the built-in model's tokenizer
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(ROOT, "lomo_ds", "data", "builtin", "long_context")

WORDS = ["falcon", "harbor", "copper", "meadow", "lantern", "violet", "glacier", "pepper", "saddle", "orchid",
         "timber", "canyon", "marble", "walnut", "ember", "quartz", "beacon", "willow", "thistle", "cobalt",
         "ferret", "juniper", "lagoon", "mantle", "nectar", "otter", "pebble", "raven", "sierra", "tundra",
         "velvet", "zephyr", "anchor", "bramble", "cricket", "dynamo", "fossil", "garnet", "hazel", "ivory"]
OPENINGS = ["The code word is {}.", "Remember this code word: {}.", "Today's code word is {}.",
            "Write down the code word {}."]
QUESTIONS = ["Was the code word {}?", "Is the code word {}?", "Was {} the code word?"]
SUBJECTS = ["The train", "A farmer", "The old bridge", "My cousin", "The river", "A small bakery", "The library",
            "Our neighbour", "The committee", "A gull", "The lighthouse", "The market"]
VERBS = ["stood near", "waited by", "looked at", "walked past", "talked about", "painted", "cleaned", "visited",
         "counted", "photographed"]
OBJECTS = ["the hills", "a blue door", "the station", "an empty field", "the harbour wall", "a row of houses",
           "the evening sky", "a wooden fence", "the town square", "a quiet road", "the orchard", "the clock tower"]
TIMES = ["in the morning", "after lunch", "on Sunday", "before the rain", "at dusk", "last winter", "every day",
         "for an hour"]


def filler(rng: random.Random) -> str:
    return " ".join(f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(TIMES)}."
                    for _ in range(FILLER_SENTENCES))


def record(rng: random.Random, words: list[str], label: int) -> dict:
    key = rng.choice(words)
    asked = key if label else rng.choice([w for w in words if w != key])
    passage = f"{rng.choice(OPENINGS).format(key)} {filler(rng)}"
    return {"passage": passage, "question": rng.choice(QUESTIONS).format(asked), "label": label}


def split(rng: random.Random, words: list[str], n: int) -> list[dict]:
    records = [record(rng, words, i % 2) for i in range(n)]
    rng.shuffle(records)
    return records


def generate() -> dict[str, list[dict]]:
    """The splits by name, the same every time."""
    rng = random.Random(SEED)
    words = WORDS[:]
    rng.shuffle(words)
    cut = len(words) * 3 // 4
    return {"train": split(rng, words[:cut], N_TRAIN), "validation": split(rng, words[cut:], N_VALIDATION)}


def main() -> None:
    write_yes_no_splits(OUT_DIR, generate())


if __name__ == "__main__":
    main()
