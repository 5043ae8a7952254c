"""What the multi-rank engine checks build and measure; tests/engine/test_engine_dist.py declares them
(tests/ranks.py runs them in one launch per world size) and asserts on their figures. Every check
builds a fresh engine, runs it, and rank 0's figures go to the pytest side."""
from __future__ import annotations

import copy
import math

import deepspeed
import torch

import lomo_ds
from lomo_ds.profiling import count_comm
from lomo_ds.runtime import ds_compat
from lomo_ds.runtime.device import group_device
from tests.tiny import (
    engine_sections,  # noqa: E402
    global_batch,
    tiny_llama,
)

LR = 0.05
STEPS = 3


# zero_optimization.leaf_module: each decoder layer gathered whole, by one set of hooks (the
# shipped configs' fetch granularity; without it, DeepSpeed's default: one gather per module).
PER_LAYER = {"leaf_module": {"classes": ["LlamaDecoderLayer"]}}


# lomo options every ds_cfg() of this process takes unless the check names them: the GPU suite
# (tests/gpu/gpu_checks.py) sets grad_reduction "reduce_scatter", so one GPU runs the buckets too.
LOMO_DEFAULTS: dict = {}


def ds_cfg(persist=0, micro=2, fetch=None, **lomo):
    return {"train_micro_batch_size_per_gpu": micro,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": persist,
                                  "stage3_prefetch_bucket_size": 0, **(fetch or {})},
            **engine_sections({"lr": LR, "bucket_size": 700, **LOMO_DEFAULTS, **lomo})}


def max_diff(engine, ref):
    full = engine.full_state_dict()
    if engine.rank != 0:
        return None
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    assert set(full) == set(ref_params), (sorted(full), sorted(ref_params))
    return max((full[k] - ref_params[k].detach()).abs().max().item() for k in ref_params)


def forward_seed(step, index):
    """The random state micro-batch `index` of `step` is forwarded with (dropout), by the engine
    on rank `index` and by the reference alike."""
    return 7919 * step + index


def reference_step(ref, mbs, world, clip_norm=None, clip_value=None, wd=0.0, forward=None, step=None):
    forward = forward or (lambda m, b: m(**b).loss)
    opt = torch.optim.SGD(ref.parameters(), lr=LR, weight_decay=wd)
    opt.zero_grad()

    def micro(i, mb):
        if step is not None:
            torch.manual_seed(forward_seed(step, i))
        return forward(ref, mb)

    loss = sum(micro(i, mb) for i, mb in enumerate(mbs)) / world
    loss.backward()
    norm = None
    if clip_norm is not None:
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip_norm).item()
    if clip_value is not None:
        torch.nn.utils.clip_grad_value_(ref.parameters(), clip_value)
    opt.step()
    return loss.item(), norm


def equivalence(make_model, cfg, ref_kwargs=None, forward=None, engine_forward_batch=None, zero_init=False,
                steps=STEPS, prepare=None, seeded=False, own_group=False,
                batches=global_batch):
    ref_kwargs = ref_kwargs or {}
    ref = make_model()
    if zero_init:
        # Built already partitioned (no rank ever holds the whole model), then loaded from rank 0
        # the way from_pretrained loads a checkpoint under zero.Init.
        ds_conf = {k: v for k, v in cfg.items() if k != "lomo"}
        # own_group: sharded over a process group of every rank that is not the default group
        # object, so the engine must take each parameter's ds_process_group, not assume WORLD.
        group = torch.distributed.new_group(list(range(torch.distributed.get_world_size()))) if own_group else None
        with deepspeed.zero.Init(config_dict_or_path=ds_conf, data_parallel_group=group):
            model = make_model()
        for p, src in zip(model.parameters(), ref.parameters(), strict=True):
            with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                if torch.distributed.get_rank() == 0:
                    p.data.copy_(src.data)
    else:
        model = copy.deepcopy(ref)
    if prepare:
        prepare(model), prepare(ref)
    engine = lomo_ds.initialize(model, cfg)
    world, rank = engine.world, engine.rank
    losses, ref_losses, norms, ref_norms = [], [], [], []
    for step in range(steps):
        mbs = batches(step, world)
        if seeded:
            torch.manual_seed(forward_seed(step, rank))
        out = engine.train_step(mbs[rank])
        rl, rn = reference_step(ref, mbs, world, forward=forward, step=step if seeded else None, **ref_kwargs)
        losses.append(out["loss"]), ref_losses.append(rl), norms.append(out["grad_norm"]), ref_norms.append(rn)
    diff = max_diff(engine, ref)
    return {"max_abs_diff": diff, "loss": losses, "ref_loss": ref_losses, "grad_norm": norms,
            "ref_grad_norm": ref_norms, "host_updates": host_updates_applied(engine),
            "n_persistent": len(engine.offload.persistent_parameters), "n_params": len(engine.params),
            "leaf_modules": sorted({type(m).__name__ for m in ds_compat.leaf_modules(engine.module)}),
            "shard_device": str(ds_compat.shard(engine.params[0]).device),
            "param_group_is_world": ds_compat.process_group(engine.params[0]) is torch.distributed.group.WORLD}


