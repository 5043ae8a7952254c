"""Data: the task registry (tasks.py), and loading, tokenization and order (loading.py); the
built-in tasks' files in builtin/."""
