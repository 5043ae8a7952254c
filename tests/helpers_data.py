"""Shared helpers for the data/evaluation/run-config tests: tokenizers trained locally in
milliseconds (nothing is downloaded) and hand-written SuperGLUE-schema records."""
from __future__ import annotations

import functools
import json
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

CORPUS = [
    "The cat sat on the mat. Does this mean that the cat is happy? Yes or No?",
    "The weather was lovely so we went out because it was sunny.",
    "In the previous sentence, does the pronoun refer to the dog? Yes or No?",
    "Does the word have the same meaning in these two sentences? Yes, No?",
    "Question: what did I find? I found this answer. Is that correct? Yes or No?",
    "The review was great. Is this review positive? No it was terrible.",
] * 4


@functools.lru_cache(maxsize=None)
def byte_bpe_tokenizer(bos: bool = False) -> PreTrainedTokenizerFast:
    """A byte-level BPE (GPT-2 / SmolLM style: spaces belong to the following word).
    With bos=True it prepends <s> like LLaMA's tokenizer does."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


# One hand-written record per task, in SuperGLUE's schema, and the exact prompt MeZO builds from it.
RECORDS = {
    "rte": ({"premise": "The cat sat on the mat.", "hypothesis": "A cat is sitting", "label": 0},
            'The cat sat on the mat.\nDoes this mean that "A cat is sitting" is true? Yes or No?\n', ["Yes", "No"], 0),
    "boolq": ({"passage": "Paris is the capital of France.", "question": "is paris in france", "label": 1},
              "Paris is the capital of France. Is paris in france?\n", ["Yes", "No"], 0),
    "wsc": ({"text": "Mark told Pete he was late.", "span1_text": "Pete", "span2_text": "He", "label": 0},
            'Mark told Pete he was late.\nIn the previous sentence, does the pronoun "he" refer to Pete? Yes or No?\n',
            ["Yes", "No"], 1),
    "wic": ({"word": "bank", "sentence1": "He sat on the bank.", "sentence2": "The bank was closed.", "label": 0},
            'Does the word "bank" have the same meaning in these two sentences? Yes, No?\n'
            "He sat on the bank.\nThe bank was closed.\n", ["Yes", "No"], 1),
    "multirc": ({"paragraph": "Ann has two dogs.", "question": "How many dogs?", "answer": "Two", "label": 1},
                'Ann has two dogs.\nQuestion: How many dogs?\nI found this answer "Two". Is that correct? Yes or No?\n',
                ["Yes", "No"], 0),
    "copa": ({"premise": "The man broke his toe.", "choice1": "He dropped a hammer on his foot.",
              "choice2": "I got a hole in my sock.", "question": "cause", "label": 0},
             "The man broke his toe because ", ["he dropped a hammer on his foot.", "I got a hole in my sock."], 0),
}


def write_jsonl(path: str, records: list) -> str:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def boolq_records(n: int, prefix: str = "p") -> list[dict]:
    return [{"passage": f"{prefix} passage {i}.", "question": f"is it {i}", "label": i % 2} for i in range(n)]


# ChatML, as SmolLM2's and Qwen's templates write it (with SmolLM2's default system message).
CHATML = ("{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<|im_start|>system\nYou help."
          "<|im_end|>\n{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chatml_tokenizer(template: bool = True) -> PreTrainedTokenizerFast:
    """byte_bpe_tokenizer with ChatML's special tokens, and (template=True) the template itself."""
    import copy

    tok = copy.deepcopy(byte_bpe_tokenizer())
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML if template else None
    return tok


def conversation(*turns: str, system: str | None = None) -> dict:
    """{"messages": [...]} alternating user/assistant contents, with an optional system message."""
    msgs = [{"role": "system", "content": system}] if system else []
    msgs += [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(turns)]
    return {"messages": msgs}
