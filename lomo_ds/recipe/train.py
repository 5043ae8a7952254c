"""Fine-tune a causal language model with LOMO (or a baseline method) on DeepSpeed ZeRO-3.

    deepspeed --num_gpus 8 launch/train.py --config ds_configs/llama65b.json
    deepspeed --num_gpus 2 -m lomo_ds.cli train --config ds_configs/cpu_default.json   # = lomo-ds train
    lomo-ds train --config ds_configs/llama7b.json --dry-run                             # config + memory plan

One file describes the run (DeepSpeed's keys, the engine's lomo, comm and memory sections, model,
tokenizer, data, train, eval, output); common fields have flags, any field has --set key=value.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from functools import partial

import torch
from tqdm import tqdm

from lomo_ds.config.errors import ConfigError
from lomo_ds.config.presets import describe_update
from lomo_ds.config.run import LOMO_METHODS, check_model_on_disk, load_run_config
from lomo_ds.data.chat import chat_format
from lomo_ds.data.collate import pad_id_of
from lomo_ds.data.errors import DataError
from lomo_ds.data.loading import build_datasets
from lomo_ds.data.order import batches_for_step, position_of_step, steps_per_epoch, window_of_step
from lomo_ds.data.packing import make_batch, padding_fraction, train_order
from lomo_ds.data.streaming import build_streamed_datasets
from lomo_ds.methods import build_engine
from lomo_ds.recipe.evaluation_hooks import EvaluationHooks
from lomo_ds.recipe.metrics import Metrics
from lomo_ds.recipe.preflight import (  # noqa: F401 (the program's parts, named here as before)
    add_arguments,
    check_runtime,
    check_sequence_parallel_model,
    dry_run,
    overrides_from,
    parse_args,
    print_eval_plan,
    show_what_matters,
    stop_every_rank,
)
from lomo_ds.recipe.resume import Resume
from lomo_ds.runtime.device import accelerator_device, set_cpu_threads
from lomo_ds.runtime.dist import accepts_logits_to_keep, init_distributed, io_barrier, keep_labelled_logits
from lomo_ds.runtime.host_malloc import keep_freed_memory
from lomo_ds.runtime.layout import ParallelLayout
from lomo_ds.runtime.memory import cuda_peak_bytes, process_peak_rss_bytes
from lomo_ds.runtime.preemption import PREEMPTED_EXIT, Preempted, Preemption
from lomo_ds.storage import checkpoint, int8_export
from lomo_ds.storage.models import load_model, load_tokenizer, release_model_build_config


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


class TrainRecipe(EvaluationHooks, Resume):
    """One fine-tuning run, in the parts a reader (or a test) takes one at a time:

        recipe = TrainRecipe(cfg, resume=False)
        recipe.setup()       # process group, tokenizer, data, engine, resume point, metrics
        recipe.train()       # the steps, with periodic checkpoints and evaluations
        recipe.finish()      # final evaluation, checkpoint, Hugging Face export, summary.json
        recipe.cleanup()     # close the metrics; every rank done

    evaluate(tag, step) and save() are the parts train() and finish() call; the evaluations are
    recipe/evaluation_hooks.py's, the resume point recipe/resume.py's."""

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
        # The ranks and their layout. Sequence parallelism: the ranks of an SP group train on the same
        # rows (each its slice of positions), so the data is dealt to the layout's data-parallel
        # replicas. The engine takes the same layout (ParallelLayout.build: one per process).
        self.layout = ParallelLayout.build(self.cfg.train.sequence_parallel_size)
        self.rank, self.world = self.layout.rank, self.layout.world
        self.dp_world, self.dp_rank = self.layout.dp_size, self.layout.dp_rank
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
        check_sequence_parallel_model(self.cfg, self.layout)  # before any rank allocates the model
        model = load_model(self.cfg, self.cfg.ds, self.rank, self.barrier)
        self.engine = build_engine(self.cfg, model, self.total_steps)
        # See keep_labelled_logits; under SP the engine's loss reads its slice's every position.
        self.labelled_logits_only = accepts_logits_to_keep(model) and self.layout.sp_size == 1
        if not self.engine.supports_resume and (self.resume_requested or self.cfg.output.checkpoint_every):
            self.say(f"train.method={self.cfg.train.method}: nothing to checkpoint or resume")

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
            batch = self.layout.pad_rows(make_batch(micro[self.dp_rank], self.pad_id, self.data.packed), self.pad_id)
            if self.labelled_logits_only:
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
        if "int8_rescaled_blocks" in out:  # rank 0's 8-bit blocks whose scale the step recomputed
            record["int8_rescaled_blocks"] = out["int8_rescaled_blocks"]
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
        if self.cfg.output.export_int8:
            int8 = int8_export.export_int8(self.engine, os.path.join(self.cfg.output.dir, "hf_model_int8"),
                                           self.cfg.output.io_timeout)
            self.say(f"exported its 8-bit weight shards and scales to {int8}")
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

    def write_summary(self) -> None:
        results = self.results
        # Which split (validation or heldout) and how many examples the figures are on.
        summary = {"steps": self.total_steps, "eval_split": self.cfg.eval.split,
                   "eval_examples": self.data.stats["eval_size"],
                   **{f"{k}_{m}": v.get(f"eval/{m}") for k, v in results.items() if v
                      for m in ("accuracy", "label_nll", "exact_match", "contains") if f"eval/{m}" in v},
                   **results.get("harness", {})}
        with open(os.path.join(self.cfg.output.dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        method = self.cfg.train.method
        if method in LOMO_METHODS:
            method += self.cfg.lomo.rule_words  # " with AdaLomo": the rule the shipped configs default to
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
