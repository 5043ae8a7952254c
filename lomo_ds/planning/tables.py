"""The planner's figures for several models side by side (`lomo-ds plan --models A.json B.json ...`):
per-GPU memory on 1, 2, 4 and 8 GPUs at each sequence length, for LOMO and AdaLomo with and without
`offload_param: cpu` (with it, the node's host RAM beside), and DeepSpeed's SGD and AdamW."""
from __future__ import annotations

import os
from dataclasses import replace

from lomo_ds.planning import planner


def variants(int8_shards: bool = False) -> list[tuple[str, bool]]:
    """(row, offload_param cpu) of the table: each registered rule's row without and then with
    offload (lomo, adalomo, ...: planning/specs.py FUSED), then DeepSpeed's SGD and AdamW (not with
    8-bit shards, which only the fused update writes)."""
    baselines = [] if int8_shards else [(m, False) for m in planner.METHODS if m not in planner.FUSED]
    return [(m, False) for m in planner.FUSED] + [(m, True) for m in planner.FUSED] + baselines


def model_name(path: str) -> str:
    """A config file's model name: its file name without .json (or its folder's name)."""
    base = os.path.basename(os.path.normpath(path))
    return base[:-5] if base.endswith(".json") and base != "config.json" else os.path.basename(os.path.dirname(path))


def _assumptions(run: planner.RunSpec) -> str:
    """The run's assumptions less the sequence length and the offload, which each row names."""
    return run.assumptions(batch=False).replace(f"seq {run.seq}, ", "").replace("offload_param none, ", "")


def format_models_table(paths: list[str], seqs: list[int], gpu_mem_gib: float = 24.0,
                        gpu_counts=planner.GPU_COUNTS, **overrides) -> str:
    run = replace(planner.RunSpec(), batch=1, **overrides)
    lines = [f"# GiB per GPU on {', '.join(map(str, gpu_counts))} x {gpu_mem_gib:g} GiB GPUs (OOM: over); "
             f"with offload_param cpu, GiB per GPU / host RAM GiB of the node. "
             f"{_assumptions(run)}, micro-batch {run.batch}", "",
             "| model | params | seq | method | " + " | ".join(f"{n} GPU{'s' if n > 1 else ''}" for n in gpu_counts)
             + " |", "|---" * (4 + len(gpu_counts)) + "|"]
    for path in paths:
        spec = replace(planner.resolve_model(path), name=model_name(path))
        for seq in seqs:
            for method, offload in variants(run.int8_shards):
                r = replace(run, seq=seq, offload=offload)
                cells = []
                for n in gpu_counts:
                    e = planner.estimate(spec, method, n, r)
                    cell = f"{e.total / planner.GIB:.1f}" + (f" / {e.host / planner.GIB:.0f}" if offload else "")
                    cells.append(cell if e.total <= gpu_mem_gib * planner.GIB else f"{cell} OOM")
                label = planner.METHOD_LABELS[method] + (" + offload" if offload else "")
                lines.append(f"| {spec.name} | {spec.n_params / 1e9:.2f}B | {seq} | {label} | " + " | ".join(cells)
                             + " |")
    return "\n".join(lines)


# The long-context goals (docs/memory.md "Long sequences"): model config, GPUs, sequence length and
# the settings that make the row fit. Qwen2.5-7B's 28 heads do not divide by 8 Ulysses ranks: it
# runs SP = 4 x 2 data-parallel on 8 GPUs (ZeRO-3 shards over all 8).
LONG_CONTEXT = (
    ("Llama-3.1-8B", 1, 32768, {"tiled_mlp": True, "offload_checkpoints": True}),
    ("Qwen2.5-7B", 1, 32768, {"tiled_mlp": True, "offload_checkpoints": True}),
    ("Llama-3.1-8B", 8, 131072, {"sp": 8}),
    ("Qwen2.5-7B", 8, 131072, {"sp": 4, "tiled_mlp": True}),
    ("Llama-3.1-70B", 8, 32768, {"sp": 8, "offload": True}),
)


def settings_label(fields: dict) -> str:
    parts = [f"SP {fields['sp']}"] if fields.get("sp", 1) > 1 else []
    parts += [label for key, label in (("offload", "offload_param cpu"), ("tiled_mlp", "tiled MLP"),
                                       ("offload_checkpoints", "offloaded checkpoints")) if fields.get(key)]
    return ", ".join(parts) or "none"


