"""What the multi-rank Trainer / SFTTrainer checks build and measure; tests/integrations/test_hf_trainer.py
declares them (tests/ranks.py runs them in one launch per world size) and asserts on rank 0's figures.

The references are single-process: torch.optim.SGD (or the reference AdaLomo) stepping once per
window on the window's whole global batch (K micro-batches of every rank), with the Trainer's
loss (every label token of the window weighs the same: the token sum over num_items_in_batch),
its global-norm clipping, and its learning-rate schedule (transformers.get_scheduler on the
reference's optimizer); and lomo_ds's own engine (train.loss_normalization "tokens") fed the same
micro-batches with the same learning rates.
"""
from __future__ import annotations

import contextlib
import copy
import os

import torch

import lomo_ds
from tests.adalomo_reference import ReferenceAdaLomo
from tests.engine.dist_engine_checks import max_diff
from tests.ranks import ROOT
from tests.tiny import VOCAB, engine_sections, tiny_llama

SEQ = 11
BATCH = 2  # per_device_train_batch_size
K = 2  # gradient_accumulation_steps
STEPS = 4
WARMUP = 2
LR = {"lomo": 0.05, "adalomo": 0.01}
# The reference's pre-clip global norms are 1.73-1.94 on 1 rank and 1.30-1.39 on 2 (the window's batch
# doubles): these clip some steps and not others (the test asserts that they do).
CLIP = {1: 1.9, 2: 1.35}
# TrainingArguments.seed of every check: it is the engine's train.seed (the key of its rounding
# noise), so an engine built beside a Trainer as its reference is given the same.
SEED = 0


class Samples(torch.utils.data.Dataset):
    """Fixed-length token rows with label masks of different lengths (so micro-batches and ranks
    carry different label counts); row i is the same on every rank."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(500 + i)
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        labels = ids.clone()
        labels[: (3 * i) % 9] = -100
        return {"input_ids": ids, "labels": labels}


def ds_config(**lomo) -> dict:
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                  "stage3_prefetch_bucket_size": 0},
            **engine_sections({"bucket_size": 700, **lomo})}


def TrainingArgumentsFor(**kw):  # noqa: N802 (a class, imported late)
    from transformers import TrainingArguments

    return TrainingArguments(**kw)


def training_args(out_dir: str, optim: str = "lomo", **kw):
    from transformers import TrainingArguments

    base = dict(output_dir=out_dir, optim=optim, deepspeed=ds_config(), learning_rate=LR[optim],
                per_device_train_batch_size=BATCH, gradient_accumulation_steps=K, max_steps=STEPS,
                lr_scheduler_type="linear", warmup_steps=WARMUP, max_grad_norm=1.0, logging_steps=1,
                report_to=[], save_strategy="no", seed=SEED, train_sampling_strategy="sequential",
                disable_tqdm=True)
    return TrainingArguments(**{**base, **kw})


@contextlib.contextmanager
def trainer_session():
    """Leave no DeepSpeed config registered with transformers (from_pretrained would load under
    zero.Init) and no accelerate state behind for the launch's other checks."""
    try:
        yield
    finally:
        from accelerate.state import AcceleratorState
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
        AcceleratorState._reset_state()


def lomo_trainer_class(base=None):
    from transformers import Trainer

    from lomo_ds.integrations.transformers import LomoTrainerMixin

    return type("LomoTrainer", (LomoTrainerMixin, base or Trainer), {})


def window_rows(window: int, world: int) -> slice:
    per = K * world * BATCH
    return slice(window * per, (window + 1) * per)


def stacked(data: Samples, rows: slice) -> dict:
    items = [data[i] for i in range(rows.start, rows.stop)]
    return {k: torch.stack([it[k] for it in items]) for k in items[0]}


def label_count(batch) -> int:
    return int((batch["labels"][..., 1:] != -100).sum())


def trainer_lrs(lr: float) -> list[float]:
    """The Trainer's learning rate of each step: its scheduler on a plain optimizer."""
    from transformers import get_scheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = get_scheduler("linear", opt, num_warmup_steps=WARMUP, num_training_steps=STEPS)
    lrs = []
    for _ in range(STEPS):
        lrs.append(sched.get_last_lr()[0])
        opt.step(), sched.step()
    return lrs


