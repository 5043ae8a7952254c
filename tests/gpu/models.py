"""The GPU checks' LLaMA models by size, and their batches (tests/gpu/gpu_checks.py, timing_checks.py)."""
from __future__ import annotations

import gc

import torch
from transformers import LlamaConfig, LlamaForCausalLM

# Model sizes: (GPU, --smoke). The memory model's states (0.9 GB bf16 + the update's 0.35 GB) dwarf
# the allocator's fixed costs; its activations (checkpointed, 2 x 256 tokens) stay small, so the
# planner's conservative sum of peaks that do not quite coincide is tested where it matters.
MEMORY_MODEL = {"gpu": dict(vocab_size=8192, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                            num_attention_heads=16, micro=2, seq=256)}
# The clipping memory model is the other way round: small states (39M parameters, 78 MB in bf16)
# and a 32k vocabulary whose 1023 labelled positions fit one chunk of the loss (2^25 logits), so
# the chunk's kept fp32 gradient of the logits (125 MiB) is about 40% of the planned peak. How long
# norm clipping's measuring backward keeps it alive (which the planner must count) then decides the peak,
# instead of hiding under the model states as it does in the memory model. It runs eager attention:
# under sdpa the logits' recompute outgrows the measuring backward's retained graph, so the peak would
# be the same with clipping and without, and a clipping that kept too much could not show.
CLIP_MEMORY_MODEL = {"gpu": dict(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=2,
                                 num_attention_heads=8, micro=1, seq=1024, attn_implementation="eager")}
# The long-row model: 16k positions of a layer small enough for any GPU. Its checkpointed layer
# inputs (32 MiB a layer in bf16) and the MLP's recomputed intermediates (about 0.4 GiB at once)
# outweigh its states (0.3 GiB), so memory.tiled_mlp and memory.offload_checkpoints decide its peak
# and a planner that mis-counts either, or an option that saves nothing, shows.
LONG_ROWS_MODEL = {"gpu": dict(vocab_size=8192, hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
                               num_attention_heads=8, micro=1, seq=16384)}
STEP_MODEL = {"gpu": dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                          num_attention_heads=16, micro=4, seq=512, warmup=3, steps=10),
              "smoke": dict(vocab_size=97, hidden_size=40, intermediate_size=83, num_hidden_layers=2,
                            num_attention_heads=4, micro=2, seq=16, warmup=0, steps=2)}


def llama_config(sizes: dict) -> LlamaConfig:
    arch = {k: v for k, v in sizes.items() if k not in ("micro", "seq", "warmup", "steps", "attn_implementation")}
    return LlamaConfig(**arch, max_position_embeddings=sizes["seq"], tie_word_embeddings=False, use_cache=False)


def llama(sizes: dict, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = llama_config(sizes)
    if "attn_implementation" in sizes:
        config._attn_implementation = sizes["attn_implementation"]
    return LlamaForCausalLM(config)


def measured_llama(sizes: dict, device: torch.device) -> tuple[int, LlamaForCausalLM]:
    """(the memory allocated on `device` before the model, the model) for a peak-memory check: the
    llama of `sizes` with gradient checkpointing, as lomo_ds.storage.models.load_model builds it for a
    run config. cuBLAS keeps a workspace per thread (the autograd thread's included) once it has
    multiplied: both are made before the baseline, so the measured peak is the run's own memory."""
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.ones(64, 64, device=device, dtype=dtype, requires_grad=True)
        (a @ a).sum().backward()
    del a
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device)
    model = llama(sizes)
    model.gradient_checkpointing_enable()
    return base, model


def random_batch(sizes: dict, device: torch.device, seed: int) -> dict:
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, sizes["vocab_size"], (sizes["micro"], sizes["seq"]), generator=g, device="cpu")
    return {"input_ids": ids.to(device), "labels": ids.to(device)}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    torch.distributed.barrier()
