"""An update rule written and registered in this file alone, as docs/rules.md ("How to add an update
rule") walks through: SGD with momentum (torch.optim.SGD(momentum=0.9, dampening 0)), whose momentum
buffer is cut by ranks as its parameter is (its declared per-rank state). No file of lomo_ds names
it (test_no_file_of_lomo_ds_names_the_rule). It is

- chosen through the run config's `lomo.optimizer` (every check builds it by lomo_ds.initialize with
  `lomo: {optimizer: momentum_sgd, momentum_sgd: {momentum: 0.9}}`; the run config's loading and the
  planner read it too), and for the Trainer through `optim="lomo"` plus the deepspeed config's
  `lomo.optimizer` (optim="adalomo" against that key is refused);
- trained on 2 ranks within TOL of single-process torch.optim.SGD(momentum=0.9) on the same global
  batch, 3 steps (the fp32 SGD oracle's tolerance, tests/engine/test_engine_dist.py), and under the
  Trainer within the Trainer oracle's tolerance (tests/integrations/test_hf_trainer.py);
- checkpointed and resumed on 2 ranks, and moved from 2 ranks to 3 (a checkpoint written by 2 ranks,
  as a 2-rank run cuts its state, read by a 3-rank run: every rank then holds its own slice of the
  momentum), each equal to the uninterrupted run bit for bit;
- sized by the planner with its own terms: the planner's state figure for 2 ranks is the largest
  state a rank of the 2-rank run holds, byte for byte.

The rule is registered only while a check or test uses it (`plugged_in`): the other tests of a
session, and the other checks of a launch, see the built-in rules alone.
"""
from __future__ import annotations

import contextlib
import copy
import math
import os
import types

import pytest
import torch
from pydantic import Field

import lomo_ds
from lomo_ds.config import rules
from lomo_ds.config.section import Section
from lomo_ds.engine.update.rule import BuildContext, Cut, unscale_and_clip
from lomo_ds.engine.update.shard import grad_chunk
from lomo_ds.methods.lomo import load_engine_state
from lomo_ds.runtime import ds_compat
from lomo_ds.runtime.shard_geometry import PIECES, ShardGeometry
from lomo_ds.storage.engine_state import save_engine_state
from tests.engine.dist_engine_checks import LR, ds_cfg, max_diff
from tests.engine.state_cuts import at, cut_for, full_pieces
from tests.ranks import assert_matches_reference, multi_rank, ok, work_dir
from tests.tiny import global_batch, tiny_llama, tiny_llama_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NAME = "momentum_sgd"
MOMENTUM = 0.9
STEPS = 3
TOL = 1e-6  # fp32, 3 steps: the SGD oracle's (tests/engine/test_engine_dist.py)
TRAINER_TOL = 1e-5  # the Trainer oracle's (tests/integrations/test_hf_trainer.py)


# ----------------------------------------------------------------------------- the rule
class MomentumOptions(Section):
    """lomo.momentum_sgd: the rule's own options (unknown keys refused, as every section's)."""

    momentum: float = Field(MOMENTUM, ge=0.0, lt=1.0, description="the momentum buffer's decay")