def reference_run(ref, data: Samples, world: int, optim: str, clip: float | None) -> tuple[list, list]:
    """Single process: one step per window on its whole global batch, token-mean loss."""
    lrs = trainer_lrs(LR[optim])
    opt = (torch.optim.SGD(ref.parameters(), lr=LR[optim]) if optim == "lomo"
           else ReferenceAdaLomo(ref.parameters(), lr=LR[optim]))
    losses, norms = [], []
    for step in range(STEPS):
        batch = stacked(data, window_rows(step, world))
        ref.zero_grad()
        loss = ref(**batch, num_items_in_batch=label_count(batch)).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip if clip else float("inf")).item()
        if optim == "lomo":
            for group in opt.param_groups:
                group["lr"] = lrs[step]
        else:
            opt.lr = lrs[step]
        opt.step()
        losses.append(loss.item()), norms.append(norm)
    return losses, norms


class _ListSchedule:
    def __init__(self, lrs):
        self.lrs = lrs

    def lr_at(self, step):
        return self.lrs[step]


def engine_run(model, data: Samples, optim: str, clip: float | None):
    """lomo_ds's engine (loss_normalization tokens) on the micro-batches the Trainer's ranks get:
    micro-step m of a window gives rank r the batch m * world + r of the window's rows."""
    cfg = {"train_micro_batch_size_per_gpu": BATCH,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "stage3_prefetch_bucket_size": 0},
           "lomo": {"lr": LR[optim], "optimizer": "sgd" if optim == "lomo" else "adalomo"},
           "comm": {"bucket_size": 700},
           "train": {"clip_grad_norm": clip, "accumulation_steps": K, "loss_normalization": "tokens",
                     "seed": SEED}}
    engine = lomo_ds.initialize(model, cfg)
    engine.schedule = _ListSchedule(trainer_lrs(LR[optim]))
    world, rank = engine.world, engine.rank
    for step in range(STEPS):
        rows = window_rows(step, world)
        for m in range(K):
            start = rows.start + (m * world + rank) * BATCH
            engine.train_step(stacked(data, slice(start, start + BATCH)))
    return engine


def full_params(trainer) -> dict | None:
    return trainer.lomo_engine.full_state_dict()


def diff(a: dict | None, b: dict | None) -> float | None:
    if a is None or b is None:
        return None
    return max((a[k] - b[k]).abs().max().item() for k in a)


def check_equivalence(optim: str = "lomo", seed: int = 0, **kw) -> dict:
    """The Trainer with the mixin against the single-process reference and lomo_ds's engine; `kw`:
    more TrainingArguments."""
    world = torch.distributed.get_world_size()
    clip = CLIP[world]
    data = Samples(STEPS * K * world * BATCH)
    ref = tiny_llama(seed)
    with trainer_session():
        args = training_args(_out("equivalence"), optim=optim, max_grad_norm=clip or 0.0, **kw)
        trainer = lomo_trainer_class()(model=copy.deepcopy(ref), args=args, train_dataset=data)
        trainer.train()
        trained = full_params(trainer)
        logs = [h for h in trainer.state.log_history if "loss" in h]
        engine_kind = type(trainer.model_wrapped).__name__
        engine_seed = trainer.lomo_engine.config.train.seed
    engine = engine_run(tiny_llama(seed), data, optim, clip)
    by_engine = engine.full_state_dict()
    ref_losses, ref_norms = reference_run(ref, data, world, optim, clip)
    reference = {n: p.detach() for n, p in ref.named_parameters()} if trained is not None else None
    return {"max_abs_diff": diff(trained, reference), "engine_vs_trainer": diff(trained, by_engine),
            "loss": [h["loss"] for h in logs], "ref_loss": ref_losses,
            "grad_norm": [h.get("grad_norm") for h in logs], "ref_grad_norm": ref_norms,
            "lr": [h["learning_rate"] for h in logs], "ref_lr": trainer_lrs(LR[optim]),
            "wrapped": engine_kind, "use_cpu": args.use_cpu, "device": str(args.device),
            "seed": args.seed, "engine_seed": engine_seed}


