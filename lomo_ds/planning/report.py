"""The planner's printed reports: one plan's per-method table and assumptions, the fetch
granularities, and the shipped configs' summaries."""
from __future__ import annotations

from dataclasses import replace

from lomo_ds.planning.estimate import Plan, estimate, io_host_bytes, plan
from lomo_ds.planning.granularity import GRANULARITIES, granularity_rows
from lomo_ds.planning.inputs import shipped_run
from lomo_ds.planning.sequence import mlp_tiles, sequence_terms
from lomo_ds.planning.specs import EXPORT_FILE_BYTES, GIB, LLAMA, METHOD_LABELS, METHODS


def format_granularity(p: Plan, gpus: int | None = None) -> str:
    """The gathered working set and LOMO's total under each fetch granularity, on `gpus` GPUs
    (default: the smallest count LOMO fits on, else the largest planned)."""
    counts = sorted({n for _, n in p.estimates})
    n = gpus or p.min_gpus.get("lomo") or counts[-1]
    rows = granularity_rows(p.model, p.run, n, p.gpu_mem_gib)
    lines = [f"fetch granularity: LOMO on {n} GPU(s), {p.gpu_mem_gib:g} GiB each (this config: {p.run.fetch_label})",
             "", "| fetch | gathers per pass | largest unit (elements) | gathered GiB/GPU | total GiB/GPU | fits |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row.name} | {row.units} | {row.largest[1]:,} ({row.largest[0]}) | {row.gathered / GIB:.2f} | "
                     f"{row.estimate.total / GIB:.2f} | {'yes' if row.fits else 'OOM'} |")
    best = next((r for r in rows if r.name in GRANULARITIES and r.fits), None)
    lines.append("")
    lines.append(f"coarsest fetch that fits: {best.name} ({best.run.fetch_label})" if best else
                 "coarsest fetch that fits: none (LOMO does not fit on this count even per module)")
    if n == 1 and not p.run.int8_shards:
        lines.append("(one GPU holds whole parameters: nothing is gathered, so coarse fetch costs no memory)")
    return "\n".join(lines)


