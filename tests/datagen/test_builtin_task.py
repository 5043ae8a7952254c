"""The built-in task's files are what datagen/make_builtin_task.py writes, and its held-out split
holds out what it says."""
import json
import os

from datagen import make_builtin_task as gen
from lomo_ds.config.tasks import BUILTIN_DIR

HELDOUT_DIR = os.path.join(BUILTIN_DIR, "heldout")


def _read(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_builtin_generator_is_reproducible():
    train, val = gen.generate()
    assert train == _read(os.path.join(BUILTIN_DIR, "train.jsonl"))
    assert val == _read(os.path.join(BUILTIN_DIR, "validation.jsonl"))


def _words(records, vocab):
    text = " ".join(r["passage"].lower() for r in records)
    return {w for words in vocab for w in words if w in text}


def test_heldout_files_are_the_generators_output():
    train, validation = gen.generate(vocabs=(gen.SEEN, gen.HELDOUT))
    assert _read(os.path.join(HELDOUT_DIR, "train.jsonl")) == train
    assert _read(os.path.join(HELDOUT_DIR, "validation.jsonl")) == validation


def test_heldout_validation_uses_no_training_vocabulary():
    train = _read(os.path.join(HELDOUT_DIR, "train.jsonl"))
    validation = _read(os.path.join(HELDOUT_DIR, "validation.jsonl"))
    # Every opinion word and item of the validation split is held out, and none occurs in training.
    assert _words(validation, gen.FULL) == set(w for v in gen.HELDOUT for w in v)
    assert not _words(train, gen.HELDOUT)
    for split in (train, validation):
        assert sum(r["label"] for r in split) * 2 == len(split)  # balanced