CHAT = os.path.join(ROOT, "lomo_ds", "data", "builtin", "chat", "train.jsonl")


def check_sft(world_rows: int = 8) -> dict:
    """TRL's SFTTrainer with the mixin, through its own loss path (the fused LM head's log-probs),
    on the built-in chat data: every micro-batch each rank trained on is recorded, and a
    single-process SGD reference steps once per window on all of them with the token-mean loss."""
    import datasets
    from transformers import LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    from tests.helpers_data import chatml_tokenizer
    from tests.tiny import tiny_llama_config

    world = torch.distributed.get_world_size()
    tok = chatml_tokenizer()
    data = datasets.load_dataset("json", data_files=CHAT, split="train").select(range(world_rows * world * K))
    torch.manual_seed(3)
    ref = LlamaForCausalLM(tiny_llama_config(vocab=len(tok)))
    seen = []

    class Recording(lomo_trainer_class(SFTTrainer)):
        def training_step(self, model, inputs, num_items_in_batch=None):
            seen.append({k: inputs[k].detach().cpu().clone() for k in ("input_ids", "attention_mask", "labels")})
            return super().training_step(model, inputs, num_items_in_batch)

    with trainer_session():
        args = SFTConfig(output_dir=_out("sft"), optim="lomo", deepspeed=ds_config(), learning_rate=LR["lomo"],
                         per_device_train_batch_size=BATCH, gradient_accumulation_steps=K, max_steps=STEPS,
                         lr_scheduler_type="linear", warmup_steps=WARMUP, max_grad_norm=1.0, logging_steps=1,
                         report_to=[], save_strategy="no", seed=SEED, max_length=128, disable_tqdm=True,
                         dataset_num_proc=None, bf16=False)
        trainer = Recording(model=copy.deepcopy(ref), args=args, train_dataset=data, processing_class=tok)
        trainer.train()
        trained = full_params(trainer)
        logs = [h for h in trainer.state.log_history if "loss" in h]
    everyone = [None] * world
    torch.distributed.all_gather_object(everyone, seen)
    if trained is None:
        return None
    lrs = trainer_lrs(LR["lomo"])
    opt = torch.optim.SGD(ref.parameters(), lr=LR["lomo"])
    ref_losses, ref_norms, counts = [], [], []
    for step in range(STEPS):
        mbs = [everyone[r][step * K + m] for m in range(K) for r in range(world)]
        n = sum(label_count(mb) for mb in mbs)
        counts.append([label_count(mb) for mb in mbs])
        ref.zero_grad()
        loss = sum(ref(**mb, num_items_in_batch=n).loss for mb in mbs)
        loss.backward()
        ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0).item())
        opt.param_groups[0]["lr"] = lrs[step]
        opt.step()
        ref_losses.append(loss.item())
    reference = {n: p.detach() for n, p in ref.named_parameters()}
    return {"max_abs_diff": diff(trained, reference), "loss": [h["loss"] for h in logs], "ref_loss": ref_losses,
            "grad_norm": [h.get("grad_norm") for h in logs], "ref_grad_norm": ref_norms, "label_counts": counts,
            "token_accuracy": [h.get("mean_token_accuracy") for h in logs]}


