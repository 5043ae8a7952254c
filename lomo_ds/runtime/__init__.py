"""The bottom layer: DeepSpeed's internals (ds_compat, the one place that touches them), devices,
and the process-group helpers every method shares."""
