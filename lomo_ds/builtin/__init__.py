"""The builtin task: lomo_ds/builtin/{train,validation}.jsonl, written by make_builtin_task.py."""
