"""`deepspeed launch/train.py --config ds_configs/llama65b.json --model PATH`: the training program is
lomo_ds.recipe.train (also `lomo-ds train`)."""
from lomo_ds.recipe.train import main

raise SystemExit(main())

