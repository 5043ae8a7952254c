"""The long-context task's files are what datagen/make_long_context_task.py writes: balanced, the
code word in the first sentence and asked for at the end, no code word in both splits."""
import json
import os
import re

from datagen import make_long_context_task as gen


def _read(name):
    with open(os.path.join(gen.OUT_DIR, f"{name}.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _key(record) -> str:
    return re.search(r"\b(" + "|".join(gen.WORDS) + r")\b", record["passage"].split(".")[0]).group(1)


def test_files_are_the_generators_output_and_balanced():
    splits = gen.generate()
    for name, records in splits.items():
        assert records == _read(name)
        assert sum(r["label"] for r in records) * 2 == len(records)


def test_answer_hangs_on_the_opening_key_only():
    splits = gen.generate()
    keys = {name: {_key(r) for r in records} for name, records in splits.items()}
    assert not keys["train"] & keys["validation"]
    for records in splits.values():
        for r in records:
            key = _key(r)
            assert key not in r["passage"].split(".", 1)[1]  # only in the first sentence
            assert (key in r["question"]) == bool(r["label"])
