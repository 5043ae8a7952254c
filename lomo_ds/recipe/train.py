"""Fine-tune a causal language model with LOMO (or a baseline method) on DeepSpeed ZeRO-3.

    deepspeed --num_gpus 8 launch/train.py --config ds_configs/llama65b.json
    deepspeed --num_gpus 2 -m lomo_ds.cli train --config ds_configs/cpu_default.json   # = lomo-ds train
    lomo-ds train --config ds_configs/llama7b.json --dry-run                             # config + memory plan

One file describes the run (DeepSpeed's keys, the engine's lomo, comm and memory sections, model,
tokenizer, data, train, eval, output); common fields have flags, any field has --set key=value.
"""
from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import os
import sys
import time
import warnings
from functools import partial

import torch
from tqdm import tqdm

from lomo_ds.config import leaf_module
from lomo_ds.config.errors import ConfigError
from lomo_ds.config.overrides import parse_override_args
from lomo_ds.config.presets import describe_update
from lomo_ds.config.run import LOMO_METHODS, METHODS, check_model_on_disk, load_run_config
from lomo_ds.data.chat import chat_format
from lomo_ds.data.collate import pad_id_of
from lomo_ds.data.errors import DataError
from lomo_ds.data.loading import build_datasets
from lomo_ds.data.order import batches_for_step, position_of_step, steps_per_epoch, window_of_step
from lomo_ds.data.packing import make_batch, padding_fraction, train_order
from lomo_ds.data.sequence_split import pad_to_multiple
from lomo_ds.data.streaming import build_streamed_datasets
from lomo_ds.evaluation import harness
from lomo_ds.evaluation.generation import evaluate_generation, write_generations
from lomo_ds.evaluation.scoring import evaluate, evaluate_loss
from lomo_ds.methods import build_engine
from lomo_ds.planning import inference, planner
from lomo_ds.planning.model_tree import hf_config, meta_model
from lomo_ds.recipe import harness_eval
from lomo_ds.recipe.metrics import Metrics
from lomo_ds.runtime import sequence_parallel as seqpar
from lomo_ds.runtime.device import accelerator_device, set_cpu_threads
from lomo_ds.runtime.dist import accepts_logits_to_keep, init_distributed, io_barrier, keep_labelled_logits
from lomo_ds.runtime.host_malloc import keep_freed_memory
from lomo_ds.runtime.memory import cuda_peak_bytes, process_peak_rss_bytes
from lomo_ds.runtime.preemption import PREEMPTED_EXIT, Preempted, Preemption
from lomo_ds.storage import checkpoint
from lomo_ds.storage.models import load_model, load_tokenizer, model_config, release_model_build_config


def add_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    ap.add_argument("--config", required=True, help="run config JSON (see ds_configs/)")
    ap.add_argument("--lr", type=float, help="lomo.lr: the LOMO methods' learning rate (the others': --set train.lr=)")
    ap.add_argument("--task", help="data.task")
    ap.add_argument("--model", help="model.path")
    ap.add_argument("--method", help=f"train.method ({', '.join(METHODS)})")
    ap.add_argument("--output-dir", help="output.dir")
    ap.add_argument("--epochs", type=int, help="train.epochs")
    ap.add_argument("--max-steps", type=int, help="train.max_steps")
    ap.add_argument("--accumulation-steps", type=int,
                    help="gradient_accumulation_steps: micro-batches per optimizer step (= train.accumulation_steps)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override any field, e.g. --set train.clip_grad_norm=1.0 (value parsed as JSON)")
    ap.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in output.dir")
    ap.add_argument("--dry-run", action="store_true", help="print the resolved config and predicted memory, then exit")
    # the deepspeed launcher's
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    return add_arguments(ap).parse_args(argv)


def overrides_from(args) -> dict:
    flags = {"lomo.lr": args.lr, "data.task": args.task, "model.path": args.model, "train.method": args.method,
             "output.dir": args.output_dir, "train.epochs": args.epochs, "train.max_steps": args.max_steps,
             "gradient_accumulation_steps": args.accumulation_steps}
    out = {k: v for k, v in flags.items() if v is not None}
    out.update(parse_override_args(args.set))
    return out


