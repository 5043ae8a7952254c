"""lomo_ds inside other trainers: Hugging Face's Trainer and TRL's SFTTrainer (transformers.py),
TRL's DPOTrainer (dpo.py), with every TrainingArguments field that touches the update supported,
mapped or refused (training_args.py)."""
