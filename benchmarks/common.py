"""What the benchmarks and the experiments (the paper's tables) share: the models they build, the DeepSpeed
and lomo settings every method runs under, the methods' options, random batches, and launching ranks on
this machine.

The scripts run from the repository as modules (`python -m experiments.tableN`, `python -m
benchmarks.bench_step`). Heavy imports (torch, transformers, DeepSpeed) happen inside the functions: a
launcher that only starts workers, or prints --help, never loads them.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from typing import Iterable

from lomo_ds.planning.planner import LLAMA, ModelSpec

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
GIB = 2**30
MIB = 2**20
# Parameters (billions) of the paper's LLaMA sizes: the x axis of the plots.
LLAMA_PARAMS_B = {size: spec.n_params / 1e9 for size, spec in LLAMA.items()}
# The baselines' options: the LR each was tuned to, and DeepSpeed's gradient clipping by norm
# (the paper's shared setting). LOMO's options are its lomo section (lomo_section).
METHOD_OPTS = {"adamw": {"lr": 1e-5, "clip": 1.0}, "sgd": {"lr": 1e-3, "clip": 1.0}}
RESULT_PREFIX = "RESULT "  # a worker's result line on stdout: the prefix, then one JSON object


# ----------------------------------------------------------------------------- configuration
def add_run_shape_args(ap, layers=None, hidden=None, vocab=None, seq=None, micro=None, steps=None,
                       warmup=None) -> None:
    """The benchmarks' random-LLaMA and run-size flags, with each benchmark's defaults (None: the
    benchmark fills it from a preset)."""
    for flag, default, what in (("--layers", layers, "decoder layers"), ("--hidden", hidden, "hidden size"),
                                ("--vocab", vocab, "vocabulary size"), ("--seq", seq, "tokens per sequence"),
                                ("--micro", micro, "sequences per rank per micro-batch"),
                                ("--steps", steps, "timed steps"), ("--warmup", warmup, "untimed steps before them")):
        ap.add_argument(flag, type=int, default=default, help=what)


def ds_config(cpu: bool, dtype: str, batch: int) -> dict:
    """The same ZeRO-3 settings for every method. On a CPU the buckets and the gathered working set
    are scaled to the small models (as DeepSpeed's defaults, used on GPUs, are to a 7B one)."""
    zero = {"stage": 3}
    if cpu:
        zero.update(reduce_bucket_size=1_000_000, stage3_prefetch_bucket_size=0,
                    stage3_max_live_parameters=1_000_000, stage3_max_reuse_distance=1_000_000,
                    stage3_param_persistence_threshold=10_000)
    else:
        zero.update(stage3_prefetch_bucket_size=50_000_000, stage3_param_persistence_threshold=100_000,
                    stage3_max_live_parameters=1_000_000_000, stage3_max_reuse_distance=1_000_000_000)
    cfg = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1, "zero_optimization": zero,
           "steps_per_print": 10**9, "wall_clock_breakdown": False}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 16}
    return cfg


def lomo_section(bucket_size: int, clip_norm: bool = False) -> dict:
    """LOMO's options, by key (build_method_engine groups them into their sections): LR 3e-2 (within
    Table 4's sweep); one backward pass per step (the paper's value-clipping mode) unless norm
    clipping, which needs a second, is asked for."""
    sec = {"lr": 3e-2, "bucket_size": bucket_size}
    if clip_norm:
        sec["clip_grad_norm"] = 1.0
    return sec


def build_method_engine(model, ds_cfg: dict, method: str, lomo_cfg: dict, activation_checkpointing: bool = False):
    """`method`'s engine (lomo_ds.methods.build_engine) with the options every experiment gives it: a
    run config made of these sections, for a model built in memory. The baselines get their tuned LR
    and norm clipping (every method clips by train.clip_grad_norm); LOMO keeps `lomo_cfg` as given."""
    from lomo_ds.config.engine_sections import group_by_section
    from lomo_ds.config.run import LOMO_METHODS, load_run_config
    from lomo_ds.methods import build_engine

    if activation_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
        model.config.use_cache = False
    options, train = dict(lomo_cfg), {"method": method}
    if method in LOMO_METHODS:
        # DeepSpeed's reduce bucket sizes its own optimizer's gradient path; LOMO's is comm.bucket_size
        # (lomo_ds refuses the DeepSpeed key for LOMO rather than guess the conversion).
        ds_cfg = {**ds_cfg, "zero_optimization": {k: v for k, v in ds_cfg["zero_optimization"].items()
                                                  if k != "reduce_bucket_size"}}
    if method in METHOD_OPTS:
        options["clip_grad_norm"] = METHOD_OPTS[method]["clip"]
        train["lr"] = METHOD_OPTS[method]["lr"]
    sections = group_by_section(options)
    sections["train"] = {**sections.get("train", {}), **train}
    cfg = load_run_config({**ds_cfg, **sections, "model": {"path": "<built in memory>"}}, check_files=False)
    return build_engine(cfg, model, total_steps=0)


