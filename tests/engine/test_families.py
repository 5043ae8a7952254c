"""Every model family users fine-tune: LLaMA, Qwen2, Qwen3, Mistral, Gemma 2, Gemma 3, Phi-3, OLMo-2,
Mixtral and Qwen2-MoE (tiny models from their configs, tests/families.py).

- zero_optimization.leaf_module "auto" (lomo_ds/config/leaf_module.py) gathers each family's own
  decoder layer as one unit; a class the model lacks is a config error naming the ones it has. With
  ds_configs/cpu_default.json's settings a Qwen2 model fetches one unit per decoder layer per pass.
- LOMO against torch.optim.SGD on 2 ranks with norm clipping, for every family, and every parameter
  (the MoE families' stacked experts included) gets its gradient in every pass of every step.
- AdaLomo factors a stacked [E, R, C] expert tensor per matrix: the reference (tests/adalomo_reference.py)
  against lomo-optim's factorisation, and the sharded engine against the reference on 2 and 3
  ranks (3: slices that start mid-row and span two experts).

Reverts checked: with AdaLomo factoring 2-D tensors only again (`is_factored` len == 2), the MoE
checks differ from the reference by about 1e-3 (tolerance 1e-6).
"""
import collections
import copy
import os
from unittest import mock

import pytest
import torch

from lomo_ds.config import leaf_module
from lomo_ds.config.engine_config import load_config
from lomo_ds.config.errors import ConfigError
from lomo_ds.config.run import load_run_config
from tests.adalomo_reference import ReferenceAdaLomo
from tests.engine import dist_adalomo_checks as A
from tests.engine import dist_engine_checks as E
from tests.families import FAMILIES, MOE, expert_names, tiny_family
from tests.ranks import ROOT, assert_matches_reference, multi_rank_checks, ok
from tests.tiny import global_batch

AUTO = {"leaf_module": "auto"}
CLIP = 0.5
SHIPPED = sorted(f for f in os.listdir(os.path.join(ROOT, "ds_configs")) if f.endswith(".json"))


# ----------------------------------------------------------------------------- leaf_module "auto"
@pytest.mark.parametrize("family", list(FAMILIES))
def test_auto_is_the_models_own_decoder_layer(family):
    model = tiny_family(family)
    layer = type(model.model.layers[0]).__name__
    ds = leaf_module.resolve({"zero_optimization": {"stage": 3, "leaf_module": "auto"}}, model)
    assert ds["zero_optimization"]["leaf_module"] == {"classes": [layer]}
    # a config naming the class itself passes the check as it is
    named = {"zero_optimization": {"leaf_module": {"classes": [layer]}}}
    assert leaf_module.resolve(named, model) == named


def test_unknown_leaf_class_names_the_models_classes():
    model = tiny_family("qwen2")
    with pytest.raises(ConfigError) as e:
        leaf_module.resolve({"zero_optimization": {"leaf_module": {"classes": ["LlamaDecoderLayer"]}}}, model)
    msg = str(e.value)
    print(msg)
    assert "zero_optimization.leaf_module.classes" in msg and "LlamaDecoderLayer" in msg
    assert "Qwen2DecoderLayer" in msg and "Qwen2Attention" in msg and "Qwen2ForCausalLM" in msg
    with pytest.raises(ConfigError, match=r"leaf_module\.names.*model\.layers\.7"):
        leaf_module.resolve({"zero_optimization": {"leaf_module": {"names": ["model.layers.7"]}}}, model)
    with pytest.raises(ConfigError, match=r"leaf_module\.name_suffixes.*\.moe"):
        leaf_module.resolve({"zero_optimization": {"leaf_module": {"name_suffixes": [".moe"]}}}, model)


def test_auto_without_no_split_modules_is_refused():
    with pytest.raises(ConfigError, match=r'"auto".*_no_split_modules.*Sequential'):
        leaf_module.resolve({"zero_optimization": {"leaf_module": "auto"}}, torch.nn.Sequential(torch.nn.Linear(2, 2)))


@pytest.mark.parametrize("value", ["LlamaDecoderLayer", 3, ["LlamaDecoderLayer"], {"class": ["X"]}, {"classes": [1]}])
def test_bad_leaf_module_value_fails_on_load(value):
    with pytest.raises(ConfigError, match=r"zero_optimization\.leaf_module"):
        load_config({"zero_optimization": {"stage": 3, "leaf_module": value}})


