"""Callbacks that tests add with --trainer.callbacks+=tests.helpers.X to observe a real run."""
from __future__ import annotations

import json
import os

import pytorch_lightning as pl


class SampleRecorder(pl.Callback):
    """Writes, per rank and epoch, the dataset indices its train sampler hands out."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        loader = trainer.train_dataloader
        sampler = loader.sampler
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(trainer.current_epoch)
        indices = [int(i) for i in sampler]
        os.makedirs(self.out_dir, exist_ok=True)
        path = os.path.join(self.out_dir, f"rank{trainer.global_rank}_epoch{trainer.current_epoch}.json")
        with open(path, "w") as f:
            json.dump({"indices": indices, "world_size": trainer.world_size, "num_nodes": trainer.num_nodes,
                       "steps": len(loader)}, f)