def dry_run(cfg) -> None:
    """The resolved config, then the memory planner's per-GPU prediction for it."""
    print(json.dumps(cfg.to_dict(), indent=2))
    world = int(os.environ.get("WORLD_SIZE", "0")) or None  # the launcher's rank count, if launched
    try:
        p = planner.plan_for_run(cfg, world)
    except ValueError as e:
        print(f"memory plan: not available ({e})")
        return
    print(planner.format_plan(p, world))
    method = planner.method_of_run(cfg)
    if world and method is not None:
        need = p.estimates[(method, world)].total / planner.GIB
        print(f"this launch ({world} ranks): {planner.METHOD_LABELS[method]} needs {need:.2f} GiB per GPU")
    print_eval_plan(cfg, p, world)


def print_eval_plan(cfg, p, world: int | None) -> None:
    """The evaluation's and generation's memory on this launch's GPU count (else the smallest the
    run's method fits on)."""
    method = planner.method_of_run(cfg)
    if method not in planner.FUSED:
        return
    gpus = world or p.min_gpus.get(method) or max(n for _, n in p.estimates)
    print()
    print(inference.format_eval(p, inference.eval_spec_for(cfg), gpus, method))


def check_runtime(cfg) -> None:
    """Errors only the machine can tell, still before any model is allocated."""
    from deepspeed.accelerator import get_accelerator  # not at the top: show_what_matters runs first

    if cfg.precision.dtype == "fp16" and get_accelerator().device_name() == "cpu":
        raise ConfigError(f"{cfg.source_path}: fp16.enabled: DeepSpeed refuses fp16 on a CPU; use bf16 or fp32 here")
    check_fetch_unit(cfg)
    if cfg.eval.harness_tasks:
        try:
            harness_eval.check_tasks(cfg)
        except ValueError as e:
            raise ConfigError(f"{cfg.source_path or '<config>'}: eval.harness_tasks: {e}") from None


def check_fetch_unit(cfg) -> None:
    """zero_optimization.leaf_module against the model's own module classes, from its config.json
    built on the meta device (no memory), where model.path is a folder on this machine; otherwise
    the engine checks it on the loaded model (lomo_ds/config/leaf_module.py)."""
    value = (cfg.ds.get("zero_optimization") or {}).get("leaf_module")
    config_json = os.path.join(cfg.model.path, "config.json")
    if value is None or not os.path.isfile(config_json):
        return
    with open(config_json) as f:
        raw = json.load(f)
    try:
        model = meta_model(hf_config(raw, config_json))
    except (ValueError, KeyError):  # remote code, or an architecture transformers cannot build alone
        return
    try:
        leaf_module.resolve_value(value, model)
    except ConfigError as e:
        raise ConfigError(f"{cfg.source_path or '<config>'}: {e} (model.path {cfg.model.path!r})") from None


def check_sequence_parallel_model(cfg) -> None:
    """train.sequence_parallel_size against the model's heads and attention, from its config alone.
    A GGUF model not converted yet has no config to read: the engine checks the built model then."""
    if cfg.train.sequence_parallel_size == 1:
        return
    config = model_config(cfg)
    if config is not None:
        seqpar.check_model_config(config, cfg.train.sequence_parallel_size, accelerator_device().type)


def show_what_matters(rank: int) -> None:
    """Rank 0 prints progress, results, and each library warning once; the other ranks print only
    errors (every rank would otherwise repeat the same DeepSpeed/torch/transformers messages).
    Called before DeepSpeed is imported: it logs from its first import on."""
    if rank == 0:
        warnings.simplefilter("once")
        return
    warnings.simplefilter("ignore")
    # DeepSpeed resets its logger's level when it creates it; a filter stays.
    logging.getLogger("DeepSpeed").addFilter(lambda record: record.levelno >= logging.ERROR)
    logging.getLogger("torch").setLevel(logging.ERROR)
    import datasets  # these two after the filters above: they log from their first import on
    import transformers

    # Libraries draw their own bars (transformers' loading and GGUF conversion, datasets' maps): off
    # by default here, as the TQDM_DISABLE variable would do had tqdm not been imported already.
    tqdm.__init__ = functools.partialmethod(tqdm.__init__, disable=True)
    transformers.utils.logging.set_verbosity_error()
    datasets.utils.logging.set_verbosity_error()


