"""LOMO and AdaLomo inside Hugging Face's Trainer and TRL's SFTTrainer (lomo_ds.integrations).

The multi-rank checks (tests/integrations/dist_hf_checks.py) train through a real Trainer on real DeepSpeed
ZeRO-3 ranks: K = 2 micro-batches, label counts that differ per micro-batch and rank, a linear
schedule with warm-up, and norm clipping that is active on some steps and not on others. After the
run the parameters must equal a single-process reference (torch.optim.SGD, or the reference
AdaLomo, on each window's whole batch with the Trainer's token-mean loss and schedule) and
lomo_ds's own engine with train.loss_normalization "tokens".

Revert checked: without the mixin turning the Trainer's loss (token sum / the window's tokens x
ranks) back into the micro-batch's token mean, so that the normalisation is applied twice,
trainer_lomo on 2 ranks differs from the reference by 2.1e-3 and sft by 4.3e-3 (and their losses
by half).
"""
import importlib.util
import os

import pytest

from tests.integrations import dist_hf_checks as H
from tests.ranks import LONG_TESTS, multi_rank_checks, ok

TOL = 1e-5
WORLDS = [1, 2]
EQUIVALENCE = multi_rank_checks(
    WORLDS,
    trainer_lomo=lambda: H.check_equivalence("lomo"),
    trainer_adalomo=lambda: H.check_equivalence("adalomo"),
)
# SFTTrainer, resume and trackers: on 2 ranks (the Trainer's own equivalence covers 1 and 2).
(sft,) = multi_rank_checks([2], sft=H.check_sft)
# Three Trainer runs and a resume in the 2-rank launch: a long check (CI); the engine state's layout
# is read on every rank count in every suite (tests/storage/test_engine_state.py).
resume = multi_rank_checks([2], resume=H.check_resume)[0] if LONG_TESTS else None
sequence_parallel, sequence_parallel_adalomo = multi_rank_checks(
    [2], sequence_parallel=H.check_sequence_parallel,
    sequence_parallel_adalomo=lambda: H.check_sequence_parallel("adalomo"))
# enable_jit_checkpoint: three Trainer runs in the 2-rank launch, a long check (CI).
jit = multi_rank_checks([2], jit_checkpoint=H.check_jit_checkpoint)[0] if LONG_TESTS else None
# save_on_each_node with two nodes that share no storage (two Trainer runs and a resume: a long
# check, CI); use_cpu on CPU ranks (the Trainer's equivalence again: a long check too).
use_cpu = (multi_rank_checks([2], trainer_use_cpu=lambda: H.check_equivalence("lomo", use_cpu=True))[0]
           if LONG_TESTS else None)
each_node = multi_rank_checks([2], save_on_each_node=H.check_save_on_each_node)[0] if LONG_TESTS else None
# The trackers are the `trackers` extra's (CI installs it; `make install` does not): their check is
# declared only where they are, so that a launch without them does not fail it.
NO_TRACKERS = [m for m in ("tensorboard", "wandb") if importlib.util.find_spec(m) is None]
trackers = None if NO_TRACKERS else multi_rank_checks([2], trackers=H.check_trackers)[0]


@pytest.mark.parametrize("check", EQUIVALENCE, ids=str)
@pytest.mark.parametrize("world", WORLDS)
def test_trainer_matches_reference(rank_results, world, check):
    r = ok(rank_results(world), check)
    print(f"{check} on {world}: max |Trainer - reference| = {r['max_abs_diff']:.2e}, "
          f"|Trainer - engine| = {r['engine_vs_trainer']:.2e}")
    assert r["wrapped"] == "DeepSpeedEngine"  # the LomoEngine's, no second one built by accelerate
    assert r["engine_seed"] == r["seed"] == H.SEED != 42  # TrainingArguments.seed is train.seed (default 42)
    assert r["max_abs_diff"] <= TOL
    assert r["engine_vs_trainer"] <= TOL
    assert r["lr"] == pytest.approx(r["ref_lr"], abs=1e-12)  # the Trainer's schedule, warm-up from 0
    assert r["loss"] == pytest.approx(r["ref_loss"], abs=1e-5)  # the window's token mean, every step
    assert r["grad_norm"] == pytest.approx(r["ref_grad_norm"], rel=1e-5)
    clipped = [n > H.CLIP[world] for n in r["ref_grad_norm"]]
    assert any(clipped) and not all(clipped), r["ref_grad_norm"]  # the clip acts on some steps only