def with_dropout(model, p=0.3):
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = p
    return model


def offload_cfg(**lomo):
    return offloaded(ds_cfg(**lomo))


def offloaded(cfg):
    cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    return cfg


def host_updates_applied(engine) -> int:
    """Slices the host-update worker applied (host_updates.py). On an accelerator every update
    (SGD's, or AdaLomo's host part) of a shard in host memory must go there: the GPU suite's
    offload checks (the equivalences) fail on the serialised path, where the hook itself copies
    and updates."""
    applied = engine.host_updates.applied if engine.host_updates is not None else 0
    in_host_memory = [p for p in engine.params if ds_compat.shard(p).device.type == "cpu"]
    if engine.device.type != "cpu" and in_host_memory and not applied:
        raise AssertionError(f"{len(in_host_memory)} shards in host memory on {engine.device}, none updated by the "
                             "host-update thread: their updates ran inside the backward")
    return applied


def inline_and_thread(make_cfg, steps: int = 2) -> tuple[dict, int]:
    """The full state after `steps` bf16 steps (stochastic rounding) of tiny_llama(11), with
    memory.host_update "inline" and "thread" (make_cfg(mode): the engine's config), and how many
    slices the worker applied in the thread run."""
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    full, applied = {}, 0
    for mode in ("inline", "thread"):
        cfg = make_cfg(mode)
        cfg["bf16"] = {"enabled": True}
        engine = lomo_ds.initialize(tiny_llama(11), cfg)
        for step in range(steps):
            engine.train_step(global_batch(step, world)[rank])
        full[mode] = engine.full_state_dict()
        applied = host_updates_applied(engine)
    return full, applied


def check_host_update_thread():
    """memory.host_update "thread" with offloaded shards: bf16 with stochastic rounding and norm
    clipping gives bit-identical shards to the inline update (the same slices, the same rounding
    draws in the same order); a non-finite gradient in the updating pass is skipped everywhere."""
    rank = torch.distributed.get_rank()
    full, applied = inline_and_thread(lambda mode: offload_cfg(clip_grad_norm=0.5, host_update=mode))
    same = None if rank else all(torch.equal(full["inline"][k], full["thread"][k]) for k in full["inline"])
    return {"bitwise_equal": same, "thread_applied": applied,
            "nonfinite": nonfinite_grad_steps(offload_cfg(clip_grad_norm=0.5, two_pass_mode="recompute",
                                                          host_update="thread"), poison_pass=2)}


def scaled_forward(m, b):
    return m(**b)


def on_every_rank(*values: float) -> list[list[float]]:
    """`values` from every rank, rank by rank (a test-side collective, on the group's device: NCCL
    gathers only accelerator tensors)."""
    mine = torch.tensor([float(v) for v in values], dtype=torch.float64, device=group_device())
    gathered = [torch.zeros_like(mine) for _ in range(torch.distributed.get_world_size())]
    ds_compat.all_gather(gathered, mine, name="check figures")
    return [g.cpu().tolist() for g in gathered]


