"""Every DeepSpeed internal lomo_ds touches, in one place.

These are private names of DeepSpeed's ZeRO-3 (tested with the range pinned in pyproject.toml).
`check_internals()` fails loudly, naming what moved, if a DeepSpeed release changes them;
tests/runtime/test_ds_compat.py runs it.
"""
from __future__ import annotations

# DeepSpeed, transformers, safetensors and peft are imported inside the functions that use them: the
# CLI and the config checks start without them, and recipe/train.py's show_what_matters sets the
# ranks' logging before their first import.
import contextlib

import torch

from lomo_ds.runtime.device import group_device

PARAM_ATTRS = ("ds_tensor", "ds_numel", "ds_shape", "ds_id", "ds_status", "ds_persist", "ds_process_group",
               "partition_numel", "all_gather", "partition")


def is_zero_param(p) -> bool:
    return hasattr(p, "ds_id")


def full_numel(p) -> int:
    return int(p.ds_numel)


def full_shape(p) -> torch.Size:
    return torch.Size(p.ds_shape)


def shard(p) -> torch.Tensor:
    """This rank's flat shard (with padding at the end on the last ranks)."""
    return p.ds_tensor.data


def param_id(p) -> int:
    return int(p.ds_id)


def is_persistent(p) -> bool:
    return bool(p.ds_persist)


def grad_is_ready(p) -> bool:
    """False while DeepSpeed's TiledMLP is still adding tiles into p.grad (ds_grad_is_ready, which it
    sets True at its last tile); True for every other parameter."""
    return getattr(p, "ds_grad_is_ready", True) is not False


def process_group(p):
    return p.ds_process_group


def check_device(tensor: torch.Tensor, device: torch.device, name: str) -> None:
    """A collective given a tensor off its group's device fails deep inside the backend (NCCL
    cannot reduce a CPU tensor, gloo a CUDA one), or not at all on a CPU test: refuse it here."""
    if tensor.device != device:
        raise ValueError(f"{name}: a collective on this process group takes tensors on {device}, "
                         f"got one on {tensor.device}")


def _comm():
    """deepspeed.comm once DeepSpeed started it (its collectives are the ones lomo_ds.profiling.count_comm counts);
    torch.distributed for code that runs without DeepSpeed (evaluation in a plain process group)."""
    import deepspeed.comm as dist

    return dist if dist.is_initialized() else torch.distributed


def all_reduce(tensor: torch.Tensor, group=None, name: str = "all-reduce tensor", op: str = "sum") -> None:
    dist = _comm()
    check_device(tensor, group_device(group), name)
    dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op.upper()), group=group)


def all_gather(outputs: list[torch.Tensor], tensor: torch.Tensor, group=None, name: str = "all-gather tensor") -> None:
    check_device(tensor, group_device(group), name)
    torch.distributed.all_gather(outputs, tensor, group=group)


def reduce_scatter_async(output: torch.Tensor, input: torch.Tensor, group, name: str = "gradient bucket"):
    """Start the reduce-scatter and return its handle; `handle.wait()` before reading `output`.

    On gloo (CPU ranks) the same collective is issued in its list form, which gloo completes
    sooner than its flat reduce_scatter_tensor for bucket-sized inputs. Elsewhere (NCCL) the flat
    form is the fast one: the list form would copy the input first."""
    dist = _comm()
    device = group_device(group)
    check_device(input, device, f"{name} (reduce-scatter input)")
    check_device(output, device, f"{name} (reduce-scatter output)")
    if torch.distributed.get_backend(group) == "gloo":
        world = torch.distributed.get_world_size(group)
        return dist.reduce_scatter(output, list(input.chunk(world)), group=group, async_op=True)
    return dist.reduce_scatter_tensor(output, input, group=group, async_op=True)


