"""The routes a gradient takes to the rank that owns each slice of it (`comm.grad_reduction`),
behind one small interface the gradient buckets (lomo_ds/engine/buckets.py) drive:

  payload(world, width, dtype)  the [world, width + 1] rank-major matrix to fill (payload.py)
  pack(send, spans, grads)      fill it; flag(...) sets its non-finite flag column
  post(received, send, group)   start the reduction; returns a handle
  handle.wait()                 the reduced slice is in `received`; returns whether it is all
                                finite (a device bool, or a host bool where the route's verdict
                                is host memory)

Routes:
  reduce_scatter  a collective through deepspeed.comm (ds_compat): NCCL on GPUs, gloo between CPU
                  nodes. The gradient bytes are those of DeepSpeed's own ZeRO-3 path.
  shared_memory   CPU ranks all on one node: the payload is packed straight into this rank's
                  shared-memory buffer and reduced by each rank reading its own row of every
                  rank's payload when the bucket is due (shm_reduce_scatter.py): gloo's
                  reduce-scatter goes through TCP loopback, copies through the kernel.
  all_reduce      the public reference implementation's way (all-reduce each whole gradient,
                  synchronously, keep this rank's slice): twice the bytes. A baseline for
                  benchmarks/bench_comm.py only. Not bucketed: `reduce_one` per parameter.
  direct          one rank, nothing to reduce: each gradient is applied as it arrives (one
                  gradient alive, no payload copy). Not bucketed.
"""
from __future__ import annotations

import enum

import torch

from lomo_ds.comm import shm_reduce_scatter
from lomo_ds.comm.payload import all_finite, nonfinite_marker
from lomo_ds.comm.payload import pack as pack_payload
from lomo_ds.runtime import ds_compat


class GradReduction(str, enum.Enum):
    """What comm.grad_reduction asks for."""

    AUTO = "auto"
    REDUCE_SCATTER = "reduce_scatter"
    SHARED_MEMORY = "shared_memory"
    ALL_REDUCE = "all_reduce"


class GradRoute(str, enum.Enum):
    """What it comes to on these ranks (a str: compares equal to its config spelling)."""

    DIRECT = "direct"
    REDUCE_SCATTER = "reduce_scatter"
    SHARED_MEMORY = "shared_memory"
    ALL_REDUCE = "all_reduce"


def resolve_grad_route(requested: str, groups: list, world: int) -> GradRoute:
    """The route `requested` (comm.grad_reduction) comes to on ranks reducing over `groups`:
    "auto" picks shared memory where the ranks can use it; asking for it where they cannot is an
    error."""
    try:
        requested = GradReduction(requested)
    except ValueError:
        choices = tuple(r.value for r in GradReduction)
        raise ValueError(f"comm.grad_reduction: expected one of {choices}, got {requested!r}") from None
    if world == 1 and requested is GradReduction.AUTO:
        # Asked for by name, a route runs as a one-rank collective (the GPU suite's path).
        return GradRoute.DIRECT
    if requested in (GradReduction.REDUCE_SCATTER, GradReduction.ALL_REDUCE):
        return GradRoute(requested.value)
    # Named on one rank too: one GPU has no shared-memory route, whatever the world size.
    possible = all(shm_reduce_scatter.available(g) for g in groups)
    if requested is GradReduction.SHARED_MEMORY and not possible:
        raise ValueError(f"comm.grad_reduction: 'shared_memory' needs CPU (gloo) ranks all on one x86-64 node, "
                         f"sharded over every rank (LOCAL_SIZE or LOCAL_WORLD_SIZE, as the launcher sets them, = "
                         f"world size = {world}); use 'auto' or 'reduce_scatter'")
    return GradRoute.SHARED_MEMORY if possible else GradRoute.REDUCE_SCATTER


