"""Where a run resumes: the newest checkpoint in output.dir loaded into the engine, and what a resume
on another rank count does to the data order. TrainRecipe (lomo_ds/recipe/train.py) calls
resume_point() at the end of its setup."""
from __future__ import annotations

from lomo_ds.storage import checkpoint

# Under "mean" a step's gradient is the average of its micro-batches' token means: another rank
# count cuts the same global batch into other micro-batches, so rows of unequal label counts weigh
# differently from the uninterrupted run's (equal only where every row has as many label tokens).
MEAN_AFTER_MOVE = ("train.loss_normalization is 'mean': each micro-batch's token mean weighs the same, and this rank "
                   "count cuts the global batch into other micro-batches, so a step's gradient differs from the "
                   "uninterrupted run's wherever rows have unequal label counts; 'tokens' weighs every label token "
                   "the same however the batch is cut")


class Resume:
    """TrainRecipe's resume_point(), global_batch and data_position_after_resume()."""

    def resume_point(self) -> int:
        """The step to start from: the newest checkpoint's when resuming (loaded into the engine), else 0."""
        if not (self.resume_requested and self.engine.supports_resume):
            return 0
        ckpt = checkpoint.latest_checkpoint(self.cfg.output.dir)
        if ckpt is None:
            self.say(f"resume: no checkpoint in {self.cfg.output.dir}; starting from scratch")
            return 0
        try:
            meta = checkpoint.load_checkpoint(ckpt, self.engine)
        except (ValueError, FileNotFoundError) as e:  # refused before any shard is written
            raise checkpoint.CheckpointError(f"{ckpt}: {e}") from None
        step = meta["step"]
        self.say(f"resumed from {ckpt} at step {step}")
        if meta["world"] != self.world:
            self.say(f"resumed on {self.world} rank(s) a run checkpointed on {meta['world']}: "
                     + self.data_position_after_resume(meta.get("global_batch")))
            if self.cfg.train.loss_normalization == "mean":
                self.say("warning: " + MEAN_AFTER_MOVE)
        return step

    @property
    def global_batch(self) -> int:
        return self.dp_world * self.cfg.micro_batch * self.cfg.accumulation_steps

    def data_position_after_resume(self, written_batch: int | None) -> str:
        """What a resume on another rank count does to the data order, in words."""
        if written_batch == self.global_batch:
            return f"the same global batch ({self.global_batch} examples a step): the data order continues exactly"
        # The order is a pure function of (seed, epoch, step) for a global batch: another batch
        # cuts the same epoch order into other steps.
        return (f"global batch {written_batch} -> {self.global_batch}: the steps from here on take the new "
                "batch's share of the epoch order, so some examples of the resumed epoch are seen twice or "
                "not at all; keep world x micro-batch x accumulation the same for the uninterrupted order")
