"""Every training method on this launch's ranks, through lomo_ds.methods.build_engine: the
interface and memory breakdown, resume (k steps, save, a fresh engine loads, N-k more == N steps
straight), and LoRA+LOMO's adapter gradients with two backward passes. tests/methods/test_baselines.py
declares them as multi-rank checks (tests/ranks.py) and asserts on the figures."""
import os
import tempfile

import torch

from lomo_ds.config.run import LOMO_METHODS, load_run_config
from lomo_ds.methods import METHODS, Engine, build_engine
from lomo_ds.storage import checkpoint
from tests.tiny import engine_sections, global_batch, tiny_llama

BUCKET = 2000  # LOMO reduce-scatter bucket (shard elements)
DS = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 0}}
DS_BASELINE_BUCKET = 5000  # DeepSpeed's own reduce bucket (full-gradient elements); refused for LOMO methods
BASELINE_LR = {"adamw": 1e-3, "sgd": 0.1}


def run_config(method: str, zero_extra: dict | None = None, accumulation: int = 1, **lomo):
    sections = engine_sections({"lr": 0.05 if method == "lomo" else 1e-3, "bucket_size": BUCKET, **lomo})
    # train.lr: the DeepSpeed optimizer's (adamw, sgd), the adapters' (lora, lora_lomo: their default)
    lr = {"lr": BASELINE_LR.get(method, 1e-5)} if method in ("adamw", "sgd") else {}
    train = {**sections.pop("train", {}), "method": method, **lr, "lora": {"warmup_ratio": 0.25}}
    zero = {**DS["zero_optimization"], **(zero_extra or {})}
    if method not in LOMO_METHODS:
        zero["reduce_bucket_size"] = DS_BASELINE_BUCKET
    return load_run_config({**DS, "gradient_accumulation_steps": accumulation, "zero_optimization": zero, **sections,
                            "model": {"path": "tiny-llama-in-memory"}, "train": train}, check_files=False)


def fresh_engine(cfg, total_steps: int, seed: int = 0):
    model = tiny_llama(seed=0, layers=2, hidden=48)  # the same pretrained weights every time
    torch.manual_seed(seed)  # LoRA's adapter initialisation
    return build_engine(cfg, model, total_steps)


def batch_for(step: int, eng) -> dict:
    return global_batch(step, eng.world)[eng.rank]


def interface_and_memory(method: str) -> dict:
    eng = fresh_engine(run_config(method), total_steps=0)
    n_params = sum(p.numel() for p in tiny_llama(seed=0, layers=2, hidden=48).parameters())
    batch = batch_for(0, eng)
    before = eng.full_state_dict()
    loss0 = eng.eval_forward(batch).loss.item()
    eng.enable_memory_tracking()
    steps = [eng.train_step(batch) for _ in range(2)]
    mem = eng.memory_breakdown()
    loss1 = eng.eval_forward(batch).loss.item()
    after = eng.full_state_dict()
    changed = {n: bool((after[n].float() - t.float()).abs().max().item() > 0) for n, t in before.items()} \
        if eng.rank == 0 else {}
    return {"world": eng.world, "device": str(eng.device), "is_engine": isinstance(eng, Engine),
            "supports_resume": eng.supports_resume,
            "loss_before": loss0, "loss_after": loss1,
            "steps": [{k: s[k] for k in ("loss", "lr", "grad_norm", "skipped", "loss_scale")} for s in steps],
            "step_keys": sorted(steps[0]), "global_step": eng.global_step, "memory": mem, "n_params": n_params,
            "changed": changed, "fp32_param_bytes": n_params * 4}


def resume(method: str, root: str, total: int = 4, k: int = 2) -> dict:
    cfg = run_config(method, scheduler={"type": "linear", "warmup_ratio": 0.25})
    barrier = torch.distributed.barrier
    straight = fresh_engine(cfg, total)
    lrs_straight, path = [], None
    for s in range(total):
        if s == k:  # the checkpoint after k steps; the run goes on
            path = checkpoint.save_checkpoint(os.path.join(root, method), straight, {}, keep_last=1, barrier=barrier)
        lrs_straight.append(straight.train_step(batch_for(s, straight))["lr"])
    want = straight.full_state_dict()
    del straight

    second = fresh_engine(cfg, total, seed=1234)  # other adapters: only the checkpoint can make them equal
    checkpoint.load_checkpoint(path, second)
    step_after_load = second.global_step
    lrs_resumed = [second.train_step(batch_for(s, second))["lr"] for s in range(k, total)]
    got = second.full_state_dict()
    diff = max((want[n].float() - got[n].float()).abs().max().item() for n in want) if second.rank == 0 else None
    return {"max_abs_diff": diff, "step_after_load": step_after_load, "lrs_straight": lrs_straight[k:],
            "lrs_resumed": lrs_resumed}


def lora_lomo_two_passes(**lomo) -> dict:
    """One step of LoRA+LOMO with one backward vs two (norm clipping that never binds, and a
    loss scale of 32): the adapters' gradient must be the same. `lomo`: more lomo options."""
    out = {}
    for name, extra in (("one_pass", {}),
                        ("two_passes", {"clip_grad_norm": 1e9, "loss_scale": {"enabled": True,
                                                                               "initial_scale_power": 5}})):
        eng = fresh_engine(run_config("lora_lomo", **lomo, **extra), total_steps=0)
        res = eng.train_step(batch_for(0, eng))
        out[name] = {"lora_grad_norm": res["lora_grad_norm"], "loss_scale": res["loss_scale"],
                     "two_passes": eng.engine.two_passes}
        del eng
    return out


