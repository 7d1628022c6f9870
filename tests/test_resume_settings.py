"""A fit resumed from a checkpoint with the optimiser's settings changed (docs/clusters.md: "To go on with other
settings (more epochs, another lr), name the checkpoint") trains at the new settings
(lightning_app/lr_schedule.py, SettingsKeepingLambdaLR). Torch's Optimizer.load_state_dict took each group's lr,
initial_lr and weight decay from the checkpoint: the fault campaign of issue 52 resumed a good run with
`--model.lr 1e6`, was told "resuming ... with changed settings: model.lr unset -> 1000000.0", and trained on at the
old rate to exit 0 instead of diverging.
"""
from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch

from datamodules import ImageFolderDataModule
from lightning_app.module import ImageClassifier
from tests.helpers.cli import train_checkpoint

pytestmark = pytest.mark.slow


def test_a_resumed_fit_trains_at_its_own_lr_and_weight_decay_from_the_restored_step(tiny_data, tmp_path):
    _, _, _, path = train_checkpoint(tiny_data, tmp_path, epochs=1, batch=32, lr=0.1, weight_decay=1e-4)
    saved = torch.load(path, map_location="cpu", weights_only=False)
    step = saved["lr_schedulers"][0]["last_epoch"]

    pl.seed_everything(0)
    dm = ImageFolderDataModule(data_dir=str(tiny_data), batch_size=32, num_workers=0, image_size=32,
                               val_crop_ratio=1.0, persistent_workers=False)
    model = ImageClassifier(arch="conv11", num_classes=dm.num_classes, image_size=32, global_batch_size=32,
                            arch_kwargs={"width": 8}, pictures=[], lr=0.3, weight_decay=5e-4)
    seen = {}

    class AtTheFirstResumedStep(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if not seen:
                seen["groups"] = [dict(g, params=None) for g in trainer.optimizers[0].param_groups]
                seen["schedule"] = trainer.lr_scheduler_configs[0].scheduler

    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[AtTheFirstResumedStep()],
                         limit_val_batches=1, num_sanity_val_steps=0, default_root_dir=tmp_path)
    trainer.fit(model, dm, ckpt_path=path)

    schedule = seen["schedule"]
    head = seen["groups"][0]  # the head's decayed weights: its rate is the logged one
    assert head["initial_lr"] == pytest.approx(model.scaled_lr)
    assert schedule.base_lrs[0] == pytest.approx(model.scaled_lr)
    assert head["lr"] == pytest.approx(model.scaled_lr * schedule.lr_lambdas[0](step))  # at the restored step
    assert head["weight_decay"] == pytest.approx(5e-4)
    assert schedule.last_epoch >= step  # the step count is the checkpoint's, not a fresh warm-up