def format_plan(p: Plan, gpus: int | None = None) -> str:
    m, run = p.model, p.run
    accumulating = run.accumulation > 1
    host = run.offload or (accumulating and run.accumulate_on_host)
    grads = ["grads (incl. accumulator)", "accumulator"] if accumulating else ["grads"]
    columns = ["method", "GPUs", "params", *grads,
               "optimizer states",
               "activations (+recompute)", "update tmp", "total GiB/GPU", *(["host RAM GiB (node)"] if host else []),
               "fits"]
    moe = f", {m.experts} experts of f={m.expert_intermediate}, top {m.experts_per_tok}" if m.experts else ""
    lines = [f"# {m.name}: {m.n_params / 1e9:.2f}B parameters (h={m.hidden}, L={m.layers}, f={m.intermediate}, "
             f"V={m.vocab}{moe}); decoder layer {m.layer_class}; {p.gpu_mem_gib:g} GiB per GPU",
             f"assumptions ({p.source}): {run.assumptions()}",
             "",
             "| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    for (method, n), e in p.estimates.items():
        cells = [method, str(n), f"{e.params / GIB:.2f}", f"{e.grads / GIB:.2f}"]
        if accumulating:
            # Per GPU, inside grads; or per rank in host RAM (the node's host column counts every rank's).
            cells.append("-" if not e.accumulator else
                         f"{e.accumulator / GIB:.2f}" + (" (host)" if e.accumulator_on_host else ""))
        cells += [f"{e.optimizer_states / GIB:.2f}", f"{e.activations / GIB:.2f} (+{e.recompute / GIB:.2f})",
                  f"{e.update / GIB:.2f}", f"{e.total / GIB:.2f}"]
        if host:
            cells.append(f"{e.host / GIB:.1f}")
        cells.append("yes" if p.fits(method, n) else "OOM")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    counts = sorted({n for _, n in p.estimates})
    for method, g in p.min_gpus.items():
        lines.append(f"smallest GPU count for {method}: {g if g else 'none of ' + ','.join(map(str, counts))}")
    n = gpus or max(counts)
    export, per_rank = io_host_bytes(m, run, n)
    lines.append(f"host RAM for checkpoints and the export (beyond training's, on {n} GPU(s)): the export "
                 f"{export / GIB:.2f} GiB on rank 0 (one file of at most {EXPORT_FILE_BYTES / 1e9:g} GB and the "
                 f"tensor being gathered); a checkpoint save or resume {per_rank / GIB:.2f} GiB per rank "
                 "(one piece at a time, read into the live shards on resume)")
    if run.int8_shards:
        lines += ["", format_int8_terms(p, gpus)]
    lines += ["", format_sequence_terms(p, gpus)]
    if "lomo" in p.min_gpus:
        lines += ["", format_granularity(p, gpus)]
    return "\n".join(lines)


def format_int8_terms(p: Plan, gpus: int | None = None) -> str:
    """The 8-bit shards' terms (planning/int8_shards.py) of each fused rule on `gpus` GPUs (default:
    the smallest count LOMO fits on, else the largest planned), in GiB per GPU, and the same run's
    total with compute-dtype shards beside."""
    counts = sorted({n for _, n in p.estimates})
    n = gpus or p.min_gpus.get("lomo") or counts[-1]
    run = p.run
    methods = [m for m in METHODS if m in p.min_gpus]
    ests = {m: p.estimates.get((m, n)) or estimate(p.model, m, n, run) for m in methods}
    lines = [f"8-bit shards (memory.int8_shards, an fp32 scale per {run.int8_block} elements) on {n} GPU(s), "
             f"GiB per GPU (in params):"]
    lines += [f"  {k}: {v / GIB:.2f}" for k, v in ests[methods[0]].int8.items()]
    lines.append("  update tmp (a chunk dequantized, updated and requantized): "
                 + ", ".join(f"{METHOD_LABELS[m]} {e.update / GIB:.2f}" for m, e in ests.items()))
    for m, e in ests.items():
        plain = estimate(p.model, m, n, replace(run, int8_shards=False))
        lines.append(f"{METHOD_LABELS[m]} on {n} GPU(s): {e.total / GIB:.2f} "
                     f"({'fits' if e.total <= p.gpu_mem_gib * GIB else 'OOM'}); with {run.dtype} shards "
                     f"{plain.total / GIB:.2f} ({'fits' if plain.total <= p.gpu_mem_gib * GIB else 'OOM'})")
    return "\n".join(lines)


def format_sequence_terms(p: Plan, gpus: int | None = None) -> str:
    """The terms that grow with the sequence (planning/sequence.py), in GiB per GPU, and LOMO's total
    with each long-sequence option on the plan's smallest fitting GPU count (or `gpus`)."""
    m, run = p.model, p.run
    counts = sorted({n for _, n in p.estimates})
    n = gpus or p.min_gpus.get("lomo") or counts[-1]
    terms = sequence_terms(m, run)
    positions = terms.pop("positions per rank")
    lines = [f"terms that grow with the sequence: {positions:,} positions per rank through the layers "
             f"(seq {run.seq:,} / sp {run.sp} x micro-batch {run.batch}), attention {run.attn}"]
    lines += [f"  {name}: {v / GIB:.3f} GiB" for name, v in terms.items() if v]
    if run.tiled_mlp:
        lines.append(f"  MLP tiles: {mlp_tiles(m, run)}")
    if "lomo" not in p.min_gpus or n % run.sp:
        return "\n".join(lines)
    lines.append(f"LOMO on {n} GPU(s) with each option (GiB per GPU; host RAM of the node for offloaded checkpoints):")
    options = [("as planned", {}), ("+ tiled MLP", {"tiled_mlp": True})]
    if run.checkpointing:  # offloaded checkpoints need checkpointed layers
        options.append(("+ tiled MLP + offloaded checkpoints", {"tiled_mlp": True, "offload_checkpoints": True}))
    for label, fields in options:
        e = estimate(m, "lomo", n, replace(run, **fields))
        fits = "fits" if e.total <= p.gpu_mem_gib * GIB else "OOM"
        host = f", checkpoints {n * e.checkpoints_host / GIB:.1f} GiB host RAM" if e.checkpoints_host else ""
        lines.append(f"  {label}: {e.total / GIB:.2f} ({fits}){host}")
    return "\n".join(lines)


def shipped_plans(gpu_mem_gib: float = 24.0, offload: bool = False, **overrides) -> dict[str, Plan]:
    """One plan per LLaMA size, each with its shipped config's settings (and `overrides`)."""
    return {size: plan(spec, gpu_mem_gib, replace(shipped_run(size), offload=offload, **overrides),
                       source=f"ds_configs/llama{size}.json defaults")
            for size, spec in LLAMA.items()}


def format_summary(plans: dict[str, Plan]) -> str:
    """Smallest GPU count per size and method (with offload: LOMO's, and the host RAM it needs)."""
    first = next(iter(plans.values()))
    offload = first.run.offload
    # AdaLomo, and SGD and AdamW where they are planned (not with offload)
    others = [m for m in METHODS if m != "lomo" and m in first.min_gpus]
    columns = ["model", "params", "micro-batch", "LOMO GPUs", "GiB/GPU",
               *(["host RAM GiB (node)"] if offload else []), *(f"{METHOD_LABELS[m]} GPUs" for m in others)]
    lines = [f"# the smallest number of {first.gpu_mem_gib:g} GiB GPUs for each LLaMA size with its shipped config "
             f"(ds_configs/llama<size>.json): {first.run.assumptions(batch=False)}", "",
             "| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    for size, p in plans.items():
        g = p.min_gpus["lomo"]
        e = p.estimates[("lomo", g)] if g else None
        cells = [size, f"{p.model.n_params / 1e9:.2f}B", str(p.run.batch), str(g or "none"),
                 f"{e.total / GIB:.2f}" if e else "-"]
        if offload:
            cells.append(f"{e.host / GIB:.1f}" if e else "-")
        cells += [str(p.min_gpus[m] or "none") for m in others]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


ACCUMULATOR_PLACES = (("fp32", False), ("bf16", False), ("fp32", True))  # (memory.accumulate_dtype, on the host)


def format_accumulation_summary(gpu_mem_gib: float = 24.0, accumulation: int = 4, **overrides) -> str:
    """LOMO with gradient accumulation for every LLaMA size and its shipped config: the smallest GPU
    count with an fp32 or bf16 accumulator on the GPU, or an fp32 one in host RAM."""
    lines = [f"# LOMO with gradient_accumulation_steps {accumulation}: the accumulator (1/N of the model per rank) "
             f"on each {gpu_mem_gib:g} GiB GPU or in host RAM (memory.accumulate_on cpu)", "",
             "| model | micro-batch | accumulator | LOMO GPUs | GiB/GPU | accumulator GiB/rank | host RAM GiB (node) |",
             "|---|---|---|---|---|---|---|"]
    for size, spec in LLAMA.items():
        for dtype, on_host in ACCUMULATOR_PLACES:
            run = replace(shipped_run(size), accumulation=accumulation, accumulate_dtype=dtype,
                          accumulate_on_host=on_host, **overrides)
            p = plan(spec, gpu_mem_gib, run, methods=("lomo",))
            g = p.min_gpus["lomo"]
            e = p.estimates[("lomo", g)] if g else None
            lines.append(f"| {size} | {run.batch} | {dtype} on the {'host' if on_host else 'GPU'} | {g or 'none'} | "
                         + (f"{e.total / GIB:.2f} | {e.accumulator / GIB:.2f} | {e.host / GIB:.1f} |" if e else
                            "- | - | - |"))
    return "\n".join(lines)
