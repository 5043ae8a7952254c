"""Runtime, just above config: DeepSpeed's internals (ds_compat, the one place that touches them),
devices, the process-group helpers every method shares, and memory accounting (memory.py).
8-bit weight shards: the block format and keyed stochastic rounding (quant8*.py)."""
