"""The generators of the data the package ships (lomo_ds/data/builtin), not installed with it: run
from the repository root, `python3 -m datagen.make_<task>`, or as a script. splits.py is what they
share; measure_zero_shot.py measures the built-in model on what they write."""
