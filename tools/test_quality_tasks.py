"""The quality benchmark's tasks (numcompare, rhyme, countryfacts): the committed files load through
lomo_ds's loading code with the registry's prompt, are balanced, keep the separations their
generators promise, and are what the generators write (where the generators' packages are
installed: num2words comes with the `test` extra; the others, tens of MB of word lists and ISO
data, with the `tools` extra)."""
from __future__ import annotations

import importlib
import json
import os
import re

import pytest

from lomo_ds.config.run import load_run_config
from lomo_ds.data import loading as D
from lomo_ds.data.tasks import BUILTIN_DIR, QUALITY_TASKS, TASKS

SIZES = {"train": 2000, "validation": 500, "heldout": 500}
# The packages each generator imports (tools/make_<name>_task.py).
PACKAGES = {"numcompare": ["num2words"], "rhyme": ["pronouncing", "wordfreq", "english_words"],
            "countryfacts": ["pycountry"]}


def _read(task: str, split: str) -> list[dict]:
    return [r for r, _ in D.read_jsonl(os.path.join(BUILTIN_DIR, task, f"{split}.jsonl"))]


@pytest.mark.parametrize("task", sorted(QUALITY_TASKS))
def test_task_loads_through_the_registry_with_boolq_prompt(task):
    spec = TASKS[task]
    assert spec.default_source == os.path.join(BUILTIN_DIR, task) and spec.title == QUALITY_TASKS[task]
    for eval_split in ("validation", "heldout"):
        cfg = load_run_config({"model": {"path": "x"}, "lomo": {"lr": 0.03}, "data": {"task": task},
                               "eval": {"split": eval_split}})
        train = D.load_split(cfg.data, "train", cfg.eval.split)
        evaluated = D.load_split(cfg.data, "eval", cfg.eval.split)
        assert len(train) == SIZES["train"] and len(evaluated) == SIZES[eval_split]
        assert evaluated == _read(task, eval_split)  # the split asked for, not another one
    r = train[0]
    ex = D.format_example(task, r)
    question = r["question"] if r["question"].endswith("?") else r["question"] + "?"
    assert ex.prompt == f'{r["passage"]} {question[0].upper()}{question[1:]}\n'
    assert ex.candidates == ["Yes", "No"]
    assert [D.format_example(task, x).label for x in train[:50]] == [0 if x["label"] == 1 else 1 for x in train[:50]]


@pytest.mark.parametrize("task", sorted(QUALITY_TASKS))
def test_labels_balanced_in_every_split(task):
    for split, n in SIZES.items():
        records = _read(task, split)
        assert len(records) == n and sum(r["label"] for r in records) * 2 == n, split


def _quoted_words(r: dict, field: str = "passage") -> frozenset:
    return frozenset(re.findall(r'"([a-z]+)"', r[field]))


_COUNTRY_QUESTION = re.compile(r"^(?:Is (?P<r1>.+) (?:in|part of|a region of) (?P<c1>.+)"
                               r"|Does (?P<c2>.+) include (?P<r2>.+))\?$")


def _asked_country(r: dict) -> str:
    m = _COUNTRY_QUESTION.match(r["question"])
    assert m, r["question"]
    return m["c1"] or m["c2"]


def _numcompare_place(r: dict) -> str:
    # Every passage starts with its setting's place ("The school has", "The school ordered"), or says
    # "According to the count, the school has"; the first three words tell the settings apart.
    return " ".join(re.sub(r"^According to the count, ", "", r["passage"]).lower().split(" ")[:3])


# task -> (the item no two splits share, what heldout shares with no other split)
SEPARATIONS = {
    "numcompare": (lambda r: r["passage"], _numcompare_place),
    "rhyme": (_quoted_words, lambda r: _quoted_words(r) | _quoted_words(r, "question")),
    "countryfacts": (lambda r: r["passage"], _asked_country),
}


