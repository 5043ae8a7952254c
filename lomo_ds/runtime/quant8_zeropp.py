"""A torch quantizer with the interface DeepSpeed's ZeRO++ quantized partitions call, for devices
without DeepSpeed's CUDA quantizer op.

DeepSpeed's gather (partition_parameters.py) calls its quantizer in two ways, and reads nothing
else from it:
    - quantize(tensor, groups=None) -> (int8 tensor of the input's shape, fp32 scales of shape
      (groups, 1)), on a partition or on the concatenation of several;
    - dequantize(int8 tensor, scales, dtype=None) -> a tensor of the int8 tensor's shape: the
      scales are split evenly, numel / scales.numel() elements a group, which is how it reads the
      concatenated partitions and scales of every rank after two all-gathers. Without dtype its
      op returns fp16.
The format is quant8's: value = q * scale with q in [-127, 127] and scale = absmax / 127, rounded
to nearest (as DeepSpeed's op rounds), computed in fp32 whatever the input's dtype (DeepSpeed's op
reads fp16 and would pass a bf16 model through an fp16 temporary). DeepSpeed's op stores its own
scale as absmax / 128 with q in [-128, 127]; both read back as q * scale, so each side dequantizes
the other's output. Installing it (on `Init` and on `Init.quantizer_module`) is ds_compat's work.
"""
from __future__ import annotations

import torch

from lomo_ds.runtime.quant8 import DEFAULT_BLOCK, QMAX, check_block


class TorchQuantizer:
    """Symmetric 8-bit group quantizer in torch ops, on the input's own device.

    groups=None picks groups of `block` elements where `block` divides the input, else the
    largest group size below `block` that divides it (whole numbers of groups are what the
    gather's even split needs). `default_dtype` is what dequantize returns without a dtype:
    fp16, as DeepSpeed's op does, unless the installer asks for another."""

    def __init__(self, block: int = DEFAULT_BLOCK, default_dtype: torch.dtype = torch.float16) -> None:
        self.block = check_block(block)
        self.default_dtype = default_dtype

    def group_count(self, numel: int) -> int:
        if numel <= 0:
            raise ValueError(f"cannot quantize an empty tensor (numel={numel})")
        size = min(self.block, numel)
        while numel % size:
            size -= 1
        return numel // size

    def quantize(self, param: torch.Tensor, groups: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        numel = param.numel()
        if groups is None:
            groups = self.group_count(numel)
        if groups <= 0 or numel % groups:
            raise ValueError(f"quantize: groups must divide the tensor's {numel} elements, got groups={groups}")
        x = param.detach().reshape(groups, numel // groups).to(torch.float32)
        scales = x.abs().amax(dim=1, keepdim=True) / QMAX
        safe = torch.where(scales > 0, scales, torch.ones((), dtype=torch.float32, device=scales.device))
        q = torch.round(x / safe).clamp_(-QMAX, QMAX).to(torch.int8)
        return q.view(param.shape), scales

    def dequantize(self, quantized_param: torch.Tensor, scale: torch.Tensor,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
        if quantized_param.dtype != torch.int8:
            raise TypeError(f"dequantize: quantized_param must be int8, got {quantized_param.dtype}")
        groups, numel = scale.numel(), quantized_param.numel()
        if groups == 0 or numel % groups:
            raise ValueError(f"dequantize: {numel} elements do not split into {groups} equal scale groups")
        s = scale.reshape(groups, 1).to(device=quantized_param.device, dtype=torch.float32)
        out = quantized_param.reshape(groups, numel // groups).to(torch.float32).mul_(s)
        return out.view(quantized_param.shape).to(dtype if dtype is not None else self.default_dtype)
