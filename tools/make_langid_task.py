"""Generate lomo_ds/data/builtin/langid/{train,validation,heldout}.jsonl: which language are these words?

    python3 -m tools.make_langid_task        # rewrites all three files, same bytes every time

Each passage lists three words of one language ('The words are "ventana", "perro" and "siempre".');
the question names a language and asks whether the words are in it ("Are these words Spanish?").
The asked language and the words' language always come from the same family, so the "No" answers
are about close languages: Spanish, Portuguese, Italian, Catalan, French and Romanian; Swedish,
Danish, Norwegian, Dutch and German. Schema: BoolQ's (passage, question, label: 1 = yes), so it
uses the BoolQ prompt "{passage} {question}\\n" -> Yes/No. The words are frequent words of each
language from the package `wordfreq`.

Why this task: a skill of recognising a language from its words, unlike the other two (word
valence, and spelling). Every question is answered by the words alone: no question can be answered
by noticing that it names something the passage lacks (the shortcut the first benchmark's tasks
had). A word counts only if it is in no other listed language's frequent words and not a frequent
English word, so no single word is in two languages' lists; what is left to tell, say, Spanish from
Portuguese is the language's spelling and vocabulary, which the model partly knows from
pre-training.

No word is in two splits: each language's vocabulary is cut once, by the seed, 25% to heldout, then
25% of the rest to validation and the remainder to train, so both evaluated splits ask only about
words the model was never trained on. Labels are balanced in every split; every language is
asked about equally often in each label.

Generated with wordfreq 3.1.1 (the `tools` extra: pip install -e '.[tools]'); another version of
its word lists would change the bytes.
"""
from __future__ import annotations

import os
import random
import re

import wordfreq

from tools.splits import three_way_pool, train_validation_heldout, write_yes_no_splits

SEED = 20261201
N_TRAIN, N_VALIDATION, N_HELDOUT = 2000, 500, 500
HELDOUT_SHARE = 0.25
WORDS_PER_PASSAGE = 3
FIRST_RANK, LAST_RANK = 300, 6000  # skip the shortest function words; keep words the model has seen
EXCLUSION_DEPTH = 30000  # a word in another language's (or English's) top-N list is ambiguous
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(ROOT, "lomo_ds", "data", "builtin", "langid")

FAMILIES = [
    {"es": "Spanish", "pt": "Portuguese", "it": "Italian", "ca": "Catalan", "fr": "French", "ro": "Romanian"},
    {"sv": "Swedish", "da": "Danish", "nb": "Norwegian", "nl": "Dutch", "de": "German"},
]
PASSAGES = [
    'The words are "{a}", "{b}" and "{c}".',
    'A list of words: "{a}", "{b}", "{c}".',
    'Someone wrote down three words: "{a}", "{b}" and "{c}".',
    'Three words from a text: "{a}", "{b}", "{c}".',
]
QUESTIONS = ["Are these words {language}?", "Are these {language} words?", "Are the words in {language}?",
             "Is this list in {language}?"]


def vocabularies() -> dict[str, list[str]]:
    """language code -> its usable words, in frequency order (see the module docstring)."""
    codes = [code for family in FAMILIES for code in family]
    deep = {code: set(wordfreq.top_n_list(code, EXCLUSION_DEPTH)) for code in codes + ["en"]}
    out = {}
    for code in codes:
        others = set().union(*(deep[c] for c in deep if c != code))
        out[code] = [w for w in wordfreq.top_n_list(code, LAST_RANK)[FIRST_RANK:]
                     if re.fullmatch(r"[^\W\d_]{4,14}", w) and w not in others]
    return out


def make_record(rng: random.Random, label: int, words: dict[str, list[str]]) -> dict:
    family = rng.choice(FAMILIES)
    asked = rng.choice(sorted(family))
    shown = asked if label else rng.choice(sorted(c for c in family if c != asked))
    a, b, c = rng.sample(words[shown], WORDS_PER_PASSAGE)
    return {"passage": rng.choice(PASSAGES).format(a=a, b=b, c=c),
            "question": rng.choice(QUESTIONS).format(language=family[asked]), "label": label}


def generate(seed: int = SEED) -> dict[str, list]:
    rng = random.Random(seed)
    train, validation, held = {}, {}, {}
    for code, words in vocabularies().items():
        train[code], validation[code], held[code] = three_way_pool(rng, words, HELDOUT_SHARE)
    return train_validation_heldout(rng, (N_TRAIN, N_VALIDATION, N_HELDOUT), train, held,
                                    lambda pool: lambda label: make_record(rng, label, pool), validation)


if __name__ == "__main__":
    write_yes_no_splits(OUT_DIR, generate())
