"""What the multi-rank 8-bit Trainer checks build and measure; tests/integrations/test_int8_trainer.py declares
them and asserts on rank 0's figures.

memory.int8_shards reaches a Trainer user the way every other engine option does: as the `memory`
section of the DeepSpeed config given to TrainingArguments(deepspeed=...). The checks train through
a real Trainer (and TRL's DPOTrainer) on real DeepSpeed ZeRO-3 ranks with that section, then read every
parameter's integers and scales back from the ranks' shards and compare them with

- lomo_ds's own engine, built from the same config (the recipe's path) and fed the micro-batches the
  Trainer's ranks got with the Trainer's learning rates;
- a single-process reference (tests/engine/test_int8_engine.py's kind): the starting weights rounded
  to nearest on the same blocks, then each window: dequantize, the window's loss and global-norm
  clipping in fp32, torch.optim.SGD at the Trainer's learning rate, requantize with the keyed noise
  (train.seed, the step, the parameter's index).

Both are keyed by the Trainer's own seed (TrainingArguments.seed, which the mixin maps onto the
engine's train.seed), never by what the Trainer's engine reports: a Trainer that left the engine
on the default seed would round with other noise and miss them.
"""
from __future__ import annotations

import copy

import torch

import lomo_ds
from lomo_ds.runtime import ds_compat, quant8
from lomo_ds.runtime.device import group_device
from tests.engine.int8_checks import module_gathered as gathered
from tests.integrations import dist_dpo_checks as D
from tests.integrations import dist_hf_checks as H
from tests.tiny import tiny_llama

BLOCK = 16  # a few blocks a parameter, some cut by the shard boundary on 2 ranks
INT8 = {"int8_shards": True, "int8_block": BLOCK}


class Int8Reference:
    """The single-process reference: `model` in fp32, its weights the dequantized 8-bit blocks."""

    def __init__(self, model, seed: int):
        self.model, self.seed = model, seed
        self.q, self.s = {}, {}
        for n, p in model.named_parameters():
            self.q[n], self.s[n] = quant8.quantize(p.detach().reshape(-1), 0, block=BLOCK)  # to nearest
        self.rescaled = 0
        self.opt = torch.optim.SGD(model.parameters(), lr=0.0)  # each window's lr set by step()
        self._load()

    def _load(self) -> None:
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                p.copy_(quant8.dequantize(self.q[n], self.s[n], 0, block=BLOCK).view_as(p))

    def step(self, step: int, loss: torch.Tensor, clip: float, lr: float) -> float:
        """One window: `loss`'s gradient clipped to the global norm, SGD at `lr`, requantized with
        the noise of (seed, step, parameter index). Returns the norm before clipping."""
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip).item()
        self.opt.param_groups[0]["lr"] = lr
        self.opt.step()
        for i, (n, p) in enumerate(self.model.named_parameters()):
            self.q[n], self.s[n], grown = quant8.requantize(p.detach().reshape(-1), self.s[n], 0,
                                                            (self.seed, step, i), block=BLOCK)
            self.rescaled += int(grown)
        self.model.zero_grad()
        self._load()
        return norm


def compare(q: dict, s: dict, rq: dict, rs: dict) -> dict:
    """Integers that differ (of how many), and the largest difference of a block's peak 127 s."""
    if set(q) != set(rq):
        return {"error": f"8-bit parameters {sorted(q)[:3]}... against the reference's {sorted(rq)[:3]}..."}
    return {"ints": sum(int((q[n] != rq[n]).sum()) for n in rq), "elements": sum(rq[n].numel() for n in rq),
            "peak_diff": quant8.QMAX * max((s[n] - rs[n]).abs().max().item() for n in rq)}


class FullLabels(H.Samples):
    """H.Samples with every token a label: every micro-batch of every rank has the same label count."""

    def __getitem__(self, i):
        row = super().__getitem__(i)
        return {"input_ids": row["input_ids"], "labels": row["input_ids"].clone()}


def window_rows(step: int, world: int, k: int) -> slice:
    per = k * world * H.BATCH
    return slice(step * per, (step + 1) * per)


