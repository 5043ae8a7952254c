"""Generate lomo_ds/data/builtin/valence/{train,validation,heldout}.jsonl: is a word meant well?

    python3 -m datagen.make_valence_task        # rewrites all three files, same bytes every time

Each passage reports one word someone used about something ('In her review of the hotel, Maria
used the word "dreary".'); the question asks, in varied words, whether the word speaks well of it
("Was that a compliment?"). Schema: BoolQ's (passage, question, label: 1 = yes), so it uses the
BoolQ prompt "{passage} {question}\\n" -> Yes/No. The words and their labels are the sentiment
lexicon of the package `vaderSentiment` (7,500 entries rated by 10 people each from -4 to +4):
"Yes" for a mean rating from +1 to under +2, "No" from -1 to over -2: mild words only.

Why this task: a skill of word meaning (is this word good or bad?), unlike the other two (the
language of a word list, and spelling). The answer is the word's sense alone: no question can be
answered by noticing that it names something the passage lacks (the shortcut the first
benchmark's tasks had), and the frame around the word (who, about what) carries no signal, as it
is drawn independently of the label. The built-in task's reviews use 28 strong opinion words; this
one uses over a thousand, nouns and verbs as well as adjectives, all of them mild ("sincere",
"hesitation", "burdens": the strongest words, rated 2 or more from neutral, left DeepSpeed AdamW too
little room: 94.0% on validation at lr 3e-5 after 100 steps, and its best lr on the grid is
higher), and the evaluated splits' words are never seen in training, so only what the model knows
of a word's sense answers them.

Kept only: lower-case alphabetic words of 3 to 14 letters with 1 <= |mean| < 2 whose raters mostly
agreed (standard deviation under 1.2), that are among the 50,000 most frequent English words of the
package `wordfreq` (the model has seen them), and none of a short list of slurs and obscenities.

No word is in two splits: the vocabulary is cut once, by the seed, 25% to heldout, then 25% of the
rest to validation and the remainder to train, so both evaluated splits ask only about words the
model was never trained on. Labels are balanced in every split.

Generated with vaderSentiment 3.3.2 and wordfreq 3.1.1 (the `datagen` extra: pip install -e
'.[datagen]'); other versions of the lexicon or word list would change the bytes.
"""
from __future__ import annotations

import os
import random
import re

import vaderSentiment
import wordfreq

from datagen.splits import OFFENSIVE, inoffensive, three_way_pool, train_validation_heldout, write_yes_no_splits

SEED = 20261202
N_TRAIN, N_VALIDATION, N_HELDOUT = 2000, 500, 500
HELDOUT_SHARE = 0.25
MIN_ABS_MEAN, MAX_ABS_MEAN, MAX_STD = 1.0, 2.0, 1.2
TOP_N = 50000
LEXICON = os.path.join(os.path.dirname(vaderSentiment.__file__), "vader_lexicon.txt")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(ROOT, "lomo_ds", "data", "builtin", "valence")
# The lexicon rates insults and swearing too: these go as well as the shared list.
BLOCKED = OFFENSIVE + ("bastard", "twat", "wank", "piss", "douche", "jerk", "damn", "hell")

PEOPLE = ["Maria", "a customer", "the critic", "my neighbour", "Tom", "a teacher", "the manager", "Aisha",
          "a visitor", "the author", "Ken", "one student", "a guest", "Lena", "the coach", "Raj"]
THINGS = ["the hotel", "the new film", "the meal", "the plan", "the concert", "her colleague", "the book",
          "the city", "the game", "the shop", "the speech", "the garden", "the app", "the lesson",
          "the team", "the trip", "the car", "the show", "the museum", "the report"]
PASSAGES = [
    'Asked about {thing}, {person} used the word "{word}".',
    'In a review of {thing}, {person} wrote "{word}".',
    '{Person} summed up {thing} in one word: "{word}".',
    'The word {person} chose for {thing} was "{word}".',
]
QUESTIONS = ["Was that a compliment?", "Is that praise?", "Did it speak well of it?",
             "Was the word meant positively?", "Was it said approvingly?"]


def lexicon() -> dict[str, int]:
    """word -> 1 (positive) or 0 (negative), for the usable words (see the module docstring)."""
    frequent = set(wordfreq.top_n_list("en", TOP_N))
    words = {}
    with open(LEXICON, encoding="utf-8") as f:
        for line in f:
            word, mean, std, _ = line.rstrip("\n").split("\t")
            mean, std = float(mean), float(std)
            if (re.fullmatch(r"[a-z]{3,14}", word) and word in frequent and MIN_ABS_MEAN <= abs(mean) < MAX_ABS_MEAN
                    and std < MAX_STD and inoffensive(word, BLOCKED)):
                words[word] = int(mean > 0)
    return words


def make_record(rng: random.Random, label: int, words: dict[int, list[str]]) -> dict:
    person = rng.choice(PEOPLE)
    passage = rng.choice(PASSAGES).format(thing=rng.choice(THINGS), person=person,
                                          Person=person[0].upper() + person[1:], word=rng.choice(words[label]))
    return {"passage": passage, "question": rng.choice(QUESTIONS), "label": label}


def generate(seed: int = SEED) -> dict[str, list]:
    rng = random.Random(seed)
    labelled = lexicon()
    pools = [{lab: [w for w in part if labelled[w] == lab] for lab in (0, 1)}
             for part in three_way_pool(rng, labelled, HELDOUT_SHARE)]
    return train_validation_heldout(rng, (N_TRAIN, N_VALIDATION, N_HELDOUT), pools,
                                    lambda pool: lambda label: make_record(rng, label, pool))


if __name__ == "__main__":
    write_yes_no_splits(OUT_DIR, generate())
