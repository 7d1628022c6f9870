"""The one line per epoch a log file gets (lightning_app/callbacks/progress.py EpochLineProgress) after a resume in
the middle of an epoch: Lightning calls no on_train_epoch_start for the resumed epoch (fit_loop.on_advance_start),
so the line's clock must start with the training. The fault campaign of issue 52 saw `epoch 2/3: ..., 2 images/s,
41.2 s` after every mid-epoch resume: the seconds since the callback was made, start-up and all.
"""
from __future__ import annotations

import re
import time

import pytest
import pytorch_lightning as pl
from pytorch_lightning.callbacks import ModelCheckpoint

from datamodules import ImageFolderDataModule
from lightning_app.callbacks import progress
from lightning_app.module import ImageClassifier

pytestmark = pytest.mark.slow
START_UP_S = 1000.0  # a clock jump standing in for the start-up between the callback's making and the training


def _fit(data, root, callbacks, max_steps: int, ckpt_path=None) -> None:
    pl.seed_everything(0)
    dm = ImageFolderDataModule(data_dir=str(data), batch_size=32, num_workers=0, image_size=32,
                               val_crop_ratio=1.0, persistent_workers=False)
    model = ImageClassifier(arch="conv11", num_classes=dm.num_classes, image_size=32, global_batch_size=32,
                            arch_kwargs={"width": 8}, pictures=[])
    trainer = pl.Trainer(max_epochs=1, max_steps=max_steps, accelerator="cpu", logger=False,
                         enable_model_summary=False, callbacks=callbacks,
                         limit_val_batches=1, num_sanity_val_steps=0, default_root_dir=root)
    trainer.fit(model, dm, ckpt_path=ckpt_path)


def test_the_epoch_line_of_a_run_resumed_mid_epoch_counts_from_the_training_start(tiny_data, tmp_path, capsys,
                                                                                   monkeypatch):
    steps = ModelCheckpoint(dirpath=tmp_path, filename="mid", every_n_train_steps=2, save_top_k=-1)
    _fit(tiny_data, tmp_path, [steps], max_steps=2)  # saved within the epoch, as a step checkpoint is
    mid_epoch = tmp_path / "mid.ckpt"

    line = progress.EpochLineProgress()  # made with the command line, before the data and the model start
    real = time.perf_counter
    monkeypatch.setattr(progress.time, "perf_counter", lambda: real() + START_UP_S)
    capsys.readouterr()
    _fit(tiny_data, tmp_path, [line], max_steps=-1, ckpt_path=mid_epoch)

    out = capsys.readouterr().out
    said = re.search(r"epoch 1/1: .*, ([\d,]+) images/s, ([\d.]+) s", out)
    assert said, out
    assert float(said.group(2)) < START_UP_S  # the resumed epoch's own seconds, not the start-up's
