"""What tests/test_scale.py adds to a real run (--trainer.callbacks+=tests.scale_helpers.LoaderProbe)."""
from __future__ import annotations

import json
import os

import pytorch_lightning as pl


class LoaderProbe(pl.Callback):
    """Writes, per rank, its CPU mask and what its train loader was built with."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_start(self, trainer, pl_module) -> None:
        dm = trainer.datamodule
        loader = trainer.train_dataloader
        share = dm.cpu_share()
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump({"mask": sorted(os.sched_getaffinity(0)), "cpus": share.cpus, "per_task": share.per_task,
                       "describe": share.describe(), "workers": loader.num_workers,
                       "decode_threads": loader.dataset.decode_threads, "world": trainer.world_size}, f)
