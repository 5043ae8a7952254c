"""Generate lomo_ds/data/builtin/spelling/{train,validation,heldout}.jsonl: is a word spelled right?

    python3 -m datagen.make_spelling_task        # rewrites all three files, same bytes every time

Each passage quotes one word from someone's writing ('In his essay, Tom wrote "accomodate".'); the
question asks, in varied words, whether it is spelled correctly ("Is that spelled correctly?").
Schema: BoolQ's (passage, question, label: 1 = yes), so it uses the BoolQ prompt
"{passage} {question}\\n" -> Yes/No. Half the words are English words as the dictionary spells
them, half are one of them with one typical slip: two neighbouring letters swapped, a double
letter made single or a single one doubled, or one vowel replaced by another. A slip counts only if
what it makes is no word of the `web2` word list (package `english-words`) and not among the
English words of the package `wordfreq`, so every "No" is a misspelling and nothing else.

Why this task: a skill of spelling (knowing a word's letters), unlike the other two (the meaning of
a word, and the language of a word list). The answer is the quoted word alone: no question can be
answered by noticing that it names something the passage lacks (the shortcut the first
benchmark's tasks had), and the frame (who, where) is drawn independently of the label. The words
are of middling frequency (wordfreq's Zipf 3 to 4.5: "harvest", "immune", "lobster"), long enough
(6 to 11 letters) that a slip leaves a plausible string.

No word is in two splits: the vocabulary is cut once, by the seed, 25% to heldout, then 25% of the
rest to validation and the remainder to train; a split's misspellings are made from its own words.
Labels are balanced in every split.

Generated with english-words 2.0.2 and wordfreq 3.1.1 (the `datagen` extra: pip install -e
'.[datagen]'); other versions of their word lists would change the bytes.
"""
from __future__ import annotations

import os
import random
import re

import wordfreq
from english_words import get_english_words_set

from datagen.splits import inoffensive, three_way_pool, train_validation_heldout, write_yes_no_splits

SEED = 20261203
N_TRAIN, N_VALIDATION, N_HELDOUT = 2000, 500, 500
HELDOUT_SHARE = 0.25
MIN_ZIPF, MAX_ZIPF = 3.0, 4.5
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(ROOT, "lomo_ds", "data", "builtin", "spelling")
VOWELS = "aeiou"

PEOPLE = ["Tom", "Maria", "a student", "my neighbour", "the intern", "Aisha", "a journalist", "Ken",
          "the new clerk", "Lena", "one applicant", "Raj", "a child", "the editor"]
PLACES = ["an essay", "a text message", "a shopping list", "the report", "a cover letter", "an email",
          "the minutes", "a birthday card", "a job advert", "the school newsletter", "a blog post"]
PASSAGES = [
    'In {place}, {person} wrote "{word}".',
    '{Person} typed the word "{word}" in {place}.',
    'One word in {place} by {person}: "{word}".',
    '{Person} used "{word}" in {place}.',
]
QUESTIONS = ["Is that spelled correctly?", "Is the word spelled right?", "Is that the correct spelling?",
             "Was the word spelled without a mistake?", "Is the spelling correct?"]


def known_words() -> set[str]:
    """Every spelling that counts as a word: web2's entries (any case) and wordfreq's English words."""
    words = {w.lower() for w in get_english_words_set(["web2"], lower=False, alpha=True)}
    return words | set(wordfreq.iter_wordlist("en"))


def vocabulary() -> list[str]:
    """The words shown spelled right and the ones slips are made from, in frequency order."""
    dictionary = get_english_words_set(["web2"], lower=False, alpha=True)  # names are capitalised there
    return [w for w in wordfreq.iter_wordlist("en")
            if re.fullmatch(r"[a-z]{6,11}", w) and w in dictionary and inoffensive(w)
            and MIN_ZIPF <= wordfreq.zipf_frequency(w, "en") <= MAX_ZIPF]


def slips(word: str) -> list[str]:
    """Every misspelling of `word` by one typical slip (first letter kept)."""
    out = set()
    for i in range(1, len(word) - 1):  # two neighbouring letters swapped
        if word[i] != word[i + 1]:
            out.add(word[:i] + word[i + 1] + word[i] + word[i + 2:])
    for i in range(1, len(word)):
        if word[i] == word[i - 1]:  # a double letter made single
            out.add(word[:i] + word[i + 1:])
        elif word[i] not in VOWELS and word[i - 1] in VOWELS:  # a single consonant doubled
            out.add(word[:i] + word[i] + word[i:])
        if word[i] in VOWELS:  # a vowel replaced by another
            out.update(word[:i] + v + word[i + 1:] for v in VOWELS if v != word[i])
    return sorted(out)


def make_record(rng: random.Random, label: int, words: list[str], known: set[str]) -> dict:
    while True:
        word = rng.choice(words)
        if label:
            break
        candidates = [s for s in slips(word) if s not in known]
        if candidates:
            word = rng.choice(candidates)
            break
    person = rng.choice(PEOPLE)
    passage = rng.choice(PASSAGES).format(place=rng.choice(PLACES), person=person,
                                          Person=person[0].upper() + person[1:], word=word)
    return {"passage": passage, "question": rng.choice(QUESTIONS), "label": label}


def generate(seed: int = SEED) -> dict[str, list]:
    rng = random.Random(seed)
    known = known_words()
    return train_validation_heldout(rng, (N_TRAIN, N_VALIDATION, N_HELDOUT),
                                    three_way_pool(rng, vocabulary(), HELDOUT_SHARE),
                                    lambda pool: lambda label: make_record(rng, label, pool, known))


if __name__ == "__main__":
    write_yes_no_splits(OUT_DIR, generate())
