"""What the multi-rank checks of the reduce-scatter buckets build and measure; tests/comm/test_buckets.py
declares them (tests/ranks.py runs them in one launch per world size) and asserts on rank 0's figures."""
from __future__ import annotations

import os
import time
from unittest import mock

import torch
from transformers import LlamaForCausalLM

import lomo_ds
from lomo_ds.comm.grad import resolve_grad_route
from lomo_ds.engine.update import geometry
from lomo_ds.profiling import count_comm
from lomo_ds.runtime import ds_compat
from tests.engine.dist_engine_checks import STEPS, ds_cfg, equivalence, max_diff, on_every_rank, reference_step
from tests.tiny import global_batch, tiny_llama, tiny_llama_config

# The two ways buckets are summed over several ranks (comm.grad_reduction).
TRANSPORTS = ("reduce_scatter", "shared_memory")


def check_nonfinite(bf16: bool, transport: str = "auto", overflow: bool = False):
    """inf in one element of one parameter's gradient on the last rank only, in a one-pass step:
    every rank sees the non-finite flag, the buckets before it are applied, that bucket and every
    later one are not. The element is the parameter's first, in rank 0's slice: on several ranks
    the last rank never receives it, and learns of it only from the flag it sent.
    `overflow`: instead, every rank's element is a finite 2e38, whose sum over the ranks overflows
    in the reduction: only rank 0, which receives it, can see it."""
    cfg = ds_cfg(bucket_size=3000, grad_reduction=transport)
    if bf16:
        cfg["bf16"] = {"enabled": True}
    engine = lomo_ds.initialize(tiny_llama(11), cfg)
    world, rank = engine.world, engine.rank
    target = engine.module.model.layers[0].mlp.up_proj.weight
    inject = {"on": False}

    def poison(g):
        if not (inject["on"] and (overflow or rank == world - 1)):
            return g
        g = g.clone()
        g.view(-1)[0] = 2e38 if overflow else float("inf")
        return g

    target.register_hook(poison)
    engine.train_step(global_batch(0, world)[rank])  # the first step settles the layout
    layout = [list(b) for b in engine.buckets.layout] if world > 1 else [[p] for p in engine.buckets.arrived]
    bad = next(b for b, params in enumerate(layout) if any(p is target for p in params))
    # Real elements only: the padded tail of the last ranks' shards is never written by the update.
    real = lambda p: ds_compat.shard(p)[:geometry(p, world, rank).local]  # noqa: E731
    shards = lambda: {id(p): real(p).clone() for p in engine.params}  # noqa: E731
    before = shards()
    inject["on"] = True
    engine.train_step(global_batch(1, world)[rank])
    after = shards()
    # 1: moved, 0: unchanged, -1: this rank holds no element of it
    changed = [[float(not torch.equal(before[id(p)], after[id(p)])) if before[id(p)].numel() else -1.0
                for p in params] for params in layout]
    found = not bool(engine.buckets.stats.finite)
    inject["on"] = False
    engine.train_step(global_batch(2, world)[rank])
    again = shards()
    moved_next = float(all(not torch.equal(after[id(p)], again[id(p)]) for p in engine.params
                           if geometry(p, world, rank).local > 0))
    # Real elements only: the padded tail of the last ranks' shards is never written and may hold
    # any bit pattern, NaN included.
    finite_after = float(all(torch.isfinite(ds_compat.shard(p)[:geometry(p, world, rank).local]).all()
                             for p in engine.params))
    flags = on_every_rank(float(found), float(not bool(engine.buckets.stats.finite)), moved_next, finite_after)
    # Which buckets moved, on every rank: a rank that never received the bad element must drop its
    # bucket too (on the flag alone).
    sizes = [len(bucket) for bucket in changed]
    every = [[flat[sum(sizes[:b]):sum(sizes[:b + 1])] for b in range(len(sizes))]
             for flat in on_every_rank(*[c for bucket in changed for c in bucket])]
    return {"n_buckets": len(layout), "bad_bucket": bad, "changed_by_bucket": every,
            "found_all_ranks": [f[0] for f in flags], "found_next_step": [f[1] for f in flags],
            "next_step_updates_all": [f[2] for f in flags], "finite_all_ranks": [f[3] for f in flags]}


class TwoExperts(torch.nn.Module):
    """Two expert layers; the caller picks one per micro-batch."""

    def __init__(self, hidden: int):
        super().__init__()
        self.experts = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(2))

    def forward(self, hidden, choice: int):
        return hidden + self.experts[choice](hidden)


