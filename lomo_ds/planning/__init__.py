"""Memory predicted before a run: the planner (planner.py, one import for specs.py, fetch_units.py,
estimate.py, report.py and inputs.py), any config.json's model built on the meta device
(model_tree.py), and evaluation's and generation's memory (inference.py). What a rank holds while it
runs is counted by lomo_ds/runtime/memory.py."""
