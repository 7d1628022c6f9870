"""A StreamingDataModule that records which samples each training step gets, for tests that run main.py
(--data.class_path tests.helpers.streaming.IdRecordingStreamingDataModule), and its reader."""
from __future__ import annotations

import os

from datamodules import StreamingDataModule


class IdRecordingStreamingDataModule(StreamingDataModule):
    """Appends "epoch batch_idx id id ..." per training batch to RECORD_DIR/rank<r>.txt (flushed, fsynced),
    before the step runs: a line is a batch the model was about to train on."""

    def __init__(self, record_dir: str | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.record_dir = record_dir

    def on_before_batch_transfer(self, batch, dataloader_idx: int):
        trainer = self.trainer
        if self.record_dir and trainer is not None and trainer.training:
            os.makedirs(self.record_dir, exist_ok=True)
            ids = " ".join(str(int(i)) for i in batch[2])
            with open(os.path.join(self.record_dir, f"rank{trainer.global_rank}.txt"), "a") as f:
                f.write(f"{trainer.current_epoch} {trainer.fit_loop.epoch_loop.batch_progress.current.ready} {ids}\n")
                f.flush()
                os.fsync(f.fileno())
        return batch


def read_records(record_dir: str, rank: int = 0) -> list[tuple[int, int, list[int]]]:
    """[(epoch, batch index in the epoch, ids)] in the order the batches were trained on."""
    path = os.path.join(record_dir, f"rank{rank}.txt")
    out = []
    with open(path) as f:
        lines = f.read().splitlines()
    for line in lines:
        epoch, batch, *ids = (int(x) for x in line.split())
        out.append((epoch, batch, ids))
    return out

