"""lomo_ds against the peer a user would pick instead: PyTorch FSDP2 with SGD applied in the backward.

  python -m torch.distributed.run --nproc_per_node 2 -m benchmarks.bench_fsdp [--fetch config|per-module|per-layer]

The peer is torchtune's optimizer-in-backward design, written here: `fully_shard` on every decoder
layer and on the whole model, one torch.optim.SGD per (sharded) parameter, stepped and cleared in
the parameter's post-accumulate-grad hook, which FSDP2 calls once its reduce-scatter has left the
parameter's averaged gradient shard in `.grad`. Four engines, each on its own copy of the same
model, take turns step by step on the same batches (a slow spell on a shared machine hits them
alike; the order rotates every step):

  deepspeed floor  ZeRO-3 forward + backward under the run config's zero_optimization, every
                   gradient dropped on arrival: no reduction, no update (lomo_ds's floor)
  lomo             lomo_ds (plain SGD, one backward) under the same zero_optimization
  fsdp2 floor      FSDP2's forward + backward (its reduce-scatter is part of it), every reduced
                   gradient dropped in the hook: no update
  fsdp2 sgd        FSDP2 with SGD in the backward, as above

`--fetch config` takes `zero_optimization` from the run config as it is (default
ds_configs/cpu_default.json); `--fetch per-module` removes its fetch-unit keys (leaf_module,
stage3_module_granularity_threshold), leaving DeepSpeed's default: one gather per module;
`--fetch per-layer` fetches each decoder layer as one unit (leaf_module LlamaDecoderLayer).

Rank 0 prints, per engine: the median step time (a step is timed until its slowest rank is done),
its ratio to FSDP2 with SGD and to its own floor (the ratio of the medians, and "paired": the median
of each round's ratio, the two steps of a round run back to back), and from extra untimed steps
after the timed ones: the collectives issued per step and the bytes sent
(lomo_ds.profiling.count_comm, which also sees DeepSpeed's and lomo_ds's shared-memory
transports), the host time in the engine's own update hooks and in the framework's parameter
fetch/release hooks, and for lomo and FSDP2 the accounted peak bytes per rank (this rank's shards,
the gathered parameters and gradients alive, sampled at every gradient hook, plus the activations
autograd saved), against the planner's prediction for lomo. A "lomo rs" engine (comm.grad_reduction
"reduce_scatter", where every collective is a torch.distributed one) is counted too, not timed. At
the end lomo's and FSDP2-with-SGD's parameters are compared (max abs difference): the two did the
same work.

On CPU ranks it also times, on every rank at once (they share the machine's memory bandwidth, as in
a step), the two passes over memory that lomo's shared-memory transport makes per step, alone and on
buffers of the step's sizes: packing this rank's whole gradient for its peers (copy and |x| sum),
and stepping this rank's shard from every rank's row of its slice. The second is the pass any fused
SGD update of fp32 shards must make (read each rank's gradient slice and the shard, write the
shard); with the floor's step it gives the least lomo / floor this machine allows, and with the
first, what this transport's passes allow. What lomo costs beyond both is its hooks' other work
and any slowdown of the compute around them.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import time

import torch

import lomo_ds
from benchmarks import common
from benchmarks.bench_step import bench_llama, start_ranks
from devkit.floor import FloorEngine
from lomo_ds.config.engine_sections import group_by_section
from lomo_ds.planning import planner
from lomo_ds.profiling import StepTimers, attach_timers, count_comm
from lomo_ds.runtime import ds_compat
from lomo_ds.runtime.device import accelerator_device
from lomo_ds.runtime.memory import ActivationCounter

FETCH_KEYS = ("leaf_module", "stage3_module_granularity_threshold", "module_granularity_threshold")
LR = 1e-3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=os.path.join(common.ROOT, "ds_configs", "cpu_default.json"),
                    help="run config whose zero_optimization both DeepSpeed engines use")
    ap.add_argument("--fetch", choices=("config", "per-module", "per-layer"), default="config",
                    help="the config's fetch granularity, DeepSpeed's default per-module one, or one decoder "
                         "layer at a time (leaf_module LlamaDecoderLayer)")
    ap.add_argument("--engines", default="deepspeed floor,lomo,fsdp2 floor,fsdp2 sgd",
                    help="comma-separated subset to time (a profile of one engine against its floor)")
    ap.add_argument("--bucket-size", type=int, default=None,
                    help="comm.bucket_size (default: the run config's lomo section, else lomo's default)")
    common.add_run_shape_args(ap, layers=6, hidden=512, vocab=10_000, seq=128, micro=4, steps=10, warmup=2)
    ap.add_argument("--lomo", action="append", default=[], metavar="KEY=VALUE",
                    help="a lomo option for the lomo engines (repeatable; VALUE as JSON, else a string), "
                         "e.g. --lomo chunked_loss=off")
    ap.add_argument("--measure-steps", type=int, default=3,
                    help="untimed steps after the timed ones: counting and hook timing, then one sampling memory")
    ap.add_argument("--json", default=None, help="also write rank 0's figures here")
    return ap.parse_args(argv)


def zero_section(args) -> dict:
    from lomo_ds.config.run import load_run_config

    zero = dict(load_run_config(args.config, check_files=False).ds["zero_optimization"])
    if args.fetch != "config":
        zero = {k: v for k, v in zero.items() if k not in FETCH_KEYS}
    if args.fetch == "per-layer":
        zero["leaf_module"] = {"classes": ["LlamaDecoderLayer"]}
    return zero


# ----------------------------------------------------------------------------- the peer
class Fsdp2Engine:
    """FSDP2 on every decoder layer and the whole model; with `lr`, torchtune's optimizer in the
    backward (one SGD per sharded parameter, stepped in its post-accumulate-grad hook), without,
    every reduced gradient dropped there (the floor)."""

    def __init__(self, model, lr: float | None):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        device = accelerator_device()
        mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        self.module = fully_shard(model.to(device), mesh=mesh)
        self.timers = StepTimers()
        self.optimizers = {p: torch.optim.SGD([p], lr=lr) for p in model.parameters()} if lr else {}
        self.sample = None  # set while memory is sampled: called at every gradient hook
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(self._on_reduced_grad)

    def _on_reduced_grad(self, param) -> None:
        with self.timers.span("update hooks"):
            if self.sample is not None:
                self.sample()
            if self.optimizers:
                self.optimizers[param].step()
                self.optimizers[param].zero_grad(set_to_none=True)
            else:
                param.grad = None

    def train_step(self, batch: dict) -> dict:
        self.module.train()
        self.module(**batch).loss.backward()
        return {}

    def param_groups(self) -> list:
        """FSDP2's per-module parameter groups (its private state: this benchmark only)."""
        return [m._get_fsdp_state()._fsdp_param_group for m in self.module.modules()
                if hasattr(m, "_get_fsdp_state") and m._get_fsdp_state()._fsdp_param_group is not None]

    @contextlib.contextmanager
    def timed_fetch_hooks(self):
        """Time FSDP2's per-group hooks (all-gather before forward and backward, free after,
        reduce-scatter in post_backward) and the root's end-of-backward callback."""
        shadowed = []
        owners = [(g, ("pre_forward", "post_forward", "pre_backward", "post_backward")) for g in self.param_groups()]
        owners.append((self.module._get_fsdp_state(), ("_root_post_backward_final_callback",)))
        for owner, names in owners:
            for name in names:
                original = getattr(owner, name)

                def timed(*a, _original=original, **k):
                    with self.timers.span("fetch hooks"):
                        return _original(*a, **k)

                setattr(owner, name, timed)
                shadowed.append((owner, name))
        try:
            yield
        finally:
            for owner, name in shadowed:
                delattr(owner, name)

    def memory_sampler(self):
        """(sample, peak): at every gradient hook, this rank's shards + the unsharded (gathered)
        parameters + every gradient alive, sharded or not."""
        groups = self.param_groups()
        peak = {"params": 0, "grads": 0, "total": 0}
        shard_bytes = sum(p.to_local().numel() * p.element_size() for p in self.module.parameters())

        def sample():
            gathered = grads = 0
            for g in groups:
                for fp in g.fsdp_params:
                    if g.is_unsharded:
                        gathered += fp._orig_size.numel() * fp.sharded_param.element_size()
                    unsharded = getattr(fp, "_unsharded_param", None)
                    for grad in (fp.sharded_param.grad, unsharded.grad if unsharded is not None else None):
                        if grad is not None:
                            local = grad.to_local() if hasattr(grad, "to_local") else grad
                            grads += local.numel() * local.element_size()
            if shard_bytes + gathered + grads > peak["total"]:
                peak.update(params=shard_bytes + gathered, grads=grads, total=shard_bytes + gathered + grads)

        return sample, peak

    def full_params(self) -> dict[str, torch.Tensor]:
        return {n: p.full_tensor().detach().cpu() for n, p in self.module.named_parameters()}


