"""Preference tuning (DPO) with LOMO and AdaLomo: TRL's DPOTrainer with LomoTrainerMixin.

    from lomo_ds.integrations.dpo import LomoDPOTrainer
    args = DPOConfig(..., optim="lomo", deepspeed="ds_zero3.json", precompute_ref_log_probs=True)
    LomoDPOTrainer(model=model, args=args, train_dataset=pairs, processing_class=tokenizer).train()

TRL's loss, collator, tokenization and metrics run unchanged; the mixin puts the step on lomo_ds's
engine. TRL's DPO loss is a mean over the micro-batch's pairs (it takes no num_items_in_batch), so
the window's gradient is the mean of its micro-batches' losses over every rank: train.loss_normalization
`mean`, as the Trainer weighs them.

The reference. DPO compares the policy with the model it started from. The route shipped is TRL's
`precompute_ref_log_probs=True`: before the first step the starting model scores every pair once
(one no-grad forward of chosen and rejected), and each record keeps two floats. Training then holds
one model. TRL would run that pass through a DeepSpeed inference engine of its own around the
policy (trl.models.prepare_deepspeed) whose ZeRO-3 hooks would sit on the same parameters as the
engine lomo_ds builds at train(); here lomo_ds's engine is built first and the pass runs through its
module, so the parameters carry one set of hooks. The other route, a second model (`ref_model`, or
precompute off, which makes TRL load one) costs a second ZeRO-3 copy of the weights on every rank
plus a no-grad forward of it each step; it is refused, not silently changed.

TRL keys its cache of reference log-probs by a hash of the model's state_dict, which under ZeRO-3
holds empty placeholders (the same hash for every model of one architecture): the hash here is of
every rank's own shards instead, so another starting model never reuses a stale cache. That cache
is a file beside the dataset's own cache files, written by rank 0 and read by every rank. A dataset
held in memory (`Dataset.from_list`, `from_dict`, a tokenized in-memory one) has no such files, and
each process would draw a temporary folder of its own: the other ranks would read a file that only
rank 0 has. Its log-probs are kept in memory on every rank instead (each rank scores its share of
the pairs, as TRL does, and every rank receives them all); no file is written.

Refused with one line naming the field (TrainingArgumentsError) before DeepSpeed starts: a
`ref_model`, precompute_ref_log_probs false, sync_ref_model (needs a live reference), a
`peft_config` (LOMO trains every weight; lomo_ds's LoRA methods are separate), padding_free (TRL
turns it off with a warning), activation_offloading (its context wraps DPOTrainer.training_step,
which the engine's step replaces).
"""
from __future__ import annotations

import hashlib

import torch
from datasets import Dataset, concatenate_datasets
from trl import DPOTrainer

from lomo_ds.integrations.training_args import TrainingArgumentsError, optim_choices
from lomo_ds.integrations.transformers import LomoTrainerMixin

REF_ROUTE = ("precompute_ref_log_probs: lomo_ds ships TRL's precomputed reference (the starting model scores "
             "every pair once, before training; no second model is held)")


def check_dpo_arguments(args, ref_model=None, peft_config=None) -> None:
    """Refuse (TrainingArgumentsError naming the field) a DPOConfig value LomoDPOTrainer cannot honour."""
    if args is None:
        raise TrainingArgumentsError(f"args: pass DPOConfig(optim={optim_choices()}, deepspeed=..., "
                                     "precompute_ref_log_probs=True)")
    if ref_model is not None:
        raise TrainingArgumentsError(f"ref_model: a second model is not supported; {REF_ROUTE}")
    if not getattr(args, "precompute_ref_log_probs", False):
        raise TrainingArgumentsError(f"precompute_ref_log_probs: expected True (got False; TRL would load a second "
                                     f"model as the reference); {REF_ROUTE}")
    refused = {
        "sync_ref_model": ("TR-DPO's reference updates need a live reference model", False),
        "padding_free": ("TRL turns it off with a warning; set it False", False),
        "activation_offloading": ("its context wraps DPOTrainer.training_step, which lomo_ds's step replaces",
                                  False),
    }
    for name, (why, accepted) in refused.items():
        value = getattr(args, name, accepted)
        if value != accepted:
            raise TrainingArgumentsError(f"{name}: {why} (got {value!r})")
    if peft_config is not None:
        raise TrainingArgumentsError("peft_config: LOMO trains every weight; adapters are lomo_ds's lora / lora_lomo "
                                     "methods, not this trainer")