class GradTransport:
    """The collective reduce-scatter (deepspeed.comm), and the defaults of every route."""

    route = GradRoute.REDUCE_SCATTER
    bucketed = True  # gradients travel in buckets of payloads (else one at a time: reduce_one)

    def __init__(self, world: int, rank: int, device: torch.device):
        self.world, self.rank, self.device = world, rank, device

    @property
    def nbytes(self) -> int:
        """Memory the route holds for itself (shared buffers)."""
        return 0

    def reserve(self, nbytes: int) -> None:
        """Collective (every rank, the same size): room for a payload of `nbytes`."""

    def abandon(self) -> None:
        """This rank's backward raised: peers waiting on it fail now, where the route can tell them
        (the collectives' peers fail by the process group's timeout)."""

    def payload(self, width: int, dtype: torch.dtype) -> torch.Tensor:
        """This rank's [world, width] send matrix for the next post."""
        return torch.empty(self.world, width, dtype=dtype, device=self.device)

    def pack(self, send: torch.Tensor, spans: list[slice], grads: list) -> None:
        """Fill the gradient columns (payload.pack)."""
        pack_payload(send, spans, grads, self.world)

    def flag(self, send: torch.Tensor, width: int, finite_so_far: torch.Tensor) -> None:
        """Set the flag column: 0 while this rank's payload and pass are finite, else NaN."""
        send[:, width] = nonfinite_marker(send[:, :width], finite_so_far)

    def post(self, received: torch.Tensor, send: torch.Tensor, group) -> "_Collective":
        return _Collective(ds_compat.reduce_scatter_async(received, send.view(-1), group), received)


class _Collective:
    def __init__(self, work, received: torch.Tensor):
        self.work, self.received = work, received

    def wait(self) -> torch.Tensor:
        self.work.wait()  # on an accelerator: the current stream waits for the collective
        # The summed flag (0, or NaN when some rank's part of the bucket or an earlier received
        # slice was not finite: the same on every rank) and this rank's reduced slices (an fp16
        # sum may overflow inside the reduction). On the device: no host sync.
        return all_finite(self.received)


class SharedMemoryTransport(GradTransport):
    """CPU ranks of one node (shm_reduce_scatter.py)."""

    route = GradRoute.SHARED_MEMORY

    def __init__(self, group, world: int, rank: int, device: torch.device, in_flight: int,
                 timeout_s: float | None):
        super().__init__(world, rank, device)
        self.shm = shm_reduce_scatter.SharedMemoryReduceScatter(group, world, rank, in_flight=in_flight,
                                                                timeout_s=timeout_s)

    @property
    def nbytes(self) -> int:
        return self.shm.nbytes

    def reserve(self, nbytes: int) -> None:
        self.shm.reserve(nbytes)

    def abandon(self) -> None:
        self.shm.abandon()

    def payload(self, width: int, dtype: torch.dtype) -> torch.Tensor:
        return self.shm.payload(width, dtype)

    def post(self, received: torch.Tensor, send: torch.Tensor, group):
        # Its verdict, read while reducing, is in host memory: wait() returns a host bool.
        return self.shm.post(received)


class AllReduceTransport(GradTransport):
    """Each whole gradient all-reduced, synchronously; this rank keeps its slice."""

    route = GradRoute.ALL_REDUCE
    bucketed = False

    def __init__(self, world: int, rank: int, device: torch.device, reduce_dtype: torch.dtype | None):
        super().__init__(world, rank, device)
        self.reduce_dtype = reduce_dtype

    def reduce_one(self, param: torch.nn.Parameter, grad: torch.Tensor, part: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's summed slice of `grad` and whether it is all finite (a device bool)."""
        full = grad.reshape(-1).to(self.reduce_dtype or grad.dtype)
        ds_compat.all_reduce(full, group=ds_compat.process_group(param))
        # Every rank holds the same summed gradient: a local check is already agreed.
        return full[self.rank * part:(self.rank + 1) * part], all_finite(full)


class DirectTransport(AllReduceTransport):
    """One rank: the gradient is its own sum."""

    route = GradRoute.DIRECT

    def __init__(self, device: torch.device):
        super().__init__(1, 0, device, None)

    def reduce_one(self, param: torch.nn.Parameter, grad: torch.Tensor, part: int) -> tuple[torch.Tensor, torch.Tensor]:
        flat = grad.reshape(-1)
        return flat, all_finite(flat)


def open_grad_transport(requested: str, group, groups: list, world: int, rank: int, device: torch.device,
                        in_flight: int = 1, timeout_s: float | None = None,
                        reduce_dtype: torch.dtype | None = None) -> GradTransport:
    """The transport `requested` (comm.grad_reduction) comes to for `world` ranks of `group`
    reducing over `groups` (the parameters' process groups, all of one partitioning: the buckets
    check it)."""
    route = resolve_grad_route(requested, groups, world)
    if route is GradRoute.DIRECT:
        return DirectTransport(device)
    if route is GradRoute.ALL_REDUCE:
        return AllReduceTransport(world, rank, device, reduce_dtype)
    if route is GradRoute.SHARED_MEMORY:
        return SharedMemoryTransport(group, world, rank, device, in_flight, timeout_s)
    return GradTransport(world, rank, device)