# ----------------------------------------------------------------------------- one run
def hooks_of(name: str, engine):
    """(the engine's timers, a context timing its framework's fetch hooks)."""
    if name.startswith("fsdp2"):
        return engine.timers, engine.timed_fetch_hooks()
    timers = attach_timers(engine, enabled=False)  # a LomoEngine's spans, or the floor's
    return timers, ds_compat.timed_fetch_hooks(ds_compat.offload_of(engine.ds_engine), timers)


@contextlib.contextmanager
def sampled_memory(name: str, engine):
    """Within the block, lomo's and FSDP2-with-SGD's peak bytes by category, sampled at every
    gradient hook (lomo: its MemoryTracker), and the activations autograd saves; yields the dict
    it fills at the block's end (left empty for the other engines)."""
    peak: dict = {}
    if name not in ("lomo", "fsdp2 sgd"):
        yield peak
        return
    acts = ActivationCounter(engine.module)
    if name == "lomo":
        tracker = engine.enable_memory_tracking()
    else:
        engine.sample, fsdp_peak = engine.memory_sampler()
    try:
        yield peak
    finally:
        acts.remove()
        if name == "lomo":
            p = tracker.peak
            engine.memory = engine.buckets.tracker = None
            peak.update(params=p.shard_bytes + p.gathered_bytes + p.persistent_bytes,
                        grads=p.grad_bytes + p.bucket_bytes)
        else:
            engine.sample = None
            peak.update(params=fsdp_peak["params"], grads=fsdp_peak["grads"])
        peak["activations"] = acts.peak