def raw_shards(engine):
    # Raw bytes: "bit-identical" includes the padding tail, which may hold NaN patterns.
    return [ds_compat.shard(p).clone().view(torch.uint8) for p in engine.params]


def watched_step(engine, step: int, watched=raw_shards) -> tuple[dict, dict]:
    """One training step on this rank's micro-batch of global batch `step`, and every rank's
    verdict on it: skipped, the watched shards bit-identical, every real shard element finite."""
    before = watched(engine)
    out = engine.train_step(global_batch(step, engine.world)[engine.rank])
    unchanged = all(torch.equal(a, b) for a, b in zip(before, watched(engine), strict=True))
    finite = all(bool(torch.isfinite(ds_compat.shard(p)[:engine.updater.geometry(p).local]).all())
                 for p in engine.params)
    g = on_every_rank(out["skipped"], unchanged, finite)
    return out, {key: [bool(x[i]) for x in g] for i, key in enumerate(("skipped", "unchanged", "finite"))}


def poison_grad_hook(param, when):
    """Make `param`'s gradient infinite on the last rank while when() is true."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    param.register_hook(lambda g: g * float("inf") if when() and rank == world - 1 else g)


def check_overflow(fp16: bool = False):
    """A non-finite gradient on the last rank only: every rank skips, parameters bit-identical.
    fp16=True: real fp16 weights (GPUs; DeepSpeed refuses fp16 on a CPU), else fp32 with the scaler forced on."""
    model = tiny_llama(3)
    cfg = ds_cfg(loss_scale={"enabled": True, "initial_scale_power": 8, "window": 2})
    if fp16:
        cfg["fp16"] = {"enabled": True}
    engine = lomo_ds.initialize(model, cfg)
    inject = {"on": False}
    poison_grad_hook(engine.module.model.layers[0].mlp.down_proj.weight, lambda: inject["on"])
    record = []
    for step in range(5):
        inject["on"] = step == 1
        out, verdict = watched_step(engine, step)
        record.append({"step": step, "skipped_all_ranks": verdict["skipped"],
                       "unchanged_all_ranks": verdict["unchanged"],
                       "loss_scale_used": out["loss_scale"], "scale_after": engine.loss_scaler.scale})
    return {"steps": record}


def check_reduction_overflow(reduce_dtype: str | None = None):
    """Every rank's gradient finite, their sum not: element 0 of a weight is set on every rank to a
    value whose double overflows the reduction's dtype (fp32: 3e38; fp16: 40000, as an fp16 sum
    overflows on GPUs). Element 0 is rank 0's: only rank 0's received slice is non-finite, and no
    outgoing payload was. Several ranks only (one rank's sum is its own gradient)."""
    huge = {None: 3e38, "fp32": 3e38, "fp16": 40000.0}[reduce_dtype]
    engine = lomo_ds.initialize(tiny_llama(3), ds_cfg(grad_reduction="reduce_scatter", reduce_dtype=reduce_dtype))
    target = engine.module.model.layers[0].mlp.down_proj.weight
    inject = {"on": False}

    def set_huge(g):
        if not inject["on"]:
            return g
        g = g.clone()
        g.view(-1)[0] = huge
        return g

    target.register_hook(set_huge)
    steps = []
    for step in range(3):
        inject["on"] = step == 1
        steps.append(watched_step(engine, step)[1])
    return {"steps": steps}


def assert_reduction_overflow_skips(r: dict) -> None:
    """check_reduction_overflow's figures (CPU and GPU suites)."""
    before, overflowed, after = r["steps"]
    assert all(overflowed["finite"]), f"an inf from the reduction reached a shard: {overflowed}"
    assert all(overflowed["skipped"]), f"the overflowed step must be skipped on every rank: {overflowed}"
    assert not any(before["skipped"]) and not any(after["skipped"]) and all(after["finite"]), r


def check_nonfinite_loss():
    """One pass (fp32, no loss scaling): NaN activations on the last rank at step 1. Every rank
    knows before the backward and skips: no shard touched anywhere; the next step trains."""
    engine = lomo_ds.initialize(tiny_llama(3), ds_cfg())
    world, rank = engine.world, engine.rank
    inject = {"on": False}
    engine.module.model.embed_tokens.register_forward_hook(
        lambda m, i, out: out * float("nan") if inject["on"] and rank == world - 1 else out)
    record = []
    for step in range(3):
        inject["on"] = step == 1
        record.append(watched_step(engine, step)[1])
    return {"steps": record, "skipped_steps": engine.skipped_steps}


def nonfinite_grad_steps(cfg, poison_pass: int) -> dict:
    """At step 1 a gradient turns infinite in the last rank's `poison_pass`-th backward only
    (the loss is finite). Every rank must mark the step skipped, no non-finite value may reach
    a shard, and the poisoned parameter stays untouched everywhere; step 2 trains again."""
    engine = lomo_ds.initialize(tiny_llama(3), cfg)
    target = engine.module.model.layers[0].mlp.down_proj.weight
    passes = {"step": -1, "seen": 0}

    def poisoned():
        passes["seen"] += 1
        return passes["step"] == 1 and passes["seen"] == poison_pass

    poison_grad_hook(target, poisoned)
    record = []
    for step in range(3):
        passes.update(step=step, seen=0)
        _, verdict = watched_step(engine, step, watched=lambda e: [ds_compat.shard(target).clone().view(torch.uint8)])
        record.append({"skipped": verdict["skipped"], "target_unchanged": verdict["unchanged"],
                       "finite": verdict["finite"]})
    return {"steps": record, "skipped_steps": engine.skipped_steps}


def check_nonfinite_grad():
    """Found by the buckets' non-finite flag (interfaces item 2): in a one-pass step, and in the
    updating pass of a two-pass step (norm clipping, recompute) whose measuring pass was clean."""
    return {"one_pass": nonfinite_grad_steps(ds_cfg(), poison_pass=1),
            "update_pass": nonfinite_grad_steps(ds_cfg(clip_grad_norm=0.5, two_pass_mode="recompute"), poison_pass=2)}


def labelled(mb):
    return bool((mb["labels"][..., 1:] != -100).any())


def check_unlabelled_rank():
    """Rank 0's micro-batch has no labelled token at step 1 (its loss alone would be 0/0 = NaN):
    it contributes a zero gradient; the others' update is SGD's on their mean loss over `world`,
    and the reported loss is the mean over the ranks with labels. Several ranks only."""
    ref = tiny_llama(4)
    engine = lomo_ds.initialize(copy.deepcopy(ref), ds_cfg())
    world, rank = engine.world, engine.rank
    losses, ref_losses, skipped = [], [], []
    for step in range(STEPS):
        mbs = global_batch(step, world)
        if step == 1:
            mbs[0]["labels"][:] = -100
        out = engine.train_step(mbs[rank])
        with torch.no_grad():
            ref_losses.append(sum(ref(**mb).loss.item() for mb in mbs if labelled(mb)) / sum(map(labelled, mbs)))
        reference_step(ref, mbs, world, forward=lambda m, b: m(**b).loss if labelled(b) else 0.0)
        losses.append(out["loss"]), skipped.append(out["skipped"])
    diff = max_diff(engine, ref)
    # No labelled token on any rank: nothing to learn, the step is skipped, and it is no
    # overflow: the loss scale stays.
    scaled = lomo_ds.initialize(tiny_llama(4), ds_cfg(loss_scale={"enabled": True}))
    mb = global_batch(0, world)[rank]
    mb["labels"][:] = -100
    before = raw_shards(scaled)
    out = scaled.train_step(mb)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, raw_shards(scaled), strict=True))
    return {"max_abs_diff": diff, "loss": losses, "ref_loss": ref_losses, "skipped": skipped,
            "none_labelled": {"skipped": out["skipped"], "unchanged": unchanged,
                              "scale_kept": scaled.loss_scaler.scale == out["loss_scale"]}}


