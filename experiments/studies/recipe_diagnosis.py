"""Step-0 diagnosis of the CPU demo's recipe, on one process (no DeepSpeed needed to read gradients).

    python -m experiments.studies.recipe_diagnosis

Prints, for the demo's data (ds_configs/cpu_default.json) and model: the loss on the answer word and
on EOS separately, what the model predicts at those positions, the global gradient norm of a batch
of 8 (the demo's global batch), and the per-tensor update-to-weight ratio |lr * u| / |w| of one
step at lr 0.03 with value clipping (|g| <= 1) and with norm clipping (global norm <= 1).
"""
import collections
import statistics

import torch
from transformers import AutoModelForCausalLM

from lomo_ds.config.run import load_run_config, resolve_model_source
from lomo_ds.data.collate import collate, pad_id_of
from lomo_ds.data.loading import build_datasets
from lomo_ds.data.order import epoch_order
from lomo_ds.storage.models import load_tokenizer

LR = 0.03


def main() -> None:
    cfg = load_run_config("ds_configs/cpu_default.json", {})
    tok = load_tokenizer(cfg)
    data = build_datasets(cfg, tok)
    source, gguf = resolve_model_source(cfg.model.path, cfg.model.gguf_file)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=gguf, dtype=torch.float32)
    order = epoch_order(len(data.train), cfg.train.seed, 0)
    batch = collate([data.train[i] for i in order[:32]], pad_id_of(tok))
    first = data.train[order[0]]
    print("a training example, tokens that carry labels marked *:",
          " ".join(t + ("*" if lab != -100 else "") for t, lab in
                   zip(tok.convert_ids_to_tokens(first["input_ids"]), first["labels"], strict=True)))

    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logp = torch.log_softmax(logits[:, :-1].float(), -1)
    labels = batch["labels"][:, 1:]
    nll = -logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    at_eos = labels == tok.eos_token_id
    at_answer = (labels != -100) & ~at_eos
    print(f"step-0 loss on 32 examples: answer word {nll[at_answer].mean():.3f}, EOS {nll[at_eos].mean():.3f}, "
          f"both {nll[labels != -100].mean():.3f}")
    for name, where in (("answer", at_answer), ("EOS", at_eos)):
        top = collections.Counter(tok.convert_ids_to_tokens(logp.argmax(-1)[where].tolist())).most_common(3)
        print(f"most likely token at the {name} position: {top}")
    yes_no = tok.convert_tokens_to_ids(["Yes", "No"])
    print(f"p(Yes) + p(No) at the answer position: {logp[at_answer][:, yes_no].exp().sum(-1).mean():.4f}")

    model.zero_grad()
    model(**{k: v[:8] for k, v in batch.items()}).loss.backward()
    params = dict(model.named_parameters())
    norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in params.values())).item()
    big = sum(int((p.grad.abs() > 1).sum()) for p in params.values()) / sum(p.numel() for p in params.values())
    print(f"global gradient norm {norm:.1f}; fraction of gradient elements value clipping at 1.0 touches: {big:.1e}")
    for clip, update in (("value", lambda g: g.clamp(-1, 1)), ("norm", lambda g: g * min(1.0, 1.0 / norm))):
        ratios = {n: (LR * update(p.grad)).norm().item() / p.norm().item() for n, p in params.items()}
        top = sorted(ratios.items(), key=lambda kv: -kv[1])[:3]
        print(f"lr {LR} {clip} clipping: update/weight median {statistics.median(ratios.values()):.1e}, largest "
              + ", ".join(f"{n.removeprefix('model.')} {r:.1e}" for n, r in top))


if __name__ == "__main__":
    main()
