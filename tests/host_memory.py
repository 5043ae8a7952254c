"""A probe of a process's peak anonymous resident memory over a block of code (Linux): a thread
reads RssAnon from /proc/self/status every millisecond. Anonymous memory is what a process holds
itself (tensors, buffers); file pages a memory map reads count apart and the kernel can drop them."""
from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import threading
import time

# Imported here, not in the probes: the multi-rank harness moves what the test modules imported out
# of the collector's sight (gc.freeze), and the probe collects many times.
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

import lomo_ds
from lomo_ds.methods.lomo import load_engine_state
from lomo_ds.runtime import ds_compat
from lomo_ds.runtime.device import EMULATE_DEVICE_COPY
from lomo_ds.storage.checkpoint import export_hf
from lomo_ds.storage.engine_state import save_engine_state
from tests.tiny import global_batch


def rss_anon_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no RssAnon line")


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def _libc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 (glibc: both exist)
        return libc
    except (OSError, AttributeError):
        return None


class AnonPeak:
    """`with AnonPeak() as probe: ...`; then probe.above_start: the peak during the block minus the
    value at its start, in bytes. Under glibc, for the block, every allocation of 64 KiB or more is
    its own memory map, given back when freed, so the figure is the memory the block held at once,
    not what the heap's holes kept (with glibc's defaults a heap grown by many freed tensors of
    varied sizes stays grown)."""

    def __init__(self, interval_s: float = 0.001):
        self.interval_s = interval_s
        self.start = self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_anon_bytes())
            time.sleep(self.interval_s)

    def __enter__(self) -> "AnonPeak":
        # Free memory the allocator kept from earlier work goes back to the system first, or the
        # block could reuse it without its resident memory growing.
        gc.collect()
        libc = _libc()
        if libc is not None:
            libc.mallopt(M_MMAP_THRESHOLD, 64 << 10)
            libc.mallopt(M_TRIM_THRESHOLD, 64 << 10)
            libc.malloc_trim(0)
        self.start = self.peak = rss_anon_bytes()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_anon_bytes())
        libc = _libc()
        if libc is not None:  # glibc's defaults (the thresholds stay fixed from now on)
            libc.mallopt(M_MMAP_THRESHOLD, 128 << 10)
            libc.mallopt(M_TRIM_THRESHOLD, 128 << 10)

    @property
    def above_start(self) -> int:
        return self.peak - self.start


def live_tensor_bytes() -> int:
    """The bytes of every tensor storage Python can reach now (after a collection), each counted once:
    what a process holds, without what its allocator keeps of memory already freed."""
    gc.collect()
    seen, total = set(), 0
    for obj in gc.get_objects():
        if torch.is_tensor(obj) and obj.device.type == "cpu":
            try:
                storage = obj.untyped_storage()
                ptr = storage.data_ptr()
            except RuntimeError:  # a tensor without valid storage (released or being freed): nothing held
                continue
            if ptr not in seen:
                seen.add(ptr)
                total += storage.nbytes()
    return total


def checkpoint_and_export_host_memory(root: str) -> dict:
    """_measure_checkpoint_and_export(root) with what the process held before it out of the
    collector's sight: the probes collect and walk every object the collector tracks, many times,
    and in the multi-rank launch the checks before this one leave millions (each walk then took
    seconds). Every tensor this one makes, its model's included, stays in sight."""
    gc.collect()
    gc.freeze()
    try:
        return _measure_checkpoint_and_export(root)
    finally:
        # What this check made is garbage now: collected with the rest in sight, then what is
        # still alive goes out of sight again, as the launch left it (tests/ranks.py main).
        gc.unfreeze()
        gc.collect()
        gc.freeze()


