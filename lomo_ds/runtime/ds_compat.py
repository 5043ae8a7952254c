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
               "partition_numel", "all_gather", "all_gather_coalesced", "partition")


def is_zero_param(p) -> bool:
    return hasattr(p, "ds_id")


def full_numel(p) -> int:
    return int(p.ds_numel)


def full_shape(p) -> torch.Size:
    return torch.Size(p.ds_shape)


def shard(p) -> torch.Tensor:
    """This rank's flat shard (with padding at the end on the last ranks)."""
    return p.ds_tensor.data


def shard_bytes(p) -> int:
    """Bytes this rank holds of the parameter's shard: its elements, and an 8-bit shard's scales."""
    t = shard(p)
    quant = int8_shard(p)
    return t.numel() * t.element_size() + (quant[1].numel() * quant[1].element_size() if quant else 0)


def shard_storage_ptr(p) -> int | None:
    """The address of the storage behind the parameter's shard (None: not a ZeRO-3 parameter)."""
    t = getattr(p, "ds_tensor", None)
    return None if t is None else t.untyped_storage().data_ptr()


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


# 8-bit shards (memory.int8_shards): DeepSpeed's own convention for a quantized partition, the int8
# values in ds_tensor and their fp32 scales in ds_tensor.ds_quant_scale, plus the block size lomo_ds
# quantized them with. The scales are one per block of the parameter's global flat index that the
# padded slice [rank * part, (rank + 1) * part) touches (quant8.piece_span), a cut block's scale the
# same on every rank that holds a piece of it.
_INT8_BLOCK = "lomo_int8_block"


def int8_shard(p) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(int8 shard, fp32 scales) of a parameter whose shard is kept in 8 bits, else None."""
    t = getattr(p, "ds_tensor", None)
    if t is None or t.dtype != torch.int8 or getattr(t, "ds_quant_scale", None) is None:
        return None
    return t.data, t.ds_quant_scale


def int8_block(p) -> int | None:
    """The block size of a parameter's 8-bit shard (None: not in 8 bits)."""
    return getattr(p.ds_tensor, _INT8_BLOCK, None) if int8_shard(p) is not None else None


def set_int8_shard(p, q: torch.Tensor, scales: torch.Tensor, block: int) -> None:
    """Make `q` (int8, the shard's numel, padding included) and `scales` (fp32) the parameter's shard,
    in place of its compute-dtype one: ds_tensor keeps its identity and DeepSpeed's attributes on it
    (ds_numel, status, final_location); its storage becomes the int8 buffer."""
    t = p.ds_tensor
    if q.dtype != torch.int8 or q.dim() != 1 or q.numel() != t.numel():
        raise ValueError(f"8-bit shard of ds_id {p.ds_id}: expected a flat int8 tensor of {t.numel()} elements, "
                         f"got {q.dtype} of shape {tuple(q.shape)}")
    if scales.dtype != torch.float32 or scales.dim() != 1:
        raise ValueError(f"8-bit shard of ds_id {p.ds_id}: scales must be a flat fp32 tensor, got {scales.dtype} "
                         f"of shape {tuple(scales.shape)}")
    t.data = q.to(t.device)
    t.ds_quant_scale = scales.to(t.device)
    setattr(t, _INT8_BLOCK, block)


def partition_slice(p) -> tuple[int, int, int, int]:
    """(start, part, rank, world) of this rank's padded slice of the flat parameter in its group."""
    part = int(p.ds_tensor.ds_numel)
    group = p.ds_process_group
    if torch.distributed.is_initialized():
        rank, world = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
    else:
        rank, world = 0, 1
    return rank * part, part, rank, world


def gathered_into(p, full: torch.Tensor) -> None:
    """A gather of an 8-bit parameter has finished: `full` (compute dtype, the full shape) is what
    the forward and backward read, until DeepSpeed releases it."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    p.data = full.view(p.ds_shape)
    p.ds_status = ZeroParamStatus.AVAILABLE


def claim_for_gather(params: list) -> list:
    """Of `params`, those whose 8-bit shards are not gathered (NOT_AVAILABLE), now marked in flight."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    out = []
    for p in params:
        if p.ds_status == ZeroParamStatus.NOT_AVAILABLE:
            p.ds_status = ZeroParamStatus.INFLIGHT
            out.append(p)
    return out


class GatherHandles:
    """Several gather handles waited as one (the shape DeepSpeed's coordinator expects)."""

    def __init__(self, handles: list) -> None:
        self.handles = handles

    def wait(self, *args, **kwargs) -> None:
        for h in self.handles:
            h.wait(*args, **kwargs)