@pytest.mark.parametrize("check", ["sequence_parallel", "sequence_parallel_adalomo"])
def test_sequence_parallel_trainer_matches_reference(rank_results, check):
    """parallelism_config(sp_size=2) on 2 ranks: the engine's Ulysses, DeepSpeed's data-loader
    adapter, the whole rows' token-mean reference with clipping and K = 2."""
    r = ok(rank_results(2), globals()[check])
    print(f"{check}: max |Trainer (SP 2) - reference| = {r['max_abs_diff']:.2e}")
    assert r["sp"] == [2, 1]
    assert r["max_abs_diff"] <= TOL
    assert r["loss"] == pytest.approx(r["ref_loss"], abs=1e-5)
    assert r["grad_norm"] == pytest.approx(r["ref_grad_norm"], rel=1e-5)
    assert all(n > 1.0 for n in r["ref_grad_norm"])  # the clip bit


def test_parallelism_config_refusals_name_the_field():
    from types import SimpleNamespace as NS

    from lomo_ds.integrations.training_args import mapped_values, parallelism_refusal

    assert parallelism_refusal(None) is None
    assert parallelism_refusal(NS(tp_size=1, cp_size=1, dp_shard_size=1, sp_size=2, sp_backend="deepspeed")) is None
    assert parallelism_refusal(NS(tp_size=2)).startswith("parallelism_config.tp_size: tensor parallelism")
    assert parallelism_refusal(NS(cp_size=2)).startswith("parallelism_config.cp_size: context parallelism other")
    assert parallelism_refusal(NS(dp_shard_size=2)).startswith("parallelism_config.dp_shard_size: ZeRO-3")
    assert parallelism_refusal(NS(sp_size=2, sp_backend="ring")).startswith("parallelism_config.sp_backend")
    args = NS(optim="lomo", learning_rate=0.1, max_grad_norm=0.0, gradient_accumulation_steps=1,
              parallelism_config=NS(sp_size=3, sp_backend="deepspeed"))
    assert mapped_values(args, True)["train.sequence_parallel_size"] == 3
    assert "train.sequence_parallel_size" not in mapped_values(NS(**{**vars(args), "parallelism_config": None}), True)


def test_sft_trainer_matches_reference(rank_results):
    """SFTTrainer's own loss (the fused LM head's log-probs) trains as the token-mean SGD reference."""
    r = ok(rank_results(2), sft)
    print(f"SFTTrainer on 2 ranks: max |SFTTrainer - reference| = {r['max_abs_diff']:.2e}, "
          f"label tokens per micro-batch {r['label_counts']}")
    assert r["max_abs_diff"] <= TOL
    assert r["loss"] == pytest.approx(r["ref_loss"], abs=1e-5)
    assert r["grad_norm"] == pytest.approx(r["ref_grad_norm"], rel=1e-5)
    assert all(a is not None for a in r["token_accuracy"])  # TRL's metrics, from its fused outputs
    assert len({c for window in r["label_counts"] for c in window}) > 1  # micro-batches differ in label count


@pytest.mark.long
def test_resume_and_save_model(rank_results):
    """Stopped after the step-2 checkpoint and resumed (AdaLomo: its statistics are in the shard
    state) = uninterrupted; save_model() loads with from_pretrained."""
    r = ok(rank_results(2), resume)
    print(f"resumed vs uninterrupted: {r['resumed_vs_whole']:.2e}; checkpoint: {r['checkpoint_files']}")
    assert r["resumed_vs_whole"] == 0.0
    assert r["stopped_vs_whole"] > 1e-4  # the stopped run is really behind: the resume did the rest
    assert r["from_pretrained_vs_trained"] == 0.0
    assert {"engine_state", "scheduler.pt", "trainer_state.json",
            "model.safetensors", "config.json"} <= set(r["checkpoint_files"])


@pytest.mark.long
def test_jit_checkpoint_on_a_signal_saves_at_the_step_boundary_and_resumes_exactly(rank_results):
    r = ok(rank_results(2), jit)
    print(f"signalled run: exit {r['code']}, checkpoints {r['checkpoints']}; resumed vs uninterrupted "
          f"{r['resumed_vs_whole']}")
    assert r["code"] == r["expected_code"]
    assert r["checkpoints"] == ["checkpoint-2"]  # signalled during step 2's window: saved at its end
    # The requeue's cue, as the training program writes it (the launcher's exit status does not carry 75)
    assert r["marker"] == {"exit": r["expected_code"], "step": 2,
                           "checkpoint": os.path.join(r["cut_dir"], "checkpoint-2")}, r["marker"]
    assert r["resumed_code"] == 0
    assert r["resumed_vs_whole"] == 0.0