class TwoExpertLlama(torch.nn.Module):
    """A tiny LLaMA with a two-expert layer after the decoder; a micro-batch's first token picks the
    expert, so an expert can get a gradient on some ranks only, or on none: a mixture-of-experts
    layer in small. As DeepSpeed requires of MoE blocks, the expert layer is a ZeRO-3 leaf module
    (gathered as a whole, so every rank runs the same module sequence)."""

    def __init__(self, seed: int):
        super().__init__()
        self.llama = tiny_llama(seed)
        torch.manual_seed(seed + 1)
        self.moe = TwoExperts(self.llama.config.hidden_size)

    def forward(self, input_ids, labels):
        hidden = self.llama.model(input_ids=input_ids).last_hidden_state
        logits = self.llama.lm_head(self.moe(hidden, int(input_ids[0, 0]) % 2))
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)),
                                                 labels[:, 1:].reshape(-1))


def routed_batch(step: int, world: int) -> list[dict]:
    """The global batch with micro-batch r routed to expert (r + step) % 2 on every step."""
    mbs = global_batch(step, world)
    for r, mb in enumerate(mbs):
        mb["input_ids"][0, 0] = (r + step) % 2
        mb["labels"][0, 0] = (r + step) % 2
    return mbs


def check_experts(transport: str = "auto"):
    """Experts reached on some ranks only, switching every step, against single-process SGD."""
    from deepspeed.utils import set_z3_leaf_modules

    return equivalence(lambda: TwoExpertLlama(12), ds_cfg(bucket_size=2000, grad_reduction=transport),
                       forward=lambda m, b: m(**b),
                       steps=4, batches=routed_batch, prepare=lambda m: set_z3_leaf_modules(m, [TwoExperts]))


def check_expert_send_order(transport: str = "auto"):
    """Experts reached on some ranks only, every parameter gathered in the backward (no persistent
    ones): each bucket is sent at the same point among ZeRO-3's all-gathers on every rank (the
    collectives' order on one communicator); the experts' buckets are the last, flush-only."""
    from deepspeed.utils import set_z3_leaf_modules

    model = TwoExpertLlama(12)
    set_z3_leaf_modules(model, [TwoExperts])
    engine = lomo_ds.initialize(model, ds_cfg(bucket_size=2000, grad_reduction=transport))
    world, rank = engine.world, engine.rank
    engine.train_step(routed_batch(0, world)[rank])  # the first step settles the layout
    gathers_at_send, send = [], engine.buckets._send_next
    with count_comm() as counts:
        engine.buckets._send_next = lambda: (gathers_at_send.append(counts.calls_by_op["all_gather_into_tensor"]),
                                             send())[-1]
        for step in (1, 2, 3):
            engine.train_step(routed_batch(step, world)[rank])
    experts = {id(p) for p in model.moe.parameters()}
    flush_only = sorted(engine.buckets.flush_only)
    return {"gathers_at_send": on_every_rank(*gathers_at_send),
            "experts_flush_only": bool(flush_only) and flush_only[-1] == len(engine.buckets.layout) - 1
            and all(any(id(p) in experts for p in engine.buckets.layout[b]) for b in flush_only)}


class HeadLlama(torch.nn.Module):
    """A tiny LLaMA with a second output head beside lm_head (partitioned over another group)."""

    def __init__(self, llama, head):
        super().__init__()
        self.llama, self.head = llama, head

    def forward(self, input_ids, labels):
        hidden = self.llama.model(input_ids=input_ids).last_hidden_state
        logits = self.llama.lm_head(hidden) + self.head(hidden)
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)),
                                                 labels[:, 1:].reshape(-1))


