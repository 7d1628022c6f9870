"""A global batch the processes cannot split evenly is said once, by rank 0, naming --data.batch_size and the fix
(it was said by every rank, twice each, with a line of our source under it)."""
from __future__ import annotations

import warnings

import pytorch_lightning as pl

from datamodules import ImageFolderDataModule


def test_a_batch_the_processes_cannot_split_is_said_once_with_the_fix(tiny_data):
    dm = ImageFolderDataModule(data_dir=str(tiny_data), batch_size=33, num_workers=0)
    dm.trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False,
                            enable_checkpointing=False)  # made, not run: its world size is 2
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        sizes = [dm.per_process_batch_size for _ in range(3)]  # asked by the loaders and the sizing, each epoch
    assert sizes == [16, 16, 16]
    said = [str(w.message) for w in seen if "divisible" in str(w.message)]
    assert said == [("--data.batch_size 33 is not divisible by the 2 processes: each uses 16, a global batch of 32. "
                     "Pass a multiple of 2.")], said