@pytest.mark.long
def test_save_on_each_node_without_shared_storage(rank_results):
    """Two nodes of one rank each, each writing into a folder of its own: both folders hold a whole
    checkpoint (the model from_pretrained loads, the engine state: its metadata, the node's own
    pieces and what every rank holds the same, the scheduler, the Trainer state), and each node
    resumes from its own folder alone.

    Revert checked: with the folder made and the model written on rank 0 only, rank 1 (its node's
    saving rank) fails writing training_args.bin into a folder that does not exist on its disk;
    with transformers' checkpoint.use_node_local_storage left in the DeepSpeed config, the
    constructor refuses the config's `checkpoint` section."""
    r = ok(rank_results(2), each_node)
    print(f"save_on_each_node: {r['checkpoint_files']}; resumed vs uninterrupted {r['resumed_vs_whole']:.2e}")
    assert r["should_save"] == [True, True]
    for rank, files in enumerate(r["checkpoint_files"]):
        assert {"engine_state", f"rng_state_{rank}.pth", "scheduler.pt", "trainer_state.json",
                "training_args.bin", "model.safetensors", "config.json"} <= set(files), (rank, files)
    assert r["from_pretrained_vs_trained"] == [0.0, 0.0]
    assert r["resumed_vs_whole"] == 0.0


@pytest.mark.long
def test_use_cpu_on_cpu_ranks(rank_results):
    """use_cpu=True on CPU ranks (DeepSpeed's CPU accelerator) trains as the reference, as without it.

    Revert checked: refused, the Trainer's constructor raises TrainingArgumentsError("use_cpu: ...")."""
    r = ok(rank_results(2), use_cpu)
    assert r["use_cpu"] is True and r["device"].split(":")[0] == "cpu"
    assert r["wrapped"] == "DeepSpeedEngine"
    assert r["max_abs_diff"] <= TOL and r["engine_vs_trainer"] <= TOL
    assert r["loss"] == pytest.approx(r["ref_loss"], abs=1e-5)


@pytest.mark.skipif(bool(NO_TRACKERS), reason=f"{' and '.join(NO_TRACKERS)} not installed (the trackers extra)")
def test_trackers_read_back(rank_results):
    """loss, learning_rate and grad_norm reach TensorBoard and W&B (offline), as the Trainer logged them."""
    r = ok(rank_results(2), trackers)
    for tracker in ("tensorboard", "wandb"):
        for key, values in r["trainer"].items():
            assert r[tracker][key] == pytest.approx(values, rel=1e-6), (tracker, key)
    assert len(r["trainer"]["loss"]) == H.STEPS and all(v is not None for v in r["trainer"]["grad_norm"])


# ----------------------------------------------------------------------------- single process: refusals
@pytest.fixture
def hf_args(monkeypatch):
    """TrainingArguments(deepspeed=...) registers its config with transformers and sets accelerate's
    environment: both undone after the test, so this worker's other tests see neither."""
    import os

    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    saved = dict(os.environ)
    made = []

    def make(**kw):
        base = dict(output_dir="/tmp/unused", optim="lomo", deepspeed=H.ds_config(), report_to=[])
        args = H.TrainingArgumentsFor(**{**base, **kw})
        made.append(args)
        return args

    yield make
    unset_hf_deepspeed_config()
    os.environ.clear()
    os.environ.update(saved)


REFUSED = [
    ({"optim": "adamw_torch"}, r"^optim: expected 'lomo' or 'adalomo', got 'adamw_torch'$"),
    ({"weight_decay": 0.1}, r"^weight_decay: the Trainer decays all but biases and norms.*\(got 0.1\)$"),
    ({"average_tokens_across_devices": False}, r"^average_tokens_across_devices: .*\(got False\)$"),
    ({"eval_on_start": True, "eval_strategy": "steps", "eval_steps": 1}, r"^eval_on_start: "),
    ({"adam_beta2": 0.95}, r"^adam_beta2: an AdamW setting"),
    ({"auto_find_batch_size": True}, r"^auto_find_batch_size: "),
    ({"deepspeed": H.ds_config(lr=0.1)}, r"^learning_rate: gives lomo.lr 0.05, the config's lomo section says 0.1; "),
    ({"deepspeed": H.ds_config(scheduler={"type": "cosine"})}, r"^deepspeed: train.scheduler is set, but under the "),
    ({"seed": 1, "deepspeed": H.ds_config(seed=5)},
     r"^seed: gives train.seed 1, the config's train section says 5; set only one of them$"),
    ({"deepspeed": {**H.ds_config(), "optimizer": {"type": "AdamW"}}}, r"^deepspeed: <config>: optimizer: LOMO is"),
]


