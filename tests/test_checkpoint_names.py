"""Step-interval saves refresh last.ckpt only; each best checkpoint holds the weights its score was measured
on and is named with the epoch counted from 1 (lightning_app.callbacks.checkpoints.ResumableCheckpoint)."""
from __future__ import annotations

import logging
import re

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities.exceptions import SIGTERMException

from datamodules import ImageFolderDataModule
from lightning_app.callbacks.checkpoints import CheckpointOnSigterm
from lightning_app.cli import ClassifierCLI
from lightning_app.module import ImageClassifier
from tests.helpers.cli import quick_args

BATCH = 48  # tiny data: 240 train images -> 5 steps per epoch


class SigtermInSecondEpoch(pl.Callback):
    """What Lightning does on SIGTERM after the first batch of the second epoch: CheckpointOnSigterm's save and line."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if trainer.current_epoch == 1 and batch_idx == 0:
            CheckpointOnSigterm(filename="sigterm").on_exception(trainer, pl_module, SIGTERMException())


def _validate(path, data_dir) -> float:
    model = ImageClassifier.load_from_checkpoint(path, map_location="cpu", weights_only=True)
    dm = ImageFolderDataModule(data_dir=str(data_dir), batch_size=BATCH, num_workers=0, image_size=32,
                               val_crop_ratio=1.0, persistent_workers=False)
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    return float(trainer.validate(model, dm, verbose=False)[0]["val/acc1"])


@pytest.mark.slow
def test_step_saves_leave_the_best_checkpoint_to_the_validation_that_scored_it(tiny_data, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="pytorch_lightning.utilities.rank_zero"):
        ClassifierCLI(args=["fit", *quick_args(tiny_data, tmp_path, epochs=2, batch=BATCH),
                            "--checkpoint.every_n_train_steps", "1", "--checkpoint.save_top_k", "-1",
                            "--model.pictures", "[]", "--trainer.enable_model_summary", "false",
                            "--data.val_crop_ratio", "1.0", "--model.lr", "2.0",
                            "--trainer.callbacks+=tests.test_checkpoint_names.SigtermInSecondEpoch"])
    assert "sigterm.ckpt in epoch 2, step 6;" in caplog.text  # counted like the epoch lines, from 1
    ckpts = tmp_path / "version_0" / "checkpoints"
    best = sorted(p.name for p in ckpts.glob("best-*.ckpt"))
    # one per validation, named by the epoch (from 1) it ended; before, a step save wrote one per improving
    # step after the first epoch, with the previous validation's score, and a 1-epoch run got none
    assert [re.sub(r"-acc.*", "", b) for b in best] == ["best-epoch001", "best-epoch002"], best
    for name in best:
        ckpt = torch.load(ckpts / name, map_location="cpu", weights_only=True)
        epoch = int(name[len("best-epoch"):][:3])
        assert ckpt["global_step"] == 5 * epoch  # saved at the end of that epoch's validation, not a step later
        named = float(re.search(r"acc([0-9.]+)\.ckpt$", name).group(1))
        assert abs(_validate(ckpts / name, tiny_data) - named) < 1e-4  # its weights score what its name says
    assert torch.load(ckpts / "last.ckpt", map_location="cpu", weights_only=True)["global_step"] == 10
