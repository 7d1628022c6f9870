"""ImageFolder, LMDB and Downscaled agree: the same label for every file, the same accuracy for one model."""
from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch

from datamodules import DownscaledDataModule, ImageFolderDataModule, LMDBDataModule
from datamodules.index import load_indexes
from datamodules.lmdb.datamodule import LMDBReader, pack
from lightning_app.module import ImageClassifier


@pytest.mark.parametrize("tree", ["tiny_data", "odd_tree"])
def test_every_backend_gives_every_file_the_same_label(tree, request, tmp_path):
    root = request.getfixturevalue(tree)
    indexes = load_indexes(root)
    reader = LMDBReader(pack(root, tmp_path / "db.lmdb", progress=False))
    down = DownscaledDataModule(str(root), max_size=16, cache_dir=str(tmp_path / "down"), batch_size=2)
    down.setup("fit")
    assert reader.classes == down.classes == indexes["train"].classes
    for split in ("train", "val"):
        folder = dict(indexes[split].samples)
        lmdb_labels = {p: reader.get(split, i)[1] for i, p in enumerate(reader.meta["splits"][split]["paths"])}
        down_labels = dict(down.indexes[split].samples)
        assert folder == lmdb_labels == down_labels
        assert len(set(folder.values())) > 1
    reader.close()


def _predictions(model: ImageClassifier, dm) -> tuple[torch.Tensor, torch.Tensor]:
    dm.setup("validate")
    model.eval()
    logits, labels = [], []
    with torch.no_grad():
        for batch in dm.val_dataloader():
            images, y = dm.on_after_batch_transfer(batch, 0)
            logits.append(model(images))
            labels.append(y)
    return torch.cat(logits), torch.cat(labels)


@pytest.mark.slow
def test_a_model_trained_on_lmdb_validates_the_same_on_every_backend(learnable_data, tmp_path):
    torch.manual_seed(0)
    common = {"batch_size": 64, "num_workers": 0, "image_size": 32, "val_image_size": 32, "val_crop_ratio": 1.0,
              "min_scale": 0.35}
    lmdb_dm = LMDBDataModule(str(learnable_data), cache_dir=str(tmp_path / "learn.lmdb"), **common)
    datamodules = {
        "lmdb": lmdb_dm,
        "imagefolder": ImageFolderDataModule(str(learnable_data), **common),
        # 32 px sources at max_size 32: the copy holds the very same JPEG bytes, so only labels
        # and file order could make the results differ
        "downscaled": DownscaledDataModule(str(learnable_data), max_size=32, cache_dir=str(tmp_path / "d"),
                                           in_memory=True, **common),
    }
    from datamodules import StreamingDataModule
    from datamodules.shards.pack import pack

    pack(learnable_data, str(tmp_path / "shards"), progress=False)
    datamodules["streaming"] = StreamingDataModule(str(tmp_path / "shards"), **common)  # val in the pack's order
    model = ImageClassifier(arch="conv11", num_classes=10, image_size=32, global_batch_size=64,
                            arch_kwargs={"width": 8}, lr=0.4, weight_decay=5e-4, label_smoothing=0.1)
    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(model, lmdb_dm)
    acc = {name: trainer.validate(model, dm, verbose=False)[0]["val/acc1"] for name, dm in datamodules.items()}
    assert max(acc.values()) - min(acc.values()) <= 0.02, acc
    # a short fit is far from converged, so compare per image: same pixels, same labels -> same outputs
    reference, labels = _predictions(model, datamodules["imagefolder"])
    assert len(reference.argmax(1).unique()) >= 3, "the model predicts (almost) one class: nothing is compared"
    for name in ("lmdb", "downscaled"):
        logits, y = _predictions(model, datamodules[name])
        assert torch.equal(y, labels), name
        torch.testing.assert_close(logits, reference, msg=name)
