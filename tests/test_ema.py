"""EMA with a delayed start: until the average starts, validation, checkpoints and the end of training use
the live weights (those of --model.weights), never the copy made at setup (the random initialisation)."""
from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch

from datamodules import ImageFolderDataModule
from lightning_app.callbacks.ema import DelayedStartEMA
from lightning_app.module import ImageClassifier

KEY = "backbone.features.0.weight"


class Probe(pl.Callback):
    def __init__(self) -> None:
        self.live: dict[str, torch.Tensor] = {}
        self.validated: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.live = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}

    def on_validation_epoch_start(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.validated = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}


def _model(weights=None) -> ImageClassifier:
    return ImageClassifier("conv11", num_classes=10, image_size=32, global_batch_size=16, arch_kwargs={"width": 4},
                           lr=1e-4, warmup_epochs=0, weights=weights, pictures=[])


@pytest.mark.slow
def test_ema_before_its_start_validates_and_saves_the_weights_being_trained(tiny_data, tmp_path):
    torch.manual_seed(1)
    start = _model().backbone.state_dict()  # the starting weights: not what a fresh model draws
    torch.save(start, tmp_path / "start.pt")
    torch.manual_seed(0)
    model = _model(weights=str(tmp_path / "start.pt"))
    random_init = model.state_dict()[KEY].clone()
    ema, probe = DelayedStartEMA(decay=0.5, update_starting_at_step=1000), Probe()
    dm = ImageFolderDataModule(data_dir=str(tiny_data), batch_size=16, num_workers=0, image_size=32)
    trainer = pl.Trainer(max_epochs=1, limit_train_batches=2, limit_val_batches=1, num_sanity_val_steps=0,
                         accelerator="cpu", logger=False, enable_progress_bar=False, enable_checkpointing=False,
                         default_root_dir=tmp_path, callbacks=[ema, probe])
    trainer.fit(model, dm)

    assert not ema.started()
    assert torch.equal(ema._average_model.module.state_dict()[KEY], random_init)  # the copy made at setup
    torch.testing.assert_close(probe.validated[KEY], start[KEY.removeprefix("backbone.")], atol=1e-3, rtol=0)
    for k, v in probe.live.items():  # validation saw the live weights
        assert torch.equal(probe.validated[k], v), k
    assert torch.equal(model.state_dict()[KEY], probe.live[KEY])  # the end of training kept them
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    ckpt = torch.load(tmp_path / "last.ckpt", map_location="cpu", weights_only=True)
    assert torch.equal(ckpt["state_dict"][KEY], probe.live[KEY])  # what validate/predict/export will load
    assert int(ckpt["averaging_state"]["n_averaged"]) == 0  # a resume starts the average as this run would


@pytest.mark.slow
def test_ema_once_started_averages_from_the_weights_being_trained(tiny_data, tmp_path):
    torch.manual_seed(0)
    model = _model()
    updates: list[torch.Tensor] = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx >= 1:  # update_starting_at_step=1: updated after the second step and on
                updates.append(pl_module.state_dict()[KEY].detach().clone())

    ema, probe = DelayedStartEMA(decay=0.5, update_starting_at_step=1), Probe()
    dm = ImageFolderDataModule(data_dir=str(tiny_data), batch_size=16, num_workers=0, image_size=32)
    trainer = pl.Trainer(max_epochs=1, limit_train_batches=3, limit_val_batches=1, num_sanity_val_steps=0,
                         accelerator="cpu", logger=False, enable_progress_bar=False, enable_checkpointing=False,
                         default_root_dir=tmp_path, callbacks=[Record(), ema, probe])
    trainer.fit(model, dm)
    assert ema.started() and len(updates) == 2
    expected = 0.5 * updates[0] + 0.5 * updates[1]  # the first update copied the live weights
    torch.testing.assert_close(probe.validated[KEY], expected)
    assert not torch.equal(probe.validated[KEY], probe.live[KEY])
