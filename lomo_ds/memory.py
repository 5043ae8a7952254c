"""Memory accounting from the engine's own tensors.

On a GPU the caching allocator gives peak figures; on a CPU there is no allocator to ask, so the
engine can count, at every gradient hook in the backward pass, the bytes held by the tensors it
is responsible for: this rank's parameter shards, parameters DeepSpeed has gathered, gradients
still alive, and the gradient buckets in flight. The peak of that sum is what the memory tests
bound and the tables report.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import ds_compat


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
        return self.shard_bytes + self.state_bytes + self.gathered_bytes + self.persistent_bytes + self.grad_bytes + self.bucket_bytes


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
            s.shard_bytes += ds_compat.shard(p).numel() * ds_compat.shard(p).element_size()
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


def model_state_bytes(params) -> dict:
    """Full-model sizes, for comparing against a rank's accounting."""
    full = sum(ds_compat.full_numel(p) * p.element_size() for p in params)
    return {"param_bytes": full}


def process_peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def cuda_peak_bytes() -> int | None:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    return None
