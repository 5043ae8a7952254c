"""keep_labelled_logits: the training loss from the logits of labelled positions only."""
import peft
import pytest
import torch

from lomo_ds.data.collate import collate
from lomo_ds.runtime.dist import accepts_logits_to_keep, keep_labelled_logits
from tests.tiny import VOCAB, tiny_llama


def _examples(lengths_and_answers):
    """Prompt-masked examples (labels only on the last `answer` tokens), as the tasks build them."""
    g = torch.Generator(device="cpu").manual_seed(0)
    out = []
    for n, answer in lengths_and_answers:
        ids = torch.randint(0, VOCAB, (n,), generator=g, device="cpu").tolist()
        out.append({"input_ids": ids, "labels": [-100] * (n - answer) + ids[n - answer:]})
    return out


def _loss_and_grads(model, batch):
    model.zero_grad()
    out = model(**batch)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_the_loss_and_every_gradient_are_the_same_from_the_labelled_positions_alone():
    model = tiny_llama(seed=3)
    batch = collate(_examples([(21, 2), (17, 1), (24, 3), (19, 2)]), pad_id=0)  # right-padded to 24
    trimmed = keep_labelled_logits(batch)
    # The earliest target is row 2's (label column 16, predicted by position 15): 24 - 15 positions kept.
    assert trimmed["logits_to_keep"] == 9 and trimmed["labels"].shape == (4, 9)
    assert torch.equal(trimmed["input_ids"], batch["input_ids"])
    full_out, full_grads = _loss_and_grads(model, batch)
    kept_out, kept_grads = _loss_and_grads(model, trimmed)
    assert kept_out.logits.shape == (4, 9, VOCAB) and full_out.logits.shape == (4, 24, VOCAB)
    torch.testing.assert_close(kept_out.loss, full_out.loss, rtol=1e-6, atol=1e-6)
    for name, g in full_grads.items():
        torch.testing.assert_close(kept_grads[name], g, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("labels", [None, "none_labelled", "first_column"])
def test_a_batch_with_nothing_to_trim_is_passed_as_it_is(labels):
    batch = collate(_examples([(6, 2), (5, 1)]), pad_id=0)
    if labels is None:
        del batch["labels"]
    elif labels == "none_labelled":
        batch["labels"].fill_(-100)
    else:  # a target in column 1 (the first position predicts it): every logit is read
        batch["labels"][0, 1] = 7
    assert keep_labelled_logits(batch) is batch


def test_causal_lms_and_their_peft_wrappers_accept_logits_to_keep():
    model = tiny_llama()
    assert accepts_logits_to_keep(model)
    lora = peft.get_peft_model(model, peft.LoraConfig(task_type="CAUSAL_LM", r=2, target_modules=["q_proj"]))
    assert accepts_logits_to_keep(lora)
    assert not accepts_logits_to_keep(torch.nn.Linear(2, 2))
