"""The GPU path on a CPU: what only a GPU run would show, made visible with a fake accelerator,
a recorded order of calls or a monkeypatched collective. Each test fails when its fix is undone
(tests/gpu runs the same paths on a real GPU)."""
import contextlib
import os
import pathlib
import re
import subprocess
import sys
import threading
import time

import deepspeed.accelerator
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lomo_ds.comm import shm_all_gather, shm_reduce_scatter
from lomo_ds.config.lomo_section import AdaLomoConfig
from lomo_ds.engine import host_updates
from lomo_ds.engine.host_updates import HostUpdates, use_thread
from lomo_ds.engine.update import AdaLomo, PassSettings, ShardGeometries, ShardUpdater
from lomo_ds.profiling import StepTimers
from lomo_ds.runtime import device as device_module
from lomo_ds.runtime import dist, ds_compat
from tests.engine.dist_engine_checks import assert_reduction_overflow_skips, check_reduction_overflow
from tests.ranks import multi_rank, multi_rank_checks, ok

ROOT = pathlib.Path(__file__).resolve().parents[2]


class FakeEvent:
    """An accelerator event whose elapsed time is set by the test (the stream's time, not the host's)."""

    def __init__(self, enable_timing=False):
        self.recorded_at = None

    def record(self, stream=None):
        FakeAccelerator.clock += 1
        self.recorded_at = FakeAccelerator.clock

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return 250.0 * (end.recorded_at - self.recorded_at)  # ms per tick


class FakeStream:
    def wait_stream(self, other):
        pass


class FakeAccelerator:
    """A CUDA-like accelerator: a current device index the code must set, events and streams."""

    clock = 0
    Stream = FakeStream

    def __init__(self):
        self.index = 0
        self.set_calls = []

    def device_name(self, index=None):
        return "cuda"

    def set_device(self, index):
        self.set_calls.append(index)
        self.index = index

    def current_device_name(self):
        return f"cuda:{self.index}"

    def current_stream(self):
        return FakeStream()

    def stream(self, stream):
        return contextlib.nullcontext()

    Event = FakeEvent


@pytest.fixture
def fake_accelerator(monkeypatch):
    fake = FakeAccelerator()
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: fake)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "nccl")
    return fake


# ----------------------------------------------------------------------------- item 1
def test_each_rank_gets_its_own_device_before_anything_reads_it(fake_accelerator, monkeypatch):
    """With a plain model nothing but lomo_ds sets the device: rank 1 must get device 1, once the
    process group has started (DeepSpeed binds NCCL to LOCAL_RANK's device itself, and under an MPI
    launcher its start is what sets LOCAL_RANK: tests/runtime/test_device.py)."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    started = []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: bool(started))
    monkeypatch.setattr(deepspeed, "init_distributed", lambda **kw: started.append(True))
    dist.init_distributed(timeout_s=30)
    assert started and fake_accelerator.set_calls == [1]
    assert device_module.accelerator_device() == torch.device("cuda:1")


def test_collective_timeout_reaches_the_process_group(fake_accelerator, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    kwargs = []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(deepspeed, "init_distributed", lambda **kw: kwargs.append(kw))
    dist.init_distributed(timeout_s=90)
    assert kwargs[0]["timeout"].total_seconds() == 90
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"


# ----------------------------------------------------------------------------- item 9
def test_step_timers_on_an_accelerator_read_events_not_the_host_clock(fake_accelerator):
    """On NCCL a collective's wait() returns at once: the host clock would put the time elsewhere."""
    timers = StepTimers(device=torch.device("cuda:0"))
    timers.enable()
    with timers.span("wait"):
        pass  # the host returns at once; the stream waited 250 ms (one tick)
    assert timers.take() == {"wait": pytest.approx(0.25)}
    cpu = StepTimers(device=torch.device("cpu"))
    cpu.enable()
    with cpu.span("update"):
        time.sleep(0.01)
    assert cpu.take()["update"] >= 0.01


# ----------------------------------------------------------------------------- item 5
def test_stochastic_rounding_draws_on_each_shards_own_device(monkeypatch):
    """Shards on two devices (persistent ones on the GPU, the rest offloaded): each one rounds with
    a generator on its own device ("meta" stands in for the second device)."""
    made, used = [], []

    class Gen:
        def __init__(self, device):
            self.device = torch.device(device)
            made.append(self.device)

        def manual_seed(self, seed):
            return self

    monkeypatch.setattr(torch, "Generator", Gen)
    monkeypatch.setattr("lomo_ds.engine.update.shard.stochastic_round_to_bf16",
                        lambda w, gen: (used.append((w.device, gen.device)), w.to(torch.bfloat16))[1])
    params = []
    for i, dev in enumerate(("cpu", "meta")):
        p = torch.nn.Parameter(torch.empty(0, dtype=torch.bfloat16))
        p.ds_tensor, p.ds_numel, p.ds_id = torch.zeros(8, dtype=torch.bfloat16, device=dev), 8, i
        params.append(p)
    updater = ShardUpdater(stochastic_rounding=True, seed=0, stats_device=torch.device("cpu"))
    stats = updater.begin_pass(PassSettings(lr=0.1), step=0)
    for p in params:
        updater.apply(p, torch.ones(8, dtype=torch.bfloat16), stats.finite)
    assert used == [(torch.device("cpu"), torch.device("cpu")), (torch.device("meta"), torch.device("meta"))]


