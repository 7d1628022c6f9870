"""Callbacks that tests add with --trainer.callbacks+=tests.helpers.X to observe a real run."""
from __future__ import annotations

import json
import os

import pytorch_lightning as pl
import torch


class SampleRecorder(pl.Callback):
    """Writes, per rank and epoch, which samples the train loader delivered, batch by batch, and their labels.

    It reads them from the batches themselves: the train dataset's labels carry each sample's index
    (index * classes + label, through the sampler, the workers and the batch), and at each batch start
    the recorder takes the index out and leaves the label, before the step sees it. It also writes the
    epoch the loader's sampler was at, and the seed the run set.
    """

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.batches: list[list[int]] = []
        self.labels: list[list[int]] = []
        self.sampler_epoch: int | None = None

    def setup(self, trainer, pl_module, stage: str) -> None:  # after the DataModule's setup
        if stage == "fit":
            dataset = trainer.datamodule.datasets["train"]
            self.classes = trainer.datamodule.num_classes
            dataset.labels = torch.arange(len(dataset.labels)) * self.classes + dataset.labels

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.batches, self.labels = [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        labels = batch[1]
        self.batches.append(torch.div(labels, self.classes, rounding_mode="floor").tolist())
        labels.remainder_(self.classes)  # in place: the step trains on the labels alone
        self.labels.append(labels.tolist())
        self.sampler_epoch = getattr(trainer.train_dataloader.sampler, "epoch", None)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        path = os.path.join(self.out_dir, f"rank{trainer.global_rank}_epoch{trainer.current_epoch}.json")
        with open(path, "w") as f:
            json.dump({"batches": self.batches, "labels": self.labels,
                       "indices": [i for batch in self.batches for i in batch], "steps": len(self.batches),
                       "sampler_epoch": self.sampler_epoch, "seed": os.environ.get("PL_GLOBAL_SEED"),
                       "world_size": trainer.world_size, "num_nodes": trainer.num_nodes}, f)