def check_max_consecutive_skips():
    """Overflow on every step (the loss scaler stuck): a clear error on every rank at the third
    skip in a row (max_consecutive_skips: 3), after a clean step reset the count."""
    engine = lomo_ds.initialize(tiny_llama(3), ds_cfg(max_consecutive_skips=3,
                                                      loss_scale={"enabled": True, "initial_scale_power": 4}))
    world, rank = engine.world, engine.rank
    inject = {"on": False}
    poison_grad_hook(engine.module.model.layers[0].mlp.down_proj.weight, lambda: inject["on"])
    message, raised_at = "", -1
    for step in range(8):
        inject["on"] = step not in (0, 2)  # skips: 1, (clean 2), 3, 4, 5 -> the third in a row at step 5
        try:
            engine.train_step(global_batch(step, world)[rank])
        except RuntimeError as e:
            message, raised_at = str(e), step
            break
    return {"raised_at": [int(g[0]) for g in on_every_rank(raised_at)], "message": message}


def check_resume_masters():
    """bf16 with fp32 masters: a resumed engine takes its masters from the checkpoint (its next
    step matches the uninterrupted engine's bit for bit); a checkpoint without masters is refused."""
    cfg = ds_cfg(fp32_master_weights=True)
    cfg["bf16"] = {"enabled": True}
    engine = lomo_ds.initialize(tiny_llama(11), cfg)
    world, rank = engine.world, engine.rank
    for step in range(2):
        engine.train_step(global_batch(step, world)[rank])
    state = engine.shard_state_dict()
    resumed = lomo_ds.initialize(tiny_llama(11), copy.deepcopy(cfg))
    resumed.load_shard_state_dict(state)
    for e in (engine, resumed):
        e.train_step(global_batch(2, world)[rank])
    a, b = engine.full_state_dict(), resumed.full_state_dict()
    same = None if rank else all(torch.equal(a[k], b[k]) for k in a)
    fresh = lomo_ds.initialize(tiny_llama(11), copy.deepcopy(cfg))
    try:
        fresh.load_shard_state_dict({**state, "masters": {}})
        refused = ""
    except ValueError as e:
        refused = str(e)
    return {"resumed_matches": same, "refused": refused}


