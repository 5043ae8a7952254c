"""A run's datasets: load, sample, format and tokenize both splits of its task (data.task), the
conversational ones through chat.py, a mixture of data.sources through mixture.py (formats.py: each
source's records to tokens; streaming.py reads them as a stream instead); the parts are io.py
(reading records), examples.py (records to tokens), packing.py (packing and length-grouped order),
collate.py and order.py (batches and their order), types.py (what they produce).
"""
from __future__ import annotations

from typing import Any

from lomo_ds.config.tasks import TASKS
from lomo_ds.data.chat import build_chat_datasets
from lomo_ds.data.examples import format_example, tokenize_eval_example, tokenize_train_example
from lomo_ds.data.io import load_split, sample_indices
from lomo_ds.data.mixture import build_mixture_datasets
from lomo_ds.data.packing import finish_train_split
from lomo_ds.data.types import Datasets, check_some_left


def build_datasets(run_cfg, tokenizer) -> Datasets:
    """Load, sample, format and tokenize both splits of run_cfg.data.task.

    stats: available/sampled records, examples kept, truncated and rejected counts, per split.
    """
    d, t = run_cfg.data, run_cfg.tokenizer
    if d.sources is not None:
        return build_mixture_datasets(run_cfg, tokenizer)
    if TASKS[d.task].conversational:
        return build_chat_datasets(run_cfg, tokenizer)
    scored = TASKS[d.task].has_candidates  # else records are prompt/response pairs, evaluated by their loss
    stats: dict[str, Any] = {"task": d.task, "eval_split": run_cfg.eval.split}
    out = Datasets(train=[], eval=[], eval_lm=[], stats=stats)
    for split, n_wanted in (("train", d.train_samples), ("eval", d.eval_samples)):
        records = load_split(d, split, run_cfg.eval.split)
        idx = sample_indices(len(records), n_wanted, run_cfg.train.seed)
        truncated = rejected = 0
        for i in idx:
            r = records[i]
            if split == "train" or not scored:
                ex = format_example(d.task, r) if scored else r
                tok = tokenize_train_example(ex, tokenizer, t.max_length, t.overlong)
                if tok is None:
                    rejected += 1
                    continue
                truncated += tok["truncated"] > 0
                (out.train if split == "train" else out.eval_lm).append(tok)
            else:
                ev, dropped = tokenize_eval_example(format_example(d.task, r), tokenizer, t.max_length, t.overlong)
                if ev is None:
                    rejected += 1
                    continue
                truncated += dropped > 0
                out.eval.append(ev)
        stats[f"{split}_available"] = len(records)
        stats[f"{split}_sampled"] = len(idx)
        stats[f"{split}_truncated"] = truncated
        stats[f"{split}_rejected"] = rejected
    stats["train_size"] = len(out.train)
    stats["eval_size"] = len(out.eval) + len(out.eval_lm)
    check_some_left(out, run_cfg, stats["train_rejected"], stats["train_sampled"])
    if not scored:  # instruction records: packed or grouped by length like conversations
        finish_train_split(out, run_cfg)
    return out
