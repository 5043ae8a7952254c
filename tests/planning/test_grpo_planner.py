"""GRPO's planner rows (lomo_ds/planning/grpo.py): the phases' terms, the issue's goal (Llama-3.1-8B
on one 24 GiB GPU with LOMO or AdaLomo, 1k-token completions, beta 0, 8 generations, generation
included; AdamW beside it), the refusals, and docs/memory.md's tables are the command's."""
from __future__ import annotations

import os
from dataclasses import replace

import pytest

from lomo_ds.cli import main
from lomo_ds.planning import planner as P
from lomo_ds.planning.grpo import GrpoSpec, format_grpo, grpo_estimate
from tests.integrations import dist_grpo_checks as D
from tests.ranks import ROOT, multi_rank_checks, ok

MODELS = os.path.join(ROOT, "docs", "models")
# The host reference's swap on a real one-rank engine (its host bytes; its order against the gathers:
# tests/integrations/test_grpo.py asserts on that).
(HOST_REFERENCE_SWAP,) = multi_rank_checks([1], grpo_host_reference_swap=D.check_host_reference_swap)


def _spec(name: str) -> P.ModelSpec:
    return replace(P.resolve_model(os.path.join(MODELS, f"{name}.json")), name=name)


def test_llama_8b_grpo_fits_one_gpu_with_generation_and_adamw_does_not():
    m, g = _spec("Llama-3.1-8B"), GrpoSpec()
    assert (g.completion, g.generations, g.beta) == (1024, 8, 0.0)
    for method in ("lomo", "adalomo"):
        e = grpo_estimate(m, method, 1, g)
        assert e.peak == max(e.generation, e.training) <= 24 * P.GIB
        assert e.generation > e.resident + e.kv_cache  # generation is included, not assumed free
        assert e.reference == 0  # beta 0: no reference
    adamw = grpo_estimate(m, "adamw", 1, g)
    assert adamw.peak > 100 * P.GIB and grpo_estimate(m, "adamw", 8, g).training > 24 * P.GIB


def test_the_phases_terms():
    m, g = _spec("Llama-3.1-8B"), GrpoSpec()
    one, eight = grpo_estimate(m, "lomo", 1, g), grpo_estimate(m, "lomo", 8, g)
    # the KV cache of the 8 generated sequences of 1,536 tokens: 2 L K d b per token
    assert one.kv_cache == 2 * 32 * 8 * 128 * 2 * 8 * 1536
    assert one.gathered == 0 and eight.gathered == 2 * m.n_params  # one GPU holds the model already
    streamed = grpo_estimate(m, "lomo", 8, replace(g, gather_for_generation=False))
    assert streamed.gathered < 0.2 * eight.gathered and streamed.training == eight.training
    ref = grpo_estimate(m, "lomo", 1, replace(g, beta=0.04, reference="ref_model"))
    host = grpo_estimate(m, "lomo", 1, replace(g, beta=0.04, reference="host"))
    assert ref.reference == 2 * m.n_params  # a second model, whole on one GPU
    # the starting shards and, while the reference's forward runs, the live ones: b P twice on the node
    assert host.reference_host == 2 * 2 * m.n_params and host.reference < 0.2 * ref.reference


@pytest.mark.parametrize("fields, gpus, message", [
    ({"generations": 1}, 1, "num_generations: GRPO compares at least 2"),
    ({"generations": 3, "steps_per_generation": 8}, 1, "num_generations: 3 does not divide the generation batch"),
    ({"beta": 0.1, "reference": "nowhere"}, 1, "reference: with beta > 0"),
])
def test_bad_grpo_input_is_refused(fields, gpus, message):
    with pytest.raises(ValueError, match=message):
        grpo_estimate(_spec("Qwen2.5-7B"), "lomo", gpus, replace(GrpoSpec(), **fields))


def test_cli(capsys):
    assert main(["plan", "--grpo"]) == 2
    assert "--grpo: name the model with --model" in capsys.readouterr().err
    assert main(["plan", "--model", os.path.join(MODELS, "Llama-3.1-8B.json"), "--grpo", "--generations", "3",
                 "--steps-per-generation", "1"]) == 2
    assert "num_generations: 3 does not divide" in capsys.readouterr().err


def test_the_docs_tables_are_the_planners():
    doc = open(os.path.join(ROOT, "docs", "memory.md")).read()
    for name in ("Llama-3.1-8B", "Qwen2.5-7B"):
        assert format_grpo(_spec(name), GrpoSpec()) in doc, \
            f"docs/memory.md is out of date: regenerate it with lomo-ds plan --model docs/models/{name}.json --grpo"


@pytest.mark.parametrize("world", [1])
def test_host_reference_is_planned_as_the_swap_holds_it(rank_results, world):
    """The host reference's host RAM as the planner counts it, against what the swap holds, measured
    (every new host tensor it makes, alive when the reference's forward starts): the starting
    shards, and a copy of the live ones beside them, 2 b P / N per rank."""
    from tests.tiny import tiny_llama

    r = ok(rank_results(world), HOST_REFERENCE_SWAP)
    print(f"host reference on {r['world']} rank: starting shards {r['starting_host_bytes']} bytes, "
          f"the swap's own {r['swap_host_bytes']} bytes ({r['dtype']})")
    assert r["starting_host_bytes"] == r["shard_bytes"] > 0 and r["dtype"] == "torch.float32"
    assert r["swap_host_bytes"] == r["shard_bytes"], "the swap keeps one host copy of the live shards"
    m = P.spec_from_hf_config(tiny_llama(0).config.to_dict())
    e = grpo_estimate(m, "lomo", 1, replace(GrpoSpec(), beta=0.1, reference="host"), run=P.RunSpec(dtype="fp32"))
    assert e.reference_host == r["starting_host_bytes"] + r["swap_host_bytes"], (e.reference_host, r)