def _engine_run(model, data, world: int, rank: int, clip: float, k: int, chunked: bool, seed: int):
    """The recipe's engine on 8-bit shards: the micro-batches the Trainer's ranks got (micro-step m
    of a window gives rank r the batch m * world + r of the window's rows), its lrs, train.seed
    `seed`. `chunked`: memory.chunked_loss (false: the model's own loss, as the Trainer's
    compute_loss computes it)."""
    cfg = {"train_micro_batch_size_per_gpu": H.BATCH,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "stage3_prefetch_bucket_size": 0},
           "lomo": {"lr": H.LR["lomo"], "optimizer": "sgd"}, "comm": {"bucket_size": 700},
           "memory": {**INT8, "chunked_loss": "auto" if chunked else "off"},
           "train": {"clip_grad_norm": clip, "accumulation_steps": k, "loss_normalization": "tokens", "seed": seed}}
    engine = lomo_ds.initialize(model, cfg)
    engine.schedule = H._ListSchedule(H.trainer_lrs(H.LR["lomo"]))
    rescaled = 0
    for step in range(H.STEPS):
        rows = window_rows(step, world, k)
        for m in range(k):
            start = rows.start + (m * world + rank) * H.BATCH
            rescaled += engine.train_step(H.stacked(data, slice(start, start + H.BATCH))).get("int8_rescaled_blocks", 0)
    return engine, rescaled


def _summed(value: int) -> int:
    total = torch.tensor([value], dtype=torch.int64, device=group_device())
    ds_compat.all_reduce(total, name="rescaled blocks")
    return int(total)


def _saved_vs_shards(folder: str, q: dict, s: dict) -> float:
    """The largest difference between save_model's folder, loaded by from_pretrained, and the
    trained 8-bit shards dequantized (the export is the weights the shards hold)."""
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    return max((p.detach().reshape(-1) - quant8.dequantize(q[n], s[n], 0, block=BLOCK)).abs().max().item()
               for n, p in loaded.named_parameters())


def check_trainer(k: int = H.K, masked: bool = True, chunked: bool = True, seed: int = 0) -> dict:
    """The Trainer (optim="lomo", K = k, warm-up, clipping) with the DeepSpeed config's memory
    section asking for 8-bit shards, against the engine and the reference. `masked`: label masks
    of different lengths (H.Samples), else every token a label (FullLabels); `chunked`: the
    engine's memory.chunked_loss."""
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    clip = H.CLIP[world]
    rows = H.STEPS * k * world * H.BATCH
    data = H.Samples(rows) if masked else FullLabels(rows)
    start = tiny_llama(seed)
    rescaled = []

    class Counting(H.lomo_trainer_class()):
        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            rescaled.append(self._lomo_last.get("int8_rescaled_blocks", 0))
            return loss

    with H.trainer_session():
        args = H.training_args(H._out("int8"), deepspeed=H.ds_config(**INT8), max_grad_norm=clip,
                               gradient_accumulation_steps=k)
        trainer = Counting(model=copy.deepcopy(start), args=args, train_dataset=data)
        trainer.train()
        engine = trainer.lomo_engine
        memory = {"int8_shards": engine.config.memory.int8_shards, "int8_block": engine.config.memory.int8_block}
        converted = len(engine.int8_params)
        tq, ts = gathered(engine.module, world, rank)
        engine_seed = engine.config.train.seed
        logs = [h for h in trainer.state.log_history if "loss" in h]
        saved = H._out("int8_saved")
        trainer.save_model(saved)
    own, own_rescaled = _engine_run(copy.deepcopy(start), data, world, rank, clip, k, chunked, args.seed)
    eq, es = gathered(own.module, world, rank)
    ref = Int8Reference(copy.deepcopy(start), args.seed)
    lrs, norms, losses = H.trainer_lrs(H.LR["lomo"]), [], []
    for step in range(H.STEPS):
        batch = H.stacked(data, window_rows(step, world, k))
        loss = ref.model(**batch, num_items_in_batch=H.label_count(batch)).loss
        losses.append(loss.item())
        norms.append(ref.step(step, loss, clip, lrs[step]))
    moved = sum(int((ref.q[n] != quant8.quantize(p.detach().reshape(-1), 0, block=BLOCK)[0]).sum())
                for n, p in start.named_parameters())
    return {"memory": memory, "converted": converted, "params": len(list(start.parameters())),
            "seed": args.seed, "engine_seed": engine_seed,
            "saved_vs_shards": _saved_vs_shards(saved, tq, ts),
            "vs_engine": compare(tq, ts, eq, es), "vs_reference": compare(tq, ts, ref.q, ref.s), "moved": moved,
            "rescaled": _summed(sum(rescaled)), "engine_rescaled": _summed(own_rescaled),
            "reference_rescaled": ref.rescaled, "loss": [h["loss"] for h in logs], "ref_loss": losses,
            "grad_norm": [h.get("grad_norm") for h in logs], "ref_grad_norm": norms}


