"""The planner's chunked-loss and two-backward terms against what they stand for: the chunked loss's
forward and backward allocations as the allocator sees them (loss_chunk_bytes,
loss_backward_bytes), and norm clipping's measuring backward over the retained graph
(measuring_backward_bytes), read from a run config as the engine decides it."""
from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from lomo_ds.config.run import load_run_config
from lomo_ds.engine import chunked_loss
from lomo_ds.engine.chunked_loss import LinearCrossEntropy
from lomo_ds.planning.planner import (
    LOSS_ADD_SLICES,
    ModelSpec,
    RunSpec,
    estimate,
    layer_activation_bytes,
    loss_backward_bytes,
    loss_chunk_bytes,
    loss_kept_bytes,
    loss_transient_bytes,
    model_spec_for,
    run_spec_for,
)
from tests.ranks import ROOT
from tests.tiny import engine_sections


def _allocations(fn) -> tuple[int, int]:
    """(peak of live CPU memory during fn() above what was live before, live at its end), from the
    allocator's own events (torch's profiler): temporaries inside an op included."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    for e in sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak, live


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_chunked_loss_allocates_what_the_planner_counts(dtype):
    """Several chunks (64 of 1,024 positions, V 2,048, h 256): the forward holds one chunk's logits
    (bf16 and fp32, or fp32 alone), its log-sum-exp taken in place (torch.logsumexp's copy of the
    logits is 4 bytes a logit more); the backward, by blocks of the vocabulary, one block's logits,
    and the fp32 sum of the input's gradient (4 T h) beside the block's product. Each within 10% of
    the planner's term, less what the pass keeps or returns."""
    n, vocab, hidden, chunk = 1024, 2048, 256, 64
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    g = torch.Generator(device="cpu").manual_seed(0)
    h = torch.randn(n, hidden, generator=g, device="cpu").to(torch_dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g, device="cpu") * 0.05).to(torch_dtype).requires_grad_()
    t = torch.randint(0, vocab, (n,), generator=g, device="cpu")
    spec = ModelSpec("head", hidden, 1, hidden, vocab)
    run = RunSpec(seq=n, batch=1, dtype=dtype, loss_chunk=chunk * vocab)
    out = []
    forward_peak, _ = _allocations(lambda: out.append(LinearCrossEntropy.apply(h, w, t, chunk, None, "mean", True)))
    # its loss and the log-sum-exp it saves (4 n) stay
    assert forward_peak - 4 * n == pytest.approx(loss_chunk_bytes(spec, run), rel=0.10)
    backward_peak, _ = _allocations(lambda: out[0].backward())
    # Less the head's gradient (the planner's "grads"); in fp32 the fp32 sum is the input's
    # gradient itself, which the planner does not count (nor the plain loss's).
    returned = w.grad.nbytes + (h.grad.nbytes if dtype == "fp32" else 0)
    assert backward_peak - returned == pytest.approx(loss_backward_bytes(spec, run), rel=0.10)
    if dtype == "bf16":
        assert loss_backward_bytes(spec, run) > loss_chunk_bytes(spec, run) + 4 * n * hidden
    else:
        assert loss_backward_bytes(spec, run) == loss_chunk_bytes(spec, run)
    assert LOSS_ADD_SLICES == chunked_loss.KEPT_SLICES
    # One chunk: its gradient is kept from the forward, and the backward adds nothing beyond it.
    one = replace(run, loss_chunk=n * vocab)
    assert loss_backward_bytes(spec, one) == loss_transient_bytes(spec, one) == loss_chunk_bytes(spec, one)


LLAMA_8B = os.path.join(ROOT, "ds_configs", "llama3.1_8b_chat.json")


def test_norm_clipping_over_the_retained_graph_is_planned_as_two_backwards():
    """One chunk (256 positions of Llama-3.1-8B): the measuring backward keeps the chunk's fp32
    gradient of the logits (125 MiB) alive beside the recomputed layer, where the updating backward
    has freed it (and updates nothing: an fp32 chunk of a slice for its squares, not the update's
    84 MiB); the planner's total is the larger backward's, 18 MiB above one backward's here. With a
    recomputed forward, or one backward, or K > 1 (no measuring pass), it is the updating one's."""
    cfg = load_run_config(LLAMA_8B, check_files=False)
    m, base = model_spec_for(cfg), replace(run_spec_for(cfg), seq=256)
    assert base.two_pass is None  # the shipped config: AdaLomo without norm clipping
    kept = loss_kept_bytes(m, base)
    assert kept == 4 * 256 * m.vocab
    for method, gpus in (("lomo", 1), ("adalomo", 1), ("lomo", 8)):
        one = estimate(m, method, gpus, base)
        two = estimate(m, method, gpus, replace(base, two_pass="retain_graph"))
        resident = one.params + one.grads + one.optimizer_states + one.activations  # activations: kept included
        measure = 4 * min(-(-max(m.param_numels()) // gpus), base.update_chunk)  # an fp32 chunk of a bf16 slice
        assert two.measuring == resident + layer_activation_bytes(m, base) + measure
        assert two.total == two.measuring > one.total, (method, gpus)
        for same in (replace(base, two_pass="recompute"), replace(base, two_pass="retain_graph", accumulation=4)):
            assert estimate(m, method, gpus, same).measuring == 0
        assert estimate(m, method, gpus, replace(base, two_pass="recompute")).total == one.total
    # Several chunks (2,048 positions): nothing is kept, the updating backward is the larger.
    long = replace(base, seq=2048, two_pass="retain_graph")
    assert estimate(m, "lomo", 1, long).total == estimate(m, "lomo", 1, replace(long, two_pass=None)).total


@pytest.mark.parametrize("lomo, dtype, expected", [
    ({}, "bf16", None),  # the shipped recipe: AdaLomo, clip_grad_norm null
    ({"optimizer": "sgd"}, "bf16", "retain_graph"),  # LOMO's recipe clips at 1.0
    ({"optimizer": "sgd", "two_pass_mode": "recompute"}, "bf16", "recompute"),
    ({"clip_grad_norm": 1.0}, "bf16", "retain_graph"),  # the HF Trainer's max_grad_norm comes here
    ({}, "fp16", "retain_graph"),  # fp16: loss scaling needs the overflow verdict first
    ({"loss_scale": {"enabled": False}}, "fp16", None),
])
def test_the_run_config_says_when_a_step_takes_two_backwards(lomo, dtype, expected):
    import json

    raw = json.load(open(LLAMA_8B))
    for section, options in engine_sections(lomo).items():
        raw.setdefault(section, {}).update(options)
    if dtype == "fp16":
        raw.pop("bf16")
        raw["fp16"] = {"enabled": True}
    run = run_spec_for(load_run_config(raw, check_files=False))
    assert run.two_pass == expected
    if expected:
        assert f"two backwards a step (norm clipping or loss scaling, {expected})" in run.assumptions()