def check_resume(optim: str = "adalomo") -> dict:
    """A run stopped right after its checkpoint at step 2 (as if killed: the process's state is
    dropped) and resumed from it by a fresh Trainer and model ends with the parameters of an
    uninterrupted run; that run's save_model() folder loads with from_pretrained."""
    from transformers import AutoModelForCausalLM, TrainerCallback

    world = torch.distributed.get_world_size()
    data = Samples(STEPS * K * world * BATCH)

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 2:
                control.should_training_stop = True

    def run(out_dir, callbacks=(), resume=None):
        with trainer_session():
            args = training_args(out_dir, optim=optim, max_grad_norm=CLIP[world], save_strategy="steps",
                                 save_steps=2, train_sampling_strategy="random")
            trainer = lomo_trainer_class()(model=tiny_llama(1), args=args, train_dataset=data,
                                           callbacks=list(callbacks))
            trainer.train(resume_from_checkpoint=resume)
            return trainer, full_params(trainer)

    whole_dir, cut_dir = _out("resume_whole"), _out("resume_cut")
    trainer, whole = run(whole_dir)
    saved = os.path.join(whole_dir, "final")
    trainer.save_model(saved)
    stopper, stopped = run(cut_dir, callbacks=[StopAt()])
    checkpoint = os.path.join(cut_dir, "checkpoint-2")
    files = sorted(os.listdir(checkpoint))
    # (save_on_each_node's check resumes from the files as written)
    _as_old_trainer_state(stopper.lomo_engine, checkpoint)
    _, resumed = run(cut_dir, resume=checkpoint)
    if whole is None:
        return None
    loaded = AutoModelForCausalLM.from_pretrained(saved)
    return {"resumed_vs_whole": diff(resumed, whole), "stopped_vs_whole": diff(stopped, whole),
            "from_pretrained_vs_trained": diff({n: p.detach() for n, p in loaded.named_parameters()}, whole),
            "checkpoint_files": files}


def check_jit_checkpoint(optim: str = "adalomo") -> dict:
    """enable_jit_checkpoint: SIGTERM to rank 1 alone, at the start of a micro-batch that is not the
    window's first (a moment transformers' own JIT checkpoint would save at, mid-window); the ranks
    agree at the step's end, the Trainer saves that step's checkpoint, and train() exits 75. A fresh
    Trainer resumed from it ends with the uninterrupted run's parameters."""
    import signal

    from transformers import TrainerCallback

    from lomo_ds.runtime.preemption import PREEMPTED_EXIT, read_marker

    world = torch.distributed.get_world_size()
    data = Samples(STEPS * K * world * BATCH)

    class SignalMidWindow(TrainerCallback):
        def on_substep_end(self, args, state, control, **kw):  # a window's micro-batch that is not its last
            if state.global_step == 1 and torch.distributed.get_rank() == 1:
                os.kill(os.getpid(), signal.SIGTERM)

    def run(out_dir, callbacks=(), resume=None, jit=False):
        with trainer_session():
            args = training_args(out_dir, optim=optim, max_grad_norm=CLIP[world], save_strategy="no",
                                 train_sampling_strategy="random", enable_jit_checkpoint=jit)
            trainer = lomo_trainer_class()(model=tiny_llama(1), args=args, train_dataset=data,
                                           callbacks=list(callbacks))
            try:
                trainer.train(resume_from_checkpoint=resume)
                code = 0
            except SystemExit as e:
                code = e.code
            return code, full_params(trainer)

    whole_dir, cut_dir = _out("jit_whole"), _out("jit_cut")
    _, whole = run(whole_dir)
    code, _ = run(cut_dir, callbacks=[SignalMidWindow()], jit=True)
    saved = sorted(d for d in os.listdir(cut_dir) if d.startswith("checkpoint-"))
    marker = read_marker(cut_dir)
    resumed_code, resumed = run(cut_dir, resume=os.path.join(cut_dir, saved[-1]) if saved else None)
    return {"code": code, "expected_code": PREEMPTED_EXIT, "checkpoints": saved, "resumed_code": resumed_code,
            "resumed_vs_whole": diff(resumed, whole), "marker": marker, "cut_dir": cut_dir}


def _as_old_trainer_state(engine, checkpoint: str) -> None:
    """Turn the checkpoint's engine state into what the Trainer integration wrote before it shared
    the recipe's: `lomo_rank_NNNNN.pt` on each rank, the engine's state alone. Such a checkpoint
    must still resume (on the rank count that wrote it)."""
    import shutil

    from lomo_ds.methods.base import OLD_TRAINER_STATE
    from lomo_ds.methods.lomo import load_engine_state
    from lomo_ds.runtime.dist import io_barrier
    from lomo_ds.storage.engine_state import state_dir

    state = load_engine_state(engine, checkpoint)
    torch.save(state, os.path.join(checkpoint, OLD_TRAINER_STATE.format(torch.distributed.get_rank())))
    io_barrier(60.0)
    if torch.distributed.get_rank() == 0:
        shutil.rmtree(state_dir(checkpoint))
    io_barrier(60.0)