def test_auto_is_left_out_of_the_model_build_config():
    ds = {"zero_optimization": {"stage": 3, "leaf_module": "auto"}}
    assert "leaf_module" not in leaf_module.for_model_build(ds)["zero_optimization"]
    assert ds["zero_optimization"]["leaf_module"] == "auto"  # not changed in place


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_configs_fetch_auto(name):
    cfg = load_run_config(os.path.join(ROOT, "ds_configs", name), check_files=False)
    assert cfg.ds["zero_optimization"].get("leaf_module", "auto") == "auto"
    if name.startswith(("llama", "cpu_default", "qwen")):
        assert cfg.ds["zero_optimization"]["leaf_module"] == "auto"


# ----------------------------------------------------------------------------- the fetch unit, counted
def count_fetches(fetch: str, layers: int = 3, steps: int = 2) -> list[dict]:
    """A Qwen2 model trained under ds_configs/cpu_default.json's settings, its leaf_module "auto" or
    removed (DeepSpeed's default): per step, ZeRO-3's all-gathers and the modules it fetched."""
    from lomo_ds.methods import build_engine
    from lomo_ds.profiling import count_comm
    from lomo_ds.runtime import ds_compat

    cfg = load_run_config(os.path.join(ROOT, "ds_configs", "cpu_default.json"), {"model.path": "tiny"},
                          check_files=False)
    if fetch == "per-module":
        zero = {k: v for k, v in cfg.ds["zero_optimization"].items() if k != "leaf_module"}
        cfg = cfg.model_copy(update={"ds": {**cfg.ds, "zero_optimization": zero}})
    model = tiny_family("qwen2", 0, layers=layers)
    eng = build_engine(cfg, model, total_steps=10)
    names = {id(m): n for n, m in eng.module.named_modules()}
    out = []
    for step in range(steps):
        with count_comm() as comm, ds_compat.counted_fetches(eng.engine.offload) as fetched:
            eng.train_step(global_batch(step, eng.world, micro=4)[eng.rank])
        out.append({"gathers": comm.calls_by_op.get("all_gather_into_tensor", 0),
                    "fetches": dict(collections.Counter(f"{phase} {type(m).__name__}" for phase, m in fetched)),
                    # units fetched inside a decoder layer (model.layers.N.something), not the layer itself
                    "inside_layers": sum(names[id(m)].count(".") > 2 for _, m in fetched),
                    "passes": 2 if eng.engine.two_passes else 1})
    return out


FETCH_LAYERS = 3
fetch_auto, fetch_per_module = multi_rank_checks(
    [2], fetch_auto=lambda: count_fetches("auto", FETCH_LAYERS),
    fetch_per_module=lambda: count_fetches("per-module", FETCH_LAYERS))


def test_qwen2_fetches_one_unit_per_decoder_layer(rank_results):
    auto, per_module = ok(rank_results(2), fetch_auto), ok(rank_results(2), fetch_per_module)
    for step, (a, m) in enumerate(zip(auto, per_module, strict=True)):
        print(f"step {step}: leaf_module auto: {a['gathers']} all-gathers, fetches {a['fetches']}; "
              f"per module: {m['gathers']} all-gathers, fetches {m['fetches']}")
        passes = a["passes"]
        assert passes == 2  # cpu_default clips by norm: a measuring and an updating backward
        assert a["fetches"]["forward Qwen2DecoderLayer"] == FETCH_LAYERS
        assert a["fetches"]["backward Qwen2DecoderLayer"] == passes * FETCH_LAYERS
        assert a["inside_layers"] == 0  # nothing inside a layer is fetched on its own
        assert "forward Qwen2DecoderLayer" not in m["fetches"] and m["inside_layers"] > 0
    # The first step has no prefetch yet (DeepSpeed records the module order): one all-gather per
    # fetch, so per layer one gather per pass instead of one per Linear and norm (9 of them).
    assert auto[0]["gathers"] + 8 * 3 * FETCH_LAYERS == per_module[0]["gathers"]


