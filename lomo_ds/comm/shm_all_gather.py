"""ZeRO-3's parameter all-gather between CPU ranks on one node, through shared memory: the
`shared_memory` choice of comm.param_gather.

DeepSpeed fetches parameters with deepspeed.comm's all_gather_into_tensor, on CPU ranks through
gloo: TCP loopback, copies through the kernel, and gloo's threads competing with the forward for
the cores; the whole model passes through such calls every forward and backward. Here each rank
copies its shard into its own shared buffer (shm_transport.py: the reduce-scatter's segments,
slots, flags and dead-peer detection), posts it and goes on; the handle's `wait()` copies every peer's shard into the
output, by which time the peers have usually posted.

The route is process-wide (DeepSpeed's fetch is process-wide code): `configure()`, called by every
engine lomo_ds builds (LOMO, the DeepSpeed baselines, zero-shot, the benchmarks' floor) before
DeepSpeed partitions its model, installs it on deepspeed.comm's backend once (ds_compat) and sets
which transport carries the calls from then on; the last engine built decides. A call goes through
shared memory only when it can be exchanged so: CPU tensors, contiguous, of one dtype, over a group
of every rank in rank order, and an input of at most MAX_SLOT_BYTES; anything else goes to the
original (every rank decides alike: the same call has the same shapes on every rank).
"""
from __future__ import annotations

import typing
from collections import deque

import torch

from lomo_ds.comm.shm_transport import MIN_SLOTS, SharedMemorySlots, available
from lomo_ds.config.engine_config import ParamGather
from lomo_ds.runtime import ds_compat

CHOICES = typing.get_args(ParamGather)
# Each rank maps MIN_SLOTS slots of the largest input gathered: larger inputs go to the original
# collective rather than pinning more than 2 x 256 MiB of /dev/shm per rank.
MAX_SLOT_BYTES = 256 * 2**20


class _Gathered:
    """The handle of one posted shard (`wait()`, as a torch.distributed work handle)."""

    def __init__(self, owner: "SharedMemoryAllGather", seq: int, output: torch.Tensor, n: int):
        self.owner, self.seq, self.output, self.n = owner, seq, output, n
        self.done = False

    def wait(self, *_args, **_kwargs) -> bool:
        if not self.done:
            self.owner.gather_into(self.output, self.n, self.seq)
            self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done


class SharedMemoryAllGather(SharedMemorySlots):
    """`all_gather(output, input)` posts this rank's `input` and returns a handle whose `wait()`
    leaves in `output` every rank's input, in rank order (torch's all_gather_into_tensor)."""

    kind = "shared-memory all-gather"
    unit = "parameter all-gather"
    abandoned_in = "its step"
    file_tag = "param"

    def __init__(self, group, world: int, rank: int, timeout_s: float | None = None):
        super().__init__(group, world, rank, slots=MIN_SLOTS, timeout_s=timeout_s)
        self.pending: deque[_Gathered] = deque()  # posted, not yet copied out, oldest first
        self.calls = self.bytes = 0  # gathers carried (what the tests check the route by)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> _Gathered:
        n = input.numel()
        nbytes = n * input.element_size()
        if nbytes > self.slot_bytes:
            # Collective: every rank meets this call with the same size. Nothing may be left
            # unread in the buffers being replaced: finish this rank's gathers, then the barrier
            # inside reserve() waits for every peer to have finished theirs.
            self.finish()
            self.reserve(nbytes)
        seq = self.seq + 1
        # This rank reads slot seq - slots before it reuses it (its peers do the same): the
        # wait for their reads below then waits on nothing that waits on this rank.
        while self.pending and (self.pending[0].done or self.pending[0].seq <= seq - self.slots):
            self.pending.popleft().wait()
        self._wait_slot_free(seq)
        self.region(self.rank, seq, nbytes).view(input.dtype).copy_(input.reshape(-1))
        flat = output.view(-1)
        own = flat[self.rank * n:(self.rank + 1) * n]
        if own.data_ptr() != input.data_ptr():  # ZeRO-3 often passes its own chunk of the output
            own.copy_(input.reshape(-1))
        self.seq = seq
        self._publish(seq)
        self.calls += 1
        self.bytes += nbytes * (self.world - 1)
        handle = _Gathered(self, seq, flat, n)
        self.pending.append(handle)
        return handle

    def gather_into(self, flat: torch.Tensor, n: int, seq: int) -> None:
        self._wait_posted(seq)
        nbytes = n * flat.element_size()
        for r in range(self.world):
            if r != self.rank:
                flat[r * n:(r + 1) * n].copy_(self.region(r, seq, nbytes).view(flat.dtype))
        self._mark_read(seq)

    def finish(self) -> None:
        """Complete every gather this rank has posted."""
        while self.pending:
            self.pending.popleft().wait()