def predicted_bytes(args, zero: dict, bucket: int, world: int) -> float:
    """The planner's accounted bytes per rank for lomo on this model and zero_optimization."""
    spec = planner.ModelSpec("bench", hidden=args.hidden, layers=args.layers, intermediate=args.hidden * 8 // 3,
                             vocab=args.vocab, heads=max(1, args.hidden // 64))
    ds = {"train_micro_batch_size_per_gpu": args.micro, "zero_optimization": zero}
    run = planner.run_spec(**{**planner.run_overrides_from_ds(ds), "seq": args.seq, "checkpointing": False,
                              "lomo_bucket": bucket})
    return planner.estimate(spec, "lomo", world, run).accounted


def lomo_section(args) -> dict:
    """Plain SGD at a constant lr (the work FSDP2's hooks do), the run config's buckets."""
    from lomo_ds.config.run import load_run_config

    bucket = args.bucket_size or load_run_config(args.config, check_files=False).comm.bucket_size
    return {"lr": LR, "bucket_size": bucket, **lomo_overrides(args.lomo)}


def lomo_overrides(pairs: list[str]) -> dict:
    """--lomo KEY=VALUE pairs as a dict (VALUE parsed as JSON where it is JSON)."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--lomo: expected KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def memory_passes(n_params: int, world: int, repeats: int = 9) -> dict[str, float]:
    """Seconds (median of `repeats`, every rank at once) of the two passes over memory that the
    shared-memory transport makes per step, on buffers of the step's sizes: "pack" copies this rank's
    whole gradient into a payload and sums its |elements| (the non-finite flag), "step" steps this
    rank's shard by the sum of `world` rows of its slice. With torch's ops, as lomo runs them (copy
    then flag; rows added into one slice, then the step)."""
    from lomo_ds.comm.payload import nonfinite_marker

    shard = -(-n_params // world)
    g = torch.Generator(device="cpu").manual_seed(torch.distributed.get_rank())
    grad = torch.randn(n_params, generator=g, device="cpu")
    payload = torch.empty(n_params, device="cpu")
    rows = [torch.randn(shard, generator=g, device="cpu") for _ in range(world)]
    weights = torch.randn(shard, generator=g, device="cpu")
    summed = torch.empty(shard, device="cpu")  # the fallback's reduced slice

    def pack():
        payload.copy_(grad)
        float(nonfinite_marker(payload))

    def step():
        summed.copy_(rows[0])
        for row in rows[1:]:
            summed.add_(row)
        weights.add_(summed, alpha=-LR)

    out = {}
    for name, fn in (("pack", pack), ("step", step)):
        spent = []
        for _ in range(repeats):
            torch.distributed.barrier()
            t0 = time.perf_counter()
            fn()
            spent.append(time.perf_counter() - t0)
        out[name] = statistics.median(spent)
    return out


def run(args) -> dict:
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    zero = zero_section(args)
    ds = {"train_micro_batch_size_per_gpu": args.micro, "zero_optimization": zero}
    lomo = lomo_section(args)
    base = bench_llama(args.layers, args.hidden, args.vocab, args.seq)
    makers = {
        "deepspeed floor": lambda m: FloorEngine(m, ds),
        "lomo": lambda m: lomo_ds.initialize(m, {**ds, **group_by_section(lomo)}),
        "fsdp2 floor": lambda m: Fsdp2Engine(m, lr=None),
        "fsdp2 sgd": lambda m: Fsdp2Engine(m, lr=LR),
    }
    wanted = args.engines.split(",")
    unknown = set(wanted) - set(makers)
    if unknown:
        raise SystemExit(f"--engines: unknown {sorted(unknown)}; expected a subset of {list(makers)}")
    engines = {name: make(copy.deepcopy(base)) for name, make in makers.items() if name in wanted}
    full = set(engines) == set(makers)  # the figures beyond step times need all four
    counted_only = {"lomo rs": lomo_ds.initialize(copy.deepcopy(base), {**ds, **group_by_section({
        **lomo, "grad_reduction": "reduce_scatter"})})} if full else {}
    deepspeed_engines = [e for e in engines.values() if hasattr(e, "ds_engine")]
    leaves = sorted({type(m).__name__ for m in ds_compat.leaf_modules(deepspeed_engines[0].module)}
                    ) if deepspeed_engines else []
    device = accelerator_device()
    batches = common.random_batches(args.vocab, args.micro, args.seq, args.warmup + args.steps + args.measure_steps,
                                    seed=rank, device=device)
    names = list(engines)
    times = {name: [] for name in names}
    for step, batch in enumerate(batches[:args.warmup + args.steps]):
        for name in names[step % len(names):] + names[:step % len(names)]:
            torch.distributed.barrier()
            t0 = time.perf_counter()
            engines[name].train_step(batch)
            torch.distributed.barrier()
            if step >= args.warmup:
                times[name].append(time.perf_counter() - t0)
        if step < args.warmup and counted_only:
            counted_only["lomo rs"].train_step(batch)  # its first step records DeepSpeed's trace
    if not full:
        return {"world": world, "zero_optimization": zero, "leaf_modules": leaves, "times": times,
                "params": sum(p.numel() for p in base.parameters()), "threads": torch.get_num_threads(),
                "bucket_size": lomo["bucket_size"]}

    # Untimed steps, each engine on its next batch: collectives and hook time, then one more with
    # memory sampled at every gradient hook (its cost kept out of the hook times).
    measured = {name: {"calls": [], "bytes": [], "update hooks": [], "fetch hooks": []} for name in [*names, "lomo rs"]}
    for batch in batches[args.warmup + args.steps:-1]:
        for name, engine in {**engines, **counted_only}.items():
            timers, fetch_timing = hooks_of(name, engine)
            timers.enabled = True
            torch.distributed.barrier()
            with fetch_timing, count_comm() as counts:
                engine.train_step(batch)
            timers.enabled = False
            spent = timers.take()
            m = measured[name]
            m["calls"].append(sum(counts.calls_by_op.values()))
            m["bytes"].append(counts.total_bytes)
            m["ops"] = counts.as_dict()  # the last step's, by collective
            m["update hooks"].append(spent.get("update hooks", 0.0) + spent.get("hook", 0.0) + spent.get("flush", 0.0))
            m["fetch hooks"].append(spent.get("fetch hooks", 0.0))
    memory = {}
    for name, engine in engines.items():
        with sampled_memory(name, engine) as peak:
            engine.train_step(batches[-1])
        if peak:
            memory[name] = peak
    counted_only["lomo rs"].train_step(batches[-1])

    lomo_full = engines["lomo"].full_state_dict()
    fsdp_full = engines["fsdp2 sgd"].full_params()
    diff = (max((lomo_full[k] - fsdp_full[k]).abs().max().item() for k in fsdp_full) if rank == 0 else None)
    n_buckets = len(counted_only["lomo rs"].buckets.layout)
    n_params = sum(p.numel() for p in base.parameters())
    passes = memory_passes(n_params, world) if device.type == "cpu" else None
    return {"memory_passes": passes, "world": world, "zero_optimization": zero, "leaf_modules": leaves, "times": times,
            "measured": measured, "memory": memory, "max_abs_diff": diff, "buckets": n_buckets,
            "predicted_lomo_bytes": predicted_bytes(args, zero, lomo["bucket_size"], world),
            "params": n_params, "threads": torch.get_num_threads(),
            "bucket_size": lomo["bucket_size"]}


def report(args, r: dict) -> None:
    times = r["times"]
    med = {n: statistics.median(t) for n, t in times.items()}
    fetch = ", ".join(r["leaf_modules"]) or "module (DeepSpeed's default)"
    extra = "".join(f"; lomo.{k} {v}" for k, v in lomo_overrides(args.lomo).items())
    print(f"\n{r['params'] / 1e6:.1f}M-parameter LLaMA (hidden {args.hidden}, {args.layers} layers), "
          f"{r['world']} ranks, micro-batch {args.micro} x {args.seq}, fp32, {r['threads']} torch thread(s) per rank; "
          f"zero_optimization {json.dumps(r['zero_optimization'])}: fetched per {fetch}; "
          f"comm.bucket_size {r['bucket_size']:,}{extra}; median of {args.steps} steps")
    floors = {"lomo": "deepspeed floor", "fsdp2 sgd": "fsdp2 floor"}

    def paired(name: str) -> float:
        """The median of the per-round ratios to the floor: each round's two steps ran back to
        back, so a slow spell of the machine divides out (the ratio of medians does not pair them)."""
        return statistics.median(a / b for a, b in zip(times[name], times[floors[name]], strict=True))

    if "measured" not in r:
        for name, t in med.items():
            own = (f", {paired(name):.3f} x its floor (median of the per-round ratios)"
                   if floors.get(name) in times else "")
            print(f"{name:16s} {t:7.3f} s{own}")
        return
    measured = r["measured"]
    print(f"{'engine':16s} {'step s':>7s} {'/ fsdp2 sgd':>11s} {'/ own floor':>11s} {'paired':>7s} "
          f"{'collectives':>11s} {'MB sent':>8s} {'update hooks ms':>15s} {'fetch hooks ms':>14s}")
    for name in [*times, "lomo rs"]:
        m = measured[name]
        step = f"{med[name]:7.3f} {med[name] / med['fsdp2 sgd']:11.3f}" if name in med else f"{'-':>7s} {'-':>11s}"
        own = (f"{med[name] / med[floors[name]]:11.3f} {paired(name):7.3f}" if name in floors
               else f"{'-':>11s} {'-':>7s}")
        print(f"{name:16s} {step} {own} {m['calls'][-1]:11d} {m['bytes'][-1] / 1e6:8.2f} "
              f"{1e3 * statistics.median(m['update hooks']):15.1f} "
              f"{1e3 * statistics.median(m['fetch hooks']):14.1f}")
    print(f"lomo's buckets: {r['buckets']}; collectives per step, lomo rs - fsdp2 sgd: "
          f"{measured['lomo rs']['calls'][-1] - measured['fsdp2 sgd']['calls'][-1]}")
    for name in ("lomo rs", "fsdp2 sgd"):
        print(f"  {name} collectives: {json.dumps(measured[name]['ops'])}")
    mib = 2**20
    for name, mem in r["memory"].items():
        total = sum(mem.values())
        line = (f"peak per rank, {name}: {total / mib:.1f} MiB (params {mem['params'] / mib:.1f}, grads "
                f"{mem['grads'] / mib:.1f}, activations {mem['activations'] / mib:.1f}; tensor accounting)")
        if name == "lomo":
            line += f"; planner {r['predicted_lomo_bytes'] / mib:.1f} MiB ({total / r['predicted_lomo_bytes']:.3f}x)"
        print(line)
    passes = r.get("memory_passes")
    if passes and "deepspeed floor" in med:
        floor = med["deepspeed floor"]
        print(f"memory passes per step, every rank at once: stepping the shard from the ranks' rows "
              f"{1e3 * passes['step']:.1f} ms, the pass any fused update of fp32 shards makes: lomo / floor >= "
              f"{1 + passes['step'] / floor:.3f} on this machine; packing the gradient for the peers "
              f"{1e3 * passes['pack']:.1f} ms; the two: {1 + (passes['step'] + passes['pack']) / floor:.3f}")
    print(f"lomo vs fsdp2 sgd parameters after {args.warmup + args.steps + args.measure_steps} steps: "
          f"max abs difference {r['max_abs_diff']:.2e}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    start_ranks()
    r = run(args)
    if torch.distributed.get_rank() == 0:
        report(args, r)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), **r}, f, indent=1)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