class MomentumSGD:
    """torch.optim.SGD(momentum) on this rank's shards: buf = momentum buf + (g + weight_decay θ),
    θ = θ - lr buf. The buffer of each parameter is this rank's slice of it (Cut), so a rank holds
    1/world of the momentum."""

    name = NAME
    takes_whole_bucket = False  # elementwise: each slice alone

    def __init__(self, momentum: float, module: torch.nn.Module, params: list, geometry):
        self.momentum = momentum
        names = {id(p): n for n, p in module.named_parameters()}
        self.names = {ds_compat.param_id(p): names[id(p)] for p in params}
        self.numels = {ds_compat.param_id(p): ds_compat.full_numel(p) for p in params}
        self.buffers = {ds_compat.param_id(p): torch.zeros(geometry(p).local, dtype=torch.float32,
                                                           device=ds_compat.shard(p).device) for p in params}

    @classmethod
    def build(cls, ctx: BuildContext) -> "MomentumSGD":
        return cls(ctx.options.momentum, ctx.module, ctx.params, ctx.geometry)

    def apply_bucket(self, shard, items, stats, settings) -> None:
        finite = stats.finite_now()
        for param, grad in items:
            self.apply(shard, param, grad, finite, settings)

    def apply(self, shard, param, grad, finite, settings) -> None:
        n = shard.geometry(param).local
        if n == 0:
            return
        buf = self.buffers[ds_compat.param_id(param)]
        g = unscale_and_clip(grad_chunk(grad, 0, n, buf.device, fresh=True), settings)
        weights = shard.weights(param)
        if settings.weight_decay:
            g.add_(weights, alpha=settings.weight_decay)  # torch.optim.SGD's decay: into the gradient
        new = buf * self.momentum + g  # the first step's buffer is g itself, as torch's
        if finite is not True:  # a skipped step moves neither the buffer nor the weights
            keep = finite.to(buf.device)
            new = torch.where(keep, new, buf)
            weights.sub_(torch.where(keep, new, torch.zeros_like(new)), alpha=settings.lr)
        else:
            weights.sub_(new, alpha=settings.lr)
        buf.copy_(new)
        shard.write_back(param, weights)

    def slice_device(self, param) -> torch.device:
        return ds_compat.shard(param).device

    def state_layout(self):
        return {(self.names[i], "momentum_buffer"): Cut(self.numels[i]) for i in self.buffers}

    def state_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def state_dict(self) -> dict:
        return {self.names[i]: {"momentum_buffer": b.detach().cpu().clone()} for i, b in self.buffers.items()}

    def check_state(self, state) -> None:
        if not isinstance(state, dict) or set(state) != set(self.names.values()) or any(
                not isinstance(s, dict) or set(s) != {"momentum_buffer"} for s in state.values()):
            raise ValueError(f"{NAME} state does not match this model: expected a momentum_buffer for each of "
                             f"{len(self.names)} parameters")

    def load_state_dict(self, state) -> None:
        self.check_state(state)
        for i, b in self.buffers.items():
            b.copy_(state[self.names[i]]["momentum_buffer"].reshape(-1)[:b.numel()])


def planned_state_bytes(model, gpus: int) -> int:
    """fp32 momentum of a rank's slice of every parameter (rank 0's, the largest: ceil(numel / gpus))."""
    return sum(4 * math.ceil(math.prod(shape) / gpus) for shape in model.param_shapes())


def planned_update_bytes(model, run, slice_n: int, bucket_n: int) -> int:
    """The largest slice's fp32 gradient copy, its new buffer and the masked step."""
    return 3 * 4 * slice_n


SPEC = rules.RuleSpec(name=NAME, label="SGD with momentum", rule=MomentumSGD, config=MomentumOptions,
                      plan=rules.PlanTerms(state_bytes=planned_state_bytes, update_bytes=planned_update_bytes))


@contextlib.contextmanager
def plugged_in():
    """The rule registered while the block runs (the built-ins alone before and after)."""
    rules.register(SPEC)
    try:
        yield SPEC
    finally:
        rules.unregister(NAME)


@pytest.fixture
def plugin():
    with plugged_in() as spec:
        yield spec


def momentum_cfg(**more) -> dict:
    cfg = ds_cfg(optimizer=NAME, **more)
    cfg["lomo"][NAME] = {"momentum": MOMENTUM}
    return cfg


# ----------------------------------------------------------------------------- on 2 ranks
def _trained(steps: int, seed: int = 0):
    engine = lomo_ds.initialize(tiny_llama(seed), momentum_cfg())
    for step in range(steps):
        engine.train_step(global_batch(step, engine.world)[engine.rank])
    return engine


@multi_rank(worlds=[2])
def momentum_trains_like_torch_sgd():
    with plugged_in():
        ref = tiny_llama(0)
        engine = lomo_ds.initialize(copy.deepcopy(ref), momentum_cfg())
        opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=MOMENTUM)
        losses, ref_losses = [], []
        for step in range(STEPS):
            mbs = global_batch(step, engine.world)
            losses.append(engine.train_step(mbs[engine.rank])["loss"])
            opt.zero_grad()
            loss = sum(ref(**mb).loss for mb in mbs) / engine.world  # the global batch's mean
            loss.backward()
            opt.step()
            ref_losses.append(loss.item())
        held = [None] * engine.world
        torch.distributed.all_gather_object(held, engine.shard_state_dict()["rule"])
        state = engine.shard_state_dict()
        return {"max_abs_diff": max_diff(engine, ref), "loss": losses, "ref_loss": ref_losses,
                "rule": state["rule"]["name"],
                "cut": sorted("/".join(p) for p in state[PIECES] if p[:2] == ("rule", "state")),
                "state_bytes": max(sum(4 * s["momentum_buffer"].numel() for s in r["state"].values()) for r in held)}