class TwoDevices(TorchDispatchMode):
    """CPU and "meta" tensors stand for two devices' memories (a GPU's, and host memory under
    offload): an op that mixes them raises, as across two real devices, except a copy from one to
    the other; a copy out of "meta" (which holds no data) gives zeros. A 0-dim CPU tensor mixes with
    any device, as CUDA kernels take CPU scalars. ("meta" alone mixes with the CPU silently.)"""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default:
            src, to = args[0], kwargs.get("device", args[0].device)
            if src.device.type == "meta" and to.type == "cpu":
                return torch.zeros(src.shape, dtype=kwargs.get("dtype") or src.dtype, device=to)
            return func(*args, **kwargs)
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            if src.device.type == "meta" and dst.device.type == "cpu":
                return dst.zero_()
            return func(*args, **kwargs)
        devices = {t.device for t in tree_leaves((args, kwargs))
                   if isinstance(t, torch.Tensor) and not (t.device.type == "cpu" and t.dim() == 0)}
        if len(devices) > 1:
            raise RuntimeError(f"{func} mixes devices {sorted(map(str, devices))}")
        return func(*args, **kwargs)


def _zero_param(shape, device, ds_id: int, seed: int) -> torch.nn.Parameter:
    """A ZeRO-3 parameter of one rank holding all of it: its flat fp32 shard on `device`."""
    p = torch.nn.Parameter(torch.empty(0, dtype=torch.float32, device="cpu"))
    values = torch.randn(torch.Size(shape).numel(), generator=torch.Generator(device="cpu").manual_seed(seed),
                         dtype=torch.float32, device="cpu")
    p.ds_tensor, p.ds_numel, p.ds_shape, p.ds_id = values.to(device), values.numel(), torch.Size(shape), ds_id
    return p


def _adalomo_bucket(specs: dict) -> tuple[list[torch.nn.Parameter], ShardUpdater]:
    """Parameters ({ds_id: (shape, device)}) and a one-rank AdaLomo updater for them (no process group)."""
    params = [_zero_param(shape, dev, i, seed=i) for i, (shape, dev) in specs.items()]
    module = torch.nn.Module()
    for p in params:
        module.register_parameter(f"p{p.ds_id}", p)
    geometries = ShardGeometries()
    adalomo = AdaLomo(AdaLomoConfig(), module, params, None, geometries)
    return params, ShardUpdater(False, 0, torch.device("cpu"), geometries, adalomo)


def _update(params, updater) -> None:
    # The received bucket lives on the engine's device (the "CPU" one here), whatever the shards'.
    grads = [torch.randn(p.ds_numel, generator=torch.Generator(device="cpu").manual_seed(100 + p.ds_id),
                         dtype=torch.float32, device="cpu") for p in params]
    stats = updater.begin_pass(PassSettings(lr=0.1, weight_decay=0.01), step=0)
    updater.apply_bucket(list(zip(params, grads, strict=True)), stats)


