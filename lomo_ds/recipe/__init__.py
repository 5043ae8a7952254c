"""The training recipe (`lomo-ds train`, train.py) and its metrics writer (metrics.py)."""
