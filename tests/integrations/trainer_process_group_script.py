"""A user's Trainer script on CPU ranks (torchrun, or `accelerate launch`): the mixin imported first,
then TrainingArguments(deepspeed=..., optim="lomo"), whose device setup has accelerate start the
process group, then one step of a tiny model, whose engine starts DeepSpeed's comm backend on that
group; lomo_ds.init_distributed never starts it. DeepSpeed's CPU backend must start without its
shared-memory all-reduce op: the script exits with an error where DeepSpeed would build the op (a
C++ build of minutes on a CPU: stopped where it would start) or holds one, else prints one JSON
line per rank of what it saw.

    python -m torch.distributed.run --nproc_per_node 2 tests/integrations/trainer_process_group_script.py OUT_DIR
"""
import json
import sys

from deepspeed.accelerator import get_accelerator


def _stop_the_build(self, *args, **kwargs):
    raise SystemExit("DeepSpeed's comm backend is building its shared-memory all-reduce op "
                     f"({self.absolute_name()}), which the Trainer path must skip")


get_accelerator().get_op_builder("ShareMemCommBuilder").load = _stop_the_build

import torch  # noqa: E402
from deepspeed.comm import comm as ds_comm  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402

from lomo_ds.integrations.transformers import LomoTrainerMixin  # noqa: E402  (a user's script imports it)

DS_CONFIG = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
             "gradient_clipping": "auto", "zero_optimization": {"stage": 3}}


class LomoTrainer(LomoTrainerMixin, Trainer):
    pass


args = TrainingArguments(output_dir=sys.argv[1], deepspeed=DS_CONFIG, optim="lomo", learning_rate=1e-3,
                         per_device_train_batch_size=2, max_steps=1, save_strategy="no", report_to=[],
                         disable_tqdm=True)
group_started_by = "accelerate" if torch.distributed.is_initialized() else "not yet"
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=2))
rows = [{"input_ids": [3 + (i + j) % 50 for j in range(8)], "labels": [3 + (i + j) % 50 for j in range(8)]}
        for i in range(8)]
LomoTrainer(model=model, args=args, train_dataset=rows).train()
backend = ds_comm.cdb
print(json.dumps({"rank": torch.distributed.get_rank(), "world": torch.distributed.get_world_size(),
                  "group_started_by": group_started_by, "deepspeed_backend": type(backend).__name__,
                  "shm_op": getattr(backend, "shm_comm_op", None) is not None}))
if getattr(backend, "shm_comm_op", None) is not None:
    sys.exit("DeepSpeed's comm backend holds its shared-memory all-reduce op")