def test_adalomo_keeps_each_slices_state_and_arithmetic_on_its_shards_device(monkeypatch):
    """Item 5: a bucket whose shards sit on two devices (persistent ones on the GPU, the rest
    offloaded). AdaLomo's state lives beside each shard, the bucket's statistics are gathered on one
    device by explicit copies, and no op mixes devices; the CPU shards' update is the one they get
    alone in a bucket."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)  # one rank, no process group
    specs = {0: ((6, 5), "cpu"), 1: ((4, 7), "meta"), 2: ((9,), "meta"), 3: ((8,), "cpu")}
    params, updater = _adalomo_bucket(specs)
    with TwoDevices():
        _update(params, updater)
    for i, (_, dev) in specs.items():
        assert {t.device.type for t in updater.rule.state[i].values()} == {dev}, (i, updater.rule.state[i])

    on_cpu = {i: spec for i, spec in specs.items() if spec[1] == "cpu"}
    alone, alone_updater = _adalomo_bucket(on_cpu)
    _update(alone, alone_updater)
    for i, p in zip(on_cpu, alone, strict=True):
        assert torch.equal(params[i].ds_tensor, p.ds_tensor)
        assert not torch.equal(p.ds_tensor, _zero_param(p.ds_shape, "cpu", i, seed=i).ds_tensor)


class Transfers(TwoDevices):
    """TwoDevices on the backward's thread, "meta" standing for the accelerator and the CPU for host
    memory: records every copy between the two (source, destination, non_blocking, the destination's
    address) and every op that touches one of `shards` (host memory the hook must leave alone)."""

    def __init__(self, shards: list[torch.Tensor]):
        super().__init__()
        self.shards = {s.untyped_storage().data_ptr() for s in shards}
        self.copies, self.shard_ops = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if threading.current_thread() is threading.main_thread():
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if any(t.device.type == "cpu" and t.untyped_storage().data_ptr() in self.shards for t in tensors):
                self.shard_ops.append(str(func))
            if func is torch.ops.aten._to_copy.default:
                src, to = args[0], kwargs.get("device") or args[0].device
                if src.device != to:
                    self.copies.append((src.device.type, to.type, kwargs.get("non_blocking", False), None))
            elif func is torch.ops.aten.copy_.default:
                dst, src = args[0], args[1]
                if dst.device != src.device:
                    blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
                    self.copies.append((src.device.type, dst.device.type, blocking, dst.data_ptr()))
        return super().__torch_dispatch__(func, types, args, kwargs)


def test_adalomo_on_offloaded_shards_stays_on_the_device_in_the_hook(fake_accelerator, monkeypatch):
    """Item 8 for AdaLomo, on an accelerator ("meta") with the shards in host memory (the CPU) and
    the host-update worker: AdaLomo's state lives on the accelerator; in the hook, once the worker
    has updated each slice, no op touches a shard (the sums of θ^2 come from the worker's table),
    every copy between host and device is non_blocking, those to the host into staging buffers
    only; the worker applies every slice, on its own thread, after the hook returned."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)  # one rank, no process group
    buffers = []

    def buffer(numel, dtype, pin):
        t = torch.empty(numel, dtype=dtype, device="cpu")  # no page-locked memory without a real accelerator
        buffers.append((t, pin))
        return t

    monkeypatch.setattr(host_updates, "host_buffer", buffer)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)  # a fake stream
    specs = {0: (6, 5), 1: (4, 7), 2: (9,)}
    params = [_zero_param(shape, "cpu", i, seed=i) for i, shape in specs.items()]
    module = torch.nn.Module()
    for p in params:
        module.register_parameter(f"p{p.ds_id}", p)
    meta = torch.device("meta")
    host = HostUpdates(torch.device("cuda:0"), name_of=lambda p: f"p{p.ds_id}")
    geometries = ShardGeometries()
    adalomo = AdaLomo(AdaLomoConfig(), module, params, None, geometries, host=host, device=meta)
    updater = ShardUpdater(False, 0, meta, geometries, adalomo)
    assert sorted(adalomo.deferred) == [0, 1, 2]
    assert all({t.device for t in adalomo.state[i].values()} == {meta} for i in specs), adalomo.state
    threads = []
    apply_host = adalomo.apply_host
    adalomo.apply_host = lambda *args: (threads.append(threading.current_thread().name), apply_host(*args))

    def one_pass(mode):
        stats = updater.begin_pass(PassSettings(lr=0.1), step=0)
        with mode:
            updater.apply_bucket([(p, torch.empty(p.ds_numel, dtype=torch.float32, device=meta)) for p in params],
                                 stats)
        host.join()
        return mode

    one_pass(TwoDevices())  # the first update takes each slice's sum of θ^2 in the hook, once
    staging = len(buffers)
    watched = one_pass(Transfers([p.ds_tensor for p in params]))
    assert watched.shard_ops == [], f"the hook touched a shard in host memory: {watched.shard_ops}"
    assert watched.copies, "nothing crossed between host and device"
    assert all(non_blocking for *_, non_blocking, _ in watched.copies), watched.copies
    staged = [b for b, _ in buffers[staging:]]

    def in_staging(ptr):
        return any(b.data_ptr() <= ptr < b.data_ptr() + max(b.nbytes, 1) for b in staged)

    to_host = [c for c in watched.copies if c[1] == "cpu"]
    assert to_host and all(in_staging(ptr) for *_, ptr in to_host), to_host
    assert all(pin for _, pin in buffers), "host buffers a device copies with must be pinned"
    assert threads == ["lomo-host-update"] * 6 and host.applied == 6


# ----------------------------------------------------------------------------- item 6
def test_check_figures_are_gathered_on_the_groups_device(monkeypatch):
    """The checks' figures are gathered over the ranks (tests/engine/dist_engine_checks.py on_every_rank:
    the GPU suite's overflow and accumulation checks): on NCCL the tensor must be on the GPU, the
    group's device ("meta" stands for it here). ds_compat.all_gather's own refusal stays in."""
    from tests.engine import dist_engine_checks

    meta = torch.device("meta")
    monkeypatch.setattr(dist_engine_checks, "group_device", lambda group=None: meta)
    monkeypatch.setattr(ds_compat, "group_device", lambda group=None: meta)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    given = []
    monkeypatch.setattr(torch.distributed, "all_gather",
                        lambda outputs, tensor, group=None: given.append((tensor.device, {o.device for o in outputs})))
    with TwoDevices():
        figures = dist_engine_checks.on_every_rank(1.0, 0.0, 1.0)
    assert given == [(meta, {meta})]
    assert figures == [[0.0, 0.0, 0.0]] * 2  # read back to the host (zeros: "meta" holds no data)


GPU_SUITE_SOURCES = ("tests/gpu/*.py", "tests/*/dist_*.py", "tests/tiny.py", "tests/ranks.py")
TENSOR_COLLECTIVE = re.compile(r"\b(?:torch\.distributed|dist|tdist)\.(all_reduce|all_gather|all_gather_into_tensor|"
                               r"reduce_scatter|reduce_scatter_tensor|broadcast|reduce|gather|scatter|all_to_all\w*|"
                               r"send|recv|isend|irecv)\(")


def test_the_gpu_suite_hands_tensors_to_collectives_only_through_ds_compat():
    """Every tensor collective of the GPU suite's code goes through lomo_ds.runtime.ds_compat, which
    refuses a tensor off the group's device (the CPU tensor NCCL cannot gather fails there, named,
    on a CPU run too); object collectives and barriers place their own tensors."""
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}" for pattern in GPU_SUITE_SOURCES
             for path in sorted(ROOT.glob(pattern))
             for n, line in enumerate(path.read_text().splitlines(), 1) if TENSOR_COLLECTIVE.search(line)]
    assert not found, found


# ----------------------------------------------------------------------------- items 11 and 12
def _no_collectives(monkeypatch):
    monkeypatch.setattr("lomo_ds.runtime.ds_compat.broadcast_from_first", lambda t, group, name="": None)
    monkeypatch.setattr("lomo_ds.runtime.ds_compat.all_reduce", lambda t, group=None, name="", op="sum": None)


