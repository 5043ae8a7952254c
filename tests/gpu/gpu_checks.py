"""The multi-rank GPU checks, run once per world size by tests/gpu/test_gpu.py (NCCL, one GPU per rank).

    python -m torch.distributed.run --nproc_per_node N -m tests.gpu.gpu_checks OUT.json
    ... -m tests.gpu.gpu_checks OUT.json --smoke --only step_time,offload   # the same code, tiny, on a CPU

Each check builds its own engines and rank 0 records figures; the pytest side asserts on them.

One GPU runs the bucket path too: every check's engine names grad_reduction "reduce_scatter"
(dist_engine_checks.LOMO_DEFAULTS), which one rank runs as a one-rank collective, so a world-1 NCCL
group, the buckets' side stream and the timers' events run on a single GPU as on many
(bucket_path records that they did); "sgd_direct" keeps one rank's default path (each gradient
applied as it arrives).

Most checks are the CPU suite's, run on CUDA: equivalence with SGD
(tests/engine/dist_engine_checks.py; clipping, recompute mode, reduce_dtype, mixture-of-experts),
AdaLomo against its reference (tests/engine/dist_adalomo_checks.py), LoRA+LOMO
(tests/methods/dist_methods_checks.py), gradient accumulation, bf16 and fp16 overflow, and the
integrations (tests/integrations/dist_hf_checks.py, tests/integrations/dist_dpo_checks.py through
tests/gpu/integration_checks.py). New here: the bucket path's facts, evaluation and generation on
the engine after a step against the unpartitioned model with its weights, parameter offload, peak
memory against the planner (with norm clipping's two passes too), step time against the floor and
DeepSpeed's own ZeRO-3 SGD and the host-update thread's overlap (tests/gpu/timing_checks.py), and
bf16 precision: AdaLomo through accumulation, the chunked loss (tests/gpu/precision_checks.py).
--smoke runs the new ones with tiny sizes on whatever device there is, so a CPU proves they run.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import os
import tempfile
import threading
import traceback
import warnings
from functools import partial

import torch

import lomo_ds
from lomo_ds.profiling import attach_timers, count_comm
from lomo_ds.runtime import ds_compat
from lomo_ds.runtime.device import accelerator_device
from tests import ranks
from tests.comm.dist_bucket_checks import check_experts
from tests.engine import dist_accumulation_checks as A
from tests.engine import dist_adalomo_checks as AD
from tests.engine import dist_engine_checks as E
from tests.engine.dist_engine_checks import check_bf16, check_overflow, ds_cfg, equivalence
from tests.gpu import integration_checks as I
from tests.gpu import precision_checks as P
from tests.gpu.compare import memory_run_config, predicted_peak_bytes
from tests.gpu.device_checks import by_owner, check_worker_contexts, sync_owner, worker_copy_wait
from tests.gpu.int8_checks import int8_checks
from tests.gpu.models import (
    CLIP_MEMORY_MODEL,
    LONG_ROWS_MODEL,
    MEMORY_MODEL,
    STEP_MODEL,
    llama,
    llama_config,
    measured_llama,
    random_batch,
    sync,
)
from tests.gpu.sequence_parallel_checks import sequence_parallel_checks
from tests.gpu.timing_checks import check_offload_overlap, check_step_time
from tests.host_memory import checkpoint_and_export_host_memory
from tests.integrations import dist_hf_checks as H
from tests.integrations.dist_grpo_generation_checks import check_generation as check_grpo_generation
from tests.methods.dist_methods_checks import fetch_per_layer, lora_lomo_two_passes
from tests.ranks import run_checks
from tests.tiny import (
    engine_sections,  # noqa: E402
    global_batch,
    tiny_llama,
)


def check_offload(pin: bool):
    """offload_param: cpu. The update must follow the shard to the host and still equal SGD
    (equivalence reports where the engine's first shard lives)."""
    cfg = ds_cfg()
    cfg["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": pin}
    result = equivalence(partial(tiny_llama, 0), cfg)
    result["shard_device"] = torch.device(result["shard_device"]).type
    return result


def check_bucket_path():
    """The bucket path as this launch runs it: the backend, the transport, the side stream, one
    reduce-scatter per bucket in a step, the step timers (accelerator events on a GPU), and the
    ZeRO-3 gather stream that the step's last update is ordered before (None: nothing to order)."""
    engine = lomo_ds.initialize(tiny_llama(0), ds_cfg(bucket_size=700))
    world, rank = engine.world, engine.rank
    attach_timers(engine)
    engine.train_step(global_batch(0, world)[rank])  # the first step settles the layout
    engine.timers.take()
    with count_comm() as counts:
        out = engine.train_step(global_batch(1, world)[rank])
    spans = engine.timers.take()
    gather_stream = getattr(engine.offload.get_param_coordinator(),
                            "_PartitionedParameterCoordinator__allgather_stream", None)
    # Each rank's device index, as lomo_ds set it (main() leaves it to lomo_ds).
    devices = [int(d[0]) for d in E.on_every_rank(engine.device.index or 0)]
    return {"backend": torch.distributed.get_backend(), "world": world, "device": str(engine.device),
            "device_per_rank": devices,
            "transport": engine.buckets.route.value, "side_stream": engine.buckets.stream is not None,
            "timers_on_accelerator": engine.timers.on_accelerator, "spans": spans,
            "buckets": len(engine.buckets.layout), "reduce_scatters": counts.calls_by_op["reduce_scatter"],
            "gather_stream": None if gather_stream is None else type(gather_stream).__name__,
            "skipped": out["skipped"]}


def adalomo_offload_cfg(pin: bool) -> dict:
    """AdaLomo with norm clipping on shards in host memory (uneven slices on 3 or more ranks)."""
    cfg = AD.adalomo_cfg(clip_grad_norm=0.5)
    cfg["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": pin}
    return cfg


def check_offload_two_devices():
    """offload_param cpu with persistent parameters: their shards stay on the GPU and the rest go
    to host memory, so one bucket updates shards on two devices. SGD and AdaLomo
    against their references, and bf16 with stochastic rounding (a generator per device) trains."""
    cfg = E.offload_cfg()
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 2000
    acfg = AD.adalomo_cfg(persist=2000)
    acfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    out = {"sgd": equivalence(partial(tiny_llama, 7), cfg), "adalomo": AD.equivalence(partial(tiny_llama, 7), acfg)}
    bf16 = copy.deepcopy(cfg)
    bf16["bf16"] = {"enabled": True}
    bf16["lomo"].update(stochastic_rounding=True, lr=1e-3)
    engine = lomo_ds.initialize(tiny_llama(7), bf16)
    out["shard_devices"] = sorted({ds_compat.shard(p).device.type for p in engine.params})
    before = [ds_compat.shard(p).clone() for p in engine.params]
    out["bf16_losses"] = [engine.train_step(global_batch(step, engine.world)[engine.rank])["loss"] for step in range(3)]
    out["bf16_moved_on"] = sorted({ds_compat.shard(p).device.type for p, b in zip(engine.params, before, strict=True)
                                   if not torch.equal(ds_compat.shard(p), b)})
    return out


def check_host_syncs():
    """CUDA's sync debug mode over the backward passes of a step (after the first, which settles
    the layout): the synchronising calls whose innermost caller outside torch is lomo_ds code (on a
    GPU each one drains the queue), and, for information, the others (DeepSpeed's
    hooks; the backward kernels', which autograd replays at the `.backward(` call). One pass, norm
    clipping, AdaLomo on the bucket path (and with offload_param cpu: the hook's part on the GPU,
    the shards' update on the host-update thread, whose own waits for its copies are reported
    apart: they keep that thread, not the backward, waiting), and one rank's direct path. Each
    call is lomo_ds's or not by its stack, whatever thread made it (device_checks.sync_owner): on
    CUDA the gradient hooks run on autograd's device thread, and the host-update worker's other
    syncs are lomo_ds's too."""
    if not torch.cuda.is_available():
        return {"skipped": "CUDA's sync debug mode needs CUDA"}
    torch_dir = os.path.dirname(torch.__file__)

    def owner(stack) -> str:
        return sync_owner(stack, threading.current_thread().name, torch_dir)

    out = {}
    for name, lomo in {"sgd": {}, "clip_norm": {"clip_grad_norm": 0.5}, "adalomo": {"optimizer": "adalomo"},
                       "adalomo_offload": {"optimizer": "adalomo"}, "direct": {"grad_reduction": "auto"},
                       # Accumulation: the host accumulator (slices copied to pinned memory, added as
                       # their copies finish), fused and one pass after the backward (norm clipping).
                       "accumulate_host": {"accumulation_steps": 2, "accumulate_on": "cpu"},
                       "accumulate_host_clip_norm": {"accumulation_steps": 2, "accumulate_on": "cpu",
                                                     "clip_grad_norm": 0.5},
                       "accumulate_clip_norm": {"accumulation_steps": 2, "clip_grad_norm": 0.5}}.items():
        cfg = ds_cfg(bucket_size=3000, **lomo)
        if name.endswith("_offload"):
            cfg = E.offloaded(cfg)
        engine = lomo_ds.initialize(tiny_llama(0), cfg)
        for i in range(engine.accumulation_steps):  # the first step settles the layout
            engine.train_step(global_batch(i, engine.world)[engine.rank])
        found = []

        def record(message, category, filename, lineno, file=None, line=None, _found=found):
            _found.append(owner(traceback.extract_stack()[:-1]))

        # CUDA's sync debug mode does not see an event's synchronize: counted apart, by its caller.
        event_waits = []
        event_sync = torch.cuda.Event.synchronize

        def counted(event, _waits=event_waits, _sync=event_sync):
            _waits.append(owner(traceback.extract_stack()[:-1]))
            return _sync(event)

        def watched(*args, _backward=engine._backward, _record=record, _counted=counted, _sync=event_sync,
                    **kwargs):
            with warnings.catch_warnings():  # restores warnings.showwarning at its end
                warnings.simplefilter("always")
                warnings.showwarning = _record
                torch.cuda.set_sync_debug_mode("warn")
                torch.cuda.Event.synchronize = _counted
                try:
                    return _backward(*args, **kwargs)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                    torch.cuda.Event.synchronize = _sync

        engine._backward = watched
        for i in range(engine.accumulation_steps):
            engine.train_step(global_batch(10 + i, engine.world)[engine.rank])
        syncs, others = by_owner(found)
        waits, other_waits = by_owner([w for w in event_waits if not worker_copy_wait(w)])
        out[name] = {"lomo_ds": syncs, "others": others, "event_waits_lomo_ds": waits,
                     "event_waits_others": other_waits,
                     "event_waits_worker_copies": sorted({w for w in event_waits if worker_copy_wait(w)})}
        del engine
    return out


def trained_engine_and_reference(seed: int = 21):
    """An engine after one LOMO step, and (rank 0) the unpartitioned model with its weights on the
    engine's device: what evaluation and generation on the engine must agree with."""
    engine = lomo_ds.initialize(tiny_llama(seed), ds_cfg())
    engine.train_step(global_batch(0, engine.world)[engine.rank])
    full = engine.full_state_dict()  # collective
    reference = None
    if engine.rank == 0:
        reference = tiny_llama(seed)
        reference.load_state_dict(full)
        reference.to(engine.device).eval()
    return engine, reference


def check_evaluation():
    """lomo_ds.evaluation.scoring on the engine after a step (candidate accuracy and the LM loss,
    the examples split over the ranks) against the same on the unpartitioned model, on one rank."""
    from lomo_ds.data.types import EvalExample
    from lomo_ds.evaluation.scoring import evaluate, evaluate_loss

    engine, reference = trained_engine_and_reference()
    g = torch.Generator(device="cpu").manual_seed(3)

    def ids(n):
        return torch.randint(3, 90, (n,), generator=g, device="cpu").tolist()

    examples = [EvalExample("t", ids(3 + i % 4), [ids(1 + i % 2), ids(2)], i % 2) for i in range(11)]
    texts = [ids(5 + i % 3) for i in range(7)]
    lm = [{"input_ids": t, "labels": [-100, -100] + t[2:]} for t in texts]

    def on(model, rank, world):
        fwd = (lambda b: engine.eval_forward(b).logits) if model is None else (lambda b: model(**b).logits)
        return {"accuracy": evaluate(fwd, examples, 0, 2, rank, world, device=engine.device),
                "loss": evaluate_loss(fwd, lm, 0, 2, rank, world, device=engine.device)}

    got = on(None, engine.rank, engine.world)
    want = on(reference, 0, 1) if reference is not None else None
    return {"engine": got, "reference": want}


PROMPT_LENGTHS = (4, 9, 6, 12, 5, 7, 3)


def gen_prompts(lengths=PROMPT_LENGTHS) -> list[dict]:
    g = torch.Generator(device="cpu").manual_seed(5)
    return [{"prompt_ids": torch.randint(3, 90, (n,), generator=g, device="cpu").tolist(), "messages": [],
             "reference": ""} for n in lengths]


class TokenIds:
    """A tokenizer's decode that writes the token ids: replies compared exactly."""

    @staticmethod
    def decode(ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def check_generation(lengths=PROMPT_LENGTHS):
    """lomo_ds.evaluation.generation on the engine after a step (greedy, KV cache, prompts of
    `lengths` split over the ranks, replies of different lengths) against the unpartitioned model
    answering each prompt alone."""
    from lomo_ds.evaluation.generation import evaluate_generation, generate_ids

    engine, reference = trained_engine_and_reference()
    synced = engine.world > 1
    ps = gen_prompts(lengths)
    # A stop token the first reply meets after 2 tokens (every rank asks the same, as one collective).
    stop = generate_ids(engine.module, [ps[0]["prompt_ids"]], stop_ids=[], pad_id=0, max_new_tokens=3,
                        device=engine.device, synced=synced)[0][2]
    _, rows = evaluate_generation(engine.module, ps, TokenIds, stop_ids=[stop], pad_id=0, max_new_tokens=8,
                                  batch_size=2, rank=engine.rank, world=engine.world, device=engine.device)
    if reference is None:
        return {}
    alone = [generate_ids(reference, [p["prompt_ids"]], stop_ids=[stop], pad_id=0, max_new_tokens=8,
                          device=engine.device)[0] for p in ps]
    return {"replies": [r["reply"] for r in rows], "reference": [TokenIds.decode(r) for r in alone],
            "lengths": [len(r) for r in alone]}


def check_memory(device: torch.device, workdir: str, sizes: dict = MEMORY_MODEL["gpu"], **lomo):
    """torch.cuda.max_memory_allocated over a steady-state step against the planner's prediction for
    the same run config (plan_for_run, as --dry-run prints it). `lomo`: more lomo options (norm
    clipping: both its passes are in the step whose peak is measured)."""
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    model_dir = os.path.join(workdir, "memory_model_" + "_".join(str(v) for v in sizes.values()))
    if rank == 0:
        llama_config(sizes).save_pretrained(model_dir)  # the planner reads the architecture from it
    torch.distributed.barrier()
    run = memory_run_config(model_dir, sizes["micro"], sizes["seq"], sizes.get("attn_implementation"), **lomo)
    base, model = measured_llama(sizes, device)
    engine = lomo_ds.initialize(model, {k: v for k, v in run.items() if k not in ("model", "tokenizer")})
    batch = random_batch(sizes, device, seed=rank)
    engine.train_step(batch)  # the first step records DeepSpeed's module trace
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    engine.train_step(batch)
    sync(device)
    measured = torch.cuda.max_memory_allocated(device) - base
    per_rank = [None] * world
    torch.distributed.all_gather_object(per_rank, measured)
    del engine, model
    gc.collect()
    torch.cuda.empty_cache()
    return {"measured": max(per_rank), "per_rank": per_rank, "predicted": predicted_peak_bytes(run, world),
            "base": base, "lomo": lomo}


# GPU clock cycles torch.cuda._sleep spins before the window's step reads the host accumulator:
# long enough (tens of ms at GPU clocks) that the host reaches the window's end first.
DELAY_CYCLES = 200_000_000
DELAYED_MODEL = {"gpu": dict(STEP_MODEL["gpu"], micro=2, seq=128, steps=2),
                 "smoke": dict(STEP_MODEL["smoke"], steps=2)}


def check_delayed_window_tail(device: torch.device, sizes: dict, cycles: int = DELAY_CYCLES):
    """accumulate_on cpu with norm clipping (the step is one pass over the accumulated shards after
    the backward, reading pinned host sums with copies that do not block), on the step-time model,
    with the device held back by torch.cuda._sleep just before that pass: the host reaches the
    window's end (zeroing the sums) while the copies are still queued. The result must still be
    torch.optim.SGD's on the window (K = 2, 2 windows), reference on this device."""
    from tests.engine.dist_accumulation_checks import reference_window

    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    k, lr = 2, 0.05
    ref = llama(sizes).to(device)
    cfg = {"train_micro_batch_size_per_gpu": sizes["micro"], "zero_optimization": {"stage": 3},
           **engine_sections({"lr": lr, "accumulation_steps": k, "accumulate_on": "cpu", "clip_grad_norm": 0.5,
                    **E.LOMO_DEFAULTS})}
    engine = lomo_ds.initialize(llama(sizes), cfg)
    apply = engine.closer.apply_accumulated

    def delayed(rule):
        if device.type == "cuda":
            torch.cuda._sleep(cycles)  # every copy of the pass queues behind it
        return apply(rule)

    engine.closer.apply_accumulated = delayed
    opt = torch.optim.SGD(ref.parameters(), lr=lr)
    norms = []
    for step in range(sizes["steps"]):
        window = [[random_batch(sizes, device, seed=10_000 * step + 100 * i + r) for r in range(world)]
                  for i in range(k)]
        out = [engine.train_step(mbs[rank]) for mbs in window][-1]
        _, ref_norm = reference_window(ref, opt, window, clip_norm=0.5)
        norms.append((out["grad_norm"], ref_norm))
    full = engine.full_state_dict()
    if rank:
        return {}
    diff = max((full[n].to(device) - p.detach()).abs().max().item() for n, p in ref.named_parameters())
    return {"max_abs_diff": diff, "norms": norms, "fused": engine.fused_accumulation,
            "accumulator_device": str(next(iter(engine.accumulator.buffers.values())).device),
            "delayed": device.type == "cuda", "model": sizes}


def checkpointed_llama(seed: int):
    model = tiny_llama(seed)
    model.gradient_checkpointing_enable()  # offload_checkpoints moves what checkpointing keeps
    return model


def long_rows(step: int, world: int) -> list[dict]:
    return global_batch(step, world, seq=90)  # 90 positions, hidden 40: the MLP in ceil(90 / 40) = 3 tiles


def gpu_checks(device: torch.device, on_gpu: bool, world: int, workdir: str, smoke: bool = False) -> dict:
    """The checks of this launch by name, as partials (tests/gpu/test_helpers.py binds each one's
    arguments to its function's signature and validates its config without running it)."""
    tiny = partial(partial, tiny_llama)  # tiny(seed): the model factory a check builds its copies with
    checks = {
        "bucket_path": partial(check_bucket_path),
        "sgd": partial(equivalence, tiny(0), ds_cfg()),
        # One rank's default (grad_reduction auto): each gradient applied as it arrives, no bucket.
        "sgd_direct": partial(equivalence, tiny(0), ds_cfg(grad_reduction="auto")),
        "clip_norm": partial(equivalence, tiny(1), ds_cfg(clip_grad_norm=0.5), {"clip_norm": 0.5}),
        "clip_norm_recompute": partial(equivalence, tiny(1), ds_cfg(clip_grad_norm=0.5, two_pass_mode="recompute"),
                                       {"clip_norm": 0.5}),
        # Buckets reduced in bf16 (an fp32 model): SGD's result up to bf16's rounding of the gradients.
        "reduce_dtype_bf16": partial(equivalence, tiny(0), ds_cfg(reduce_dtype="bf16")),
        "adalomo": partial(AD.equivalence, tiny(0), AD.adalomo_cfg()),
        "adalomo_clip_norm": partial(AD.equivalence, tiny(1), AD.adalomo_cfg(clip_grad_norm=0.5), clip_norm=0.5),
        # offload_param cpu: statistics and collectives in the hook on the GPU, the shards' update
        # on the host-update thread from pinned staging (memory.host_update auto).
        "adalomo_offload": partial(AD.equivalence, tiny(1), adalomo_offload_cfg(pin=on_gpu), clip_norm=0.5),
        "lora_lomo": partial(lora_lomo_two_passes, **E.LOMO_DEFAULTS),
        # Every method under the shipped configs' per-layer fetch with nothing persistent (LoRA's
        # frozen embedding once left the first layer's weights released before its backward).
        "fetch_per_layer": partial(fetch_per_layer),
        # Experts reached by some micro-batches only, switching every step (flush-only buckets).
        "experts": partial(check_experts, E.LOMO_DEFAULTS.get("grad_reduction", "auto")),
        "evaluation": partial(check_evaluation),
        "generation": partial(check_generation),
        "bf16": partial(check_bf16),
        "overflow": partial(check_overflow, fp16=True),
        "offload": partial(check_offload, pin=on_gpu),
        "offload_two_devices": partial(check_offload_two_devices),
        # The host-update thread against the updates inside the hook and against no offload (item 8).
        "offload_overlap": partial(check_offload_overlap, device, STEP_MODEL["gpu" if on_gpu else "smoke"]),
        "adalomo_offload_overlap": partial(check_offload_overlap, device, STEP_MODEL["gpu" if on_gpu else "smoke"],
                                           optimizer="adalomo"),
        "host_syncs": partial(check_host_syncs),
        # offload_param cpu on several GPUs: no rank's process (its host-update thread) on another's GPU.
        "worker_contexts": partial(check_worker_contexts),
        # A sum that overflows only inside the fp16 reduction (several ranks).
        "reduction_overflow": partial(E.check_reduction_overflow, "fp16" if on_gpu else None),
        "memory": partial(check_memory, device, workdir),
        # Norm clipping's two passes (HF's default max_grad_norm 1.0) on a model whose peak is mostly
        # the loss's one chunk: over the retained graph, and recomputed; and the same model without.
        "memory_loss_heavy": partial(check_memory, device, workdir, CLIP_MEMORY_MODEL["gpu"]),
        "memory_clip_retain_graph": partial(check_memory, device, workdir, CLIP_MEMORY_MODEL["gpu"],
                                            clip_grad_norm=1.0, two_pass_mode="retain_graph"),
        "memory_clip_recompute": partial(check_memory, device, workdir, CLIP_MEMORY_MODEL["gpu"],
                                         clip_grad_norm=1.0, two_pass_mode="recompute"),
        # The long-row options (memory.tiled_mlp, memory.offload_checkpoints) on the device: the
        # layer inputs go out to pinned host memory and come back for the recompute, the MLP runs in
        # tiles. Equal to SGD; and the long-row model's peak without and with them against the
        # planner's long-sequence terms (test_gpu.py also asks that the options save what is planned).
        "sequence_memory_sgd": partial(equivalence, partial(checkpointed_llama, 9),
                                       ds_cfg(clip_grad_norm=0.5, tiled_mlp=True, offload_checkpoints=True),
                                       {"clip_norm": 0.5}, batches=long_rows),
        "memory_long_rows": partial(check_memory, device, workdir, LONG_ROWS_MODEL["gpu"]),
        "memory_long_rows_tiled_offload": partial(check_memory, device, workdir, LONG_ROWS_MODEL["gpu"],
                                                  tiled_mlp=True, offload_checkpoints=True),
        "step_time": partial(check_step_time, device, STEP_MODEL["gpu" if on_gpu else "smoke"]),
        # Gradient accumulation on the GPU: the accumulator beside the shards, and in pinned host
        # memory (memory.accumulate_on cpu: slices copied over without blocking, the sum copied back),
        # fused into the K-th backward and as one pass after it (norm clipping).
        "accumulation": partial(A.equivalence, tiny(0), A.acc_cfg()),
        "accumulation_host": partial(A.equivalence, tiny(0), A.acc_cfg(accumulate_on="cpu")),
        "accumulation_host_clip_norm": partial(A.equivalence, tiny(1), A.acc_cfg(accumulate_on="cpu",
                                                                               clip_grad_norm=0.5), clip_norm=0.5),
        # The same on the step-time model with the device held back before the step's pass (a
        # missing wait before the host zeroes the sums shows as a wrong update).
        "delayed_window_tail": partial(check_delayed_window_tail, device, DELAYED_MODEL["gpu" if on_gpu else "smoke"]),
        # Rank 0's host memory around an export, a checkpoint save and its load (tests/host_memory.py).
        "host_memory": partial(checkpoint_and_export_host_memory, workdir),
        **precision_and_integration_checks(device, on_gpu),
        # Sequence parallelism on the device, sdpa and flash attention (2 or more GPUs).
        **sequence_parallel_checks(world),
        # 8-bit weight shards: the update against its references, the gather, the peak, held-back streams.
        **int8_checks(device, on_gpu, workdir),
    }
    if not on_gpu:  # DeepSpeed refuses fp16 on a CPU, and only CUDA reports allocator peaks and syncs
        checks.pop("overflow"), checks.pop("host_syncs"), checks.pop("worker_contexts")
        for name in [n for n in checks if n.startswith("memory")]:
            checks.pop(name)
    if world < 2:
        checks.pop("reduction_overflow")  # one rank's sum is its own gradient
        if not smoke:
            checks.pop("step_time")  # side by side on 2+ GPUs: one GPU has no reduction to overlap
    return checks


def precision_and_integration_checks(device: torch.device, on_gpu: bool) -> dict:
    """The bf16 paths: bf16 AdaLomo through accumulation against its reference on the same bf16
    weights, the chunked loss's head gradient with many chunks against fp64, and the integrations
    (the HF Trainer, SFTTrainer, DPO; the Trainer's bf16 AdaLomo with K = 4 against fp32 masters)."""
    return {
        "bf16_adalomo_accumulation": partial(P.check_bf16_adalomo_accumulation, device),
        "chunked_loss_precision": partial(P.check_chunked_loss_precision, device,
                                          P.CHUNK_SIZES["gpu" if on_gpu else "smoke"]),
        "trainer_lomo": partial(I.trainer_on_gpus, "lomo"),
        "trainer_adalomo": partial(I.trainer_on_gpus, "adalomo"),
        "trainer_bf16_adalomo": partial(I.trainer_bf16_adalomo, use_cpu=not on_gpu),
        "sft": partial(H.check_sft),
        "dpo_lomo": partial(I.dpo_on_device, "lomo"),
        "dpo_adalomo": partial(I.dpo_on_device, "adalomo"),
        # GRPO's generation: TRL samples from the gathered engine as a plain model with its weights does.
        "grpo_generation": partial(check_grpo_generation),
    }


@contextlib.contextmanager
def bucket_path_forced():
    """Within the block every ds_cfg() names the reduce-scatter transport: one rank runs it as a
    one-rank collective (lomo_ds/engine/buckets.py), so one GPU exercises what many do."""
    saved = dict(E.LOMO_DEFAULTS)
    E.LOMO_DEFAULTS["grad_reduction"] = "reduce_scatter"
    try:
        yield
    finally:
        E.LOMO_DEFAULTS.clear()
        E.LOMO_DEFAULTS.update(saved)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU: proves the new checks run")
    ap.add_argument("--only", default=None, help="comma-separated check names")
    args = ap.parse_args()

    on_gpu = torch.cuda.is_available() and not args.smoke
    # lomo_ds puts each rank on its own GPU (LOCAL_RANK), before anything reads the device: not
    # set here, so that a regression shows (bucket_path's device_per_rank; NCCL refuses two ranks
    # on one GPU).
    lomo_ds.init_distributed()
    device = accelerator_device() if on_gpu else torch.device("cpu")
    world = torch.distributed.get_world_size()
    workdir = os.path.dirname(os.path.abspath(args.out)) or tempfile.gettempdir()
    # The integrations' checks write their runs under tests.ranks.work_dir(), a launch's folder.
    ranks._work_dir = workdir
    with bucket_path_forced():  # the configs built now and those the checks build as they run
        run_checks(gpu_checks(device, on_gpu, world, workdir, smoke=args.smoke), args.out, only=args.only)


if __name__ == "__main__":
    main()