@pytest.mark.parametrize("task", sorted(QUALITY_TASKS))
def test_splits_share_no_item_and_heldout_shares_no_vocabulary(task):
    item, domain = SEPARATIONS[task]
    splits = {s: _read(task, s) for s in SIZES}
    items = {s: [item(r) for r in recs] for s, recs in splits.items()}
    for s in SIZES:
        assert len(set(items[s])) == len(items[s]), f"{task}/{s}: an item repeats"
    assert not set(items["train"]) & set(items["validation"])
    assert not (set(items["train"]) | set(items["validation"])) & set(items["heldout"])

    def vocabulary(recs):
        out = set()
        for r in recs:
            d = domain(r)
            out |= d if isinstance(d, frozenset) else {d}
        return out

    seen = vocabulary(splits["train"]) | vocabulary(splits["validation"])
    held = vocabulary(splits["heldout"])
    assert held and not seen & held, f"{task}: heldout shares {sorted(seen & held)[:5]}"


@pytest.mark.parametrize("task", sorted(QUALITY_TASKS))
def test_committed_files_are_the_generators_output(task):
    for package in PACKAGES[task]:
        pytest.importorskip(package, reason=f"tools/make_{task}_task.py needs {package}: pip install -e '.[tools]'")
    gen = importlib.import_module(f"tools.make_{task}_task")
    generated = gen.generate()
    assert sorted(generated) == sorted(SIZES)
    for split, records in generated.items():
        with open(os.path.join(BUILTIN_DIR, task, f"{split}.jsonl"), encoding="utf-8") as f:
            assert f.read() == "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), f"{task}/{split}"


def test_rhyme_asks_about_absent_words_in_half_its_no_questions():
    """The lookup half: a "No" question names a word its passage does not in about half the cases
    (a "Yes" question never does), and every question names two words."""
    for split in SIZES:
        recs = _read("rhyme", split)
        absent = {0: [], 1: []}
        for r in recs:
            asked = _quoted_words(r, "question")
            assert len(asked) == 2, r
            absent[r["label"]].append(bool(asked - _quoted_words(r)))
        assert not any(absent[1]), f"rhyme/{split}: a Yes question names a word its passage does not"
        share = sum(absent[0]) / len(absent[0])
        assert 0.4 < share < 0.6, f"rhyme/{split}: {share:.2f} of the No questions are lookups"


@pytest.mark.parametrize("task", sorted(QUALITY_TASKS))
def test_the_lookup_shortcut_scores_half_plus_its_lookups(task):
    """tools/lookup_shortcut.py: every question's names are found from its generator's templates;
    every question it calls a lookup is a "No", and half of the "No"s are lookups, so the rule scores
    50% + the lookups' share (about 75%) with no skill: the line a fine-tuned accuracy is read against."""
    for package in PACKAGES[task]:
        pytest.importorskip(package, reason=f"tools/make_{task}_task.py needs {package}: pip install -e '.[tools]'")
    from tools import lookup_shortcut as L

    patterns = L.task_patterns(task)
    for split in SIZES:
        records = _read(task, split)
        answers = [L.shortcut_answer(r["passage"], L.names_asked(r["question"], patterns)) for r in records]
        assert all(r["label"] == 0 for a, r in zip(answers, records, strict=True) if a == 0), split
        lookups = answers.count(0) / len(records)
        assert 0.2 <= lookups <= 0.3, (split, lookups)
        assert L.score(task, split)["accuracy"] == pytest.approx(100 * (0.5 + lookups)), split
    with pytest.raises(ValueError, match="matches none of the task's templates"):
        L.names_asked("What is the capital of France?", patterns)


def test_the_lookup_shortcut_matches_whole_words():
    from tools import lookup_shortcut as L

    pattern = L.template_pattern('Does "{a}" rhyme with "{b}"?')
    assert L.names_asked('Does "cat" rhyme with "hat"?', [pattern]) == ["cat", "hat"]
    assert L.shortcut_answer('Two words: "cat" and "hat".', ["cat", "hat"]) == 1
    assert L.shortcut_answer('Two words: "category" and "hat".', ["cat", "hat"]) == 0
    assert L.shortcut_answer("The Central African Republic has a prefecture called Ouaka.",
                             ["central african republic", "Ouaka"]) == 1
