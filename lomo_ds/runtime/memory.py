"""Memory accounting from the engine's own tensors.

On a GPU the caching allocator gives peak figures; on a CPU there is no allocator to ask, so the
engine can count, at every gradient hook in the backward pass, the bytes held by the tensors it
is responsible for: this rank's parameter shards, parameters DeepSpeed has gathered, gradients
still alive, and the gradient buckets in flight. The peak of that sum is what the memory tests
bound and the tables report. ActivationCounter adds what autograd saves in the forward pass, and
`breakdown` assembles a method's categories (the rules: lomo_ds/methods/base.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lomo_ds.runtime import ds_compat


@dataclass
class MemorySample:
    shard_bytes: int = 0  # this rank's parameter shards (+ fp32 masters)
    state_bytes: int = 0  # optimizer state (AdaLomo's second moments)
    gathered_bytes: int = 0  # full copies of parameters gathered by ZeRO-3 (not persistent ones)
    persistent_bytes: int = 0  # small parameters ZeRO-3 keeps gathered for good
    grad_bytes: int = 0  # .grad tensors alive
    bucket_bytes: int = 0  # gradients waiting in, or being sent from, the reduce-scatter bucket

    @property
    def total(self) -> int:
        return (self.shard_bytes + self.state_bytes + self.gathered_bytes + self.persistent_bytes + self.grad_bytes
                + self.bucket_bytes)


@dataclass
class MemoryTracker:
    params: list
    master_bytes: int = 0
    state_bytes: int = 0
    peak: MemorySample = field(default_factory=MemorySample)
    peak_gathered_plus_grad: int = 0
    peak_param_bytes: int = 0  # shards + gathered + persistent, at their own peak
    samples: int = 0
    _bucket_bytes: int = 0

    def note_bucket(self, nbytes: int) -> None:
        self._bucket_bytes = max(self._bucket_bytes, nbytes)

    def reset(self) -> None:
        self.peak = MemorySample()
        self.peak_gathered_plus_grad = 0
        self.peak_param_bytes = 0
        self.samples = 0
        self._bucket_bytes = 0

    def sample(self) -> MemorySample:
        s = MemorySample(shard_bytes=self.master_bytes, state_bytes=self.state_bytes, bucket_bytes=self._bucket_bytes)
        for p in self.params:
            esize = p.element_size()
            s.shard_bytes += ds_compat.shard_bytes(p)  # an 8-bit shard's scales included
            # Gathered: a full copy exists besides the shard (on one rank it is the shard itself).
            if p.data.numel() > 0 and p.data.data_ptr() != ds_compat.shard(p).data_ptr():
                if ds_compat.is_persistent(p):
                    s.persistent_bytes += p.data.numel() * esize
                else:
                    s.gathered_bytes += p.data.numel() * esize
            if p.grad is not None:
                s.grad_bytes += p.grad.numel() * p.grad.element_size()
        self._bucket_bytes = 0
        self.samples += 1
        if s.total > self.peak.total:
            self.peak = s
        self.peak_gathered_plus_grad = max(self.peak_gathered_plus_grad, s.gathered_bytes + s.grad_bytes)
        self.peak_param_bytes = max(self.peak_param_bytes, s.shard_bytes + s.gathered_bytes + s.persistent_bytes)
        return s


class ActivationCounter:
    """Counts the bytes of unique storages autograd saves while the model's forward runs.

    Installed as forward pre/post hooks on the top module, so it sees every forward the engine
    runs (LOMO's second forward in recompute mode included) and keeps the largest.
    """

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.peak = 0
        self._ctx = None
        self._seen: dict[int, int] = {}
        self._param_ptrs: set[int] = set()
        self._handles = [module.register_forward_pre_hook(self._enter),
                         module.register_forward_hook(self._exit)]

    def _pack(self, t: torch.Tensor):
        try:
            if isinstance(t, torch.nn.Parameter) or hasattr(t, "ds_id"):
                return t
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr == 0 or ptr in self._seen or t.device.type == "meta":
                return t
            if ptr in self._param_ptrs:
                return t
            self._seen[ptr] = st.nbytes()
        except Exception:  # a tensor subclass without storage
            pass
        return t

    def _enter(self, module, args):
        if not torch.is_grad_enabled() or self._ctx is not None:
            return
        self._seen = {}
        self._param_ptrs = set()
        for p in module.parameters():
            # A DTensor (FSDP2's sharded parameter) has no storage of its own: its local shard does.
            local = p.to_local() if hasattr(p, "to_local") else p.data
            self._param_ptrs.add(local.untyped_storage().data_ptr())
            shard_ptr = ds_compat.shard_storage_ptr(p)
            if shard_ptr is not None:
                self._param_ptrs.add(shard_ptr)
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()

    def _exit(self, module, args, output):
        if self._ctx is None:
            return
        self._ctx.__exit__(None, None, None)
        self._ctx = None
        self.peak = max(self.peak, sum(self._seen.values()))
        self._seen = {}

    def reset(self) -> None:
        self.peak = 0

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def tensor_bytes(t) -> int:
    return t.numel() * t.element_size() if torch.is_tensor(t) else 0


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    total = 0
    for state in optimizer.state.values():
        for v in state.values():
            if torch.is_tensor(v) and v.numel() > 1:  # skip the scalar `step`
                total += tensor_bytes(v)
    return total


def breakdown(params: int, grads: int, optimizer_states: int, activations: int) -> dict[str, int]:
    """A method's per-rank peak bytes by category, their total, and the process's own peaks beside
    them (peak_rss always; cuda_peak on GPUs). The rules for each category: lomo_ds/methods/base.py."""
    b = {"params": int(params), "grads": int(grads), "optimizer_states": int(optimizer_states),
         "activations": int(activations)}
    b["total"] = sum(b.values())
    b["peak_rss"] = process_peak_rss_bytes()
    cuda = cuda_peak_bytes()
    if cuda is not None:
        b["cuda_peak"] = cuda
    return b


def process_peak_rss_bytes() -> int:
    import resource  # Unix only: imported where it is used

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def cuda_peak_bytes() -> int | None:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    return None
