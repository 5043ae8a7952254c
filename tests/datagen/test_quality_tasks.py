"""The quality benchmark's tasks (valence, spelling, syllables): the committed files load through
lomo_ds's loading code with the registry's prompt, are balanced, ask about words no other split
has, carry no answer outside the quoted word (no frame word and no word length decides them), are
labelled by their source's rule, and are what the generators write (the generators' word lists,
tens of MB, come with the `datagen` extra; the tests that need them skip without it)."""
from __future__ import annotations

import importlib
import json
import os
import re
from collections import Counter, defaultdict

import pytest

import datagen
from lomo_ds.config.run import load_run_config
from lomo_ds.config.tasks import BUILTIN_DIR, QUALITY_TASKS, TASKS
from lomo_ds.data.examples import format_example
from lomo_ds.data.io import load_split, read_jsonl

SIZES = {"train": 2000, "validation": 500, "heldout": 500}
# The packages each generator imports (datagen/make_<name>_task.py).
PACKAGES = {"valence": ["vaderSentiment", "wordfreq"], "spelling": ["english_words", "wordfreq"],
            "syllables": ["pronouncing", "wordfreq", "english_words"]}
# A rule that reads no skill scores about 50% on a balanced split; this is how far above it noise may
# take one on 500 examples (2.7 standard errors) before the rule counts as a shortcut.
SHORTCUT_LIMIT = 0.56


def _read(task: str, split: str) -> list[dict]:
    return [r for r, _ in read_jsonl(os.path.join(BUILTIN_DIR, task, f"{split}.jsonl"))]


def _word(r: dict) -> str:
    """The quoted word a record asks about (every passage quotes exactly one)."""
    quoted = re.findall(r'"([^"]+)"', r["passage"])
    assert len(quoted) == 1, r
    return quoted[0]


def _frame_words(r: dict) -> set[str]:
    """Every word of the record but the one it asks about: who, where, and the question's wording."""
    return set(re.findall(r"[A-Za-z']+", r["passage"].replace(f'"{_word(r)}"', " ") + " " + r["question"]))


def _importorskip(task: str) -> None:
    for package in PACKAGES[task]:
        pytest.importorskip(package, reason=f"datagen/make_{task}_task.py needs {package}: pip install -e '.[datagen]'")


def test_the_registry_lists_every_generated_task():
    assert sorted(QUALITY_TASKS) == sorted(PACKAGES)
    assert {n[len("make_"):-len("_task.py")] for n in os.listdir(os.path.dirname(datagen.__file__))
            if n.startswith("make_") and n.endswith("_task.py")} == set(PACKAGES) | {"builtin", "chat", "long_context"}


@pytest.mark.parametrize("task", sorted(QUALITY_TASKS))
def test_task_loads_through_the_registry_with_boolq_prompt(task):
    spec = TASKS[task]
    assert spec.default_source == os.path.join(BUILTIN_DIR, task) and spec.title == QUALITY_TASKS[task]
    for eval_split in ("validation", "heldout"):
        cfg = load_run_config({"model": {"path": "x"}, "lomo": {"lr": 0.03}, "data": {"task": task},
                               "eval": {"split": eval_split}})
        train = load_split(cfg.data, "train", cfg.eval.split)
        evaluated = load_split(cfg.data, "eval", cfg.eval.split)
        assert len(train) == SIZES["train"] and len(evaluated) == SIZES[eval_split]
        assert evaluated == _read(task, eval_split)  # the split asked for, not another one
    r = train[0]
    ex = format_example(task, r)
    assert ex.prompt == f'{r["passage"]} {r["question"]}\n'
    assert ex.candidates == ["Yes", "No"]
    assert [format_example(task, x).label for x in train[:50]] == [0 if x["label"] == 1 else 1 for x in train[:50]]


@pytest.mark.parametrize("task", sorted(QUALITY_TASKS))
def test_labels_balanced_and_no_word_in_two_splits(task):
    words = {}
    for split, n in SIZES.items():
        records = _read(task, split)
        assert len(records) == n and sum(r["label"] for r in records) * 2 == n, split
        assert len({r["passage"] for r in records}) == n, f"{task}/{split}: a passage repeats"
        words[split] = {_word(r) for r in records}
    for a, b in (("train", "validation"), ("train", "heldout"), ("validation", "heldout")):
        assert not words[a] & words[b], f"{task}: {a} and {b} share {sorted(words[a] & words[b])[:5]}"


