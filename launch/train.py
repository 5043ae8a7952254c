"""`deepspeed launch/train.py --config ds_configs/llama65b.json`: the training program is lomo_ds.train (also `lomo-ds train`)."""
from lomo_ds.train import main

raise SystemExit(main())