def check_device():
    """The batch is moved to engine.device by train_step and eval_forward (a tensor subclass
    records the .to calls); a collective given a tensor off its group's device is refused,
    naming it; total_steps= wins over train.scheduler.total_steps."""
    cfg = ds_cfg(scheduler={"type": "linear", "total_steps": 0})
    engine = lomo_ds.initialize(tiny_llama(3), cfg, total_steps=10)
    world, rank = engine.world, engine.rank
    moves = []

    class Recording(torch.Tensor):
        def to(self, *args, **kwargs):
            moves.append(str(args[0] if args else kwargs.get("device")))
            return super().to(*args, **kwargs).as_subclass(torch.Tensor)

    def recorded(mb):
        return {k: v.as_subclass(Recording) for k, v in mb.items()}

    out = engine.train_step(recorded(global_batch(0, world)[rank]))
    train_moves = list(moves)
    moves.clear()
    engine.eval_forward(recorded(global_batch(1, world)[rank]))
    refused = {}
    for name, call in {"all_reduce": lambda: ds_compat.all_reduce(torch.zeros(2, device="meta"), engine.group,
                                                                  name="test tensor"),
                       "reduce_scatter": lambda: ds_compat.reduce_scatter_async(torch.zeros(1, device="meta"),
                                                                                torch.zeros(world, device="meta"),
                                                                                engine.group, name="test bucket"),
                       "broadcast": lambda: ds_compat.broadcast_from_first(torch.zeros(1, device="meta"), engine.group,
                                                                           name="test order")}.items():
        try:
            call()
            refused[name] = ""
        except ValueError as e:
            refused[name] = str(e)
    return {"device": str(engine.device), "train_moves": train_moves, "eval_moves": moves, "refused": refused,
            "lr": [engine.schedule.lr_at(s) for s in (0, 5, 10)], "trained": not out["skipped"]}