def route_all_gather_into_tensor(route) -> None:
    """From now on, every all_gather_into_tensor of deepspeed.comm (ZeRO-3's parameter fetch:
    partition_parameters' _dist_allgather_fn -> deepspeed.comm.allgather_fn, and its direct calls)
    calls `route(original, output, input, group, async_op)`. Installed on deepspeed.comm's backend
    object (`cdb`), the one point both paths reach, as an attribute of that object: count_comm's
    counter wraps whatever is there, so the route's calls are counted too. A second call replaces
    the route and keeps the original."""
    import deepspeed.comm.comm as dscomm

    cdb = dscomm.cdb
    if cdb is None:
        raise RuntimeError("deepspeed.comm is not initialized: start the process group first (init_distributed)")
    current = cdb.__dict__.get("all_gather_into_tensor")
    original = getattr(current, "lomo_original", None) or cdb.all_gather_into_tensor

    def routed(output_tensor, input_tensor, group=None, async_op=False):
        return route(original, output_tensor, input_tensor, group, async_op)

    routed.lomo_original = original
    cdb.all_gather_into_tensor = routed


def broadcast_from_first(tensor: torch.Tensor, group, name: str = "broadcast tensor") -> None:
    """Overwrite `tensor` on every rank of `group` with the group's first rank's copy."""
    dist = _comm()
    check_device(tensor, group_device(group), name)
    dist.broadcast(tensor, src=torch.distributed.get_global_rank(group, 0), group=group)


def skip_shm_allreduce_op() -> None:
    """Before deepspeed.init_distributed: DeepSpeed's CPU backend starts without its shared-memory
    all-reduce op. It serves DeepSpeed's inference all-reduce (inference_all_reduce) alone, which
    lomo_ds never calls (its CPU ranks reduce through lomo_ds.comm.shm_transport), yet on a CPU the
    backend compiles it (about a minute of one core's C++ build, again in every new environment) and
    maps 68 MB of /dev/shm per rank whose names it never removes. Without it, inference_all_reduce
    falls back to torch.distributed.all_reduce."""
    _ds_torch_backend().build_shm_op = lambda: None


def _ds_torch_backend():
    # importlib, not `import deepspeed.comm.torch as m`: deepspeed.comm's star import leaves the name
    # `torch` on the package bound to torch itself, which that statement would return.
    import importlib

    return importlib.import_module("deepspeed.comm.torch")


def offload_of(engine):
    """The ZeRO-3 parameter manager DeepSpeed builds when no optimizer is given."""
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

    opt = engine.optimizer
    if not isinstance(opt, DeepSpeedZeRoOffload):
        raise RuntimeError("expected DeepSpeed to build DeepSpeedZeRoOffload with no optimizer, "
                           f"got {type(opt).__name__}")
    return opt


def zero3_optimizer_tensors(opt) -> dict[str, list[torch.Tensor]]:
    """What DeepSpeed's ZeRO-3 optimizer (DeepSpeedZeroOptimizer_Stage3) holds besides the
    parameter shards, for the baselines' memory accounting: its flat gradient shard buffer and
    reduce buckets ("grads"), its fp32 master partitions ("masters") and the low-precision flat
    partitions the masters may alias ("low_precision")."""
    buckets = [getattr(b, "buffer", None) for b in getattr(opt, "ipg_buckets", {}).values()]
    grads = [getattr(opt, "grad_partitions_flat_buffer", None), *buckets]
    return {"grads": [t for t in grads if torch.is_tensor(t)],
            "masters": list(getattr(opt, "fp32_partitioned_groups_flat", [])),
            "low_precision": [t for t in getattr(opt, "fp16_partitioned_groups_flat", []) if t is not None]}


def release_all(offload) -> None:
    """Release every gathered parameter (backward can leave some gathered), persistent ones
    included, and reset the trace. Whatever is used next is gathered from its shard: after an
    update, no stale gathered copy survives (DeepSpeed's own optimizer instead re-gathers its
    persistent parameters after each step, one all-gather each)."""
    offload.get_param_coordinator().release_and_reset_all(offload.module)