def check_two_groups():
    """The head is partitioned over a second process group (same ranks, another communicator):
    its gradients go to buckets of their own, reduced in that group; the result matches SGD."""
    import deepspeed

    world = torch.distributed.get_world_size()
    second = torch.distributed.new_group(list(range(world)))
    cfg = ds_cfg(bucket_size=2000)
    ds_conf = {k: v for k, v in cfg.items() if k != "lomo"}
    config = tiny_llama_config()
    torch.manual_seed(15)
    ref = HeadLlama(tiny_llama(14), torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False))
    with deepspeed.zero.Init(config_dict_or_path=ds_conf):
        llama = LlamaForCausalLM(config)
    with deepspeed.zero.Init(config_dict_or_path=ds_conf, data_parallel_group=second):
        head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    model = HeadLlama(llama, head)
    for p, src in zip(model.parameters(), ref.parameters(), strict=True):
        with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
            if torch.distributed.get_rank() == 0:
                p.data.copy_(src.data)
    engine = lomo_ds.initialize(model, cfg)
    rank = engine.rank
    for step in range(STEPS):
        mbs = global_batch(step, world)
        engine.train_step(mbs[rank])
        reference_step(ref, mbs, world, forward=lambda m, b: m(**b))
    buckets = engine.buckets
    head_buckets = [b for b, params in enumerate(buckets.layout) if any(p is head.weight for p in params)]
    return {"max_abs_diff": max_diff(engine, ref),
            "one_group_per_bucket": all(ds_compat.process_group(p) is buckets.bucket_groups[b]
                                        for b, params in enumerate(buckets.layout) for p in params),
            "head_reduced_in_second_group": world == 1 or all(buckets.bucket_groups[b] is second
                                                              for b in head_buckets),
            "head_bucket_only_head": world == 1 or all(len(buckets.layout[b]) == 1 for b in head_buckets)}


def check_other_partitioning_refused():
    """A parameter partitioned over a group of a different size (here: each rank alone) cannot be
    updated by the sharded rule: the engine refuses it with an error naming the group sizes."""
    import deepspeed

    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    alone = [torch.distributed.new_group([r]) for r in range(world)][rank]
    cfg = ds_cfg()
    ds_conf = {k: v for k, v in cfg.items() if k != "lomo"}
    config = tiny_llama_config()
    with deepspeed.zero.Init(config_dict_or_path=ds_conf):
        llama = LlamaForCausalLM(config)
    with deepspeed.zero.Init(config_dict_or_path=ds_conf, data_parallel_group=alone):
        head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    try:
        lomo_ds.initialize(HeadLlama(llama, head), cfg)
    except ValueError as e:
        return {"error_message": str(e)}
    return {"error_message": None}


def check_overlap():
    """Each bucket is applied only after later gradients have arrived: its reduce-scatter ran
    while the backward went on (a synchronous one is applied inside the hook that filled it)."""
    engine = lomo_ds.initialize(tiny_llama(13), ds_cfg(bucket_size=2000, grad_reduction="reduce_scatter"))
    world, rank = engine.world, engine.rank
    engine.train_step(global_batch(0, world)[rank])
    events = []
    add, apply_bucket = engine.buckets.add, engine.buckets.on_bucket
    engine.buckets.add = lambda p, g: (events.append(("grad", id(p))), add(p, g))[-1]
    engine.buckets.on_bucket = lambda items, stats: (events.append(("apply", tuple(id(p) for p, _ in items))),
                                                     apply_bucket(items, stats))[-1]
    engine.train_step(global_batch(1, world)[rank])
    arrived_before = []  # for each applied bucket: gradients that arrived after its last one
    for i, (kind, what) in enumerate(events):
        if kind == "apply":
            last = max(j for j, (k, w) in enumerate(events[:i]) if k == "grad" and w in what)
            arrived_before.append(sum(1 for k, _ in events[last + 1:i] if k == "grad"))
    return {"n_buckets": len(engine.buckets.layout), "later_grads_before_apply": arrived_before}


def check_apply_points(transport: str = "auto"):
    """Where in the backward each bucket is applied, on every rank, with the last rank's backward
    slowed down: the same point everywhere (an update may be a collective, AdaLomo's, and ranks
    must issue collectives in one order), however early a bucket's reduction happened to finish."""
    engine = lomo_ds.initialize(tiny_llama(13), ds_cfg(bucket_size=2000, grad_reduction=transport))
    world, rank = engine.world, engine.rank
    engine.train_step(global_batch(0, world)[rank])  # the first step settles the layout
    if rank == world - 1:
        for p in engine.params:
            p.register_hook(lambda g: (time.sleep(0.005), g)[1])
    arrived, applied_at = [0], []
    add, apply_bucket = engine.buckets.add, engine.buckets.on_bucket

    def counted_add(p, g):
        arrived[0] += 1
        add(p, g)

    engine.buckets.add = counted_add
    engine.buckets.on_bucket = lambda items, stats: (applied_at.append(arrived[0]), apply_bucket(items, stats))[-1]
    engine.train_step(global_batch(1, world)[rank])
    return {"n_buckets": len(engine.buckets.layout), "applied_at": on_every_rank(*applied_at)}