def test_shared_memory_slots_are_aligned_for_every_dtype(monkeypatch):
    """A bf16 bucket's odd byte count must not misalign the next slot's fp32 view."""
    _no_collectives(monkeypatch)
    shm = shm_reduce_scatter.SharedMemoryReduceScatter(None, world=1, rank=0)
    shm.reserve(6)  # a 1 x 3 bf16 payload
    for width, dtype in ((3, torch.bfloat16), (1, torch.float32), (3, torch.bfloat16), (1, torch.float64)):
        payload = shm.payload(width, dtype)
        assert payload.data_ptr() % shm_reduce_scatter.ALIGN == 0
        payload.fill_(1)
        out = torch.empty(width, dtype=dtype)
        shm.post(out).wait()
        assert out.tolist() == [1.0] * width


def _post_one(shm):
    """Rank 0's first send of `shm`'s collective (rank 1 never posts its own): the handle to wait on."""
    if isinstance(shm, shm_all_gather.SharedMemoryAllGather):
        return shm.all_gather(torch.empty(2), torch.zeros(1))
    shm.payload(1, torch.float32).zero_()
    return shm.post(torch.empty(1))


# Both shared-memory collectives wait on their peers through shm_transport.py's one mechanism.
SHM_TRANSPORTS = {"reduce_scatter": (shm_reduce_scatter.SharedMemoryReduceScatter, "its backward"),
                  "all_gather": (shm_all_gather.SharedMemoryAllGather, "its step")}


def _waiting_rank(peer_header: dict, timeout_s: float = 60.0, transport: str = "reduce_scatter"):
    """Rank 0 of 2 waiting for rank 1's first send; rank 1's header as `peer_header` says.
    Returns the error rank 0 raised (None if it is still waiting after 10 s)."""
    shm = SHM_TRANSPORTS[transport][0](None, world=2, rank=0, timeout_s=timeout_s)
    shm.slot_bytes = 64
    shm.buffers = [torch.zeros(shm.header_bytes + shm.slots * 64, dtype=torch.uint8) for _ in range(2)]
    shm.flags = [b[:shm.header_bytes].view(torch.int64) for b in shm.buffers]
    shm.flags[0][2 * shm.slots] = os.getpid()
    shm.flags[1][2 * shm.slots] = peer_header.get("pid", os.getpid())
    shm.flags[1][2 * shm.slots + 1] = peer_header.get("abandoned", 0)
    pending = _post_one(shm)
    raised = []

    def wait():
        try:
            pending.wait()
        except RuntimeError as e:
            raised.append(e)

    waiter = threading.Thread(target=wait, daemon=True)  # a regression spins: left to die with the process
    waiter.start()
    waiter.join(10)
    return raised[0] if raised else None


@pytest.mark.parametrize("transport", SHM_TRANSPORTS)
def test_a_dead_peer_is_named_within_a_second(transport):
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # its pid now names no process
    t0 = time.monotonic()
    error = _waiting_rank({"pid": child.pid}, transport=transport)
    assert error is not None, "rank 0 still spins on a peer that has exited"
    assert "rank 1 has exited" in str(error) and time.monotonic() - t0 < 5


@pytest.mark.parametrize("transport", SHM_TRANSPORTS)
def test_a_peer_whose_step_raised_is_named(transport):
    error = _waiting_rank({"abandoned": 1}, transport=transport)
    assert error is not None and f"rank 1 raised an error in {SHM_TRANSPORTS[transport][1]}" in str(error)


@pytest.mark.parametrize("transport", SHM_TRANSPORTS)
def test_a_live_peer_that_never_posts_times_out_by_the_config(transport):
    error = _waiting_rank({}, timeout_s=1.0, transport=transport)
    assert error is not None and "train.collective_timeout" in str(error)


