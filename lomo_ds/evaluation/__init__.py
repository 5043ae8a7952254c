"""Evaluation: candidate scoring and eval loss, spread over the ranks (scoring.py)."""