# ----------------------------------------------------------------------------- models and data
def torch_dtype(name: str):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def random_llama(spec: ModelSpec, seq: int, dtype: str, attn: str = "sdpa"):
    """A random-init LLaMA of `spec`'s shape, the same weights every time."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
                      num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.k,
                      max_position_embeddings=max(2048, seq), tie_word_embeddings=spec.tie,
                      attn_implementation=attn, use_cache=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(torch_dtype(dtype))


def pretrained_llama(path: str, dtype: str, ds_cfg: dict):
    """LLaMA weights from a Hugging Face folder, built partitioned: with an HfDeepSpeedConfig alive,
    from_pretrained runs under zero.Init and loads the checkpoint shard by shard, so no rank holds
    the whole model."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    pretrained_llama.keep = HfDeepSpeedConfig(ds_cfg)  # transformers holds it weakly; it must outlive the build
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(dtype), attn_implementation="sdpa")
    model.config.use_cache = False
    return model


def count_params(model) -> int:
    """Full parameter count, also of a model already partitioned by ZeRO-3."""
    from lomo_ds.runtime import ds_compat

    return sum(ds_compat.full_numel(p) if ds_compat.is_zero_param(p) else p.numel() for p in model.parameters())


def random_batches(vocab: int, batch: int, seq: int, n: int, seed: int, device=None) -> list[dict]:
    """`n` language-modelling batches of random tokens (labels = inputs), reproducible from `seed`."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (batch, seq), generator=g).to(device or "cpu")
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


# ----------------------------------------------------------------------------- ranks
def run_ranks(module: str, nproc: int, args: list[str], cpu: bool, timeout: float) -> subprocess.CompletedProcess:
    """Run the benchmark `module` (e.g. "experiments.table2") on `nproc` local ranks; raises
    subprocess.TimeoutExpired."""
    from devkit.launch_local import run_local

    return run_local(["-m", module, *args], nproc, timeout=timeout, cpu=cpu, cwd=ROOT)


def print_result(row: dict) -> None:
    print(RESULT_PREFIX + json.dumps(row), flush=True)


def results_of(stdout: str) -> list[dict]:
    return [json.loads(line[len(RESULT_PREFIX):]) for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)]


# ----------------------------------------------------------------------------- throughput
def measure_tgs(engine, batches: Iterable[dict], warmup: int = 2, steps: int = 5,
                tokens_per_step: int | None = None) -> dict[str, float]:
    """Tokens per rank (GPU) per second, the paper's TGS: `warmup` steps excluded, median of `steps`
    timed steps. `batches` yields this rank's micro-batches (cycled when short). Each step ends
    with a barrier so the time is the slowest rank's."""
    batches = list(batches)
    if not batches:
        raise ValueError("measure_tgs: no batches")
    times = []
    for i in range(warmup + steps):
        batch = batches[i % len(batches)]
        _sync()
        t0 = time.perf_counter()
        engine.train_step(batch)
        _sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    tokens = tokens_per_step if tokens_per_step is not None else int(batches[0]["input_ids"].numel())
    med = statistics.median(times)
    return {"step_time_s": med, "tgs": tokens / med, "tokens_per_step": tokens, "steps": steps,
            "warmup": warmup, "all_times_s": times}


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def pyplot():
    """matplotlib's pyplot on its file-only backend (a training node has no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str, title: str) -> None:
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


def status_kib(key: str) -> int:
    """A /proc/self/status figure in KiB (VmRSS: resident now, VmHWM: its high-water mark)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {key}")
