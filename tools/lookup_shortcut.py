"""The lookup shortcut of the quality benchmark's tasks, and what it scores with no skill at all.

    python3 -m tools.lookup_shortcut            # every task and split: the shortcut's accuracy

Half of each task's "No" questions are lookups: they name a thing the passage does not count (a
word it does not give, a country it does not name). The shortcut answers "No" exactly when the
question names something the passage does not contain, else "Yes". On a balanced split it is right
on every "Yes" and every lookup, wrong on every other "No": about 75%, with no comparison of
numbers, no rhyme and no binding of a region to its country. A fine-tuned model's accuracy is read
against it: at or below 75%, a method may have learned the lookup and nothing of the skill.

The names a question asks about are what fills its generator's template (tools/make_<task>_task.py's
QUESTIONS, so the generator's package must be installed: the `tools` extra, or num2words alone for
numcompare); a name is "in the passage" when the passage contains it as whole words, any case.
"""
from __future__ import annotations

import argparse
import importlib
import os
import re

from lomo_ds.data.loading import read_jsonl
from lomo_ds.data.tasks import BUILTIN_DIR, QUALITY_TASKS

SPLITS = ("train", "validation", "heldout")


def template_pattern(template: str) -> re.Pattern:
    """A question template ('Does "{a}" rhyme with "{b}"?') as a regex capturing what fills each slot."""
    parts = re.split(r"\{\w+\}", template)
    return re.compile("^" + "(.+?)".join(re.escape(p) for p in parts) + "$", re.IGNORECASE)


def names_asked(question: str, patterns: list[re.Pattern]) -> list[str]:
    """What the question names (its template's slots), from the first template it matches."""
    for pattern in patterns:
        m = pattern.match(question.strip())
        if m:
            return list(m.groups())
    raise ValueError(f"question matches none of the task's templates: {question!r}")


def shortcut_answer(passage: str, names: list[str]) -> int:
    """1 ("Yes") when the passage contains every name the question asks about, else 0 ("No")."""
    return int(all(re.search(rf"(?<!\w){re.escape(n)}(?!\w)", passage, re.IGNORECASE) for n in names))


def task_patterns(task: str) -> list[re.Pattern]:
    module = importlib.import_module(f"tools.make_{task}_task")
    return [template_pattern(t if isinstance(t, str) else t[0]) for t in module.QUESTIONS]


def score(task: str, split: str) -> dict:
    """The shortcut on one split: accuracy, and the share of questions it calls lookups."""
    patterns = task_patterns(task)
    records = [r for r, _ in read_jsonl(os.path.join(BUILTIN_DIR, task, f"{split}.jsonl"))]
    answers = [shortcut_answer(r["passage"], names_asked(r["question"], patterns)) for r in records]
    right = sum(a == int(r["label"]) for a, r in zip(answers, records, strict=True))
    return {"n": len(records), "accuracy": 100.0 * right / len(records),
            "lookups": 100.0 * answers.count(0) / len(records)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", default=",".join(QUALITY_TASKS), help="comma list (default: the three)")
    ap.add_argument("--splits", default=",".join(SPLITS), help="comma list (default: train,validation,heldout)")
    a = ap.parse_args(argv)
    print("| task | split | examples | shortcut accuracy | questions it calls lookups |")
    print("|---|---|---|---|---|")
    for task in a.tasks.split(","):
        for split in a.splits.split(","):
            r = score(task, split)
            print(f"| {QUALITY_TASKS[task]} | {split} | {r['n']} | {r['accuracy']:.1f} | {r['lookups']:.1f}% |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
