"""Multi-rank checks of the chat pieces. tests/dist_checks.py runs them; tests/test_chat_dist.py
asserts on the figures.

  export/<method>   every training method trains 2 steps, exports with export_hf (LoRA merged, the
                    tokenizer's chat template beside the weights) and saves the engine's logits on a
                    fixed batch; the test loads the export with transformers and compares (2 ranks)
  packed            a packed batch through the LOMO engine under ZeRO-3 (2 ranks): each example's
                    loss from the packed logits against its loss alone, and a training step on it
  generation        greedy replies spread over 3 ranks under ZeRO-3 (7 prompts: 3/2/2 per rank,
                    replies of different lengths) against the unpartitioned model answering each
                    prompt alone
"""
import os

import torch

from dist_methods_checks import batch_for, fresh_engine, run_config
from helpers_data import chatml_tokenizer
from lomo_ds.evaluation.generation import evaluate_generation, generate_ids
from lomo_ds.methods import METHODS
from lomo_ds.storage.checkpoint import export_hf
from tiny import tiny_llama

PROBE = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38], [2, 71, 82, 81, 82, 84, 59, 4, 5, 23]])


def export_method(method: str, out_dir: str) -> dict:
    steps = 0 if method == "zero_shot" else 2
    eng = fresh_engine(run_config(method), total_steps=max(steps, 1))
    for s in range(steps):
        eng.train_step(batch_for(s, eng))
    export_hf(eng, chatml_tokenizer(), out_dir, torch.distributed.barrier)
    logits = eng.eval_forward({"input_ids": PROBE}).logits
    if eng.rank == 0:
        torch.save({"input_ids": PROBE, "logits": logits}, os.path.join(out_dir, "engine_logits.pt"))
    return {"dir": out_dir, "steps": steps}


def prompts() -> list[dict]:
    g = torch.Generator(device="cpu").manual_seed(5)
    return [{"prompt_ids": torch.randint(3, 90, (n,), generator=g, device="cpu").tolist(), "messages": [],
             "reference": ""} for n in (4, 9, 6, 12, 5, 7, 3)]


def generation(world: int) -> dict:
    import lomo_ds

    full = tiny_llama(21).eval()  # built outside ZeRO-3: this rank's whole copy, the reference
    ps = prompts()
    unstopped = [generate_ids(full, [p["prompt_ids"]], stop_ids=[], pad_id=0, max_new_tokens=8,
                              device=torch.device("cpu"))[0] for p in ps]
    stop = unstopped[0][2]  # prompt 0 stops after 2 tokens; the others when they meet it, or at 8
    reference = [generate_ids(full, [p["prompt_ids"]], stop_ids=[stop], pad_id=0, max_new_tokens=8,
                              device=torch.device("cpu"))[0] for p in ps]
    engine = lomo_ds.initialize(tiny_llama(21), {"train_micro_batch_size_per_gpu": 1,
                                                 "zero_optimization": {"stage": 3,
                                                                       "stage3_param_persistence_threshold": 0},
                                                 "lomo": {"lr": 0.01}})

    class Ids:  # the replies as token-id strings, so they can be compared exactly
        @staticmethod
        def decode(ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    metrics, rows = evaluate_generation(engine.module, ps, Ids, stop_ids=[stop], pad_id=0, max_new_tokens=8,
                                        batch_size=2, rank=engine.rank, world=engine.world, device=engine.device)
    return {"world": engine.world, "metrics": metrics, "replies": None if rows is None else [r["reply"] for r in rows],
            "reference": [" ".join(map(str, r)) for r in reference], "lengths": [len(r) for r in reference]}


def packed_through_the_engine() -> dict:
    import lomo_ds
    from lomo_ds.data.loading import collate
    from lomo_ds.data.packing import collate_packed, pack

    model = tiny_llama(4)
    model.config._attn_implementation = "sdpa"
    engine = lomo_ds.initialize(model, {"train_micro_batch_size_per_gpu": 2, "lomo": {"lr": 0.01},
                                        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    g = torch.Generator(device="cpu").manual_seed(8 + engine.rank)
    examples = []
    for n in (7, 12, 5, 9, 6):
        ids = torch.randint(0, 90, (n,), generator=g, device="cpu").tolist()
        examples.append({"input_ids": ids, "labels": [-100, -100] + ids[2:]})
    rows = pack(examples, max_length=24, seed=engine.rank)
    batch = collate_packed(rows, pad_id=0)

    def loss(logits, labels):
        return torch.nn.functional.cross_entropy(logits[0, :-1].float(), labels[0, 1:], ignore_index=-100).item()

    logits = engine.eval_forward(batch).logits
    packed, alone = [], []
    for r, row in enumerate(rows):
        start = 0
        for n in row["lengths"]:
            packed.append(loss(logits[r:r + 1, start:start + n], batch["labels"][r:r + 1, start:start + n]))
            one = collate([{"input_ids": row["input_ids"][start:start + n], "labels": row["labels"][start:start + n]}], 0)
            alone.append(loss(engine.eval_forward({"input_ids": one["input_ids"]}).logits, one["labels"]))
            start += n
    step = engine.train_step(batch)
    return {"rows": len(rows), "max_diff": max(abs(a - b) for a, b in zip(packed, alone)), "loss": step["loss"]}


def chat_checks(world: int, work_dir: str) -> dict:
    if world == 3:
        return {"generation": lambda: generation(world)}
    return {**{f"export/{m}": (lambda m=m: export_method(m, os.path.join(work_dir, f"export_{m}"))) for m in METHODS},
            "packed": packed_through_the_engine}
