"""Who a synchronising call belongs to, and on which GPUs each rank's process holds a context: the
GPU launch's checks of where work lands (tests/gpu/gpu_checks.py runs them; tests/gpu/test_helpers.py
runs the classifier on real stacks on a CPU)."""
from __future__ import annotations

import csv
import io
import os
import subprocess
import traceback

import torch

LOMO_DS_DIR = f"{os.sep}lomo_ds{os.sep}"


def sync_owner(stack: list[traceback.FrameSummary], thread: str, torch_dir: str) -> str:
    """Who a synchronising call belongs to, by its stack (innermost frame last, as
    traceback.extract_stack gives it), on whatever thread it came: on CUDA autograd runs the gradient
    hooks on a device thread of its own, and lomo_ds's host-update worker runs the updates of shards
    in host memory on another. Walking outwards past torch's frames and the warnings module's, the
    first lomo_ds frame makes it lomo_ds's ("lomo_ds: file:line"); a `.backward(` call reached first
    makes it the backward kernels' (autograd replays them there, on the calling thread); a stack with
    neither (DeepSpeed's hooks on autograd's thread) is another's ("other: innermost file:line").
    A thread other than the main one is named after the place."""
    innermost = None
    label = None
    for frame in reversed(stack):
        if frame.filename.startswith(torch_dir) or frame.filename.endswith("warnings.py"):
            continue
        where = f"{os.path.basename(frame.filename)}:{frame.lineno}"
        innermost = innermost or where
        if ".backward(" in (frame.line or ""):
            label = f"backward kernels (replayed at {where})"
            break
        if LOMO_DS_DIR in frame.filename:
            label = f"lomo_ds: {where}"
            break
    label = label or f"other: {innermost or 'torch'}"
    return label if thread == "MainThread" else f"{label} ({thread} thread)"


def by_owner(labels: list[str]) -> tuple[list[str], list[str]]:
    """sync_owner's labels split into lomo_ds's and the others', each sorted without repeats."""
    mine = sorted({s for s in labels if s.startswith("lomo_ds: ")})
    return mine, sorted(set(labels) - set(mine))


# The host-update worker's one wait by design: for the copies that staged its bucket (host_updates.py,
# HostUpdates._run), on its own thread, so that the backward never waits for them.
WORKER_COPY_WAIT = ("host_updates.py", "lomo-host-update")


def worker_copy_wait(label: str) -> bool:
    return label.startswith(f"lomo_ds: {WORKER_COPY_WAIT[0]}:") and label.endswith(f"({WORKER_COPY_WAIT[1]} thread)")


def gpu_processes() -> dict[str, dict[int, int]] | None:
    """{GPU UUID (lower case, without its "GPU-" prefix): {pid: bytes}} of every compute process the
    driver lists, read through NVML (pynvml) or nvidia-smi: neither opens a CUDA context, which
    torch.cuda.mem_get_info on another rank's GPU would. None where neither is there."""
    try:
        import pynvml
    except ImportError:
        pynvml = None
    if pynvml is not None:
        pynvml.nvmlInit()
        try:
            out = {}
            for i in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                uuid = pynvml.nvmlDeviceGetUUID(handle)
                uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
                out[_uuid(uuid)] = {p.pid: int(p.usedGpuMemory or 0)
                                    for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
            return out
        finally:
            pynvml.nvmlShutdown()
    try:
        text = subprocess.run(["nvidia-smi", "--query-compute-apps=gpu_uuid,pid,used_memory",
                               "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=60,
                              check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    out: dict[str, dict[int, int]] = {}
    for row in csv.reader(io.StringIO(text)):
        if len(row) == 3:
            used = row[2].strip()
            out.setdefault(_uuid(row[0]), {})[int(row[1])] = int(used) << 20 if used.isdigit() else 0
    return out


def _uuid(text: str) -> str:
    text = text.strip().lower()
    return text[4:] if text.startswith("gpu-") else text


def check_worker_contexts(steps: int = 3) -> dict:
    """offload_param: cpu on every rank with memory.host_update auto (the host-update worker on a
    GPU): after a few steps, each rank's process must appear in the driver's list of compute
    processes on its own GPU and on no other. A worker thread left on the first device would put
    every other rank's process on GPU 0 as well (a context of its own, several hundred MB that no
    allocator statistic of that rank shows)."""
    import lomo_ds
    from tests.engine import dist_engine_checks as E
    from tests.tiny import global_batch, tiny_llama

    if not torch.cuda.is_available():
        return {"skipped": "the driver's process list needs CUDA"}
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    if world < 2:
        return {"skipped": "one GPU: there is no other rank's GPU to hold a context on"}
    engine = lomo_ds.initialize(tiny_llama(0), E.offload_cfg(bucket_size=3000))
    for step in range(steps):
        engine.train_step(global_batch(step, world)[rank])
    torch.cuda.synchronize(engine.device)
    mine = {"rank": rank, "pid": os.getpid(), "gpu": _uuid(str(torch.cuda.get_device_properties(engine.device).uuid)),
            "worker": engine.host_updates is not None, "applied": E.host_updates_applied(engine)}
    everyone = [None] * world
    torch.distributed.all_gather_object(everyone, mine)
    listed = gpu_processes() if rank == 0 else None
    torch.distributed.barrier()  # every rank alive (its contexts held) while rank 0 reads the list
    if rank != 0:
        return None
    if listed is None:
        return {"skipped": "neither pynvml nor nvidia-smi is there to list the GPUs' processes"}
    foreign = [{"rank": r["rank"], "on_gpu": gpu, "bytes": pids[r["pid"]]}
               for r in everyone for gpu, pids in listed.items() if r["pid"] in pids and gpu != r["gpu"]]
    return {"ranks": everyone, "own_listed": [r["pid"] in listed.get(r["gpu"], {}) for r in everyone],
            "foreign": foreign,
            "processes": {gpu: {str(p): b for p, b in pids.items()} for gpu, pids in listed.items()}}