def check_save_on_each_node(optim: str = "adalomo") -> dict:
    """Nodes that share no storage, one rank each, on one machine: every rank is its node's first
    (LOCAL_RANK 0, from which the Trainer's should_save follows under save_on_each_node) and trains
    into an output folder of its own. Each folder must hold a whole checkpoint: the model loads from
    it with from_pretrained, and each rank resumes from its own folder alone."""
    from transformers import AutoModelForCausalLM

    from lomo_ds.integrations import transformers as lomo_transformers
    from lomo_ds.runtime.dist import io_barrier

    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    data = Samples(STEPS * K * world * BATCH)
    base = _out("each_node")
    saved_env, saved_timeout = os.environ.get("LOCAL_RANK"), lomo_transformers.IO_TIMEOUT_S
    # A rank whose save fails leaves the others waiting in io_barrier: under a minute's timeout they
    # fail too, and the launch goes on. Its gloo group is made here, by every rank at the same call.
    lomo_transformers.IO_TIMEOUT_S = 60.0
    io_barrier(60.0)
    os.environ["LOCAL_RANK"] = "0"

    def run(out_dir, resume=None):
        with trainer_session():
            args = training_args(out_dir, optim=optim, max_grad_norm=CLIP[world], save_strategy="steps",
                                 save_steps=2, save_on_each_node=True, train_sampling_strategy="random")
            trainer = lomo_trainer_class()(model=tiny_llama(1), args=args, train_dataset=data)
            trainer.train(resume_from_checkpoint=resume)
            return args.should_save, full_params(trainer)

    error = should_save = whole = files = loaded = resumed = None
    try:
        mine = os.path.join(base, f"node{rank}")
        should_save, whole = run(mine)
        files = sorted(os.listdir(os.path.join(mine, "checkpoint-2")))
        loaded = AutoModelForCausalLM.from_pretrained(os.path.join(mine, f"checkpoint-{STEPS}"))
        loaded = {n: p.detach() for n, p in loaded.named_parameters()}
        _, resumed = run(os.path.join(base, f"resumed{rank}"), resume=os.path.join(mine, "checkpoint-2"))
    except Exception as e:  # noqa: BLE001 (only rank 0's figures are kept: every rank's error is raised there)
        error = f"rank {rank}: {type(e).__name__}: {e}"
    finally:
        lomo_transformers.IO_TIMEOUT_S = saved_timeout
        if saved_env is None:
            os.environ.pop("LOCAL_RANK", None)
        else:
            os.environ["LOCAL_RANK"] = saved_env
    every = [None] * world
    torch.distributed.all_gather_object(every, (error, should_save, files, loaded))
    if any(e[0] for e in every):
        raise RuntimeError("; ".join(e[0] for e in every if e[0]))
    if whole is None:
        return None
    return {"should_save": [e[1] for e in every], "checkpoint_files": [e[2] for e in every],
            "from_pretrained_vs_trained": [diff(e[3], whole) for e in every], "resumed_vs_whole": diff(resumed, whole)}


