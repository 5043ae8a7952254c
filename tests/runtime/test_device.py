"""One device per rank: batches are moved to it, collectives refuse tensors off their group's
device. On this CPU the `meta` device stands in for "some other device" (a GPU); the engine's own
moves are checked on 1, 2 and 3 ranks in tests/engine/dist_engine_checks.py ("device")."""
import os

import pytest
import torch

from lomo_ds.data.types import EvalExample
from lomo_ds.evaluation.scoring import evaluate, evaluate_loss
from lomo_ds.runtime import ds_compat
from lomo_ds.runtime.device import (
    EMULATE_DEVICE_COPY,
    capture_rng,
    host_resident,
    move_batch,
    restore_rng,
    set_cpu_threads,
)

V = 7


class Recording(torch.Tensor):
    """A tensor that records where it was asked to go."""
    moves: list = []

    def to(self, *args, **kwargs):
        Recording.moves.append(torch.device(args[0] if args else kwargs["device"]))
        return super().to(*args, **kwargs).as_subclass(torch.Tensor)


def test_no_tensor_is_host_memory_where_device_copies_are_emulated(monkeypatch):
    """LOMO_DS_EMULATE_DEVICE_COPY=1 sends a CPU run's checkpoint through an accelerator's host copies."""
    on_host, elsewhere = torch.zeros(2, device="cpu"), torch.zeros(2, device="meta")
    monkeypatch.delenv(EMULATE_DEVICE_COPY, raising=False)
    assert host_resident(on_host) and not host_resident(elsewhere)
    monkeypatch.setenv(EMULATE_DEVICE_COPY, "1")
    assert not host_resident(on_host) and not host_resident(elsewhere)


def test_move_batch_moves_every_tensor_and_keeps_the_rest():
    Recording.moves = []
    batch = {"input_ids": torch.ones(2, 3, dtype=torch.long).as_subclass(Recording),
             "labels": torch.zeros(2, 3).as_subclass(Recording), "note": "kept"}
    out = move_batch(batch, torch.device("meta"))
    assert Recording.moves == [torch.device("meta")] * 2
    assert out["input_ids"].device.type == "meta" and out["labels"].device.type == "meta" and out["note"] == "kept"
    with pytest.raises(TypeError, match="batch: expected a dict of tensors"):
        move_batch([torch.ones(1)], torch.device("cpu"))


def test_collective_tensor_off_the_group_device_is_refused_by_name():
    ds_compat.check_device(torch.zeros(1), torch.device("cpu"), "loss")  # on the right device: fine
    with pytest.raises(ValueError,
                       match=r"loss: a collective on this process group takes tensors on cpu, got one on meta"):
        ds_compat.check_device(torch.zeros(1, device="meta"), torch.device("cpu"), "loss")


def recording_forward():
    seen = []

    def fwd(batch):
        seen.extend(v.device.type for v in batch.values())
        return torch.zeros(*batch["input_ids"].shape, V)  # scores need real numbers: built on the CPU

    fwd.seen = seen
    return fwd


def test_evaluation_forwards_get_their_batches_on_the_device():
    fwd = recording_forward()
    examples = [EvalExample("t", [1, 2], [[3], [4]], 0), EvalExample("t", [1], [[3, 5], [4]], 1)]
    evaluate(fwd, examples, pad_id=0, batch_size=2, device=torch.device("meta"))
    assert fwd.seen and set(fwd.seen) == {"meta"}
    fwd = recording_forward()
    evaluate_loss(fwd, [{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}], pad_id=0, batch_size=2,
                  device=torch.device("meta"))
    assert fwd.seen and set(fwd.seen) == {"meta"}


def test_rng_state_restores_the_same_draws():
    state = capture_rng(torch.device("cpu"))
    first = torch.rand(4)
    restore_rng(state, torch.device("cpu"))
    assert torch.equal(torch.rand(4), first)


def test_cpu_ranks_split_the_cores_unless_omp_num_threads_is_set(monkeypatch):
    before = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
        monkeypatch.setenv("LOCAL_SIZE", "2")  # DeepSpeed's launcher: two ranks on this node
        line = set_cpu_threads(torch.device("cpu"))
        assert torch.get_num_threads() == max(1, cores // 2)
        assert line.startswith(f"{max(1, cores // 2)} torch thread(s) per rank ({cores} cores / 2 ranks")
        # The user's choice (or DeepSpeed's --bind_cores_to_rank) is kept, and said so.
        torch.set_num_threads(3)
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        assert set_cpu_threads(torch.device("cpu")) == "3 torch thread(s) per rank (OMP_NUM_THREADS=3)"
        assert torch.get_num_threads() == 3
        assert set_cpu_threads(torch.device("cuda", 0)) == "cuda ranks"
    finally:
        torch.set_num_threads(before)


def test_rank_device_is_set_after_deepspeed_discovers_an_mpi_launch(monkeypatch):
    """Under mpirun or srun, DeepSpeed's init_distributed discovers the ranks and sets LOCAL_RANK:
    the rank's device is chosen after it, or every rank would take the first GPU."""
    import deepspeed
    import torch

    from lomo_ds.runtime import dist

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    seen = []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(deepspeed, "init_distributed", lambda **kw: monkeypatch.setenv("LOCAL_RANK", "3"))
    monkeypatch.setattr(dist, "set_rank_device", lambda: seen.append(os.environ.get("LOCAL_RANK")))
    dist.init_distributed(timeout_s=60)
    assert seen == ["3"]
