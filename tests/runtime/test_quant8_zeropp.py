"""The torch quantizer for DeepSpeed's ZeRO++ quantized partitions (lomo_ds/runtime/quant8_zeropp.py):
its methods take what DeepSpeed's CUDAQuantizer takes, and it round-trips the way DeepSpeed's gather
uses it: a partition quantized alone, every rank's int8 partition and scales concatenated by two
all-gathers and dequantized at once, and a coalesced bucket quantized as one tensor."""
import inspect
import math

import pytest
import torch
from deepspeed.runtime.zero.partition_parameters import CUDAQuantizer

from lomo_ds.runtime import quant8
from lomo_ds.runtime.quant8_zeropp import TorchQuantizer

CPU = torch.device("cpu")


def params_of(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_methods_take_what_deepspeeds_quantizer_takes():
    assert params_of(TorchQuantizer.quantize) == params_of(CUDAQuantizer.quantize)
    assert params_of(TorchQuantizer.dequantize) == params_of(CUDAQuantizer.dequantize)
    ds_defaults = inspect.signature(CUDAQuantizer.dequantize).parameters["dtype"].default
    assert inspect.signature(TorchQuantizer.dequantize).parameters["dtype"].default is ds_defaults


def partitions(flat: torch.Tensor, world: int) -> list[torch.Tensor]:
    """Each rank's ds_tensor: ceil(n/N) elements, the last ones zero-padded."""
    part = math.ceil(flat.numel() / world)
    padded = torch.zeros(part * world, dtype=flat.dtype, device=flat.device)
    padded[:flat.numel()] = flat
    return list(padded.split(part))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_gathered_partitions_dequantize_like_each_partition(world):
    """As the gather does it: quantize(ds_tensor) on every rank, all-gather the int8 partitions and
    the scales, dequantize(gathered, gathered_scales, dtype=param.dtype), narrow to ds_numel."""
    quantizer = TorchQuantizer()
    weight = torch.randn(37, 29, generator=torch.Generator(device=CPU).manual_seed(1), device=CPU)
    weight = weight.to(torch.bfloat16)
    parts = partitions(weight.reshape(-1), world)
    quantized = [quantizer.quantize(p) for p in parts]
    for p, (q, s) in zip(parts, quantized, strict=True):
        assert q.dtype == torch.int8 and q.shape == p.shape
        assert s.dtype == torch.float32 and s.shape == (quantizer.group_count(p.numel()), 1)
    gathered = torch.cat([q for q, _ in quantized])
    scales = torch.cat([s for _, s in quantized])
    out = quantizer.dequantize(gathered, scales, dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    each = torch.cat([quantizer.dequantize(q, s, dtype=torch.bfloat16) for q, s in quantized])
    assert torch.equal(out, each)
    full = out.narrow(0, 0, weight.numel()).view(weight.shape).float()
    step = torch.cat([s.expand(-1, p.numel() // s.numel()).reshape(-1) for p, (_, s) in zip(parts, quantized,
                                                                                            strict=True)])
    step = step[:weight.numel()].view(weight.shape)
    # round to nearest (half a step), then one bf16 rounding of the result (2^-8 relative)
    assert bool(((full - weight.float()).abs() <= step / 2 + weight.float().abs() * 2**-8 + 1e-12).all())


def test_coalesced_bucket_and_default_dtype():
    """The coalesced gather quantizes the concatenated partitions of several parameters as one
    tensor and dequantizes without a dtype: fp16, as DeepSpeed's op returns."""
    quantizer = TorchQuantizer()
    g = torch.Generator(device=CPU).manual_seed(2)
    bucket = torch.cat([torch.randn(n, generator=g, device=CPU) for n in (256, 512, 1024)])
    q, s = quantizer.quantize(bucket)
    assert s.shape == (bucket.numel() // quantizer.block, 1)
    out = quantizer.dequantize(q, s)
    assert out.dtype == torch.float16 and out.shape == bucket.shape
    assert torch.equal(out, quantizer.dequantize(q, s, dtype=torch.float32).half())
    q8, s8 = quantizer.quantize(bucket, groups=8)
    assert s8.shape == (8, 1)
    assert bool(((quantizer.dequantize(q8, s8, dtype=torch.float32) - bucket).abs()
                 <= s8.repeat_interleave(bucket.numel() // 8).view(-1) / 2 * (1 + 1e-5)).all())


def test_quant8_shards_read_through_the_gather_when_blocks_are_whole():
    """With B dividing the partition size, each rank's quant8 pieces are the gather's equal
    groups: the concatenated shards (padding quantized as zeros) dequantize to the parameter as
    quant8 dequantizes it in one process."""
    n, world, block = 1150, 3, quant8.DEFAULT_BLOCK
    part = math.ceil(n / world)
    assert quant8.uniform_groups(part, block) and not quant8.uniform_groups(part + 8, block)
    x = torch.randn(n, generator=torch.Generator(device=CPU).manual_seed(3), device=CPU)
    key = (1, 2, 3)
    ref_q, ref_s = quant8.quantize(x, 0, key=key)
    qs, ss = [], []
    for r in range(world):
        start = r * part
        local = max(0, min(part, n - start))
        q, s = quant8.quantize(x[start:start + local], start, key=key)
        qs.append(torch.cat([q, torch.zeros(part - local, dtype=torch.int8, device=CPU)]))
        ss.append(torch.cat([s, torch.zeros(part // block - s.numel(), dtype=torch.float32, device=CPU)]))
    out = TorchQuantizer(block).dequantize(torch.cat(qs), torch.cat(ss), dtype=torch.float32)
    assert torch.equal(out[:n], quant8.dequantize(ref_q, ref_s, 0))


def test_reads_deepspeeds_own_scales():
    """DeepSpeed's op stores absmax / 128 with integers down to -128: still q * scale."""
    q = torch.tensor([-128, -1, 0, 127, 5, 6, 7, 8], dtype=torch.int8, device=CPU)
    s = torch.tensor([[0.5]], dtype=torch.float32, device=CPU)
    out = TorchQuantizer().dequantize(q, s, dtype=torch.float32)
    assert torch.equal(out, q.float() * 0.5)


def test_bad_input_is_refused():
    quantizer = TorchQuantizer()
    with pytest.raises(ValueError, match="groups must divide"):
        quantizer.quantize(torch.zeros(100, device=CPU), groups=3)
    with pytest.raises(ValueError, match="equal scale groups"):
        quantizer.dequantize(torch.zeros(100, dtype=torch.int8, device=CPU), torch.ones(3, 1, device=CPU))
    with pytest.raises(TypeError, match="int8"):
        quantizer.dequantize(torch.zeros(8, device=CPU), torch.ones(1, 1, device=CPU))
    with pytest.raises(ValueError, match="multiple of 8"):
        TorchQuantizer(block=100)
