"""What is read from and written to disk: models loaded already partitioned (models.py), atomic
checkpoints and Hugging Face exports (checkpoint.py)."""