def check_memory():
    """Peak bytes held during backward against the bound: shards + bucket + one layer."""
    model = tiny_llama(4, layers=4, hidden=64)
    cfg = ds_cfg(micro=2)
    cfg["zero_optimization"].update({"stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0})
    engine = lomo_ds.initialize(model, cfg)
    tracker = engine.enable_memory_tracking()
    world, rank = engine.world, engine.rank
    for step in range(2):
        tracker.reset()
        engine.train_step(global_batch(step, world)[rank])
    esize = 4
    shard_bytes = sum(ds_compat.shard(p).numel() * esize for p in engine.params)
    full_bytes = sum(ds_compat.full_numel(p) * esize for p in engine.params)
    # The largest "layer" DeepSpeed gathers at once: a module's own (direct) parameters.
    layer_bytes = max(sum(ds_compat.full_numel(p) * esize for p in m.parameters(recurse=False))
                      for m in engine.module.modules())
    block_bytes = max(sum(ds_compat.full_numel(p) * esize for p in blk.parameters())
                      for blk in engine.module.model.layers)
    bucket_cap = cfg["comm"]["bucket_size"] * esize * world  # gradients pending + the send buffer
    largest_param = max(ds_compat.full_numel(p) for p in engine.params) * esize
    p = tracker.peak
    return {"peak": {"shard": p.shard_bytes, "gathered": p.gathered_bytes, "persistent": p.persistent_bytes,
                     "grad": p.grad_bytes, "bucket": p.bucket_bytes, "total": p.total},
            "peak_gathered_plus_grad": tracker.peak_gathered_plus_grad,
            "shard_bytes": shard_bytes, "full_model_bytes": full_bytes, "layer_bytes": layer_bytes,
            # A bucket filling (gradients, then its send buffer) while the previous one is in flight:
            # its send buffer and this rank's 1/world receive buffer.
            "block_bytes": block_bytes, "bucket_bound": (2 + 1 / world) * (bucket_cap + largest_param),
            "samples": tracker.samples}


def check_comm(two_pass: bool):
    """Bytes sent per step, by collective, against the ZeRO-3 minimum."""
    model = tiny_llama(5, layers=2)
    lomo = {"clip_grad_norm": 1e-3} if two_pass else {}
    cfg = ds_cfg(grad_reduction="reduce_scatter", **lomo)
    # No parameter kept gathered between uses: every use is a fresh all-gather, the ZeRO-3 floor
    # for a model that does not fit gathered.
    cfg["zero_optimization"].update({"stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0})
    engine = lomo_ds.initialize(model, cfg)
    world, rank = engine.world, engine.rank
    engine.train_step(global_batch(0, world)[rank])  # first step records DeepSpeed's trace
    with count_comm() as counts:
        engine.train_step(global_batch(1, world)[rank])
    esize = 4
    padded = sum(math.ceil(ds_compat.full_numel(p) / world) * world for p in engine.params)
    nonpersistent_padded = sum(math.ceil(ds_compat.full_numel(p) / world) * world for p in engine.params
                               if not ds_compat.is_persistent(p))
    ring = (world - 1) / world
    # Each bucket's payload carries one non-finite flag element per rank besides the gradients.
    flags = world * len(engine.buckets.layout)
    return {"counts": counts.as_dict(),
            "param_padded_bytes": padded * esize, "nonpersistent_padded_bytes": nonpersistent_padded * esize,
            "expected_reduce_scatter": int(ring * (padded + flags) * esize) * (2 if two_pass else 1),
            "ring": ring, "world": world}


def check_bf16(steps=20, lr=1e-3):
    """bf16 shards with no master copy: stochastic rounding keeps the small updates that
    round-to-nearest drops. Measured as the relative error of the total parameter change
    against an fp32 reference trained on the same batches."""
    ref = tiny_llama(10)
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    world = torch.distributed.get_world_size()
    opt = torch.optim.SGD(ref.parameters(), lr=lr)
    for step in range(steps):
        mbs = global_batch(step, world)
        opt.zero_grad()
        (sum(ref(**mb).loss for mb in mbs) / world).backward()
        opt.step()
    return bf16_movement(ref, start, lambda **lomo: ds_cfg(lr=lr, **lomo), steps)


def bf16_movement(ref, start: dict, make_cfg, steps: int) -> dict:
    """bf16 runs of the engine (stochastic rounding, round-to-nearest, fp32 masters) against the
    movement `ref` made from `start` in fp32 on the same batches. make_cfg(**lomo options) is
    the engine's config before bf16 is switched on."""
    world = torch.distributed.get_world_size()
    ref_delta = torch.cat([(p.detach() - start[n]).reshape(-1) for n, p in ref.named_parameters()])
    out = {}
    for mode, lomo in {"stochastic": {"stochastic_rounding": True},
                       "nearest": {"stochastic_rounding": False},
                       "fp32_master": {"stochastic_rounding": False, "fp32_master_weights": True}}.items():
        cfg = make_cfg(**lomo)
        cfg["bf16"] = {"enabled": True}
        model = tiny_llama(10)
        bf16_start = {n: p.detach().to(torch.bfloat16).float() for n, p in model.named_parameters()}
        engine = lomo_ds.initialize(model, cfg)
        for step in range(steps):
            engine.train_step(global_batch(step, world)[engine.rank])
        full = engine.full_state_dict()
        if engine.rank == 0:
            delta = torch.cat([(full[n].float() - bf16_start[n]).reshape(-1) for n, _ in ref.named_parameters()])
            # realized: the share of the reference's movement the bf16 run made (1.0 = all of
            # it, on average); round-to-nearest loses the updates below half an ulp.
            out[mode] = {"rel_error": ((delta - ref_delta).norm() / ref_delta.norm()).item(),
                         "realized": (delta @ ref_delta / (ref_delta @ ref_delta)).item(),
                         "dtype": str(next(iter(full.values())).dtype)}
    return out


# ----------------------------------------------------------------------------- shared assertions
def assert_overflow_recovers(r: dict) -> None:
    """check_overflow's figures (CPU and GPU suites): every rank skips the overflowed step, the scale halves
    and grows back."""
    s0, s1, s2, s3 = r["steps"][:4]
    assert not any(s0["skipped_all_ranks"]) and not any(s0["unchanged_all_ranks"])
    assert all(s1["skipped_all_ranks"]), "every rank must skip the step the last rank overflowed"
    assert all(s1["unchanged_all_ranks"]), "a skipped step must leave every shard bit-identical"
    assert s1["scale_after"] == s1["loss_scale_used"] / 2
    assert not any(s2["skipped_all_ranks"]) and not any(s3["skipped_all_ranks"])
    assert s3["scale_after"] == s1["scale_after"] * 2, "the scale grows back after `window` clean steps"


def assert_bf16_rounding(r: dict) -> None:
    """check_bf16's figures (CPU and GPU suites): stochastic rounding and fp32 masters keep the small
    updates that round-to-nearest loses."""
    print({k: (round(v["realized"], 3), round(v["rel_error"], 3)) for k, v in r.items()})
    assert all(v["dtype"] == "torch.bfloat16" for v in r.values())
    assert 0.9 <= r["stochastic"]["realized"] <= 1.1
    assert 0.9 <= r["fp32_master"]["realized"] <= 1.1
    assert r["nearest"]["realized"] < r["stochastic"]["realized"] - 0.1, "round-to-nearest should lose updates"
    assert r["fp32_master"]["rel_error"] < r["nearest"]["rel_error"]