def planned_steps(cfg, n_train: int, world: int) -> tuple[int, int]:
    """(optimizer steps per epoch, optimizer steps in the whole run); a step takes
    gradient_accumulation_steps micro-batches per rank (fewer at the end of an epoch)."""
    per_epoch = steps_per_epoch(max(1, n_train), world, cfg.micro_batch, cfg.accumulation_steps)
    total = cfg.train.epochs * per_epoch
    if cfg.train.max_steps is not None:
        total = min(total, cfg.train.max_steps)
    return per_epoch, 0 if cfg.train.method == "zero_shot" else total


def main(argv=None) -> int:
    return run(parse_args(argv))


def stop_every_rank(rank: int, message: str) -> int:
    """Every rank stops; rank 0 alone says why. The others wait before exiting: a launcher kills the
    whole group as soon as one rank exits, and if a silent rank went first, rank 0 would be killed
    before its message was printed. The launcher ends the wait as soon as rank 0 has exited."""
    if rank == 0:
        print(message, file=sys.stderr, flush=True)
    elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
        time.sleep(30)
    return 2


def run(args: argparse.Namespace) -> int:
    """The program: the config checked before anything heavy, then the recipe from setup to cleanup."""
    rank = int(os.environ.get("RANK", "0"))  # the launcher's
    try:
        cfg = load_run_config(args.config, overrides_from(args))
        if args.dry_run:
            dry_run(cfg)
            return 0
        check_model_on_disk(cfg)
        show_what_matters(rank)  # before any library speaks
        check_runtime(cfg)
    except ConfigError as e:
        return stop_every_rank(rank, f"config error: {e}")


    recipe = TrainRecipe(cfg, resume=args.resume)
    try:
        recipe.setup()
    except (DataError, checkpoint.CheckpointError) as e:
        if recipe.preemption is not None:  # a launcher's SIGTERM must end stop_every_rank's wait
            recipe.preemption.restore()
        return stop_every_rank(rank, f"{'data' if isinstance(e, DataError) else 'checkpoint'} error: {e}")
    try:
        recipe.train()
        recipe.finish()
    except Preempted:
        return PREEMPTED_EXIT  # every rank has checkpointed: requeue with --resume
    finally:
        recipe.cleanup()
    return 0


def loss_by_source(loss, sets: dict[str, list[dict]]) -> dict:
    """data.sources' evaluation: each source's loss (loss/<name>) and the loss over all of them
    (every token weighing the same), from `loss(examples)` per source."""
    parts = {name: loss(examples) for name, examples in sets.items()}
    n = sum(r["n_tokens"] for r in parts.values())
    total = sum(r["loss"] * r["n_tokens"] for r in parts.values() if r["n_tokens"])
    return {"loss": total / n if n else float("nan"), "n_tokens": n,
            "forward_calls": sum(r["forward_calls"] for r in parts.values()),
            **{f"loss/{name}": r["loss"] for name, r in parts.items()}}


