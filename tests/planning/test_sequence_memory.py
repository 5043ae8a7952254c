"""The planner's terms that grow with the sequence (lomo_ds/planning/sequence.py) against what a CPU
step measures, within 10%, at 8,192 positions (the longest that keeps these checks to seconds on
two cores; every term is linear in the positions, and each is checked at two lengths):

- sdpa attention's layer: the bytes autograd saves (lomo_ds.runtime.memory.ActivationCounter), no
  S x S term;
- the tiled MLP: the layer without the MLP's intermediates, and its backward's peak (the allocator's
  events, torch's profiler) with one tile's;
- checkpointed inputs: the forward's saved bytes with checkpointing, and with offloaded
  checkpoints the bytes save_on_cpu moved to host memory (the planner's host term) and the saved
  bytes left beside them.

Not measured here: the Ulysses all-to-all buffers (sequence-parallel attention is another module's)."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lomo_ds.config.engine_sections import MemoryConfig
from lomo_ds.engine import sequence_memory
from lomo_ds.planning import planner as P
from lomo_ds.planning.sequence import checkpoint_bytes, mlp_backward_bytes
from lomo_ds.runtime.memory import ActivationCounter

pytestmark = pytest.mark.long
DIMS = dict(hidden=128, layers=2, intermediate=344, vocab=64, heads=4, kv_heads=2, head_dim=32)
SEQS = (4096, 8192)
TILES = 8


def _model(dtype: torch.dtype, checkpointing: bool = False, **memory) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=DIMS["vocab"], hidden_size=DIMS["hidden"], intermediate_size=DIMS["intermediate"],
                      num_hidden_layers=DIMS["layers"], num_attention_heads=DIMS["heads"],
                      num_key_value_heads=DIMS["kv_heads"], head_dim=DIMS["head_dim"], max_position_embeddings=8192,
                      attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(dtype).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    if memory:
        sequence_memory.install(model, MemoryConfig(**memory), None, torch.device("cpu"))
    return model


def _spec() -> P.ModelSpec:
    d = DIMS
    return P.ModelSpec("tiny", d["hidden"], d["layers"], d["intermediate"], d["vocab"], d["heads"], d["kv_heads"],
                       d["head_dim"])


def _run(seq: int, dtype: str, **fields) -> P.RunSpec:
    return P.run_spec(seq=seq, batch=1, dtype=dtype, loss_chunk=LOSS_CHUNK, **fields)


LOSS_CHUNK = 1 << 16  # logits per chunk of the engine's chunked loss: 1,024 positions of V = 64


def _saved(model, seq: int) -> int:
    """The bytes the model's forward saves for its backward (what the planner's activations are),
    through the engine's loss (the chunked one)."""
    from lomo_ds.engine.chunked_loss import causal_lm_loss, head_of

    counter = ActivationCounter(model)
    ids = torch.randint(0, DIMS["vocab"], (1, seq), generator=torch.Generator(device="cpu").manual_seed(0),
                        device="cpu")
    causal_lm_loss(model, head_of(model, "on"), {"input_ids": ids, "labels": ids}, LOSS_CHUNK).loss.backward()
    counter.remove()
    return counter.peak


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("seq", SEQS)
@pytest.mark.parametrize("tiled", [False, True], ids=["mlp", "tiled_mlp"])
def test_sdpa_layers_and_the_tiled_mlp_save_what_the_planner_says(dtype, seq, tiled):
    torch_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    memory = {"tiled_mlp": True, "mlp_tiles": TILES} if tiled else {}
    measured = _saved(_model(torch_dtype, **memory), seq)
    planned, _ = P.activation_bytes(_spec(), _run(seq, dtype, checkpointing=False, tiled_mlp=tiled, mlp_tiles=TILES))
    print(f"{dtype} seq {seq} tiled {tiled}: measured {measured:,} B, planned {planned:,.0f} B "
          f"({planned / measured - 1:+.1%})")
    assert measured == pytest.approx(planned, rel=0.10)


@pytest.mark.parametrize("seq", SEQS)
def test_the_tiled_mlps_backward_holds_one_tile(seq):
    """The MLP's backward alone, its weights' gradients already allocated: the peak of live memory
    above what lived before it (the allocator's events), against the planner's term."""
    from torch.profiler import ProfilerActivity, profile

    mlp = _model(torch.float32, tiled_mlp=True, mlp_tiles=TILES).model.layers[0].mlp
    x = torch.randn(1, seq, DIMS["hidden"], device="cpu", requires_grad=True)
    y = mlp(x)
    g = torch.randn_like(y)
    y.backward(g, retain_graph=True)  # the weights' .grad exist from here on, as in a step
    x.grad = None
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        y.backward(g, retain_graph=True)
    live = peak = 0
    for e in sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    planned = mlp_backward_bytes(_spec(), _run(seq, "fp32", tiled_mlp=True, mlp_tiles=TILES))
    untiled = 4 * seq * DIMS["intermediate"] * 4  # what the untiled MLP saves: its intermediates
    print(f"seq {seq}: tiled MLP backward peak {peak:,} B, planned {planned:,} B; untiled saves {untiled:,} B")
    assert peak == pytest.approx(planned, rel=0.10)
    assert peak < 0.5 * untiled


@pytest.mark.parametrize("seq", SEQS)
def test_checkpointed_and_offloaded_inputs(seq):
    spec, run = _spec(), _run(seq, "fp32", checkpointing=True)
    measured = _saved(_model(torch.float32, checkpointing=True), seq)
    planned, _ = P.activation_bytes(spec, run)
    assert measured == pytest.approx(planned, rel=0.10), (measured, planned)
    # Offloaded: what save_on_cpu moves to host memory is the planner's host term (L T h b); the
    # forward's saved tensors left are the head's. (The two layers' inputs in flight on a GPU are
    # not visible on a CPU rank, whose host is its device.)
    moved = []
    real = torch.autograd.graph.save_on_cpu

    class Counted(real):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            pack = self.pack_hook

            def counting(t):
                moved.append(t.numel() * t.element_size())
                return pack(t)

            self.pack_hook = counting

    torch.autograd.graph.save_on_cpu = Counted
    try:
        left = _saved(_model(torch.float32, checkpointing=True, offload_checkpoints=True), seq)
    finally:
        torch.autograd.graph.save_on_cpu = real
    host = checkpoint_bytes(spec, P.run_spec(**{**run.__dict__, "offload_checkpoints": True}))[1]
    kept = planned - checkpoint_bytes(spec, run)[0]  # the forward's saved bytes but the checkpoints
    print(f"seq {seq}: checkpointed forward saves {measured:,} B (planned {planned:,.0f}); offloaded "
          f"{sum(moved):,} B to host (planned {host:,}), {left:,} B left beside them (planned {kept:,.0f})")
    assert sum(moved) == pytest.approx(host, rel=0.10)
    assert left == pytest.approx(kept, rel=0.10)