_transport: SharedMemoryAllGather | None = None  # carries the gathers while set
_world_ranks: dict[int, bool] = {}  # id(group) -> whether it is every rank in rank order


def _every_rank(group) -> bool:
    if group is None or group is torch.distributed.group.WORLD:
        return True
    if id(group) not in _world_ranks:
        world = torch.distributed.get_world_size()
        _world_ranks[id(group)] = torch.distributed.get_process_group_ranks(group) == list(range(world))
    return _world_ranks[id(group)]


def _route(original, output, input, group, async_op):
    shm = _transport
    if (shm is None or input.device.type != "cpu" or output.device.type != "cpu" or input.dtype != output.dtype
            or not input.is_contiguous() or not output.is_contiguous()
            or output.numel() != shm.world * input.numel() or input.numel() * input.element_size() > MAX_SLOT_BYTES
            or not _every_rank(group)):
        return original(output_tensor=output, input_tensor=input, group=group, async_op=async_op)
    handle = shm.all_gather(output, input)
    if async_op:
        return handle
    handle.wait()
    return None


def resolve(requested: str) -> str:
    """What comm.param_gather `requested` comes to on these ranks: "auto" picks shared memory
    where the ranks can use it (one rank gathers nothing: "torch"); asking for it where they
    cannot is an error."""
    if requested not in CHOICES:
        raise ValueError(f"comm.param_gather: expected one of {CHOICES}, got {requested!r}")
    world = torch.distributed.get_world_size()
    if requested == "torch" or world == 1:
        return "torch"
    possible = available(torch.distributed.group.WORLD)
    if requested == "shared_memory" and not possible:
        raise ValueError("comm.param_gather: 'shared_memory' needs CPU (gloo) ranks all on one x86-64 node "
                         f"(LOCAL_SIZE or LOCAL_WORLD_SIZE, as the launcher sets them, = world size = {world}); "
                         "use 'auto' or 'torch'")
    return "shared_memory" if possible else "torch"


def configure(requested: str = "auto", timeout_s: float | None = None) -> str:
    """Collective in effect (every rank, the same arguments, at the same point; no collective is
    issued here): route ZeRO-3's parameter all-gathers through shared memory or torch.distributed
    from now on, as `requested` (comm.param_gather) resolves here; returns what it resolved to."""
    global _transport
    chosen = resolve(requested)
    if _transport is not None:
        _transport.finish()
    if chosen == "shared_memory":
        ds_compat.route_all_gather_into_tensor(_route)
        if _transport is None:
            _transport = SharedMemoryAllGather(torch.distributed.group.WORLD, torch.distributed.get_world_size(),
                                               torch.distributed.get_rank(), timeout_s=timeout_s)
        elif timeout_s:
            _transport.timeout_s = timeout_s
    else:
        _transport = None
    return chosen


def transport() -> SharedMemoryAllGather | None:
    """The shared-memory transport carrying the gathers now (None: torch.distributed does)."""
    return _transport


def abandon() -> None:
    """This rank's step raised: peers waiting on its next gather fail now and name it."""
    if _transport is not None:
        _transport.abandon()
