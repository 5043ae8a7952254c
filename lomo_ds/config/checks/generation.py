"""Generated replies at evaluation (eval.generate_samples): evaluated on a chat task's
conversations, and each reply must leave room for its prompt."""
from __future__ import annotations

from lomo_ds.config.errors import ConfigError
from lomo_ds.config.tasks import TASKS


def check_generation(cfg, loading) -> None:
    if not cfg.eval.generate_samples:
        return
    if not TASKS[cfg.data.task].conversational:
        raise ConfigError(f"eval.generate_samples: generation is evaluated on conversations; task {cfg.data.task!r} "
                          f"is not a chat task")
    if cfg.eval.max_new_tokens >= cfg.tokenizer.max_length:
        raise ConfigError(f"eval.max_new_tokens: {cfg.eval.max_new_tokens} leaves no room for a prompt in "
                          f"tokenizer.max_length={cfg.tokenizer.max_length}")