def check_transport():
    """Which transport "auto" comes to here, and a shared_memory request where the ranks share no
    memory (LOCAL_SIZE not the world size: ranks on several nodes) refused."""
    model = tiny_llama(0)
    rng = torch.get_rng_state()
    engine = lomo_ds.initialize(model, ds_cfg())
    # Setting the transport up draws nothing from torch's generator (the training's dropout and
    # data draw from it, and must draw alike whichever transport runs).
    rng_untouched = torch.equal(rng, torch.get_rng_state())
    error = None
    with mock.patch.dict(os.environ, {"LOCAL_SIZE": str(10 * engine.world)}):  # ranks that share no memory
        try:
            resolve_grad_route("shared_memory", engine.buckets.bucket_groups, engine.world)
        except ValueError as e:
            error = str(e)
    torch.distributed.barrier()  # every rank past its engine's set-up
    # This engine's buffers (another launch beside this one maps its own meanwhile), and DeepSpeed's
    # all-reduce buffers of this job (named by its port).
    port = os.environ.get("MASTER_PORT")
    stems = tuple(getattr(engine.buckets.transport, "file_stems", ()))  # none on one rank (no buffers)
    leftovers = [f for f in os.listdir("/dev/shm") if f.startswith(stems)
                 or (f.startswith("deepspeed_allreduce_buffer_") and f"_{port}_" in f)]
    from deepspeed.comm import comm as ds_comm

    return {"auto": engine.buckets.route, "local_size": os.environ.get("LOCAL_SIZE"), "refused": error,
            "rng_untouched": rng_untouched, "ds_shm_op": getattr(ds_comm.cdb, "shm_comm_op", None) is not None,
            "shm_bytes": engine.buckets.transport.nbytes, "shm_files_left": leftovers}


def check_sgd(transport: str = "auto", clip_norm: float | None = None):
    """The engine against SGD with several buckets, one pass, or two with norm clipping."""
    lomo = {"clip_grad_norm": clip_norm} if clip_norm else {}
    return equivalence(lambda: tiny_llama(0), ds_cfg(bucket_size=3000, grad_reduction=transport, **lomo),
                       {"clip_norm": clip_norm})


def check_step_sums(transport: str):
    """The step's agreements (loss, norm, verdict): their sums against gloo's all-reduce, the same
    bits on every rank, and how many of them went through the process group in two steps (none
    where the buckets use shared memory: they go through it too)."""
    engine = lomo_ds.initialize(tiny_llama(0), ds_cfg(bucket_size=3000, grad_reduction=transport))
    world, rank = engine.world, engine.rank
    values = [0.5 * (rank + 1), 3.0 - rank, -0.25 * rank]  # exact in fp32: sums are exact in any order
    wide = torch.tensor([1.0 / 3.0 * (rank + 1)], dtype=torch.float64, device="cpu")
    sums, wide_sum = engine._sum_over_ranks(values, "test"), engine._sum_over_ranks(wide, "test")
    expected = torch.tensor(values, dtype=torch.float32, device="cpu")
    ds_compat.all_reduce(expected, name="expected sums")
    same_bits = on_every_rank(*sums, *wide_sum)
    calls = []
    real = ds_compat.all_reduce

    def counted(t, *a, name="", **k):
        calls.append(name)
        return real(t, *a, name=name, **k)

    with mock.patch.object(ds_compat, "all_reduce", side_effect=counted):
        for step in range(2):
            engine.train_step(global_batch(step, world)[rank])
    agreements = [n for n in calls if n in ("loss", "squared norm", "non-finite flag")]
    return {"equal": float(sums == expected.tolist()), "wide": wide_sum[0],
            "wide_expected": sum(1.0 / 3.0 * (r + 1) for r in range(world)),
            "same_on_every_rank": float(all(row == same_bits[0] for row in same_bits)),
            "process_group_agreements": len(agreements),
            "step_sums": float(engine.step_sums.through_shared_memory),
            # the pass's verdict as the update reads it: known on the host where every bucket's came
            # from host memory (the shared-memory transport; the update then skips masking), else the
            # device flag, never read inside the pass (a collective's, as on an accelerator)
            "finite_on_host": float(engine.buckets.stats.finite_now() is True)}