def format_long_context_table(models_dir: str, gpu_mem_gib: float = 24.0) -> str:
    """`lomo-ds plan --long-context docs/models`: the long-context goals per GPU under each registered
    rule (LOMO, AdaLomo, ...)."""
    run = replace(planner.RunSpec(), batch=1)
    rows = list(planner.FUSED)
    lines = [f"# GiB per GPU ({gpu_mem_gib:g} GiB GPUs): {_assumptions(run)}, micro-batch 1", "",
             "| model | GPUs | seq | settings | " + " | ".join(planner.METHOD_LABELS[m] for m in rows)
             + " | host RAM GiB (node) | fits |", "|---" * (6 + len(rows)) + "|"]
    for name, gpus, seq, fields in LONG_CONTEXT:
        path = os.path.join(models_dir, f"{name}.json")
        if not os.path.isfile(path):
            raise ValueError(f"--long-context {models_dir!r}: no {name}.json there")
        spec = replace(planner.resolve_model(path), name=name)
        r = replace(run, seq=seq, **fields)
        ests = [planner.estimate(spec, method, gpus, r) for method in rows]
        fits = all(e.total <= gpu_mem_gib * planner.GIB for e in ests)
        lines.append(f"| {name} | {gpus} | {seq:,} | {settings_label(fields)} | "
                     + " | ".join(f"{e.total / planner.GIB:.2f}" for e in ests)
                     + f" | {max(e.host for e in ests) / planner.GIB:.1f} | {'yes' if fits else 'no'} |")
    return "\n".join(lines)


# The 8-bit shards' goals (docs/memory.md "8-bit weight shards"): model config, GPUs, GiB per GPU,
# sequence length and the settings of the row, each planned with 8-bit and with bf16 shards. A row
# that does not fit is kept beside the settings that make it fit.
INT8_FITS = (
    ("Llama-3.1-8B", 1, 16, 2048, {}),
    ("Qwen2.5-7B", 1, 16, 2048, {}),
    ("Llama-3.1-8B", 1, 24, 32768, {"tiled_mlp": True, "offload_checkpoints": True}),
    ("Qwen2.5-7B", 1, 24, 32768, {"tiled_mlp": True, "offload_checkpoints": True}),
    ("Llama-3.1-70B", 8, 24, 4096, {}),
    ("Llama-3.1-70B", 8, 24, 4096, {"offload_checkpoints": True}),
)


def format_int8_table(models_dir: str) -> str:
    """`lomo-ds plan --int8-fits docs/models`: each goal of INT8_FITS under every registered rule,
    with 8-bit shards (memory.int8_shards, block 128) and with bf16 shards."""
    run = replace(planner.RunSpec(), batch=1)
    rows = list(planner.FUSED)
    labels = [planner.METHOD_LABELS[m] for m in rows]
    lines = [f"# GiB per GPU with 8-bit shards (an fp32 scale per {run.int8_block} elements) and with bf16 shards: "
             f"{_assumptions(run).replace('bf16 weights', 'bf16 compute')}, micro-batch 1", "",
             "| model | GPUs x GiB | seq | settings | " + " | ".join(f"{x} 8-bit" for x in labels) + " | "
             + " | ".join(f"{x} bf16" for x in labels) + " | 8-bit fits | bf16 fits |",
             "|---" * (6 + 2 * len(rows)) + "|"]
    for name, gpus, mem, seq, fields in INT8_FITS:
        path = os.path.join(models_dir, f"{name}.json")
        if not os.path.isfile(path):
            raise ValueError(f"--int8-fits {models_dir!r}: no {name}.json there")
        spec = replace(planner.resolve_model(path), name=name)
        r = replace(run, seq=seq, **fields)
        int8 = [planner.estimate(spec, m, gpus, replace(r, int8_shards=True)).total for m in rows]
        plain = [planner.estimate(spec, m, gpus, r).total for m in rows]
        fits = ["yes" if max(t) <= mem * planner.GIB else "no" for t in (int8, plain)]
        lines.append(f"| {name} | {gpus} x {mem} | {seq:,} | {settings_label(fields)} | "
                     + " | ".join(f"{t / planner.GIB:.2f}" for t in int8 + plain) + f" | {fits[0]} | {fits[1]} |")
    return "\n".join(lines)
