"""LOMO and AdaLomo inside Hugging Face's Trainer and TRL's SFTTrainer (lomo_ds.integrations).

The multi-rank checks (tests/dist_hf_checks.py) train through a real Trainer on real DeepSpeed
ZeRO-3 ranks: K = 2 micro-batches, label counts that differ per micro-batch and rank, a linear
schedule with warm-up, and norm clipping that is active on some steps and not on others. After the
run the parameters must equal a single-process reference (torch.optim.SGD, or the reference
AdaLomo, on each window's whole batch with the Trainer's token-mean loss and schedule) and
lomo_ds's own engine with lomo.loss_normalization "tokens".
"""
import pytest

from tests import dist_hf_checks as H
from tests.ranks import multi_rank_checks, ok

TOL = 1e-5
WORLDS = [1, 2]
EQUIVALENCE = multi_rank_checks(
    WORLDS,
    trainer_lomo=lambda: H.check_equivalence("lomo"),
    trainer_adalomo=lambda: H.check_equivalence("adalomo"),
    sft=H.check_sft,
)
resume, trackers = multi_rank_checks([2], resume=H.check_resume, trackers=H.check_trackers)


@pytest.mark.parametrize("check", EQUIVALENCE[:2], ids=str)
@pytest.mark.parametrize("world", WORLDS)
def test_trainer_matches_reference(rank_results, world, check):
    r = ok(rank_results(world), check)
    print(f"{check} on {world}: max |Trainer - reference| = {r['max_abs_diff']:.2e}, "
          f"|Trainer - engine| = {r['engine_vs_trainer']:.2e}")
    assert r["wrapped"] == "DeepSpeedEngine"  # the LomoEngine's, no second one built by accelerate
    assert r["max_abs_diff"] <= TOL
    assert r["engine_vs_trainer"] <= TOL
    assert r["lr"] == pytest.approx(r["ref_lr"], abs=1e-12)  # the Trainer's schedule, warm-up from 0
    assert r["loss"] == pytest.approx(r["ref_loss"], abs=1e-5)  # the window's token mean, every step
    assert r["grad_norm"] == pytest.approx(r["ref_grad_norm"], rel=1e-5)
    clipped = [n > H.CLIP[world] for n in r["ref_grad_norm"]]
    assert any(clipped) and not all(clipped), r["ref_grad_norm"]  # the clip acts on some steps only


@pytest.mark.parametrize("world", WORLDS)
def test_sft_trainer_matches_reference(rank_results, world):
    """SFTTrainer's own loss (the fused LM head's log-probs) trains as the token-mean SGD reference."""
    r = ok(rank_results(world), EQUIVALENCE[2])
    print(f"SFTTrainer on {world}: max |SFTTrainer - reference| = {r['max_abs_diff']:.2e}, "
          f"label tokens per micro-batch {r['label_counts']}")
    assert r["max_abs_diff"] <= TOL
    assert r["loss"] == pytest.approx(r["ref_loss"], abs=1e-5)
    assert r["grad_norm"] == pytest.approx(r["ref_grad_norm"], rel=1e-5)
    assert all(a is not None for a in r["token_accuracy"])  # TRL's metrics, from its fused outputs
    assert len({c for window in r["label_counts"] for c in window}) > 1  # micro-batches differ in label count


def test_resume_and_save_model(rank_results):
    """Stopped after the step-2 checkpoint and resumed (AdaLomo: its statistics are in the shard
    state) = uninterrupted; save_model() loads with from_pretrained."""
    r = ok(rank_results(2), resume)
    print(f"resumed vs uninterrupted: {r['resumed_vs_whole']:.2e}; checkpoint: {r['checkpoint_files']}")
    assert r["resumed_vs_whole"] == 0.0
    assert r["stopped_vs_whole"] > 1e-4  # the stopped run is really behind: the resume did the rest
    assert r["from_pretrained_vs_trained"] == 0.0
    assert {"lomo_rank_00000.pt", "lomo_rank_00001.pt", "scheduler.pt", "trainer_state.json",
            "model.safetensors", "config.json"} <= set(r["checkpoint_files"])


def test_trackers_read_back(rank_results):
    """loss, learning_rate and grad_norm reach TensorBoard and W&B (offline), as the Trainer logged them."""
    r = ok(rank_results(2), trackers)
    for tracker in ("tensorboard", "wandb"):
        for key, values in r["trainer"].items():
            assert r[tracker][key] == pytest.approx(values, rel=1e-6), (tracker, key)
    assert len(r["trainer"]["loss"]) == H.STEPS and all(v is not None for v in r["trainer"]["grad_norm"])