def _best_rule(train: list[dict], features) -> tuple[object, int]:
    """The single feature value f and answer a ("Yes" exactly when f is present, or exactly when it is
    absent) that scores best on `train`: the strongest one-feature shortcut the split offers."""
    counts = defaultdict(Counter)
    for r in train:
        for f in features(r):
            counts[f][r["label"]] += 1
    n_yes = sum(r["label"] for r in train)

    def train_accuracy(f, yes_when_present):
        c = counts[f]
        right_present = c[1] if yes_when_present else c[0]
        right_absent = (len(train) - n_yes - c[0]) if yes_when_present else (n_yes - c[1])
        return right_present + right_absent
    return max(((f, a) for f in counts for a in (1, 0)), key=lambda fa: train_accuracy(*fa))


def _rule_accuracy(records: list[dict], features, rule) -> float:
    f, yes_when_present = rule
    return sum(int((f in features(r)) == bool(yes_when_present)) == r["label"] for r in records) / len(records)


@pytest.mark.parametrize("task", sorted(QUALITY_TASKS))
@pytest.mark.parametrize("feature", ["frame word", "word length"])
def test_nothing_but_the_quoted_word_answers(task, feature):
    """The frame around the word (who, where, the question's wording) and the word's length are drawn
    independently of the label: the best one-feature rule learned on train scores at chance on the
    evaluated splits."""
    features = _frame_words if feature == "frame word" else (lambda r: {len(_word(r))})
    rule = _best_rule(_read(task, "train"), features)
    for split in ("validation", "heldout"):
        accuracy = _rule_accuracy(_read(task, split), features, rule)
        assert accuracy <= SHORTCUT_LIMIT, f"{task}/{split}: '{rule[0]}' alone scores {accuracy:.1%}"


def test_the_shortcut_rule_finds_a_planted_shortcut():
    """The rule above is not blind: a frame word planted on every "Yes" is found and scores 100%."""
    train = [dict(r, question=r["question"] + (" Really?" if r["label"] else "")) for r in _read("valence", "train")]
    rule = _best_rule(train, _frame_words)
    assert rule == ("Really", 1) and _rule_accuracy(train, _frame_words, rule) == 1.0


@pytest.mark.parametrize("task", sorted(QUALITY_TASKS))
def test_labels_follow_the_sources_rule(task):
    _importorskip(task)
    gen = importlib.import_module(f"datagen.make_{task}_task")
    if task == "valence":
        truth = gen.lexicon()
    elif task == "syllables":
        truth = gen.vocabulary()
    else:  # a word spelled right is a dictionary word; a "No" is a slip of one that is no word at all
        known = gen.known_words()
        vocabulary = gen.vocabulary()
        slipped = set().union(*map(gen.slips, vocabulary)) - known
        truth = {**{w: 0 for w in slipped}, **{w: 1 for w in vocabulary}}
    for split in SIZES:
        for r in _read(task, split):
            assert truth[_word(r)] == r["label"], (split, r)


def test_spelling_slips_are_the_documented_ones():
    _importorskip("spelling")  # the generator imports its word lists (the datagen extra) at the top
    from datagen.make_spelling_task import slips

    got = set(slips("letter"))
    assert {"lteter", "leter", "lettre", "lettar", "litter"} <= got  # swap, undouble, swap, vowel, vowel
    assert "etter" not in got and "letter" not in got and all(s[0] == "l" for s in got)


@pytest.mark.parametrize("task", sorted(QUALITY_TASKS))
def test_committed_files_are_the_generators_output(task):
    _importorskip(task)
    gen = importlib.import_module(f"datagen.make_{task}_task")
    generated = gen.generate()
    assert sorted(generated) == sorted(SIZES)
    for split, records in generated.items():
        with open(os.path.join(BUILTIN_DIR, task, f"{split}.jsonl"), encoding="utf-8") as f:
            assert f.read() == "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), f"{task}/{split}"