def _measure_checkpoint_and_export(root: str) -> dict:
    """Collective (writes under `root`, one folder every rank sees). Rank 0's peak anonymous host
    memory above its start, over the export, a checkpoint save and its load, on a model of many
    ~1 MB tensors (no single tensor dominates): an export that held
    the whole model, or a save or load that copied the whole shard state, shows as a multiple of
    what a streamed one holds (one file of the export, one tensor beyond the shards)."""
    engine = _engine_of_many_tensors()
    model_bytes = sum(ds_compat.full_numel(p) * 4 for p in engine.params)
    shard_bytes = sum(ds_compat.shard(p).numel() * 4 for p in engine.params)
    largest = max(ds_compat.full_numel(p) * 4 for p in engine.params)
    file_limit = model_bytes // 16
    out = {"model_bytes": model_bytes, "shard_bytes": shard_bytes, "largest_tensor": largest, "file_limit": file_limit}
    # The first export warms what the gathers keep for the next (the all-gather's buffers); the
    # second shows the export's resident memory, and the third the tensors alive while each file is
    # written (exact, where resident memory also counts what the allocator kept). Apart, because
    # counting the live tensors walks every object the collector tracks: its list of them would
    # count in the resident peak, and it grows with whatever the process did before.
    export_dir = os.path.join(root, "rss_export")
    export_hf(engine, None, export_dir, 600.0, max_shard_size=file_limit)
    with AnonPeak() as probe:
        export_hf(engine, None, export_dir, 600.0, max_shard_size=file_limit)
    out["export"] = probe.above_start
    base, at_write = live_tensor_bytes(), []

    def write(tensors, path):
        at_write.append(live_tensor_bytes() - base)
        save_file(tensors, path)

    export_hf(engine, None, export_dir, 600.0, max_shard_size=file_limit, write_file=write)
    out["export_live"] = max(at_write) if at_write else 0
    out.update(_measure_checkpoint(engine, os.path.join(root, "rss_checkpoint")))
    return out


@contextlib.contextmanager
def emulated_device_copy():
    """The block runs as on an accelerator: no tensor counts as host memory (runtime.device.host_resident),
    so the storage code copies what a GPU's shards would need copied."""
    before = os.environ.get(EMULATE_DEVICE_COPY)
    os.environ[EMULATE_DEVICE_COPY] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[EMULATE_DEVICE_COPY]
        else:
            os.environ[EMULATE_DEVICE_COPY] = before


def _measure_checkpoint(engine, ckpt: str) -> dict:
    """Collective: rank 0's peak anonymous host memory above its start over a save of the engine's
    state and its load, as they run here ("save", "load") and as on an accelerator, copying what is
    not host memory ("save_emulated", "load_emulated"; the same as the first pair on a GPU run)."""
    out = {}
    for suffix, mode in (("", contextlib.nullcontext), ("_emulated", emulated_device_copy)):
        folder = ckpt + suffix
        os.makedirs(folder, exist_ok=True)
        with mode():
            gc.collect()
            with AnonPeak() as probe:  # as LOMO's save_state writes it
                save_engine_state(folder, engine.shard_state_dict(), 600.0)
            out["save" + suffix] = probe.above_start
            gc.collect()
            with AnonPeak() as probe:  # as LOMO's load_state reads it
                engine.load_shard_state_dict(load_engine_state(engine, folder, 600.0))
            out["load" + suffix] = probe.above_start
    return out


def _engine_of_many_tensors():
    """An engine whose rank shards are about 28 MB whatever the rank count (four layers a rank, 8 GPUs
    included), of many ~1 MB tensors (no single tensor dominates), one step trained."""
    torch.manual_seed(0)
    layers = 4 * torch.distributed.get_world_size()
    model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=384, intermediate_size=1024,
                                         num_hidden_layers=layers, num_attention_heads=6, num_key_value_heads=6,
                                         tie_word_embeddings=False))
    engine = lomo_ds.initialize(model, {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
                                        "lomo": {"lr": 0.01}})
    engine.train_step(global_batch(0, engine.world)[engine.rank])
    return engine


def assert_checkpoint_host_memory(r: dict) -> None:
    """A save or a load, plain or as on an accelerator, held no copy of the rank's shards: at most
    about two of its largest tensors (the one written or read and the one before it)."""
    # The allocator's, Python's and the process group's threads' own, independent of the model's size;
    # it varies by several MiB between runs of the same save or load. Still far below the shard,
    # which a save or load holding a copy of it would add whole.
    slack = 16 << 20
    print({k: f"{v / 2**20:.1f} MiB" for k, v in r.items() if not k.startswith("_")})
    assert 2 * r["largest_tensor"] + slack < r["shard_bytes"], r  # else a copy of the shards would fit
    for key in ("save", "load", "save_emulated", "load_emulated"):
        assert r[key] <= 2 * r["largest_tensor"] + slack, (key, r)


def assert_checkpoint_and_export_host_memory(r: dict) -> None:
    """What checkpoint_and_export_host_memory's figures must show (the CPU suite's and the GPU suite's)."""
    # Rank 0 held one file's tensors at each write, nothing more.
    assert 0 < r["export_live"] <= r["file_limit"] + r["largest_tensor"], r
    # The export's resident peak is printed, not bounded: it also counts what the allocator keeps and
    # the other threads' (the gathers') memory, which varied from a third of this model's size to more
    # than all of it between runs of the suite; the live tensors above are the exact figure.
    assert_checkpoint_host_memory(r)
