"""Resident memory of streaming a large JSONL file through the training data path (data.streaming).

Writes a JSONL file of text records (about --size-mb MB, in a temporary folder), then reads it
through lomo_ds.data.streaming.StreamedBatches, the path a streamed run takes (datasets' streaming
mode, the shuffle buffer, tokenization, packing on the fly, the cut into every rank's micro-batches),
until the whole file has been read once (or --batches global micro-batches). Prints the resident
size's high-water mark above the resident size before streaming (the kernel's VmHWM, reset through
/proc/self/clear_refs), with the libraries a training rank has loaded already imported (torch,
transformers), importing `datasets` included (a fixed cost, also shown apart): what loading the data
costs, against the file's size.

    python -m benchmarks.stream_memory --size-mb 1024          # the 1 GB check: growth under 200 MB
    python -m benchmarks.stream_memory --size-mb 64 --json
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

from benchmarks.common import status_kib

WORDS = ("the cat sat on a mat while weather was lovely so we went out because it sunny review "
         "great terrible question answer found correct sentence meaning word pronoun refer dog").split()


def write_text_jsonl(path: str, size_mb: float, seed: int = 0) -> int:
    """A JSONL file of about `size_mb` MB of {"text"} records of 100-400 words; its record count."""
    import numpy as np

    rng = np.random.default_rng(seed)
    target, written, n = size_mb * 2**20, 0, 0
    with open(path, "w") as f:
        while written < target:
            # A block of records at once: Python's per-word work would dominate the benchmark.
            lengths = rng.integers(100, 400, size=256)
            words = rng.integers(0, len(WORDS), size=int(lengths.sum()))
            start = 0
            lines = []
            for k in lengths:
                lines.append(json.dumps({"text": " ".join(WORDS[w] for w in words[start:start + k]) + "."}) + "\n")
                start += k
            block = "".join(lines)
            f.write(block)
            written += len(block)
            n += len(lines)
    return n


def tokenizer():
    """A byte-level BPE trained on WORDS in milliseconds (nothing is downloaded)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([" ".join(WORDS)] * 8, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")




def stream_file(path: str, records: int, batches: int | None = None, world: int = 2, micro: int = 4,
                max_length: int = 512, packing: bool = True, shuffle_buffer: int = 10_000) -> dict:
    """Stream `path` (`records` records) through StreamedBatches until it has been read once (or
    `batches` global micro-batches): the resident growth in MB, and what was read."""
    import torch  # noqa: F401  a training rank's libraries, imported before the baseline: they are not the data's
    import transformers  # noqa: F401

    from lomo_ds.config.run import load_run_config
    from lomo_ds.data.streaming import StreamedBatches

    cfg = load_run_config({
        "train_micro_batch_size_per_gpu": micro, "model": {"path": "unused"}, "lomo": {"lr": 0.01},
        "tokenizer": {"max_length": max_length}, "train": {"max_steps": 1},
        "data": {"sources": [{"path": path, "format": "text"}], "streaming": True, "packing": packing,
                 "shuffle_buffer": shuffle_buffer}})
    tok = tokenizer()
    stream = StreamedBatches(cfg, tok, world)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    base = status_kib("VmRSS")
    import datasets  # noqa: F401  counted, but apart: a fixed cost, whatever the file
    imported = status_kib("VmRSS")
    t0 = time.perf_counter()
    n_batches = tokens = 0
    for batch in stream.global_micro_batches():
        n_batches += 1
        tokens += sum(len(r["input_ids"]) for r in batch)
        if (batches is not None and n_batches >= batches) or stream.encoders[0].stats["read"] >= records:
            break
    seconds = time.perf_counter() - t0
    return {"file_mb": round(os.path.getsize(path) / 2**20, 1), "records": records,
            "records_read": stream.encoders[0].stats["read"], "global_micro_batches": n_batches, "tokens": tokens,
            "rss_before_mb": round(base / 1024, 1), "rss_growth_mb": round((status_kib("VmHWM") - base) / 1024, 1),
            "of_which_import_datasets_mb": round((imported - base) / 1024, 1),
            "seconds": round(seconds, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=float, default=1024)
    ap.add_argument("--batches", type=int, default=None, help="stop after this many global micro-batches")
    ap.add_argument("--limit-mb", type=float, default=200, help="exit 1 when the growth is above this")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "corpus.jsonl")
        t0 = time.perf_counter()
        records = write_text_jsonl(path, args.size_mb)
        write_s = time.perf_counter() - t0
        r = stream_file(path, records, args.batches)
    r["write_seconds"] = round(write_s, 1)
    if args.json:
        print(json.dumps(r))
    else:
        print(f"streamed {r['records_read']:,} of {r['records']:,} records ({r['file_mb']} MB file, "
              f"{r['global_micro_batches']:,} global micro-batches, {r['tokens']:,} tokens) in {r['seconds']} s: "
              f"resident memory grew {r['rss_growth_mb']} MB above {r['rss_before_mb']} MB, of which "
              f"{r['of_which_import_datasets_mb']} MB importing datasets (limit {args.limit_mb:g} MB)")
    return 0 if r["rss_growth_mb"] <= args.limit_mb else 1


if __name__ == "__main__":
    sys.exit(main())
