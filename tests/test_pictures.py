"""TensorBoard pictures: image summaries in the real event files; the HPARAMS tab without internal keys."""
from __future__ import annotations

import pytest
import pytorch_lightning as pl
from pytorch_lightning.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_app.callbacks.hparams import public
from lightning_app.callbacks.pictures import picture_callbacks
from lightning_app.module import ImageClassifier

TAGS = {"images/confusion_matrix", "images/mistakes", "images/train_batch"}


def fit_and_read_images(data_dir, root, pictures) -> tuple[dict, ImageClassifier]:
    from datamodules import ImageFolderDataModule

    pl.seed_everything(0)
    dm = ImageFolderDataModule(data_dir=str(data_dir), batch_size=40, num_workers=0, image_size=32,
                               val_crop_ratio=1.0, persistent_workers=False)
    model = ImageClassifier(arch="conv11", num_classes=dm.num_classes, image_size=32, global_batch_size=40,
                            arch_kwargs={"width": 4}, pictures=pictures)
    logger = TensorBoardLogger(save_dir=str(root), name="", default_hp_metric=False)
    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", logger=logger, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_train_batches=2,
                         num_sanity_val_steps=1)
    trainer.fit(model, dm)
    events = EventAccumulator(logger.log_dir, size_guidance={"images": 0})
    events.Reload()
    return {tag: events.Images(tag) for tag in events.Tags()["images"]}, model


@pytest.mark.slow
def test_images_in_the_event_files(tiny_data, tmp_path):
    images, _ = fit_and_read_images(tiny_data, tmp_path, ["confusion_matrix", "mistakes", "train_batch"])
    assert set(images) == TAGS
    assert len(images["images/confusion_matrix"]) == 2  # after each validation epoch (not the sanity check)
    assert len(images["images/mistakes"]) == 2
    assert len(images["images/train_batch"]) == 1  # once per fit
    for tag in TAGS:
        picture = images[tag][-1]
        assert picture.width > 100 and picture.height > 100
        assert picture.encoded_image_string[:8] == b"\x89PNG\r\n\x1a\n"


def test_pictures_can_be_switched_off(tiny_data, tmp_path):
    images, _ = fit_and_read_images(tiny_data, tmp_path, ["train_batch"])
    assert set(images) == {"images/train_batch"}
    assert picture_callbacks({"pictures": []}) == []
    with pytest.raises(ValueError, match="unknown"):
        picture_callbacks({"pictures": ["confusion"]})


def test_hparams_tab_drops_internal_keys():
    hparams = {"arch": "conv11", "lr": 0.1, "_instantiator": "pytorch_lightning.cli.instantiate_module",
               "_class_path": "lightning_app.module.ImageClassifier"}
    assert public(hparams) == {"arch": "conv11", "lr": 0.1}
