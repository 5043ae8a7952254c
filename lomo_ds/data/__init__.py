"""Data: a run's datasets (loading.py), from records (io.py) through tokens (examples.py, chat.py,
formats.py) to packed rows, batches and their order (packing.py, collate.py, order.py); several
sources mixed by weight (mixture.py) or streamed (streaming.py); the tasks themselves are the
registry in lomo_ds/config/tasks.py, their shipped files in builtin/."""