@pytest.mark.parametrize("fields,message", REFUSED, ids=lambda v: str(v)[:40])
def test_refused_in_constructor_before_deepspeed(hf_args, fields, message):
    """One line naming the field, from check_training_arguments and from the trainer's constructor,
    before any DeepSpeed engine exists (the model is still a plain module)."""
    import torch

    from lomo_ds.integrations.training_args import TrainingArgumentsError, check_training_arguments
    from lomo_ds.runtime import ds_compat
    from tests.tiny import tiny_llama

    args = hf_args(learning_rate=0.05, **fields)
    if "deepspeed" not in fields:
        with pytest.raises(TrainingArgumentsError, match=message):
            check_training_arguments(args)
    model = tiny_llama(0)
    with pytest.raises(TrainingArgumentsError, match=message) as e:
        H.lomo_trainer_class()(model=model, args=args)
    assert "\n" not in str(e.value)
    assert not ds_compat.is_zero_param(next(model.parameters())) and not torch.distributed.is_initialized()


@pytest.mark.parametrize("seed", [1, 2])
def test_seed_is_the_engines_train_seed(hf_args, seed):
    """TrainingArguments.seed keys the engine's stochastic-rounding noise (bf16 and 8-bit shards):
    the config the Trainer builds its engine from has train.seed == args.seed, for two seeds that
    are not the engine's default, with 8-bit shards on; a config whose train section gives the same
    value is accepted, another is refused naming both (test_refused_in_constructor_before_deepspeed).

    Revert checked: with `seed` left out of mapped_values, train.seed is 42 for both seeds."""
    from lomo_ds.integrations.transformers import LomoTrainerMixin, _without_auto

    for ds in (H.ds_config(int8_shards=True), H.ds_config(int8_shards=True, seed=seed)):
        args = hf_args(learning_rate=0.05, seed=seed, bf16=True, use_cpu=True, deepspeed=ds)
        # what the constructor checks and what create_optimizer builds the engine from
        _, config = LomoTrainerMixin._lomo_config(args, _without_auto(args.hf_deepspeed_config.config), tokens=True)
        assert config.train.seed == seed
        assert config.memory.int8_shards


def test_use_cpu_checked_against_deepspeeds_accelerator(hf_args, monkeypatch):
    """use_cpu=True passes where DeepSpeed's accelerator is the CPU (this machine); where it is a GPU
    it is refused with what to do instead (the ranks would train on the GPU whatever it says)."""
    from lomo_ds.integrations import training_args as T

    args = hf_args(use_cpu=True)
    assert T.accelerator_name() == "cpu"
    T.check_training_arguments(args)
    monkeypatch.setattr(T, "accelerator_name", lambda: "cuda")
    with pytest.raises(T.TrainingArgumentsError, match=r"^use_cpu: expected False where DeepSpeed's accelerator is "
                                                       r"'cuda' \(got True.*CUDA_VISIBLE_DEVICES= \(empty\)"):
        T.check_training_arguments(args)
    T.check_training_arguments(hf_args(use_cpu=False))


def test_other_trainers_refused_by_name():
    from trl import DPOTrainer

    from lomo_ds.integrations.training_args import TrainingArgumentsError, check_trainer_class

    with pytest.raises(TrainingArgumentsError, match=r"^DPOTrainer: LomoTrainerMixin is tested with"):
        check_trainer_class(H.lomo_trainer_class(DPOTrainer))
    check_trainer_class(H.lomo_trainer_class())  # Trainer
    check_trainer_class(type("Mine", (H.lomo_trainer_class(),), {}))  # a user's subclass of a tested one


def test_table_is_generated_and_complete():
    """docs/training_arguments.md holds the generated table; every row names a real field."""
    import dataclasses
    import os

    from transformers import TrainingArguments

    from lomo_ds.integrations.training_args import FIELDS, options_markdown

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    assert [f.name for f in FIELDS if f.name not in names] == []
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "docs", "training_arguments.md")) as f:
        assert options_markdown() in f.read()


def test_sequence_parallel_refused_with_a_loss_of_the_trainers_own(hf_args):
    """SFTTrainer / DPO / a compute_loss_func compute their own loss; under sequence parallelism the
    engine's slice loss would replace it silently: refused in the constructor, naming the field."""
    from accelerate.parallelism_config import ParallelismConfig
    from transformers import Trainer

    from lomo_ds.integrations.training_args import TrainingArgumentsError
    from lomo_ds.integrations.transformers import LomoTrainerMixin
    from tests.tiny import tiny_llama

    args = hf_args(learning_rate=0.05, parallelism_config=ParallelismConfig(sp_size=2, sp_backend="deepspeed"))

    class OwnLoss(LomoTrainerMixin, Trainer):
        def compute_loss(self, model, inputs, **kw):
            return super().compute_loss(model, inputs, **kw)

    with pytest.raises(TrainingArgumentsError, match=r"^parallelism_config.sp_size: .*OwnLoss computes its own"):
        OwnLoss(model=tiny_llama(0), args=args)
    with pytest.raises(TrainingArgumentsError, match=r"^parallelism_config.sp_size: "):
        H.lomo_trainer_class()(model=tiny_llama(0), args=args, compute_loss_func=lambda *a, **k: 0)
