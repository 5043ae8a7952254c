"""Memory: what a rank holds, counted (memory.py), and predicted before a run (planner.py)."""