# ----------------------------------------------------------------------------- LOMO against SGD
def family_sgd(family: str) -> dict:
    """LOMO (leaf_module auto, norm clipping) against torch.optim.SGD, and how many times each
    parameter's gradient reached the engine (a hook registered beside the engine's)."""
    arrived = collections.Counter()

    def count(model):
        if not arrived:  # the engine's copy (prepared first), not the reference
            arrived["_watched"] = 1
            for name, p in model.named_parameters():
                p.register_post_accumulate_grad_hook(lambda p, n=name: arrived.update([n]))

    r = E.equivalence(lambda: tiny_family(family, 1), E.ds_cfg(clip_grad_norm=CLIP, fetch=AUTO),
                      {"clip_norm": CLIP}, prepare=count)
    arrived.pop("_watched")
    model = tiny_family(family, 1)
    return {**r, "arrivals": dict(arrived), "params": [n for n, _ in model.named_parameters()],
            "experts": expert_names(model), "steps": E.STEPS}


FAMILY_SGD = multi_rank_checks([2], **{f"sgd_{f}": (lambda f=f: family_sgd(f)) for f in FAMILIES})


@pytest.mark.parametrize("check", FAMILY_SGD, ids=str)
def test_family_matches_sgd_with_clipping(rank_results, check):
    family = str(check).removeprefix("sgd_")
    r = ok(rank_results(2), check)
    assert_matches_reference(r, 1e-6, f"{family} on 2 ranks (leaf_module auto, clip {CLIP}), against SGD")
    assert r["grad_norm"] == pytest.approx(r["ref_grad_norm"], rel=1e-5)
    assert all(n > CLIP for n in r["ref_grad_norm"])  # the clip was active
    assert r["leaf_modules"] == [type(tiny_family(family).model.layers[0]).__name__]
    # Every parameter's gradient reached the engine in both passes of every step: the experts too.
    assert r["arrivals"] == {n: 2 * r["steps"] for n in r["params"]}
    assert bool(r["experts"]) == (family in MOE)


# ----------------------------------------------------------------------------- AdaLomo on stacked experts
def run_public_stacked(model, steps: int, **kw):
    """lomo-optim's AdaLomo as its trainer drives it (tests/engine/test_adalomo.py's run_public), its
    state of each stacked tensor allocated in the shapes its update reduces to (rows [E, R],
    columns [E, C]): lomo-optim allocates rows [E] and columns [R] for any tensor of more than
    one dimension, which its own update then cannot add into."""
    from lomo_optim import AdaLomo

    with mock.patch.object(torch.Tensor, "cuda", lambda self, *a, **k: self):
        opt = AdaLomo(model, lr=A.LR, **kw)
    for name, p in model.named_parameters():
        if p.dim() >= 3:
            opt.exp_avg_sq_row[name] = torch.zeros(p.shape[:-1])
            opt.exp_avg_sq_col[name] = torch.zeros((*p.shape[:-2], p.shape[-1]))
    for step in range(steps):
        loss = model(**global_batch(step, 1)[0]).loss
        if kw.get("clip_grad_norm"):
            opt.grad_norm(loss)
        opt.fused_backward(loss, A.LR)
    return model


def run_reference(model, steps: int, clip_grad_norm=None):
    opt = ReferenceAdaLomo(model.parameters(), A.LR)
    for step in range(steps):
        model.zero_grad()
        model(**global_batch(step, 1)[0]).loss.backward()
        if clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
        opt.step()
    return model


@pytest.mark.parametrize("family", MOE)
def test_reference_factors_experts_as_lomo_optim(family):
    kw = {"clip_grad_norm": CLIP}
    start = tiny_family(family, 0)
    public = run_public_stacked(copy.deepcopy(start), 3, **kw)
    ref = run_reference(copy.deepcopy(start), 3, **kw)
    diff = max((a - b).abs().max().item() for a, b in zip(public.parameters(), ref.parameters(), strict=True))
    moved = max((a - b).abs().max().item() for a, b in zip(ref.parameters(), start.parameters(), strict=True))
    print(f"{family} {kw}: max |reference - lomo_optim.AdaLomo| = {diff:.2e} after 3 steps (largest move {moved:.2e})")
    assert diff <= 1e-6 and moved > 1e-2


