"""The recipe's evaluations: the eval set's accuracy or loss (per data source), greedy replies to chat
prompts, and lm-evaluation-harness on the export. TrainRecipe (lomo_ds/recipe/train.py) calls
them at the start, every eval.every_steps and at the end; they read its cfg, data, engine, ranks
and metrics."""
from __future__ import annotations

import time
from functools import partial

from lomo_ds.evaluation import harness
from lomo_ds.evaluation.generation import evaluate_generation, write_generations
from lomo_ds.evaluation.scoring import evaluate, evaluate_loss
from lomo_ds.recipe import harness_eval


def loss_by_source(loss, sets: dict[str, list[dict]]) -> dict:
    """data.sources' evaluation: each source's loss (loss/<name>) and the loss over all of them
    (every token weighing the same), from `loss(examples)` per source."""
    parts = {name: loss(examples) for name, examples in sets.items()}
    n = sum(r["n_tokens"] for r in parts.values())
    total = sum(r["loss"] * r["n_tokens"] for r in parts.values() if r["n_tokens"])
    return {"loss": total / n if n else float("nan"), "n_tokens": n,
            "forward_calls": sum(r["forward_calls"] for r in parts.values()),
            **{f"loss/{name}": r["loss"] for name, r in parts.items()}}


class EvaluationHooks:
    """TrainRecipe's evaluate(tag, step), generate(tag, step) and evaluate_export(path, step)."""

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
