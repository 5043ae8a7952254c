"""The training methods a run config names (train.method), and which update each one gets."""
from __future__ import annotations

METHODS = ("lomo", "adamw", "sgd", "lora", "lora_lomo", "zero_shot")
LOMO_METHODS = ("lomo", "lora_lomo")  # the methods whose update is LOMO's (the rest use DeepSpeed's or none)
DEEPSPEED_OPTIMIZER_METHODS = ("adamw", "sgd", "lora")  # stepped by DeepSpeed's ZeRO-3 optimizer
# train.lr when it is null: the learning rate of the optimizer beside LOMO's, per method.
DEFAULT_LR = {"adamw": 1e-5, "sgd": 1e-5, "lora": 5e-4, "lora_lomo": 5e-4}