def test_reference_state_of_experts_is_rows_plus_columns():
    model = tiny_family("mixtral", 0)
    opt = ReferenceAdaLomo(model.parameters(), A.LR)
    model(**global_batch(0, 1)[0]).loss.backward()
    opt.step()
    for p in model.parameters():
        if p.dim() == 3:
            e, r, c = p.shape
            assert [tuple(t.shape) for t in opt.moments[id(p)]] == [(e, r), (e, c)]


def crosses_experts(engine) -> int:
    """Stacked tensors whose slice on some rank spans two of its matrices (experts)."""
    from lomo_ds.engine.update import geometry
    from lomo_ds.runtime import ds_compat

    n = 0
    for p in engine.params:
        shape = ds_compat.full_shape(p)
        if len(shape) >= 3:
            per = shape[-2] * shape[-1]
            n += any(g.local and g.start // per != (g.start + g.local - 1) // per
                     for g in (geometry(p, engine.world, r) for r in range(engine.world)))
    return n


def adalomo_moe(family: str) -> dict:
    """The sharded AdaLomo with norm clipping against the reference, and its state per expert
    tensor: rows plus columns of every expert."""
    from lomo_ds.runtime import ds_compat

    captured = {}
    real_initialize = A.lomo_ds.initialize

    def initialize(model, cfg):
        captured["engine"] = real_initialize(model, cfg)
        return captured["engine"]

    with mock.patch.object(A.lomo_ds, "initialize", initialize):
        r = A.equivalence(lambda: tiny_family(family, 3), A.adalomo_cfg(clip_grad_norm=CLIP, fetch=AUTO),
                          clip_norm=CLIP)
    engine = captured["engine"]
    ada = engine.updater.rule
    shapes = {n: [list(t.shape) for k, t in ada.state[ds_compat.param_id(p)].items() if k != "step"]
              for n, p in engine.module.named_parameters() if p.dim() >= 3 or len(ds_compat.full_shape(p)) >= 3}
    return {**r, "expert_state_shapes": shapes, "crosses_experts": crosses_experts(engine),
            "full_shapes": {n: list(ds_compat.full_shape(p)) for n, p in engine.module.named_parameters()
                            if len(ds_compat.full_shape(p)) >= 3}}


ADALOMO_MOE = multi_rank_checks([2, 3], **{f"adalomo_{f}": (lambda f=f: adalomo_moe(f)) for f in MOE})


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("check", ADALOMO_MOE, ids=str)
def test_adalomo_on_moe_matches_reference(rank_results, world, check):
    r = ok(rank_results(world), check)
    assert_matches_reference(r, 1e-6, f"{check} on {world} ranks (clip {CLIP}), against the reference "
                                      f"({r['crosses_experts']} expert tensors sliced across two experts)")
    assert r["moved"] > 1e-3
    assert r["full_shapes"]  # the stacked experts are there
    for name, (e, rows, cols) in r["full_shapes"].items():
        assert r["expert_state_shapes"][name] == [[e, rows], [e, cols]], name
    if world == 3:
        assert r["crosses_experts"] > 0


def test_unknown_leaf_class_fails_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """`launch/train.py` with a Qwen2 model on disk and a config naming LlamaDecoderLayer: one config
    error naming the model's classes, from its config.json built on the meta device, before any
    rank loads the model."""
    import json

    from lomo_ds.recipe import train

    folder = tmp_path / "qwen2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(tiny_family("qwen2").config.to_dict()))
    cfg = json.load(open(os.path.join(ROOT, "ds_configs", "tiny_cpu.json")))
    cfg["model"]["path"] = str(folder)
    cfg["zero_optimization"]["leaf_module"] = {"classes": ["LlamaDecoderLayer"]}
    (tmp_path / "run.json").write_text(json.dumps(cfg))
    loaded = []
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(train, "TrainRecipe", lambda *a, **k: loaded.append(a))  # what would load the model
    assert train.main(["--config", str(tmp_path / "run.json")]) == 2
    assert loaded == []
    err = capsys.readouterr().err
    print(err)
    assert "config error" in err and "zero_optimization.leaf_module.classes" in err
    assert "LlamaDecoderLayer" in err and "Qwen2DecoderLayer" in err
