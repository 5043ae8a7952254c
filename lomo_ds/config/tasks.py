"""The task registry: one entry per task holds everything lomo_ds knows about it, so adding a task
is adding one entry.

A task is classification into candidate answers (the MeZO protocol the LOMO paper follows): its
prompt is followed by an answer word, the loss is on the answer tokens and EOS, and evaluation
scores every candidate by its mean token log-probability. The prompts are MeZO's (Malladi et al.
2023), byte for byte: tests/data/test_data.py pins them.

  SuperGLUE    rte boolq wsc (wsc.fixed) wic multirc copa: from the hub, or local JSONL/Parquet of
               the same schema
  builtin      a small review-sentiment task in BoolQ's schema, shipped in lomo_ds/data/builtin/
  valence      the quality benchmark (experiments/quality.py), BoolQ's schema, shipped in
  spelling     lomo_ds/data/builtin/<name>/ with a third split, heldout.jsonl, that tuning never
  syllables    reads (eval.split: heldout); written by datagen/make_<name>_task.py
  long_context a key near the start of a long passage, asked for at its end (BoolQ's schema;
               lomo_ds/data/builtin/long_context/, datagen/make_long_context_task.py)
  instruction  {"prompt", "response"} records with no candidates: trained on the response, and
               evaluated by the mean token loss on an eval file
  chat         conversations (messages, ShareGPT, Alpaca or prompt/response records: data/chat.py)
               rendered with the tokenizer's chat template, trained on every assistant turn;
               evaluated by the eval loss and optionally by greedy generation
  builtin_chat the chat task on a small synthetic set shipped in lomo_ds/data/builtin/chat/
               (datagen/make_chat_task.py)

This module imports nothing heavy: the run config validates `data.task` against it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

# The shipped task files are package data of lomo_ds.data.
BUILTIN_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "builtin")
SUPERGLUE_HUB = "aps/super_glue"  # super_glue's canonical copy on the hub
YES_NO = ["Yes", "No"]
# The splits a local task folder can hold: {split}.jsonl (or .parquet/.json); "heldout" is the
# quality benchmark's split for reporting chosen recipes (eval.split), never read while tuning.
SPLIT_EXTENSIONS = (".jsonl", ".parquet", ".json")
_STR, _LABEL = (str,), (int, bool)


@dataclass(frozen=True)
class Task:
    name: str
    fields: dict[str, tuple[type, ...]]  # the fields every record must have, with their accepted types
    # record -> the text the answer follows; None for the instruction task, whose records carry
    # their own prompt and response and which has no candidates
    prompt: Callable[[dict], str] | None = None
    candidates: Callable[[dict], list[str]] = lambda r: YES_NO
    answer: Callable[[dict], int] = lambda r: int(r["label"])  # record -> index of the correct candidate
    values: dict[str, tuple] = field(default_factory=dict)  # fields restricted to these values
    hub_config: str | None = None  # the task's configuration of the SuperGLUE hub dataset
    default_source: str | None = None  # where its data comes from when data.source is not set
    title: str = ""  # the name tables print (the paper's spelling)
    conversational: bool = False  # records are conversations (data/chat.py checks them, not `fields`)

    @property
    def has_candidates(self) -> bool:
        return self.prompt is not None


def _yes_when(label: int) -> Callable[[dict], int]:
    """A Yes/No task's answer: "Yes" (index 0) when the record's label is `label`."""
    return lambda r: 0 if int(r["label"]) == label else 1


def _boolq_prompt(r: dict) -> str:
    q = r["question"][:1].upper() + r["question"][1:]
    if not q.endswith("?"):  # SuperGLUE's questions have none; the builtin task's do
        q += "?"
    return f'{r["passage"]} {q}\n'


def _copa_prompt(r: dict) -> str:
    # The choice continues the premise's sentence: "<premise without its full stop> so|because ".
    premise = r["premise"][:-1] if r["premise"].endswith(".") else r["premise"]
    return premise + (" so " if r["question"] == "effect" else " because ")


def _copa_choice(choice: str) -> str:
    # Mid-sentence, the choice's first word is lower-cased, except "I".
    first, sep, rest = choice.partition(" ")
    if first != "I":
        first = first.lower()
    return first + sep + rest


# The quality benchmark's tasks (datagen/make_<name>_task.py): three skills, Yes/No in BoolQ's schema.
QUALITY_TASKS = {"valence": "Valence", "spelling": "Spelling", "syllables": "Syllables"}
_BOOLQ_FIELDS = {"passage": _STR, "question": _STR, "label": _LABEL}
_BINARY = {"label": (0, 1)}

TASKS: dict[str, Task] = {t.name: t for t in (
    Task("builtin", _BOOLQ_FIELDS, _boolq_prompt, answer=_yes_when(1), values=_BINARY, default_source=BUILTIN_DIR,
         title="built-in"),
    *(Task(name, _BOOLQ_FIELDS, _boolq_prompt, answer=_yes_when(1), values=_BINARY,
           default_source=os.path.join(BUILTIN_DIR, name), title=title)
      for name, title in QUALITY_TASKS.items()),
    # The long-context demo's (datagen/make_long_context_task.py): the answer hangs on a key at
    # the start of a long passage, asked for at its end.
    Task("long_context", _BOOLQ_FIELDS, _boolq_prompt, answer=_yes_when(1), values=_BINARY,
         default_source=os.path.join(BUILTIN_DIR, "long_context"), title="long context"),
    Task("rte", {"premise": _STR, "hypothesis": _STR, "label": _LABEL},
         lambda r: f'{r["premise"]}\nDoes this mean that "{r["hypothesis"]}" is true? Yes or No?\n',
         answer=_yes_when(0), values=_BINARY, hub_config="rte", title="RTE"),  # label 0 = entailment
    Task("boolq", _BOOLQ_FIELDS, _boolq_prompt, answer=_yes_when(1), values=_BINARY, hub_config="boolq", title="BoolQ"),
    Task("wsc", {"text": _STR, "span1_text": _STR, "span2_text": _STR, "label": _LABEL},
         lambda r: (f'{r["text"]}\nIn the previous sentence, does the pronoun "{r["span2_text"].lower()}" '
                    f'refer to {r["span1_text"]}? Yes or No?\n'),
         answer=_yes_when(1), values=_BINARY, hub_config="wsc.fixed", title="WSC"),
    Task("wic", {"word": _STR, "sentence1": _STR, "sentence2": _STR, "label": _LABEL},
         lambda r: (f'Does the word "{r["word"]}" have the same meaning in these two sentences? Yes, No?\n'
                    f'{r["sentence1"]}\n{r["sentence2"]}\n'),
         answer=_yes_when(1), values=_BINARY, hub_config="wic", title="WiC"),
    Task("multirc", {"paragraph": _STR, "question": _STR, "answer": _STR, "label": _LABEL},
         lambda r: (f'{r["paragraph"]}\nQuestion: {r["question"]}\nI found this answer "{r["answer"]}". '
                    f'Is that correct? Yes or No?\n'),
         answer=_yes_when(1), values=_BINARY, hub_config="multirc", title="MultiRC"),
    Task("copa", {"premise": _STR, "choice1": _STR, "choice2": _STR, "question": _STR, "label": _LABEL},
         _copa_prompt, candidates=lambda r: [_copa_choice(r["choice1"]), _copa_choice(r["choice2"])],
         values={**_BINARY, "question": ("cause", "effect")}, hub_config="copa", title="COPA"),
    Task("instruction", {"prompt": _STR, "response": _STR}, title="instruction"),
    Task("chat", {}, conversational=True, title="chat"),
    Task("builtin_chat", {}, conversational=True, default_source=os.path.join(BUILTIN_DIR, "chat"),
         title="built-in chat"),
)}
TASK_NAMES = tuple(TASKS)
SUPERGLUE_TASKS = tuple(name for name, t in TASKS.items() if t.hub_config is not None)


def split_file(directory: str, split: str) -> str | None:
    """The file holding `split` ("train", "validation", "heldout") in a local task folder, or None."""
    for ext in SPLIT_EXTENSIONS:
        path = os.path.join(directory, split + ext)
        if os.path.exists(path):
            return path
    return None