_FETCH_HOOKS = ("pre_sub_module_forward_function", "post_sub_module_forward_function",
                "pre_sub_module_backward_function", "post_sub_module_backward_function")


@contextlib.contextmanager
def timed_fetch_hooks(offload, timers, name: str = "fetch hooks"):
    """While the block runs, time ZeRO-3's per-module parameter hooks (gather before a module's
    forward and backward, release after) under `timers.span(name)`: the host cost of the fetch
    granularity. DeepSpeed's module hooks call these through the instance, so shadowing them
    there is enough; the block's end removes the shadows."""
    for hook in _FETCH_HOOKS:
        original = getattr(offload, hook)

        def timed(module, _original=original):
            with timers.span(name):
                return _original(module)

        setattr(offload, hook, timed)
    try:
        yield
    finally:
        for hook in _FETCH_HOOKS:
            delattr(offload, hook)


@contextlib.contextmanager
def counted_fetches(offload):
    """While the block runs, record every fetch ZeRO-3 makes: (phase "forward" | "backward", the
    module fetched) for each module whose pre-forward or pre-backward hook gathers parameters (its
    own, or all under it for a leaf). Yields the list it fills: the fetch units of the block."""
    from deepspeed.utils import z3_leaf_module

    fetched = []
    for hook, phase in (("pre_sub_module_forward_function", "forward"),
                        ("pre_sub_module_backward_function", "backward")):
        original = getattr(offload, hook)

        def counting(module, _original=original, _phase=phase):
            if next(module.parameters(recurse=z3_leaf_module(module)), None) is not None:
                fetched.append((_phase, module))
            return _original(module)

        setattr(offload, hook, counting)
    try:
        yield fetched
    finally:
        for hook in ("pre_sub_module_forward_function", "pre_sub_module_backward_function"):
            delattr(offload, hook)


def leaf_modules(module) -> list:
    """The modules ZeRO-3 fetches as one unit (leaf_module, stage3_module_granularity_threshold)."""
    from deepspeed.utils import z3_leaf_module

    return [m for m in module.modules() if z3_leaf_module(m)]


def gathers_wait_for_updates(offload) -> None:
    """ZeRO-3 issues its parameter all-gathers on a stream of its own, ordered after nothing on the
    compute stream; the shard updates run on the compute stream. Make that stream wait for
    everything queued so far (a device-side wait, no host sync): the next forward's gather reads
    the updated shards, never half-updated ones. Nothing to order on a CPU (no such stream)."""
    stream = getattr(offload.get_param_coordinator(), "_PartitionedParameterCoordinator__allgather_stream", None)
    if stream is not None:
        from deepspeed.accelerator import get_accelerator

        stream.wait_stream(get_accelerator().current_stream())


_BACKWARD_COUNTERS = ("applied_pre_backward_ref_cnt", "ds_grads_remaining")


def snapshot_backward_counters(module) -> list:
    """ZeRO-3 counts, per module, the backward hooks its forward armed: the pre-backward hook
    gathers parameters only while its count is positive, the post-backward hook releases them
    when its count reaches zero. A second backward through a retained graph finds both spent,
    so lomo_ds records them after the forward and re-arms them before the second pass."""
    return [(m, {k: m.__dict__[k] for k in _BACKWARD_COUNTERS if k in m.__dict__}) for m in module.modules()]


def restore_backward_counters(snapshot) -> None:
    for m, counters in snapshot:
        m.__dict__.update(counters)


