"""Generate lomo_ds/data/builtin/{train,validation}.jsonl: the project's own small task.

    python3 -m datagen.make_builtin_task        # rewrites all four files, same bytes every time

Short product/restaurant reviews; the question asks, in varied words, whether the review is
positive. The rule is lexical and consistent: a review is positive exactly when its opinion words
come from the positive list (a review's opinion words never mix polarities). Schema: BoolQ's
(passage, question, label: 1 = yes), so it uses the BoolQ prompt "{passage} {question}\\n" -> Yes/No.

Why this task: a 135M instruct model answers such Yes/No questions near chance zero-shot (it
mostly prefers one answer word), but the rule is easy to pick up from ~100 steps of batch 8, which
makes a CPU demo show accuracy rising. Sequences stay under ~50 tokens. Labels are balanced in
each split and no passage appears in both splits.

lomo_ds/data/builtin/heldout/{train,validation}.jsonl is the same task with the vocabulary split: the
validation reviews use opinion words and items that never occur in its training reviews, so a model
can only do well on it by learning "positive opinion -> Yes", not the training words. Use it with
`data.source=lomo_ds/data/builtin/heldout` (task `builtin`). No setting was tuned on it.
"""
from __future__ import annotations

import json
import os
import random

SEED = 20240613
N_TRAIN, N_VALIDATION = 400, 200

POSITIVE = ["wonderful", "excellent", "delightful", "fantastic", "great", "superb", "lovely",
            "brilliant", "amazing", "charming", "pleasant", "perfect", "outstanding", "terrific"]
NEGATIVE = ["awful", "terrible", "dreadful", "horrible", "disappointing", "boring", "poor",
            "nasty", "lousy", "dull", "unpleasant", "broken", "mediocre", "miserable"]
ITEMS = ["food", "service", "movie", "hotel room", "book", "phone", "concert", "coffee", "staff",
         "game", "pizza", "camera", "show", "soup", "bed", "music", "tour", "laptop", "bread", "view"]
FILLERS = ["We went on a Friday.", "It was my second visit.", "I went with my sister.",
           "We got there at noon.", "I bought it last week.", "My friend picked it.",
           "It cost about twenty dollars.", "We stayed for two hours.", ""]
TEMPLATES = [
    "The {item} was {adj}.",
    "I found the {item} {adj}.",
    "Honestly, the {item} felt {adj}.",
    "The {item} was {adj} and the {item2} was {adj2}.",
    "What a {adj} {item}!",
    "{filler} The {item} was {adj}.",
    "{filler} The {item} was {adj}, and the {item2} was {adj2}.",
    "Our {item} turned out {adj}. {filler}",
]
# The held-out check's validation vocabulary; its training reviews use the rest of each list.
HELDOUT_POSITIVE = ["superb", "charming", "terrific", "lovely"]
HELDOUT_NEGATIVE = ["dreadful", "lousy", "mediocre", "miserable"]
HELDOUT_ITEMS = ["hotel room", "concert", "soup", "camera", "tour", "bread"]
QUESTIONS = ["Is this review positive?", "Did the reviewer like it?", "Is the reviewer happy?",
             "Was the experience good?", "Is this a positive review?", "Did the writer enjoy it?"]


Vocab = tuple[list[str], list[str], list[str]]  # positive words, negative words, items
FULL: Vocab = (POSITIVE, NEGATIVE, ITEMS)
HELDOUT: Vocab = (HELDOUT_POSITIVE, HELDOUT_NEGATIVE, HELDOUT_ITEMS)
SEEN: Vocab = tuple([w for w in full if w not in held] for full, held in zip(FULL, HELDOUT, strict=True))


def make_passage(rng: random.Random, positive: bool, vocab: Vocab = FULL) -> str:
    words = vocab[0] if positive else vocab[1]
    adj, adj2 = rng.sample(words, 2)
    item, item2 = rng.sample(vocab[2], 2)
    text = rng.choice(TEMPLATES).format(adj=adj, adj2=adj2, item=item, item2=item2, filler=rng.choice(FILLERS))
    text = " ".join(text.split())  # an empty filler leaves a double or edge space
    return text[0].upper() + text[1:]


def generate(seed: int = SEED, n_train: int = N_TRAIN, n_validation: int = N_VALIDATION,
             vocabs: tuple[Vocab, Vocab] = (FULL, FULL)) -> tuple[list, list]:
    """(train, validation) records; `vocabs` is each split's vocabulary."""
    rng = random.Random(seed)
    seen: set[str] = set()
    splits = []
    for n, vocab in zip((n_train, n_validation), vocabs, strict=True):
        records = []
        for label in [1] * (n // 2) + [0] * (n - n // 2):  # balanced labels
            while True:  # a passage is used once across both splits
                passage = make_passage(rng, positive=label == 1, vocab=vocab)
                if passage not in seen:
                    seen.add(passage)
                    break
            records.append({"passage": passage, "question": rng.choice(QUESTIONS), "label": label})
        rng.shuffle(records)
        splits.append(records)
    return splits[0], splits[1]


def write_split(directory: str, name: str, records: list) -> None:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, f"{name}.jsonl"), "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"{directory}/{name}: {len(records)} records, {sum(r['label'] for r in records)} positive")


def main() -> None:
    # The data ships inside the package; this generator does not.
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lomo_ds", "data", "builtin")
    for directory, vocabs in ((here, (FULL, FULL)), (os.path.join(here, "heldout"), (SEEN, HELDOUT))):
        train, validation = generate(vocabs=vocabs)
        write_split(directory, "train", train)
        write_split(directory, "validation", validation)


if __name__ == "__main__":
    main()