class TrainRecipe:
    """One fine-tuning run, in the parts a reader (or a test) takes one at a time:

        recipe = TrainRecipe(cfg, resume=False)
        recipe.setup()       # process group, tokenizer, data, engine, resume point, metrics
        recipe.train()       # the steps, with periodic checkpoints and evaluations
        recipe.finish()      # final evaluation, checkpoint, Hugging Face export, summary.json
        recipe.cleanup()     # close the metrics; every rank done

    evaluate(tag, step) and save() are the parts train() and finish() call."""

    def __init__(self, cfg, resume: bool = False):
        self.cfg = cfg
        self.resume_requested = resume
        self.results: dict[str, dict] = {}  # evaluation results by tag: zero_shot, final
        self.generations: dict[str, list[dict]] = {}  # chat tasks: the eval replies by tag (rank 0)
        self.start_step = 0
        self.metrics = None
        self.preemption: Preemption | None = None

    # ---------------------------------------------------------------- setup
    def setup(self) -> None:
        out = self.cfg.output
        # First: a signal from here on stops the run at a step boundary (before: nothing to lose).
        self.preemption = Preemption(out.preempt_signals, out.preempt_deadline_s,
                                     marker_dir=out.dir if os.environ.get("RANK", "0") == "0" else None)
        torch.manual_seed(self.cfg.train.seed)
        init_distributed(timeout_s=self.cfg.train.collective_timeout)
        self.rank, self.world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        # Sequence parallelism: the ranks of an SP group train on the same rows (each its slice of
        # positions), so the data is dealt to the data-parallel replicas, world / sp of them.
        sp = self.cfg.train.sequence_parallel_size
        seqpar.check_world(sp, self.world)
        self.dp_world, self.dp_rank = self.world // sp, self.rank // sp
        self.barrier = torch.distributed.barrier
        # Waits on other ranks' disk writes (checkpoints): under output.io_timeout, not the collectives'.
        self.io_barrier = partial(io_barrier, self.cfg.output.io_timeout)
        # CPU ranks split the cores (unless OMP_NUM_THREADS says otherwise); the run's first line says which.
        device = accelerator_device()
        threads = set_cpu_threads(device)
        self.say(f"run: {self.cfg.train.method} on {self.world} rank(s), {threads}; "
                 f"config {self.cfg.source_path or 'given in memory'}")
        if self.cfg.train.method in LOMO_METHODS:
            self.say(f"update: {describe_update(self.cfg)}")
        self.setup_data()  # before the model: a malformed file fails fast and cheap
        self.setup_engine()
        if device.type == "cpu":
            # From here on the steps keep the memory they free for the next (host_malloc.py says when
            # not); only now, so that what loading the model freed went back to the kernel.
            self.say(f"host memory: {keep_freed_memory()}")
        self.start_step = self.resume_point()

        out = self.cfg.output
        self.metrics = Metrics(out.dir, out.metrics_file, self.rank, append=self.resume_requested,
                               tensorboard=out.tensorboard)

    def setup_data(self) -> None:
        """The tokenizer and the datasets (raises DataError on a bad file), and the run's step count."""
        self.tokenizer = load_tokenizer(self.cfg, self.rank, self.barrier)
        self.stream = None  # data.streaming: the training rows, read as the steps need them
        if self.cfg.data.streaming:
            self.stream, self.data = build_streamed_datasets(self.cfg, self.tokenizer, self.dp_world)
        else:
            self.data = build_datasets(self.cfg, self.tokenizer)
        self.pad_id = pad_id_of(self.tokenizer)
        self.stop_ids = None  # chat tasks: where generation stops (the template's end of turn, EOS)
        if self.data.eval_prompts:
            self.stop_ids = chat_format(self.tokenizer).stop_ids  # the template the data was rendered with
        k = self.cfg.accumulation_steps
        accumulation = f" of {k} micro-batches each" if k > 1 else ""
        if self.stream is not None:  # no epochs: train.max_steps steps of the stream
            self.total_steps = 0 if self.cfg.train.method == "zero_shot" else self.cfg.train.max_steps
            self.steps_per_epoch = max(1, self.total_steps)
            self.say(f"data: {json.dumps(self.data.stats)}; streamed, {self.total_steps} steps{accumulation}")
            return
        self.steps_per_epoch, self.total_steps = planned_steps(self.cfg, len(self.data.train), self.dp_world)
        self.say(f"data: {json.dumps(self.data.stats)}; {self.steps_per_epoch} steps/epoch{accumulation}, "
                 f"{self.total_steps} steps in all")

    def setup_engine(self) -> None:
        check_sequence_parallel_model(self.cfg)  # before any rank allocates the model
        model = load_model(self.cfg, self.cfg.ds, self.rank, self.barrier)
        self.engine = build_engine(self.cfg, model, self.total_steps)
        self.labelled_logits_only = accepts_logits_to_keep(model)  # see keep_labelled_logits
        if not self.engine.supports_resume and (self.resume_requested or self.cfg.output.checkpoint_every):
            self.say(f"train.method={self.cfg.train.method}: nothing to checkpoint or resume")

    def resume_point(self) -> int:
        """The step to start from: the newest checkpoint's when resuming (loaded into the engine), else 0."""
        if not (self.resume_requested and self.engine.supports_resume):
            return 0
        ckpt = checkpoint.latest_checkpoint(self.cfg.output.dir)
        if ckpt is None:
            self.say(f"resume: no checkpoint in {self.cfg.output.dir}; starting from scratch")
            return 0
        try:
            meta = checkpoint.load_checkpoint(ckpt, self.engine)
        except (ValueError, FileNotFoundError) as e:  # refused before any shard is written
            raise checkpoint.CheckpointError(f"{ckpt}: {e}") from None
        step = meta["step"]
        self.say(f"resumed from {ckpt} at step {step}")
        if meta["world"] != self.world:
            self.say(f"resumed on {self.world} rank(s) a run checkpointed on {meta['world']}: "
                     + self.data_position_after_resume(meta.get("global_batch")))
        return step

    @property
    def global_batch(self) -> int:
        return self.dp_world * self.cfg.micro_batch * self.cfg.accumulation_steps

    def data_position_after_resume(self, written_batch: int | None) -> str:
        """What a resume on another rank count does to the data order, in words."""
        if written_batch == self.global_batch:
            return f"the same global batch ({self.global_batch} examples a step): the data order continues exactly"
        # The order is a pure function of (seed, epoch, step) for a global batch: another batch
        # cuts the same epoch order into other steps.
        return (f"global batch {written_batch} -> {self.global_batch}: the steps from here on take the new "
                "batch's share of the epoch order, so some examples of the resumed epoch are seen twice or "
                "not at all; keep world x micro-batch x accumulation the same for the uninterrupted order")

    # ---------------------------------------------------------------- train
    def train(self) -> None:
        """Zero-shot evaluation on a fresh start, then every step from the resume point on."""
        cfg = self.cfg
        if cfg.train.zero_shot_eval and self.start_step == 0:
            self.results["zero_shot"] = self.evaluate("zero_shot", 0)
        progress = tqdm(total=self.total_steps, initial=self.start_step, disable=self.rank != 0, dynamic_ncols=True,
                        desc="train")
        for step in range(self.start_step, self.total_steps):
            record = self.train_step(step)
            progress.update(1)
            progress.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}", tgs=f"{record['tgs']:.0f}",
                                 mem=f"{record['peak_mem_gb']:.2f}G")
            done = step + 1
            if done < self.total_steps:  # the last step's checkpoint and evaluation are finish()'s
                every = cfg.output.checkpoint_every
                saved = self.engine.supports_resume and every and done % every == 0
                if saved:
                    self.save()
                if self.preemption.agreed():
                    self.stop_preempted(done, saved)
                if cfg.eval.every_steps and done % cfg.eval.every_steps == 0:
                    self.evaluate("eval", done)
        progress.close()

    def stop_preempted(self, done: int, saved: bool) -> None:
        """Every rank, at the same step boundary: checkpoint (unless this step's was just written), then
        raise Preempted."""
        if self.engine.supports_resume and not saved:
            self.save()
        where = checkpoint.latest_checkpoint(self.cfg.output.dir) if self.engine.supports_resume else None
        self.preemption.stopped(done, where)  # the marker; from now on a signal just exits 75
        self.metrics.log({"step": done, "phase": "preempted", "checkpoint": where})
        self.say(f"preempted after step {done}: " + (f"checkpoint {where}; run again with --resume" if where else
                                                     f"train.method={self.cfg.train.method} has nothing to resume"))
        raise Preempted(done)

    def train_step(self, step: int) -> dict:
        """Optimizer step `step` (0-based): this rank's micro-batch of each global micro-batch of the
        step's window (gradient_accumulation_steps of them; an epoch's last window may be shorter,
        and its step is the mean over its own); its record, logged."""
        epoch, window = self.step_micro_batches(step)
        if len(window) < self.engine.accumulation_steps:
            self.engine.start_window(len(window))
        t0, tokens, padding = time.perf_counter(), 0, []
        for micro in window:  # every rank's micro-batch, for the padding figure; this rank trains on its own
            batch = make_batch(micro[self.dp_rank], self.pad_id, self.data.packed)
            sp = self.cfg.train.sequence_parallel_size
            if sp > 1:
                batch = pad_to_multiple(batch, sp, self.pad_id)
            elif self.labelled_logits_only:
                batch = keep_labelled_logits(batch)
            out = self.engine.train_step(batch)
            tokens += sum(len(e["input_ids"]) for e in micro[self.dp_rank])
            padding.append(padding_fraction(micro))
        if not out["stepped"]:
            raise RuntimeError(f"step {step + 1}: its window of {len(window)} micro-batches ended without an "
                               "optimizer step")
        elapsed = time.perf_counter() - t0
        peak_mem = cuda_peak_bytes()
        peak_mem = process_peak_rss_bytes() if peak_mem is None else peak_mem
        record = {"step": step + 1, "epoch": epoch, "loss": out["loss"], "lr": out["lr"], "grad_norm": out["grad_norm"],
                  "skipped": out["skipped"], "loss_scale": out["loss_scale"], "micro_batches": len(window),
                  "tokens": tokens, "tgs": tokens / elapsed, "step_seconds": elapsed, "peak_mem_gb": peak_mem / 2**30,
                  "padding_fraction": sum(padding) / len(padding)}
        self.metrics.log(record)
        return record

    def step_micro_batches(self, step: int) -> tuple[int, list[list[list[dict]]]]:
        """(epoch, the global micro-batches of optimizer step `step`, each as every rank's examples):
        gradient_accumulation_steps of them, fewer in an epoch's last window; from the stream's
        position of that step when streaming."""
        cfg, k = self.cfg, self.engine.accumulation_steps
        if self.stream is not None:
            return 0, self.stream.window(step, k)
        epoch, step_in_epoch = position_of_step(step, self.steps_per_epoch)
        # Grouped by length for chat/instruction data that is not packed, the mixture's order for
        # data.sources; a pure function of (seed, epoch) either way, so a resumed run replays it.
        order = train_order(self.data, cfg.train.seed, epoch, self.dp_world * cfg.micro_batch)
        window = window_of_step(step_in_epoch, len(self.data.train), self.dp_world, cfg.micro_batch, k)
        return epoch, [[[self.data.train[i] for i in batches_for_step(order, m, self.dp_world, cfg.micro_batch, r)]
                        for r in range(self.dp_world)] for m in window]

    # ---------------------------------------------------------------- evaluate
    def evaluate(self, tag: str, step: int) -> dict:
        """Candidate accuracy on the eval set (or its loss, for a language-modelling task), logged
        under `tag`; for a chat task also the exact match and containment of greedy replies
        (generate()); {} when the task has no eval set."""
        def forward_logits(batch):
            return self.engine.eval_forward(batch).logits

        cfg, data, show = self.cfg, self.data, self.rank == 0
        t0 = time.perf_counter()
        if data.eval:
            res = evaluate(forward_logits, data.eval, self.pad_id, cfg.eval.batch_size, self.rank, self.world,
                           progress=show)
        elif data.eval_lm:
            # The LOMO engine's chunked loss where it has one: no fp32 logits of every position.
            token_loss = getattr(getattr(self.engine, "engine", None), "eval_token_loss", None)
            loss = partial(evaluate_loss, forward_logits, pad_id=self.pad_id, batch_size=cfg.eval.batch_size,
                           rank=self.rank, world=self.world, progress=show, token_loss=token_loss)
            res = loss_by_source(loss, data.eval_by_source) if data.eval_by_source else loss(data.eval_lm)
        else:
            return {}
        res = {f"eval/{k}": v for k, v in res.items()}
        if data.eval_prompts:
            res.update({f"eval/{k}": v for k, v in self.generate(tag, step).items()})
        self.metrics.log({"step": step, "phase": tag, **res, "eval_seconds": time.perf_counter() - t0})
        shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in res.items()
                 if any(w in k for w in ("accuracy", "loss", "exact_match", "contains"))}
        self.say(f"[{tag}] step {step}: {shown}")
        return res

    def generate(self, tag: str, step: int) -> dict:
        """Collective: greedy replies to the eval prompts, split over the ranks; rank 0 writes them
        to output.dir/generations/step_N.jsonl. Returns {"exact_match", "contains", "n"}."""
        cfg = self.cfg
        scores, rows = evaluate_generation(self.engine.module, self.data.eval_prompts, self.tokenizer,
                                           stop_ids=self.stop_ids, pad_id=self.pad_id,
                                           max_new_tokens=cfg.eval.max_new_tokens, batch_size=cfg.eval.batch_size,
                                           rank=self.rank, world=self.world, device=self.engine.device)
        if self.rank == 0:
            write_generations(cfg.output.dir, step, rows)
            self.generations[tag] = rows
        return scores

    # ---------------------------------------------------------------- save
    def save(self) -> None:
        """A checkpoint of the engine at its current step (atomic; the oldest beyond keep_last go)."""
        checkpoint.save_checkpoint(self.cfg.output.dir, self.engine, {"config": self.cfg.to_dict(),
                                                                      "global_batch": self.global_batch},
                                   self.cfg.output.keep_last, self.io_barrier)

    def export(self) -> str:
        path = checkpoint.export_hf(self.engine, self.tokenizer, os.path.join(self.cfg.output.dir, "hf_model"),
                                    self.cfg.output.io_timeout)
        self.say(f"exported Hugging Face model to {path}")
        return path

    def finish(self) -> None:
        """The end of the run: the final evaluation, the last checkpoint, the export and the summary."""
        cfg, total = self.cfg, self.total_steps
        if cfg.eval.at_end and total > 0:
            self.results["final"] = self.evaluate("final", total)
        if self.engine.supports_resume and self.start_step < total and (cfg.output.checkpoint_every or
                                                                        cfg.output.export_hf):
            self.save()
        if cfg.output.export_hf and total > 0:
            path = self.export()
            if cfg.eval.harness_tasks:
                self.evaluate_export(path, total)
        if self.rank == 0:
            self.write_summary()

    def evaluate_export(self, path: str, step: int) -> None:
        """lm-evaluation-harness on the export by rank 0 in a process of its own, once every rank freed
        its engine (gone after), while the others wait; the figures go to the metrics (and TensorBoard)
        and summary.json. A failure is raised on rank 0 after the others are released."""
        cfg, failed, device = self.cfg, None, str(self.engine.device)
        self.say(harness_eval.release(self.engine))  # the harness loads the whole model on rank 0's device
        self.engine = None
        if self.rank == 0:
            t0 = time.perf_counter()
            try:
                results = harness_eval.evaluate_export(path, cfg, device, self.say)
            except harness.HarnessError as e:
                failed = e
            else:
                flat = harness.flat_metrics(results)
                self.metrics.log({"step": step, "phase": "harness", **flat, "eval_seconds": time.perf_counter() - t0})
                self.results["harness"] = flat
        self.io_barrier()  # the others wait as for a checkpoint: under output.io_timeout
        if failed is not None:
            raise failed

    def write_summary(self) -> None:
        results = self.results
        # Which split (validation or heldout) and how many examples the figures are on.
        summary = {"steps": self.total_steps, "eval_split": self.cfg.eval.split,
                   "eval_examples": self.data.stats["eval_size"],
                   **{f"{k}_{m}": v.get(f"eval/{m}") for k, v in results.items() if v
                      for m in ("accuracy", "exact_match", "contains") if f"eval/{m}" in v},
                   **results.get("harness", {})}
        with open(os.path.join(self.cfg.output.dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        method = self.cfg.train.method
        if method in LOMO_METHODS and self.cfg.lomo.optimizer == "adalomo":
            method += " with AdaLomo"  # the update rule the shipped configs default to
        for key in ("accuracy", "exact_match", "contains"):
            zs, ft = (results.get(k, {}).get(f"eval/{key}") for k in ("zero_shot", "final"))
            if zs is not None and ft is not None and not math.isnan(zs):
                # The run's result in one line: where it started, where it ended, and the gain.
                print(f"{key.replace('_', ' ')}: zero-shot {zs:.3f} -> fine-tuned ({method}) "
                      f"{ft:.3f} ({100 * (ft - zs):+.1f} points)", flush=True)
        self.show_generations()

    def show_generations(self, n: int = 3) -> None:
        """The first n eval prompts with the reference and the replies before and after training."""
        tags = [t for t in ("zero_shot", "final") if t in self.generations]
        if not tags:
            return
        for i, row in enumerate(self.generations[tags[-1]][:n]):
            print(f"--- prompt {i + 1}: {row['messages'][-1]['content']!r} (reference {row['reference']!r})")
            for tag in tags:
                r = self.generations[tag][i]
                print(f"    {tag:>9}: {r['reply']!r}{'  [exact match]' if r['exact_match'] else ''}")
        print(flush=True)

    # ---------------------------------------------------------------- cleanup
    def cleanup(self) -> None:
        """Close the metrics (flushed to disk) and wait for every rank; models the process builds
        after the run are built whole again (release_model_build_config)."""
        release_model_build_config()
        if self.metrics is not None:
            self.metrics.close()
            if not (self.preemption and self.preemption.saved):  # stopped, saved: no peer to wait on
                self.barrier()
        if self.preemption is not None:  # last: until here a launcher's forward is the same request
            self.preemption.restore()

    def say(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, flush=True)


if __name__ == "__main__":
    sys.exit(main())