def check_internals() -> list[str]:
    """Names of the DeepSpeed internals that are missing or changed; empty when all is well."""
    problems = []
    try:
        import deepspeed
        from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
        from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator
    except Exception as e:  # pragma: no cover - reported, not raised
        return [f"import failed: {e}"]
    for name in ("get_param_coordinator", "persistent_parameters", "module"):
        if name not in dir(DeepSpeedZeRoOffload) and name not in DeepSpeedZeRoOffload.__init__.__code__.co_names:
            problems.append(f"DeepSpeedZeRoOffload.{name}")
    for hook in _FETCH_HOOKS:
        if not hasattr(DeepSpeedZeRoOffload, hook):
            problems.append(f"DeepSpeedZeRoOffload.{hook}")
    if not hasattr(PartitionedParameterCoordinator, "release_and_reset_all"):
        problems.append("PartitionedParameterCoordinator.release_and_reset_all")
    gather_stream = "_PartitionedParameterCoordinator__allgather_stream"
    if gather_stream not in PartitionedParameterCoordinator.__init__.__code__.co_names:
        problems.append("PartitionedParameterCoordinator.__allgather_stream")
    for status in ("AVAILABLE", "NOT_AVAILABLE", "INFLIGHT"):
        if not hasattr(ZeroParamStatus, status):
            problems.append(f"ZeroParamStatus.{status}")
    import deepspeed.comm as dist

    ds_torch = _ds_torch_backend()
    if not hasattr(ds_torch, "build_shm_op") or "build_shm_op" not in ds_torch.TorchBackend.__init__.__code__.co_names:
        problems.append("deepspeed.comm.torch.build_shm_op (TorchBackend's shared-memory op)")
    for fn in ("reduce_scatter_tensor", "reduce_scatter", "all_reduce", "all_gather_into_tensor", "broadcast",
               "is_initialized", "ReduceOp"):
        if not hasattr(dist, fn):
            problems.append(f"deepspeed.comm.{fn}")
    problems += _all_gather_route_problems()
    if not hasattr(deepspeed.zero, "Init") or not hasattr(deepspeed.zero, "GatheredParameters"):
        problems.append("deepspeed.zero.Init/GatheredParameters")
    return problems


def _all_gather_route_problems() -> list[str]:
    """route_all_gather_into_tensor relies on this chain: ZeRO-3's gather calls
    deepspeed.comm.allgather_fn, which calls the module's all_gather_into_tensor, which calls the
    backend object `cdb`'s method of that name."""
    import deepspeed.comm.comm as dscomm
    from deepspeed.comm.torch import TorchBackend
    from deepspeed.runtime.zero import partition_parameters

    problems = []
    gather_fn = getattr(partition_parameters, "_dist_allgather_fn", None)
    if gather_fn is None or "allgather_fn" not in gather_fn.__code__.co_names:
        problems.append("deepspeed.runtime.zero.partition_parameters._dist_allgather_fn -> allgather_fn")
    allgather_fn = getattr(dscomm, "allgather_fn", None)
    if allgather_fn is None or "all_gather_into_tensor" not in allgather_fn.__code__.co_names:
        problems.append("deepspeed.comm.comm.allgather_fn -> all_gather_into_tensor")
    into_tensor = getattr(dscomm, "all_gather_into_tensor", None)
    # Under DeepSpeed's timed_op decorator: the function it wraps is in its closure.
    inner = [c.cell_contents for c in (getattr(into_tensor, "__closure__", None) or ())
             if callable(c.cell_contents) and getattr(c.cell_contents, "__name__", "") == "all_gather_into_tensor"]
    codes = [f.__code__ for f in inner] or ([into_tensor.__code__] if into_tensor is not None else [])
    if not codes or not any("cdb" in c.co_names and "all_gather_into_tensor" in c.co_names for c in codes):
        problems.append("deepspeed.comm.comm.all_gather_into_tensor -> cdb")
    if not hasattr(dscomm, "cdb"):
        problems.append("deepspeed.comm.comm.cdb")
    if not hasattr(TorchBackend, "all_gather_into_tensor"):
        problems.append("deepspeed.comm.torch.TorchBackend.all_gather_into_tensor")
    return problems


def check_param_attrs(p) -> list[str]:
    return [a for a in PARAM_ATTRS if not hasattr(p, a)]