def check_trackers() -> dict:
    """report_to TensorBoard and W&B (offline): what each wrote, read back from its files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    world = torch.distributed.get_world_size()
    data = Samples(STEPS * K * world * BATCH)
    out = _out("trackers")
    os.environ.update(WANDB_MODE="offline", WANDB_DIR=out, WANDB_SILENT="true",
                      TENSORBOARD_LOGGING_DIR=os.path.join(out, "tb"))
    with trainer_session():
        args = training_args(out, max_grad_norm=CLIP[world], report_to=["tensorboard", "wandb"],
                             run_name="lomo-trackers")
        trainer = lomo_trainer_class()(model=tiny_llama(2), args=args, train_dataset=data)
        trainer.train()
        logs = [h for h in trainer.state.log_history if "loss" in h]
    if torch.distributed.get_rank() != 0:
        return None
    import wandb

    wandb.finish()  # the Trainer leaves the run open; finishing it flushes its file
    tb = {}
    for root, _, names in os.walk(os.path.join(out, "tb")):
        if any(n.startswith("events.") for n in names):
            acc = EventAccumulator(root)
            acc.Reload()
            tb = {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    return {"trainer": {k: [h.get(k) for h in logs] for k in ("loss", "learning_rate", "grad_norm")},
            "tensorboard": {k: tb.get(f"train/{k}") for k in ("loss", "learning_rate", "grad_norm")},
            "wandb": wandb_history(out)}


def wandb_records(path: str):
    """The protobuf records of a W&B run file (run-*.wandb): a 7-byte header (":W&B", magic,
    version), then LevelDB's log format: 32 KiB blocks of chunks, each a 7-byte header (crc32,
    little-endian length, type: 1 full, 2 first, 3 middle, 4 last) and its payload."""
    import struct

    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        raw = f.read()
    assert raw[:4] == b":W&B", path
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        if kind == 0 and length == 0:
            break
        pending += raw[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_history(root: str, wait_s: float = 60.0) -> dict:
    """The train/* series an offline W&B run wrote, read back from its run file once the run's
    exit record is in it (W&B's service process writes the file after wandb.finish returns)."""
    import glob
    import json
    import time

    (path,) = glob.glob(os.path.join(root, "wandb", "offline-run-*", "run-*.wandb"))
    deadline = time.monotonic() + wait_s
    while True:
        records = list(wandb_records(path))
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    series: dict[str, list] = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                if key in ("train/loss", "train/learning_rate", "train/grad_norm"):
                    series.setdefault(key.split("/", 1)[1], []).append(json.loads(item.value_json))
    return series


def _out(name: str) -> str:
    """An empty folder of this launch (collective)."""
    import shutil

    from tests.ranks import work_dir

    path = os.path.join(work_dir(), f"hf_{name}")
    if torch.distributed.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
    torch.distributed.barrier()
    return path


__all__ = ["check_equivalence", "max_diff"]


class SequenceSamples(Samples):
    """Samples with rows of SEQ + 1 positions: divisible by 2 SP ranks."""

    def __getitem__(self, i):
        row = super().__getitem__(i)
        g = torch.Generator().manual_seed(900 + i)
        extra = torch.randint(0, VOCAB, (1,), generator=g)
        return {"input_ids": torch.cat([row["input_ids"], extra]), "labels": torch.cat([row["labels"], extra])}


def check_sequence_parallel(optim: str = "lomo", seed: int = 0) -> dict:
    """parallelism_config(sp_size=2, sp_backend="deepspeed") on 2 ranks: one data-parallel replica
    whose every window is K of the loader's batches (DeepSpeed's adapter hands each SP rank its
    slice of one rank's batch in turn), against the single-process reference on those whole rows."""
    from accelerate.parallelism_config import ParallelismConfig

    from tests.engine.dist_sp_checks import sdpa_llama

    clip = 1.0
    data = SequenceSamples(STEPS * K * BATCH)
    ref = sdpa_llama(seed)
    with trainer_session():
        args = training_args(_out("sequence_parallel"), optim=optim, max_grad_norm=clip,
                             parallelism_config=ParallelismConfig(sp_size=2, sp_backend="deepspeed"))
        trainer = lomo_trainer_class()(model=copy.deepcopy(ref), args=args, train_dataset=data)
        trainer.train()
        trained = full_params(trainer)
        logs = [h for h in trainer.state.log_history if "loss" in h]
        sp = trainer.lomo_engine.sp
    ref_losses, ref_norms = reference_run(ref, data, 1, optim, clip)
    reference = {n: p.detach() for n, p in ref.named_parameters()} if trained is not None else None
    return {"max_abs_diff": diff(trained, reference), "loss": [h["loss"] for h in logs], "ref_loss": ref_losses,
            "grad_norm": [h.get("grad_norm") for h in logs], "ref_grad_norm": ref_norms, "sp": [sp.size, sp.dp_size]}