def shard_hash(engine) -> str:
    """Collective: a hash of every rank's own shards of the model (the same on every rank)."""
    h = hashlib.sha256()
    for name, t in sorted(engine.shard_state_dict()["shards"].items()):
        h.update(name.encode())
        h.update(t.detach().to("cpu", torch.float32).numpy().tobytes())
    every = [None] * engine.world
    torch.distributed.all_gather_object(every, h.hexdigest())
    return hashlib.sha256("".join(every).encode()).hexdigest()


class LomoDPOTrainer(LomoTrainerMixin, DPOTrainer):
    """TRL's DPOTrainer on lomo_ds's engine (module docstring)."""

    def __init__(self, model, ref_model=None, args=None, *rest, **kwargs):
        if rest:
            raise TypeError("LomoDPOTrainer: pass every argument after `args` by keyword")
        check_dpo_arguments(args, ref_model, kwargs.get("peft_config"))
        super().__init__(model=model, ref_model=None, args=args, **kwargs)

    @property
    def _loss_by_tokens(self) -> bool:
        """TRL's DPO loss is a mean over the micro-batch's pairs and takes no num_items_in_batch
        (a DPO batch has no `labels` to count), whatever the model's forward accepts: the window
        is the mean of its micro-batches (train.loss_normalization `mean`)."""
        return False

    def _precompute_ref_logps(self, dataset, name: str, batch_size: int):
        if self._precompute_engine is None:
            # deepspeed_init fills the model-dependent `auto` values before it builds an optimizer;
            # this pass comes first, so they are filled here (the same values: deepspeed_init's second
            # fill is a no-op).
            hf_ds = self.accelerator.state.deepspeed_plugin.hf_ds_config
            hf_ds.trainer_config_finalize(self.args, self.model, max(1, self.args.max_steps))
            engine = self._build_lomo_engine()
            self._precompute_model_hash = shard_hash(engine)
            # The module, not the DeepSpeedEngine: its ZeRO-3 hooks gather each layer for the
            # forward (as the engine's own forward does), without DeepSpeed's training prologue.
            self._precompute_engine = engine.module
        if isinstance(dataset, Dataset) and not dataset.cache_files:
            return self._ref_logps_in_memory(dataset, batch_size)
        return super()._precompute_ref_logps(dataset, name, batch_size)

    @torch.no_grad()
    def _ref_logps_in_memory(self, dataset: Dataset, batch_size: int) -> Dataset:
        """Collective: `dataset` with TRL's ref_chosen_logps / ref_rejected_logps columns, held in
        memory on every rank. TRL's own pass (its loader split over the ranks, the scores gathered
        in the dataset's order) without its cache file, which would be in a folder of rank 0's own."""
        from torch.utils.data import DataLoader

        loader = DataLoader(dataset, batch_size=batch_size, collate_fn=self.data_collator,
                            num_workers=self.args.dataloader_num_workers, pin_memory=self.args.dataloader_pin_memory,
                            shuffle=False)
        chosen, rejected = [], []
        for batch in self.accelerator.prepare(loader):
            c, r = self.compute_ref_log_probs(self._precompute_engine, batch)
            c, r = self.accelerator.gather_for_metrics((c, r))
            chosen.append(c.cpu()), rejected.append(r.cpu())
        # The columns as TRL's cache file holds them (its map stores the tensors' own dtype).
        scores = Dataset.from_dict({"ref_chosen_logps": torch.cat(chosen).numpy(),
                                    "ref_rejected_logps": torch.cat(rejected).numpy()})
        return concatenate_datasets([dataset, scores], axis=1)

    @torch.no_grad()
    def pair_log_probs(self, dataset, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Collective: the current policy's summed completion log-probs (chosen, rejected) of every
        pair of a tokenized dataset, every rank scoring every pair (for evaluation scripts)."""
        from torch.utils.data import DataLoader

        engine = self._build_lomo_engine()
        columns = [c for c in ("prompt_ids", "chosen_ids", "rejected_ids") if c in dataset.column_names]
        loader = DataLoader(dataset.select_columns(columns), batch_size=batch_size, collate_fn=self.data_collator,
                            shuffle=False)
        was_training = engine.module.training
        engine.module.eval()
        chosen, rejected = [], []
        for batch in loader:
            batch = {k: v.to(engine.device) for k, v in batch.items()}
            c, r = self.compute_ref_log_probs(engine.module, batch)
            chosen.append(c.float().cpu()), rejected.append(r.float().cpu())
        engine.module.train(was_training)
        return torch.cat(chosen), torch.cat(rejected)
