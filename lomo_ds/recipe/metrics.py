"""The training program's metrics: one JSON record per line (and optionally TensorBoard), written by rank 0 only."""
from __future__ import annotations

import json
import os


class Metrics:
    def __init__(self, out_dir: str, file_name: str, rank: int, append: bool, tensorboard: bool):
        self.file = self.tb = None
        if rank != 0:
            return
        os.makedirs(out_dir, exist_ok=True)
        self.file = open(os.path.join(out_dir, file_name), "a" if append else "w")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # optional: the tensorboard package

            self.tb = SummaryWriter(os.path.join(out_dir, "tensorboard"))

    def log(self, record: dict) -> None:
        if self.file is None:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()  # a watcher (or a crash) sees every finished step
        if self.tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
                    self.tb.add_scalar(k, v, record.get("step", 0))

    def close(self) -> None:
        for f in (self.file, self.tb):
            if f is not None:
                f.close()
