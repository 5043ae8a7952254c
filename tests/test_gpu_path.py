"""The GPU path on a CPU: what only a GPU run would show, made visible with a fake accelerator,
a recorded order of calls or a monkeypatched collective. Each test fails when its fix is undone
(tests/gpu runs the same paths on a real GPU)."""
import os
import subprocess
import sys
import threading
import time

import deepspeed.accelerator
import pytest
import torch

from lomo_ds.engine import shm_reduce_scatter
from lomo_ds.engine.comm_stats import StepTimers
from lomo_ds.engine.fused_update import ShardUpdater, UpdateRule
from lomo_ds.runtime import device as device_module
from lomo_ds.runtime import dist


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


class FakeAccelerator:
    """A CUDA-like accelerator: a current device index the code must set, and events."""

    clock = 0

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

    Event = FakeEvent


@pytest.fixture
def fake_accelerator(monkeypatch):
    fake = FakeAccelerator()
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: fake)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "nccl")
    return fake


# ----------------------------------------------------------------------------- item 1
def test_each_rank_gets_its_own_device_before_anything_reads_it(fake_accelerator, monkeypatch):
    """With a plain model nothing but lomo_ds sets the device: rank 1 must get device 1."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    started = []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: bool(started))
    monkeypatch.setattr(deepspeed, "init_distributed",
                        lambda **kw: started.append(device_module.accelerator_device()))
    dist.init_distributed(timeout_s=30)
    assert fake_accelerator.set_calls == [1]
    assert started == [torch.device("cuda:1")], "the process group started before the device was set"
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
    monkeypatch.setattr("lomo_ds.engine.fused_update.stochastic_round_to_bf16",
                        lambda w, gen: (used.append((w.device, gen.device)), w.to(torch.bfloat16))[1])
    params = []
    for i, dev in enumerate(("cpu", "meta")):
        p = torch.nn.Parameter(torch.empty(0, dtype=torch.bfloat16))
        p.ds_tensor, p.ds_numel, p.ds_id = torch.zeros(8, dtype=torch.bfloat16, device=dev), 8, i
        params.append(p)
    updater = ShardUpdater(stochastic_rounding=True, seed=0, stats_device=torch.device("cpu"))
    stats = updater.begin_pass(UpdateRule(lr=0.1), step=0)
    for p in params:
        updater.apply(p, torch.ones(8, dtype=torch.bfloat16), stats.finite)
    assert used == [(torch.device("cpu"), torch.device("cpu")), (torch.device("meta"), torch.device("meta"))]


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


def _waiting_rank(peer_header: dict, timeout_s: float = 60.0):
    """Rank 0 of 2 waiting for rank 1's first bucket; rank 1's header as `peer_header` says.
    Returns the error rank 0 raised (None if it is still waiting after 10 s)."""
    shm = shm_reduce_scatter.SharedMemoryReduceScatter(None, world=2, rank=0, timeout_s=timeout_s)
    shm.slot_bytes = 64
    shm.buffers = [torch.zeros(shm.header_bytes + shm.slots * 64, dtype=torch.uint8) for _ in range(2)]
    shm.flags = [b[:shm.header_bytes].view(torch.int64) for b in shm.buffers]
    shm.flags[0][2 * shm.slots] = os.getpid()
    shm.flags[1][2 * shm.slots] = peer_header.get("pid", os.getpid())
    shm.flags[1][2 * shm.slots + 1] = peer_header.get("abandoned", 0)
    shm.payload(1, torch.float32).zero_()
    pending = shm.post(torch.empty(1))
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


def test_a_dead_peer_is_named_within_a_second():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # its pid now names no process
    t0 = time.monotonic()
    error = _waiting_rank({"pid": child.pid})
    assert error is not None, "rank 0 still spins on a peer that has exited"
    assert "rank 1 has exited" in str(error) and time.monotonic() - t0 < 5


def test_a_peer_whose_backward_raised_is_named():
    error = _waiting_rank({"abandoned": 1})
    assert error is not None and "rank 1 raised an error in its backward" in str(error)


def test_a_live_peer_that_never_posts_times_out_by_the_config():
    error = _waiting_rank({}, timeout_s=1.0)
    assert error is not None and "lomo.collective_timeout" in str(error)


def test_more_buckets_in_flight_than_two_get_as_many_slots():
    """With in_flight above two slots a rank would wait for peers that wait for it (a deadlock
    until the timeout): each in-flight bucket gets its own slot."""
    assert shm_reduce_scatter.SharedMemoryReduceScatter(None, 2, 0, in_flight=3).slots >= 3