def route_int8_gathers(params: list, gather, rewrite) -> None:
    """Every ZeRO-3 parameter in `params` (all of a module's: the coordinator gathers a group through
    its first member, whichever it is) sends its 8-bit members to lomo_ds: `gather(params) -> handle`
    (handle.wait() leaves each one's dequantized weight through `gathered_into`), and
    `rewrite(param)` where DeepSpeed would copy a modified full weight into the shard
    (partition(has_been_updated=True): GatheredParameters(modifier_rank=...) writes, how
    from_pretrained loads under zero.Init), which would otherwise value-cast it into the int8
    buffer. DeepSpeed's own quantized gather is not used: it dequantizes equal groups of
    gathered_numel / scales_numel elements, which are the blocks of the global grid only where
    the block divides the partition size, and its coalesced path casts the result to ds_tensor's
    dtype (int8). Parameters in compute dtype go to DeepSpeed's own paths unchanged."""
    for p in params:
        if not is_zero_param(p) or getattr(p, "lomo_int8_routed", False):
            continue
        p.all_gather_coalesced = _coalesced(p.all_gather_coalesced, gather)
        p.all_gather = _all_gather(p, p.all_gather, gather)
        p.partition = _partition(p, p.partition, rewrite)
        p.lomo_int8_routed = True


def _split(params) -> tuple[list, list]:
    params = list(params)
    return [p for p in params if int8_shard(p) is not None], [p for p in params if int8_shard(p) is None]


def _coalesced(original, gather):
    def all_gather_coalesced(params, safe_mode: bool = False, quantize: bool = False):
        mine, rest = _split(params)
        if not mine:
            return original(rest, safe_mode=safe_mode, quantize=quantize)
        handles = [gather(claim_for_gather(mine))]
        if rest:
            handles.append(original(rest, safe_mode=safe_mode, quantize=quantize))
        return GatherHandles(handles)

    return all_gather_coalesced


def _all_gather(owner, original, gather):
    def all_gather(param_list=None, async_op: bool = False, hierarchy: int = 0):
        mine, rest = _split([owner] if param_list is None else param_list)
        out = original(param_list=rest, async_op=async_op, hierarchy=hierarchy) if rest else ([] if async_op else None)
        claimed = claim_for_gather(mine)
        if claimed:
            handle = gather(claimed)
            handle.wait()
            if async_op:
                out = [*out, handle]
        return out

    return all_gather


def _partition(owner, original, rewrite):
    def partition(param_list=None, hierarchy: int = 0, has_been_updated: bool = False, free_data: bool = True):
        mine, rest = _split([owner] if param_list is None else param_list)
        if has_been_updated:
            for p in mine:
                rewrite(p)
        if rest:
            original(param_list=rest, hierarchy=hierarchy, has_been_updated=has_been_updated, free_data=free_data)
        if mine:
            original(param_list=mine, hierarchy=hierarchy, has_been_updated=False, free_data=free_data)

    return partition


def install_torch_quantizer(block: int, dtype: torch.dtype) -> None:
    """Where DeepSpeed's Init has no quantizer (its CUDA op is built only under its own ZeRO++ flags,
    refused with 8-bit shards), `Init.quantizer_module` becomes quant8_zeropp's torch one: DeepSpeed's
    no-gather paths read that class attribute for any partition carrying ds_quant_scale, and an
    instance without its own attribute reads it too. lomo_ds routes its 8-bit parameters around those
    paths (route_int8_gathers); this keeps any DeepSpeed path that still reaches one dequantizing
    instead of failing on None."""
    from deepspeed.runtime.zero.partition_parameters import Init

    from lomo_ds.runtime.quant8_zeropp import TorchQuantizer

    if getattr(Init, "quantizer_module", None) is None:
        Init.quantizer_module = TorchQuantizer(block, default_dtype=dtype)


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group, async_op: bool = False,
                           name: str = "all-gather tensor"):
    """deepspeed.comm's all_gather_into_tensor (the route ZeRO-3's parameter fetch takes, so the
    shared-memory transport carries it between CPU ranks, and count_comm counts it)."""
    dist = _comm()
    check_device(input, group_device(group), name)
    return dist.all_gather_into_tensor(output, input, group=group, async_op=async_op)


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
    problems += _int8_route_problems()
    if not hasattr(deepspeed.zero, "Init") or not hasattr(deepspeed.zero, "GatheredParameters"):
        problems.append("deepspeed.zero.Init/GatheredParameters")
    return problems


def _int8_route_problems() -> list[str]:
    """route_int8_gathers relies on ZeRO-3's coordinator gathering through a parameter's
    all_gather_coalesced, and on GatheredParameters writing back through partition(has_been_updated)."""
    import inspect

    from deepspeed.runtime.zero.partition_parameters import GatheredParameters
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    problems = []
    fetch = getattr(PartitionedParameterCoordinator, "_PartitionedParameterCoordinator__all_gather_params_", None)
    if fetch is None or "all_gather_coalesced" not in fetch.__code__.co_names:
        problems.append("PartitionedParameterCoordinator.__all_gather_params_ -> param.all_gather_coalesced")
    if "has_been_updated=True" not in inspect.getsource(GatheredParameters):
        problems.append("GatheredParameters -> partition(has_been_updated=True)")
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