@multi_rank(worlds=[2])
def momentum_resumes_on_two_ranks():
    with plugged_in():
        straight = _trained(STEPS)
        folder = os.path.join(work_dir(), "momentum_by_2")
        save_engine_state(folder, _trained(STEPS - 1).shard_state_dict(), 60.0)
        resumed = lomo_ds.initialize(tiny_llama(12), momentum_cfg())  # other weights: all must come back
        resumed.load_shard_state_dict(load_engine_state(resumed, folder, 60.0))
        resumed.train_step(global_batch(STEPS - 1, resumed.world)[resumed.rank])
        a, b = straight.full_state_dict(), resumed.full_state_dict()
        if straight.rank != 0:
            return None
        return {"max_abs_diff": max((a[k] - b[k]).abs().max().item() for k in a)}


@multi_rank(worlds=[2])
def the_trainer_runs_the_rule_by_optim_lomo():
    """TrainingArguments(optim="lomo", deepspeed={..., "lomo": {"optimizer": momentum_sgd}}) against
    single-process torch.optim.SGD(momentum) on each window's whole batch (the Trainer's token mean)."""
    from tests.integrations import dist_hf_checks as H

    with plugged_in():
        world = torch.distributed.get_world_size()
        data = H.Samples(H.STEPS * H.K * world * H.BATCH)
        ref = tiny_llama(0)
        deepspeed = H.ds_config(optimizer=NAME)
        deepspeed["lomo"][NAME] = {"momentum": MOMENTUM}
        with H.trainer_session():
            args = H.training_args(H._out("rule_plugin"), optim="lomo", deepspeed=deepspeed, learning_rate=LR,
                                   lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=0.0)
            trainer = H.lomo_trainer_class()(model=copy.deepcopy(ref), args=args, train_dataset=data)
            trainer.train()
            trained = H.full_params(trainer)
            rule = trainer.lomo_engine.shard_state_dict()["rule"]["name"]
        opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=MOMENTUM)
        for step in range(H.STEPS):
            batch = H.stacked(data, H.window_rows(step, world))
            opt.zero_grad()
            ref(**batch, num_items_in_batch=H.label_count(batch)).loss.backward()
            opt.step()
        reference = {n: p.detach() for n, p in ref.named_parameters()} if trained is not None else None
        return {"rule": rule, "max_abs_diff": H.diff(trained, reference)}


@pytest.mark.parametrize("world", [2])
def test_trains_on_two_ranks_like_torch_sgd_with_momentum(rank_results, world):
    r = ok(rank_results(world), momentum_trains_like_torch_sgd)
    assert r["rule"] == NAME and r["cut"], r  # its state is stored under its name, declared cut
    assert_matches_reference(r, TOL, f"{NAME} on {world} ranks, against torch.optim.SGD(momentum={MOMENTUM})")


@pytest.mark.parametrize("world", [2])
def test_resumes_on_two_ranks_exactly(rank_results, world):
    assert ok(rank_results(world), momentum_resumes_on_two_ranks)["max_abs_diff"] == 0.0


def test_the_trainer_chooses_it_by_optim_lomo_and_the_config_key(rank_results):
    r = ok(rank_results(2), the_trainer_runs_the_rule_by_optim_lomo)
    print(f"Trainer with {NAME} on 2 ranks: max |Trainer - reference| = {r['max_abs_diff']:.2e}")
    assert r["rule"] == NAME and r["max_abs_diff"] <= TRAINER_TOL, r


# ----------------------------------------------------------------------------- 2 ranks -> 3


@multi_rank(worlds=[3])
def momentum_moves_from_two_ranks_to_three():
    with plugged_in():
        rank = torch.distributed.get_rank()
        two = torch.distributed.new_group([0, 1], backend="gloo")
        straight = _trained(STEPS - 1)
        state = straight.shard_state_dict()
        whole = full_pieces(state)
        folder = os.path.join(work_dir(), "momentum_by_2")
        if rank < 2:  # the checkpoint 2 ranks write: each its own cut of every piece
            save_engine_state(folder, cut_for(state, whole, 2, rank), 60.0, group=two)
        torch.distributed.barrier()
        resumed = lomo_ds.initialize(tiny_llama(12), momentum_cfg())
        resumed.load_shard_state_dict(load_engine_state(resumed, folder, 60.0))
        got = resumed.shard_state_dict()
        geo = {p: ShardGeometry(n, 3, rank) for p, n in got[PIECES].items()}
        own = all(torch.equal(at(got, p).reshape(-1)[:g.local].cpu(), whole[p][g.start:g.start + g.local])
                  for p, g in geo.items())
        momentum = [p for p in got[PIECES] if p[:2] == ("rule", "state")]
        for engine in (straight, resumed):
            engine.train_step(global_batch(STEPS - 1, 3)[rank])
        every = [None] * 3
        torch.distributed.all_gather_object(every, own)
        a, b = straight.full_state_dict(), resumed.full_state_dict()
        if rank != 0:
            return None
        return {"own_slices": all(every), "momentum_pieces": len(momentum),
                "max_abs_diff": max((a[k] - b[k]).abs().max().item() for k in a)}