def resume_every_method() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        root = [tmp]
        torch.distributed.broadcast_object_list(root, src=0)  # one directory for all ranks
        out = {m: resume(m, root[0]) for m in METHODS if m != "zero_shot"}
        torch.distributed.barrier()  # every rank is done with the directory before it goes
    return out


def fetch_per_layer() -> dict:
    """Every method under the shipped configs' fetch granularity (each decoder layer gathered
    whole) and persistence (none: every weight partitioned, LoRA's small adapters too): which
    modules DeepSpeed made leaves, and one step that trains."""
    from lomo_ds.runtime import ds_compat
    from tests.engine.dist_engine_checks import PER_LAYER

    out = {}
    for method in METHODS:
        eng = fresh_engine(run_config(method, {**PER_LAYER, "stage3_param_persistence_threshold": 0}), total_steps=0)
        batch = batch_for(0, eng)
        before = eng.eval_forward(batch).loss.item()
        step = eng.train_step(batch)
        out[method] = {"leaf_modules": sorted({type(m).__name__ for m in ds_compat.leaf_modules(eng.module)}),
                       "n_leaves": len(ds_compat.leaf_modules(eng.module)), "loss": step["loss"],
                       "loss_before": before, "loss_after": eng.eval_forward(batch).loss.item()}
        del eng
    return out


def labelled_logits_every_method() -> dict:
    """Every method steps the same from a prompt-masked batch with and without keep_labelled_logits
    (the recipe's trimming): two fresh engines, one step each, the losses and the parameters after."""
    from lomo_ds.runtime.dist import keep_labelled_logits

    out = {}
    for method in METHODS:
        results = []
        for trim in (False, True):
            eng = fresh_engine(run_config(method), total_steps=0)
            batch = batch_for(0, eng)
            batch["labels"][:, :6] = -100  # a prompt: the loss reads only the last 5 positions' targets
            if trim:
                batch = keep_labelled_logits(batch)
            step = eng.train_step(batch)
            results.append((step["loss"], batch.get("logits_to_keep"), eng.full_state_dict()))
            del eng
        (loss_full, _, params_full), (loss_kept, keep, params_kept) = results
        diff = (max(float((params_kept[n].float() - t.float()).abs().max()) for n, t in params_full.items())
                if params_full is not None else None)  # rank 0 holds the gathered parameters
        out[method] = {"loss_full": loss_full, "loss_kept": loss_kept, "logits_to_keep": keep, "max_diff": diff}
    return out


def concatenated(mbs: list[dict]) -> dict:
    return {k: torch.cat([mb[k] for mb in mbs]) for k in mbs[0]}


def accumulation_every_method(windows=(2, 1, 2)) -> dict:
    """Each method with gradient_accumulation_steps 2 (windows of 2, 1 (start_window: an epoch's
    end) and 2 micro-batches of 2 sequences) against the same method without accumulation on the
    window's micro-batches concatenated into one (4, 2, 4 sequences): every sequence has the same
    length and all its labels, so the mean of the micro-batches' means is the concatenated mean.
    LoRA+LOMO's adapters accumulate in .grad; DeepSpeed's optimizers in their own partitions.
    zero_shot ignores the setting."""
    out = {}
    for method in METHODS:
        if method == "zero_shot":
            eng = fresh_engine(run_config(method, accumulation=2), total_steps=0)
            out[method] = {"accumulation_steps": eng.accumulation_steps,
                           "boundary": eng.is_gradient_accumulation_boundary()}
            del eng
            continue
        clip = {"clip_grad_norm": 1.0}
        accumulating = fresh_engine(run_config(method, accumulation=2, **clip), total_steps=len(windows))
        plain = fresh_engine(run_config(method, **clip), total_steps=len(windows))
        start = plain.full_state_dict()
        stepped, counts = [], []
        for step, k in enumerate(windows):
            mbs = [global_batch(10 * step + i, accumulating.world)[accumulating.rank] for i in range(k)]
            if k < accumulating.accumulation_steps:
                accumulating.start_window(k)
            stepped.append([accumulating.train_step(mb)["stepped"] for mb in mbs])
            plain.train_step(concatenated(mbs))
            counts.append(accumulating.global_step)
        a, b = accumulating.full_state_dict(), plain.full_state_dict()
        diff = moved = None
        if accumulating.rank == 0:
            diff = max((a[n].float() - b[n].float()).abs().max().item() for n in a)
            moved = max((b[n].float() - start[n].float()).abs().max().item() for n in b)
        out[method] = {"max_abs_diff": diff, "moved": moved, "stepped": stepped, "global_steps": counts,
                       "accumulation_steps": accumulating.accumulation_steps}
        del accumulating, plain
    return out



def lora_writes_before_gathers() -> dict:
    """LoRA+LOMO writes the adapters' shards after the LOMO step: the gather stream must be ordered
    after those writes. What the adapters' shards hold when the step last orders the gather stream
    (ds_compat.gathers_wait_for_updates, recorded) must be what they hold after the step."""
    from lomo_ds.runtime import ds_compat

    eng = fresh_engine(run_config("lora_lomo"), total_steps=0)
    seen = []
    inner = ds_compat.gathers_wait_for_updates

    def recorded(offload):
        seen.append([ds_compat.shard(p).clone() for p in eng.adapters])
        inner(offload)

    ds_compat.gathers_wait_for_updates = recorded
    try:
        eng.train_step(batch_for(0, eng))
    finally:
        ds_compat.gathers_wait_for_updates = inner
    after = [ds_compat.shard(p) for p in eng.adapters]
    return {"orders": len(seen), "last_order_saw_final_adapters": all(
        torch.equal(a, b) for a, b in zip(seen[-1], after, strict=True)) if seen else False,
        "adapters_moved": any(not torch.equal(a, b) for a, b in zip(seen[0], after, strict=True)) if seen else False}