@pytest.mark.parametrize("cores", [1, 2])
def test_a_waiting_rank_spins_briefly_then_sleeps(cores, monkeypatch):
    """A yielding rank gets its core straight back from Linux's scheduler: a rank that waits long
    must sleep, ever longer naps, or it keeps the rank it waits for (or another job) off the cores;
    with more ranks than cores (2 ranks, 1 core) it sleeps from the start."""
    from lomo_ds.comm import shm_transport

    monkeypatch.setattr(shm_transport.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    calls = {"sleep": 0, "yield": 0}
    sleep, yield_ = shm_transport.time.sleep, shm_transport.os.sched_yield

    def counted(name, fn):
        def call(*args):
            calls[name] += 1
            return fn(*args)
        return call

    monkeypatch.setattr(shm_transport.time, "sleep", counted("sleep", sleep))
    monkeypatch.setattr(shm_transport.os, "sched_yield", counted("yield", yield_))
    t0 = time.monotonic()
    error = _waiting_rank({}, timeout_s=0.5)
    waited = time.monotonic() - t0
    assert error is not None and "train.collective_timeout" in str(error)  # it waited, then gave up
    # Sleeping, its naps growing to _MAX_SLEEP_S: about 500 looks in half a second at most (naps of
    # _SLEEP_S alone make thousands, a spinning rank hundreds of thousands).
    assert 0 < calls["sleep"] <= waited / shm_transport._MAX_SLEEP_S + 10, calls
    assert (calls["yield"] > 0) == (cores == 2), calls


def test_more_buckets_in_flight_than_two_get_as_many_slots():
    """With in_flight above two slots a rank would wait for peers that wait for it (a deadlock
    until the timeout): each in-flight bucket gets its own slot."""
    assert shm_reduce_scatter.SharedMemoryReduceScatter(None, 2, 0, in_flight=3).slots >= 3


# ----------------------------------------------------------------------------- items 2 and 7, on real ranks
HOST_READS = ("item", "tolist", "__float__", "__int__", "__bool__")


def _host_reads_in_backward(**lomo) -> dict:
    """Host reads of a tensor by lomo_ds code inside the backward passes of one step (after the
    first, which settles the layout): on a GPU each one drains the queue."""
    import lomo_ds
    from tests.engine.dist_engine_checks import ds_cfg
    from tests.tiny import global_batch, tiny_llama

    engine = lomo_ds.initialize(tiny_llama(0), ds_cfg(bucket_size=3000, **lomo))
    world, rank = engine.world, engine.rank
    engine.train_step(global_batch(0, world)[rank])
    reads, originals = [], {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counting(name):
        def read(self, *args, **kwargs):
            caller = sys._getframe(1)
            if f"{os.sep}lomo_ds{os.sep}" in caller.f_code.co_filename:
                reads.append(f"{name} at {os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno}")
            return originals[name](self, *args, **kwargs)
        return read

    backward = engine._backward

    def counted_backward(*args, **kwargs):
        for name in HOST_READS:
            setattr(torch.Tensor, name, counting(name))
        try:
            return backward(*args, **kwargs)
        finally:
            for name, fn in originals.items():
                setattr(torch.Tensor, name, fn)

    engine._backward = counted_backward
    engine.train_step(global_batch(1, world)[rank])
    return {"reads": sorted(set(reads)), "n_reads": len(reads)}


HOST_READ_CASES = multi_rank_checks(
    (1, 2),
    sgd=lambda: _host_reads_in_backward(grad_reduction="reduce_scatter"),
    clip_norm=lambda: _host_reads_in_backward(grad_reduction="reduce_scatter", clip_grad_norm=0.5),
    adalomo=lambda: _host_reads_in_backward(grad_reduction="reduce_scatter", optimizer="adalomo"),
    # The host-update worker finishing AdaLomo's updates (offload_param cpu on an accelerator).
    adalomo_host_thread=lambda: _host_reads_in_backward(grad_reduction="reduce_scatter", optimizer="adalomo",
                                                        host_update="thread"),
)
# One rank, "auto": each gradient applied as it arrives (on a CPU "auto" between ranks is shared
# memory, whose flags are host memory by design).
one_rank_direct, = multi_rank_checks((1,), one_rank_direct=lambda: _host_reads_in_backward(grad_reduction="auto"))


@pytest.mark.parametrize("world, check", [(w, c) for w in (1, 2) for c in HOST_READ_CASES] + [(1, one_rank_direct)],
                         ids=str)
def test_no_host_sync_inside_the_backward(rank_results, world, check):
    """Item 7: the per-bucket verdict, the per-parameter check on one rank, the measuring pass's
    norms and AdaLomo's per-bucket statistics stay on the device; the pass is read once, after it."""
    r = ok(rank_results(world), check)
    assert r["n_reads"] == 0, f"host reads inside the backward: {r['reads']}"


@multi_rank(worlds=(1, 2))
def gather_order():
    """Item 2: per step, the order of the shard updates, the gathers' wait and the release."""
    import lomo_ds
    from lomo_ds.runtime import ds_compat
    from tests.engine.dist_engine_checks import ds_cfg
    from tests.tiny import global_batch, tiny_llama

    engine = lomo_ds.initialize(tiny_llama(0), ds_cfg(bucket_size=3000, grad_reduction="reduce_scatter"))
    world, rank = engine.world, engine.rank
    events, apply = [], engine.buckets.on_bucket
    wait, release = ds_compat.gathers_wait_for_updates, ds_compat.release_all
    engine.buckets.on_bucket = lambda items, stats: (events.append("update"), apply(items, stats))[-1]
    ds_compat.gathers_wait_for_updates = lambda offload: (events.append("gathers wait"), wait(offload))[-1]
    ds_compat.release_all = lambda offload: (events.append("release"), release(offload))[-1]
    try:
        for step in range(2):
            engine.train_step(global_batch(step, world)[rank])
            events.append("step end")
    finally:
        ds_compat.gathers_wait_for_updates, ds_compat.release_all = wait, release
    return {"events": events}


@pytest.mark.parametrize("world", [1, 2])
def test_next_forward_gathers_wait_for_the_last_update(rank_results, world):
    events = ok(rank_results(world), gather_order)["events"]
    steps = " ".join(events).split("step end")[:-1]
    assert len(steps) == 2
    for step in steps:
        order = step.split()
        text = " ".join(order)
        assert "update" in text and "gathers wait" in text, text
        last_update = max(i for i, e in enumerate(order) if e == "update")
        wait_at = text.rfind("gathers wait")
        assert text.rfind("update") < wait_at < text.rfind("release"), \
            f"the gathers must wait after the step's last update ({last_update}) and before the release: {text}"


# ----------------------------------------------------------------------------- item 8
def _zero_params(n: int, numel: int = 8) -> list[torch.nn.Parameter]:
    """Parameters as ZeRO-3 leaves them, their (whole, one-rank) shards in host memory."""
    params = []
    for i in range(n):
        p = torch.nn.Parameter(torch.empty(0))
        p.ds_tensor, p.ds_numel, p.ds_id = torch.zeros(numel, device="cpu"), numel, i
        params.append(p)
    return params


def test_offloaded_slices_are_staged_without_blocking_and_updated_on_the_worker(fake_accelerator, monkeypatch):
    """On an accelerator, a bucket of slices for shards in host memory: non_blocking copies into
    pinned buffers, an event after them, and the hook's call returns before anything is applied;
    the worker waits for the event, then updates, on its own thread; join waits for it."""
    order, buffers = [], []

    def buffer(numel, dtype, pin):
        t = torch.empty(numel, dtype=dtype, device="cpu")  # no page-locked memory without a real accelerator
        buffers.append((t, pin))
        return t

    def staged(t):
        return any(t.data_ptr() >= b.data_ptr() and t.data_ptr() < b.data_ptr() + max(b.nbytes, 1)
                   for b, _ in buffers)

    copy = torch.Tensor.copy_

    def recording_copy(self, src, non_blocking=False):
        if staged(self):
            order.append(f"copy non_blocking={non_blocking}")
        return copy(self, src, non_blocking=non_blocking)

    class Event(FakeEvent):
        def record(self, stream=None):
            order.append("event recorded")

        def synchronize(self):
            order.append(f"event waited on {threading.current_thread().name}")

    monkeypatch.setattr(host_updates, "host_buffer", buffer)
    monkeypatch.setattr(torch.Tensor, "copy_", recording_copy)
    fake_accelerator.Event = Event
    params = _zero_params(2)
    updater = ShardUpdater(stochastic_rounding=False, seed=0, stats_device=torch.device("cpu"))
    stats = updater.begin_pass(PassSettings(lr=1.0))
    host = HostUpdates(torch.device("cuda:0"), name_of=lambda p: f"p{p.ds_id}")
    assert all(host.holds(p) for p in params)  # shards in host memory, the ranks on "cuda:0"
    handed = threading.Event()

    def apply(param, g, finite):
        if not handed.wait(timeout=2):
            order.append("update before the hook returned")
        order.append(f"update on {threading.current_thread().name}")
        updater.apply(param, g, finite)

    host.submit([(p, torch.ones(8, device="cpu")) for p in params], stats.finite, apply)
    order.append("hook returned")
    handed.set()
    host.join()
    order.append("joined")
    # The probe of whether the accelerator pins, then the slices' buffer and the flag's.
    assert [pin for _, pin in buffers] == [True] * 3, "staging buffers must be pinned on an accelerator"
    # Staged before the worker starts: the slices' and the flag's copies, then the event.
    assert order[:4] == ["copy non_blocking=True"] * 3 + ["event recorded"], order
    updates = [i for i, e in enumerate(order) if e.startswith("update")]
    assert [order[i] for i in updates] == ["update on lomo-host-update"] * 2, order
    assert order.index("hook returned") < updates[0] and order.index("event waited on lomo-host-update") < updates[0]
    assert order[-1] == "joined"
    assert host.applied == 2
    assert all(torch.equal(p.ds_tensor, torch.full((8,), -1.0, device="cpu")) for p in params)


def test_a_cpu_rank_stages_nothing_and_pins_nothing(monkeypatch):
    """On a CPU rank the slices are in host memory already: no copy, no pinned memory (which needs
    an accelerator); the worker still applies them when memory.host_update is "thread"."""
    monkeypatch.setattr(host_updates, "host_buffer", lambda *a, **k: pytest.fail("staged on a CPU rank"))
    assert use_thread("auto", torch.device("cuda:1")) and not use_thread("auto", torch.device("cpu"))
    assert use_thread("thread", torch.device("cpu")) and not use_thread("inline", torch.device("cuda:0"))
    # 8-bit shards: "auto" updates inline on an accelerator too (a cut block's scale needs a collective)
    gpu = torch.device("cuda:0")
    assert not use_thread("auto", gpu, int8_shards=True) and use_thread("thread", gpu, int8_shards=True)
    params = _zero_params(1)
    updater = ShardUpdater(stochastic_rounding=False, seed=0, stats_device=torch.device("cpu"))
    stats = updater.begin_pass(PassSettings(lr=0.5))
    host = HostUpdates(torch.device("cpu"), name_of=str)
    host.submit([(params[0], torch.ones(8, device="cpu"))], stats.finite, updater.apply)
    host.join()
    assert torch.equal(params[0].ds_tensor, torch.full((8,), -0.5, device="cpu"))



class PerThreadDevice(FakeAccelerator):
    """CUDA's rule for the current device: each thread has its own, and a new thread starts on the
    first device (where a call that names none, an event's wait for one, then opens a context)."""

    def __init__(self):
        self._local = threading.local()
        super().__init__()

    @property
    def index(self):
        return getattr(self._local, "index", 0)

    @index.setter
    def index(self, value):
        self._local.index = value

    def current_device(self):
        return self.index


@pytest.mark.parametrize("device", ["cuda:1", "cuda"])
def test_the_host_update_worker_runs_on_the_ranks_device(device, monkeypatch):
    """Rank 1 on cuda:1 (set on the main thread, as set_rank_device does; "cuda": the engine's device
    without an index, the main thread's current one): the worker's thread reads cuda:1 as its
    current device when it waits for its copies and when it applies, on every pass's new thread.
    Without set_device on the worker it reads cuda:0: on a GPU, every rank but the first would hold
    a context on the first GPU (tests/gpu: test_no_rank_holds_a_context_on_another_ranks_gpu)."""
    fake = PerThreadDevice()
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: fake)
    monkeypatch.setattr(host_updates, "host_buffer",  # no page-locked memory without a real accelerator
                        lambda numel, dtype, pin: torch.empty(numel, dtype=dtype, device="cpu"))
    seen = []

    class Event(FakeEvent):
        def synchronize(self):
            seen.append(("copies waited on", threading.current_thread().name, fake.current_device_name()))

    fake.Event = Event
    fake.set_device(1)
    params = _zero_params(2)
    updater = ShardUpdater(stochastic_rounding=False, seed=0, stats_device=torch.device("cpu"))
    host = HostUpdates(torch.device(device), name_of=lambda p: f"p{p.ds_id}")

    def apply(param, g, finite):
        seen.append(("applied on", threading.current_thread().name, fake.current_device_name()))
        updater.apply(param, g, finite)

    for _ in range(2):  # a worker thread per pass
        stats = updater.begin_pass(PassSettings(lr=1.0))
        host.submit([(p, torch.ones(8, device="cpu")) for p in params], stats.finite, apply)
        host.join()
    worker = [("copies waited on", "lomo-host-update", "cuda:1")] + [("applied on", "lomo-host-update", "cuda:1")] * 2
    assert seen == worker * 2, seen
    assert fake.current_device_name() == "cuda:1" and fake.set_calls == [1, 1, 1]
    assert all(torch.equal(p.ds_tensor, torch.full((8,), -2.0, device="cpu")) for p in params)


def _offloaded_engine():
    import lomo_ds
    from tests.engine.dist_engine_checks import offload_cfg
    from tests.tiny import tiny_llama

    return lomo_ds.initialize(tiny_llama(0), offload_cfg(bucket_size=3000, host_update="thread"))


@multi_rank(worlds=(1, 2))
def host_update_order():
    """Item 8 on real ranks: each bucket of offloaded shards is handed to the worker and the hook
    returns before it is applied; every update runs on the worker; the pass's statistics are read
    only once every handed slice is applied."""
    from tests.tiny import global_batch

    engine = _offloaded_engine()
    world, rank = engine.world, engine.rank
    hand, apply, read = engine.buckets.on_bucket, engine.updater.apply, engine._sum_over_ranks
    returned, rec = {}, {"handed": 0, "applied": 0, "early": 0, "threads": set(), "pending_at_read": []}

    def handing(items, stats):
        done = threading.Event()
        for p, _ in items:
            returned[id(p)] = done
        rec["handed"] += sum(1 for p, _ in items if engine.updater.geometry(p).local)
        try:
            return hand(items, stats)
        finally:
            done.set()

    def applying(param, g, finite):
        # Applied inside the hook that handed it over, it would wait here in vain (once: the
        # first such wait shows it, and the rest of a reverted run need not take 2 s each).
        if not returned[id(param)].wait(timeout=0 if rec["early"] else 2):
            rec["early"] += 1
        rec["threads"].add(threading.current_thread().name)
        time.sleep(0.002)  # a slow host: a pass that did not wait for the worker reads its statistics early
        apply(param, g, finite)
        rec["applied"] += 1

    def reading(values, name):
        if name == "non-finite flag":  # the updating pass's one read
            rec["pending_at_read"].append(rec["handed"] - rec["applied"])
        return read(values, name)

    engine.buckets.on_bucket, engine.updater.apply, engine._sum_over_ranks = handing, applying, reading
    for step in range(2):
        engine.train_step(global_batch(step, world)[rank])
    return {**rec, "threads": sorted(rec["threads"])}


@pytest.mark.parametrize("world", [1, 2])
def test_offloaded_updates_run_on_the_worker_after_the_hook_and_before_the_statistics(rank_results, world):
    r = ok(rank_results(world), host_update_order)
    assert r["applied"] == r["handed"] > 0
    assert r["threads"] == ["lomo-host-update"], f"offloaded updates ran on {r['threads']}"
    assert r["early"] == 0, f"{r['early']} updates ran before the hook that handed them over returned"
    assert r["pending_at_read"] == [0, 0], f"slices still unapplied when the pass was read: {r['pending_at_read']}"


@multi_rank(worlds=(1, 2))
def adalomo_host_update_order():
    """AdaLomo with offloaded shards and the host-update worker: every rank issues the bucket
    statistics' all-reduces from the backward's thread, two per bucket, while the hook holds that
    bucket, buckets in layout order; the worker applies each slice's host part after the hook that
    handed it over returned; the pass is read once every handed slice is applied."""
    import lomo_ds
    from lomo_ds.comm import step_sums
    from tests.engine.dist_engine_checks import offload_cfg
    from tests.tiny import global_batch, tiny_llama

    cfg = offload_cfg(bucket_size=3000, host_update="thread", optimizer="adalomo", grad_reduction="reduce_scatter")
    cfg["lomo"]["lr"] = 0.01
    engine = lomo_ds.initialize(tiny_llama(0), cfg)
    world, rank = engine.world, engine.rank
    adalomo = engine.updater.rule
    hand, apply_host, read, all_reduce = (engine.buckets.on_bucket, adalomo.apply_host, step_sums.sum_over_ranks,
                                          ds_compat.all_reduce)
    returned, events = {}, []
    rec = {"handed": 0, "applied": 0, "early": 0, "threads": set(), "pending_at_read": []}

    def handing(items, stats):
        done = threading.Event()
        for p, _ in items:
            returned[id(p)] = done
        # (this bucket, the pass's bucket count): the layout is re-planned after the first backward
        events.append(("bucket", [engine.buckets.slot_of[id(items[0][0])][0], len(engine.buckets.layout)]))
        rec["handed"] += sum(1 for p, _ in items if engine.updater.geometry(p).local)
        try:
            return hand(items, stats)
        finally:
            events.append(("returned", None))
            done.set()

    def applying(shard, settings, param, staged, finite):
        if not returned[id(param)].wait(timeout=0 if rec["early"] else 2):
            rec["early"] += 1
        rec["threads"].add(threading.current_thread().name)
        time.sleep(0.002)  # a slow host: a pass that did not wait for the worker reads its statistics early
        apply_host(shard, settings, param, staged, finite)
        rec["applied"] += 1

    def reducing(tensor, group=None, name="all-reduce tensor", op="sum"):
        if name == "AdaLomo bucket statistics":
            events.append(("all_reduce", threading.current_thread().name))
        return all_reduce(tensor, group=group, name=name, op=op)

    def reading(values, *args, name="", **kwargs):
        if name == "non-finite flag":  # the updating pass's one read
            rec["pending_at_read"].append(rec["handed"] - rec["applied"])
            events.append(("pass read", None))
        return read(values, *args, name=name, **kwargs)

    engine.buckets.on_bucket, adalomo.apply_host = handing, applying
    step_sums.sum_over_ranks, ds_compat.all_reduce = reading, reducing
    try:
        for step in range(2):
            engine.train_step(global_batch(step, world)[rank])
    finally:
        step_sums.sum_over_ranks, ds_compat.all_reduce = read, all_reduce
    return {**rec, "threads": sorted(rec["threads"]), "events": events, "worker_applied": engine.host_updates.applied,
            "shard_devices": sorted({ds_compat.shard(p).device.type for p in engine.params})}


@pytest.mark.parametrize("world", [1, 2])
def test_adalomo_offloaded_updates_finish_on_the_worker_after_collectives_on_the_main_thread(rank_results, world):
    r = ok(rank_results(world), adalomo_host_update_order)
    assert r["shard_devices"] == ["cpu"]
    assert r["applied"] == r["handed"] == r["worker_applied"] > 0
    assert r["threads"] == ["lomo-host-update"], f"AdaLomo's host part ran on {r['threads']}"
    assert r["early"] == 0, f"{r['early']} slices were applied before the hook that handed them over returned"
    assert r["pending_at_read"] == [0, 0], f"slices still unapplied when the pass was read: {r['pending_at_read']}"
    passes = []
    for kind, what in r["events"]:
        if kind == "bucket":
            if not passes or passes[-1][-1] == "read":
                passes.append([])
            passes[-1].append([what])
        elif kind == "all_reduce":
            passes[-1][-1].append(what)
        elif kind == "pass read":
            passes[-1].append("read")
        else:  # the hook returned: nothing of this bucket after it
            passes[-1][-1].append("returned")
    assert len(passes) == 2
    for buckets in passes:
        assert buckets[-1] == "read"
        buckets = buckets[:-1]
        assert [b[0] for b in buckets] == [[i, len(buckets)] for i in range(len(buckets))], \
            f"buckets out of layout order: {[b[0] for b in buckets]}"
        # Two all-reduces per bucket between its hand-over and the hook's return, from the main
        # thread; one rank has no peer to reduce with.
        expected = ["MainThread"] * 2 if world > 1 else []
        assert all(b[1:] == expected + ["returned"] for b in buckets), buckets


@multi_rank(worlds=(1, 2))
def host_update_error():
    """Item 8: an error inside the worker (here, every rank's update of lm_head.weight) is raised
    from train_step, naming the parameter; no worker thread is left running."""
    from tests.tiny import global_batch

    engine = _offloaded_engine()
    target, apply = engine.module.lm_head.weight, engine.updater.apply

    def failing(param, g, finite):
        if param is target:
            raise ValueError("injected failure")
        apply(param, g, finite)

    engine.updater.apply = failing
    message = cause = ""
    try:
        engine.train_step(global_batch(0, engine.world)[engine.rank])
    except RuntimeError as e:
        message, cause = str(e), repr(e.__cause__)
    return {"message": message, "cause": cause,
            "threads_left": [t.name for t in threading.enumerate() if t.name == "lomo-host-update"]}


@pytest.mark.parametrize("world", [1, 2])
def test_an_error_in_the_worker_surfaces_from_the_step_naming_the_parameter(rank_results, world):
    r = ok(rank_results(world), host_update_error)
    assert "'lm_head.weight'" in r["message"] and "ValueError: injected failure" in r["message"], r
    assert "injected failure" in r["cause"] and r["threads_left"] == []


# ----------------------------------------------------------------------------- item 4, on real ranks
reduction_overflow, = multi_rank_checks((2,), reduction_overflow=lambda: check_reduction_overflow())


def test_a_sum_that_overflows_only_inside_the_reduction_skips_the_step_everywhere(rank_results):
    """Item 4: the flag each rank sends covers its own payload; the received slice's finiteness is
    folded in before the pass's one read, so the overflow is seen and agreed on by every rank."""
    assert_reduction_overflow_skips(ok(rank_results(2), reduction_overflow))
