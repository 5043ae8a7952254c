"""The builtin task: lomo_ds/data/builtin/{train,validation}.jsonl, written by datagen/make_builtin_task.py."""