@pytest.mark.parametrize("world", [3])
def test_a_two_rank_checkpoint_resumes_on_three_ranks_exactly(rank_results, world):
    r = ok(rank_results(world), momentum_moves_from_two_ranks_to_three)
    assert r["momentum_pieces"] > 0 and r["own_slices"], r
    assert r["max_abs_diff"] == 0.0, "2 steps + moved from 2 ranks to 3 + 1 step == 3 steps, bit for bit"


# ----------------------------------------------------------------------------- the planner, the config
def _run_config(tmp_path, **lomo):
    from lomo_ds.config.run import load_run_config

    tiny_llama_config().to_json_file(str(tmp_path / "config.json"))
    return load_run_config({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
                            "lomo": {"optimizer": NAME, **lomo},
                            "model": {"path": "tiny", "planner_config": str(tmp_path / "config.json")}},
                           check_files=False)


def test_the_planner_sizes_it_by_its_own_terms(rank_results, plugin, tmp_path):
    from lomo_ds.planning import planner

    held = ok(rank_results(2), momentum_trains_like_torch_sgd)["state_bytes"]
    cfg = _run_config(tmp_path)
    assert planner.method_of_run(cfg) == NAME  # its own row, not LOMO's
    est = planner.plan_for_run(cfg, world=2).estimates[(NAME, 2)]
    assert est.optimizer_states == held, (est.optimizer_states, held)  # fp32 weights: no masters beside it
    assert planner.METHOD_LABELS[NAME] == "SGD with momentum" and NAME in planner.FUSED


def test_the_run_config_chooses_it_and_validates_its_options(plugin, tmp_path):
    from lomo_ds.config.engine_config import load_config
    from lomo_ds.config.presets import describe_update

    cfg = _run_config(tmp_path, momentum_sgd={"momentum": 0.5}, presets={NAME: {"lr": 0.2}})
    assert (cfg.lomo.rule.name, cfg.lomo.rule_options.momentum, cfg.lomo.lr) == (NAME, 0.5, 0.2)
    assert describe_update(cfg).startswith("SGD with momentum, lr 0.2") and "lomo.presets.momentum_sgd" in \
        describe_update(cfg)
    assert cfg.lomo.rule_words == " with SGD with momentum"
    for section, match in (({"nesterov": True}, r"lomo\.momentum_sgd\.nesterov: unknown key"),
                           ({"momentum": 1.0}, r"lomo\.momentum_sgd\.momentum: expected a number < 1")):
        with pytest.raises(lomo_ds.ConfigError, match=match):
            load_config({"lomo": {"optimizer": NAME, NAME: section}})


def test_unregistered_it_is_refused_naming_the_registered_rules():
    with pytest.raises(lomo_ds.ConfigError, match=r"lomo\.optimizer: expected one of \['sgd', 'adalomo'\], "
                                                  r"got 'momentum_sgd'"):
        lomo_ds.load_config({"lomo": {"optimizer": NAME}})


def test_optim_against_the_config_key_is_refused(plugin):
    from lomo_ds.integrations.training_args import TrainingArgumentsError, mapped_values, merge_mapped

    args = types.SimpleNamespace(optim="lomo", learning_rate=LR, max_grad_norm=0.0, gradient_accumulation_steps=1)
    merged = merge_mapped({"lomo": {"optimizer": NAME}}, mapped_values(args, tokens=True))
    assert merged["lomo"]["optimizer"] == NAME  # optim="lomo": the config's rule
    args.optim = "adalomo"
    with pytest.raises(TrainingArgumentsError, match=r"optim: gives lomo\.optimizer 'adalomo', the config's lomo "
                                                     r"section says 'momentum_sgd'"):
        merge_mapped({"lomo": {"optimizer": NAME}}, mapped_values(args, tokens=True))


def test_no_file_of_lomo_ds_names_the_rule():
    for folder, _, files in os.walk(os.path.join(ROOT, "lomo_ds")):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(folder, name)) as f:
                    text = f.read()
                assert NAME not in text and "MomentumSGD" not in text, os.path.join(folder, name)
