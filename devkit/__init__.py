"""What the tests, benchmarks and experiments share to run lomo_ds on this machine, not installed with
the package (nothing in it needs them): the local multi-rank launcher (launch_local.py) and the
floor a fused optimizer's step is measured against (floor.py)."""