def check_dpo() -> dict:
    """LomoDPOTrainer (optim="lomo", precomputed reference log-probs) on 8-bit shards against the
    single-process reference stepping TRL's DPO loss on the micro-batches every rank trained on,
    from the 8-bit start (the reference log-probs are the quantized start's)."""
    from trl.trainer.utils import add_fused_lm_head

    from lomo_ds.data.preference import load_preference
    from lomo_ds.integrations.dpo import LomoDPOTrainer
    from tests.helpers_data import chatml_tokenizer

    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    clip = D.CLIP[world]
    tok = chatml_tokenizer()
    data = load_preference(D.pairs_file(world))
    start = D.tiny_policy(len(tok))
    seen = []

    class Recording(LomoDPOTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            seen.append({k: v.detach().cpu().clone() for k, v in inputs.items()})
            return super().training_step(model, inputs, num_items_in_batch)

    with H.trainer_session():
        args = D.dpo_config(H._out("dpo_int8"), "lomo", clip, deepspeed=H.ds_config(**INT8))
        trainer = D.built_on_every_rank(
            lambda: Recording(model=copy.deepcopy(start), args=args, train_dataset=data, processing_class=tok))
        trainer.train()
        tq, ts = gathered(trainer.lomo_engine.module, world, rank)
        logs = [h for h in trainer.state.log_history if "loss" in h]
        everyone = [None] * world
        torch.distributed.all_gather_object(everyone, seen)
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()  # the reference is a plain module (dist_dpo_checks.check_equivalence)
        model = copy.deepcopy(start)
        add_fused_lm_head(model, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
        model.train()
        ref = Int8Reference(model, args.seed)
        ref_logp_diff = 0.0
        with torch.no_grad():
            for mb in (mb for part in everyone for mb in part):
                c, r = trainer.compute_ref_log_probs(ref.model, mb)
                ref_logp_diff = max(ref_logp_diff, (c - mb["ref_chosen_logps"]).abs().max().item(),
                                    (r - mb["ref_rejected_logps"]).abs().max().item())
        lrs, norms, losses = H.trainer_lrs(D.LR["lomo"]), [], []
        for step in range(D.STEPS):
            mbs = [everyone[r][step * D.K + m] for m in range(D.K) for r in range(world)]
            loss = sum(trainer._compute_loss(ref.model, mb, False) for mb in mbs) / len(mbs)
            losses.append(loss.item())
            norms.append(ref.step(step, loss, clip, lrs[step]))
    moved = sum(int((ref.q[n] != quant8.quantize(p.detach().reshape(-1), 0, block=BLOCK)[0]).sum())
                for n, p in start.named_parameters())
    return {"vs_reference": compare(tq, ts, ref.q, ref.s), "ref_logp_diff": ref_logp_diff, "moved": moved,
            "loss": [h["loss"] for h in logs], "ref_loss": losses,
            "grad_norm": [h.get("grad_norm") for h in logs], "ref_grad_norm": norms}


def check_resume() -> dict:
    """A Trainer run on 8-bit shards stopped after its step-2 checkpoint (the process's state
    dropped) and resumed from it by a fresh Trainer and model, against an uninterrupted run: the
    integers and scales after 4 steps."""
    from transformers import TrainerCallback

    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    data = H.Samples(H.STEPS * H.K * world * H.BATCH)

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 2:
                control.should_training_stop = True

    def run(out_dir, callbacks=(), resume=None):
        with H.trainer_session():
            args = H.training_args(out_dir, deepspeed=H.ds_config(**INT8), max_grad_norm=H.CLIP[world],
                                   save_strategy="steps", save_steps=2)
            trainer = H.lomo_trainer_class()(model=tiny_llama(1), args=args, train_dataset=data,
                                             callbacks=list(callbacks))
            trainer.train(resume_from_checkpoint=resume)
            return gathered(trainer.lomo_engine.module, world, rank)

    whole_q, whole_s = run(H._out("int8_whole"))
    cut_dir = H._out("int8_cut")
    stopped_q, stopped_s = run(cut_dir, callbacks=[StopAt()])
    resumed_q, resumed_s = run(cut_dir, resume=f"{cut_dir}/checkpoint-2")
    return {"resumed_vs_whole": compare(resumed_q, resumed_s, whole_q, whole_s),
            "stopped_vs_whole": compare(stopped_q, stopped_s, whole_q, whole_s)}
